import pytest

from envace.envs.environment import WorldEnvironment
from envace.rewards import REWARDS, Context, compute_rewards, multiset_f1, parse_verdicts, score_checklist
from envace.types import Task, ToolCall, Trajectory

WORLD = "tests.worlds:Counter"


def task(**kw):
    base = dict(id="t", world=WORLD, messages=[{"role": "user", "content": "Add 2 then 3; report the value."}], initial_state={"value": 0},
                success={"state": [{"path": "value", "equals": 5}], "answer": {"number": 5}},
                reference_calls=[{"name": "add", "arguments": {"n": 2}}, {"name": "add", "arguments": {"n": 3}}, {"name": "get", "arguments": {}}])
    base.update(kw)
    return Task(**base)


def traj(calls, answer):
    return Trajectory(task_id="t", mode="rehearse", tool_calls=[ToolCall(n, a) for n, a in calls], final_answer=answer)


def score(name, t, tr, **ctx):
    return REWARDS.get(name)(t, tr, Context(env=WorldEnvironment(), **ctx))


def test_replay_runs_calls_on_fresh_world_and_verifies():
    value, details = score("replay", task(), traj([("add", {"n": 2}), ("add", {"n": 3})], "It is 5."))
    assert value == 1.0
    assert details["real_observations"] == [{"value": 2}, {"value": 5}]
    assert details["verification_calls"] == 2


@pytest.mark.parametrize("calls,answer", [([("add", {"n": 2}), ("add", {"n": 4})], "It is 5."), ([("add", {"n": 2}), ("add", {"n": 3})], "It is 6.")])
def test_replay_wrong_call_or_answer_scores_zero(calls, answer):
    assert score("replay", task(), traj(calls, answer))[0] == 0.0


def test_reference_f1_hand_computed():
    # predicted: add(2), add(4), get()  vs reference add(2), add(3), get()
    value, d = score("reference", task(), traj([("add", {"n": 2}), ("add", {"n": 4}), ("get", {})], "x"))
    # full-call matches: add(2), get() -> TP=2, P=2/3, R=2/3, F1=2/3
    assert value == pytest.approx(2 / 3)
    # names: {add, add, get} both sides -> F1 = 1
    assert d["name_f1"] == 1.0


def test_multiset_f1_hand_computed():
    # ref [a,a,b], pred [a,b,b,c]: TP = min(1,2)+min(2,1) = 2, P=2/4, R=2/3, F1 = 2*0.5*0.667/(1.1667) = 4/7
    p, r, f1 = multiset_f1(["a", "b", "b", "c"], ["a", "a", "b"])
    assert (p, r) == (0.5, pytest.approx(2 / 3)) and f1 == pytest.approx(4 / 7)
    assert multiset_f1([], []) == (1.0, 1.0, 1.0)
    assert multiset_f1([], ["a"]) == (0.0, 0.0, 0.0)


def test_checklist_scoring_weights_and_missing_verdicts():
    verdicts = parse_verdicts("1: PASS\n2. fail\n4: PASS\n", 3)
    assert verdicts == [True, False, False]  # item 3 missing -> FAIL; item 4 out of range ignored
    checklist = [{"item": "a", "weight": 2.0}, {"item": "b", "weight": 1.0}, {"item": "c", "weight": 1.0}]
    assert score_checklist(checklist, verdicts) == 0.5


def test_judge_reward_through_a_generator(tokenizer):
    from envace.backends.scripted import ScriptedGenerator

    judge = ScriptedGenerator(tokenizer, lambda text: "1: PASS\n2: FAIL" if "Checklist" in text else "")
    t = task(checklist=[{"item": "adds 5 in total", "weight": 3.0}, {"item": "reports 5", "weight": 1.0}])
    value, d = score("judge", t, traj([("add", {"n": 5})], "5"), judge=judge)
    assert value == 0.75 and d["verdicts"] == [True, False]


def test_judge_needs_a_model_and_a_checklist():
    with pytest.raises(ValueError, match="judge model"):
        score("judge", task(checklist=[{"item": "x"}]), traj([], "x"))


def test_compute_rewards_fills_every_trajectory():
    groups = [[traj([("add", {"n": 5})], "5"), traj([], "0")]]
    compute_rewards("replay", groups, [task()], Context(env=WorldEnvironment()))
    assert [t.reward for t in groups[0]] == [1.0, 0.0]


def test_user_reward_by_module_path():
    assert REWARDS.get("envace.rewards:replay_reward") is REWARDS.get("replay")
