import pytest

from envace.envs.environment import WorldEnvironment
from envace.rewards import REWARDS, Context, RewardResult, compute_rewards, multiset_f1, parse_verdicts, score_checklist
from envace.types import CallStatus, Task, ToolCall, Trajectory

WORLD = "tests.worlds:Counter"


def task(**kw):
    base = dict(id="t", world=WORLD, messages=[{"role": "user", "content": "Add 2 then 3; report the value."}], initial_state={"value": 0},
                success={"state": [{"path": "value", "equals": 5}], "answer": {"number": 5}},
                reference_calls=[{"name": "add", "arguments": {"n": 2}}, {"name": "add", "arguments": {"n": 3}}, {"name": "get", "arguments": {}}])
    base.update(kw)
    return Task(**base)


def traj(calls, answer, mode="rehearse", status=CallStatus.REHEARSED):
    """A finished trajectory whose calls were all answered with `status` (one observation each)."""
    return Trajectory(task_id="t", mode=mode, tool_calls=[ToolCall(n, a, status=status) for n, a in calls],
                      observations=[{"value": 0}] * len(calls), final_answer=answer)


def score(name, t, tr, **ctx):
    return REWARDS.get(name)(t, tr, Context(env=WorldEnvironment(), **ctx))


def test_replay_runs_calls_on_fresh_world_and_verifies():
    result = score("replay", task(), traj([("add", {"n": 2}), ("add", {"n": 3})], "It is 5."))
    assert result.value == 1.0
    assert result.real_observations == [{"value": 2}, {"value": 5}]
    assert "real_observations" not in result.details  # the details are the verifier's report only


BANK_STATE = {"accounts": {"A1": {"owner": "me", "name": "main", "balance": 100}, "E1": {"owner": "Bob", "name": "Bob", "balance": 0}},
              "transfers": {}}
TRANSFER = ("transfer", {"from_account": "A1", "to_account": "E1", "amount": 50})


def bank_task():
    """Succeeds only if 50 reached Bob's account: only the transfer call can make it so."""
    return Task(id="pay-bob", world="bank", messages=[{"role": "user", "content": "Send Bob 50 from A1."}], initial_state=BANK_STATE,
                success={"state": [{"path": "accounts.E1.balance", "equals": 50}]})


@pytest.mark.parametrize("status,expected", [(CallStatus.EXECUTED, 1.0), (CallStatus.REHEARSED, 1.0), (CallStatus.SIMULATED, 1.0),
                                             (CallStatus.REVISED, 0.0), (CallStatus.STOPPED, 0.0), (CallStatus.UNANSWERED, 0.0),
                                             (CallStatus.MALFORMED, 0.0), (CallStatus.PENDING, 0.0)])
def test_replay_runs_only_committed_calls(status, expected):
    listed = ("list_accounts", {})  # committed in every case: only the transfer's status varies
    t = Trajectory(task_id="pay-bob", mode="real", final_answer="Sent.", observations=[{}, {}],
                   tool_calls=[ToolCall(*listed, status=CallStatus.EXECUTED), ToolCall(*TRANSFER, status=status)])
    result = score("replay", bank_task(), t)
    assert result.value == expected
    assert len(result.real_observations) == 1 + int(expected)  # the transfer's response only when it was committed


@pytest.mark.parametrize("calls,answer", [([("add", {"n": 2}), ("add", {"n": 4})], "It is 5."), ([("add", {"n": 2}), ("add", {"n": 3})], "It is 6.")])
def test_replay_wrong_call_or_answer_scores_zero(calls, answer):
    assert score("replay", task(), traj(calls, answer)).value == 0.0


def test_reference_f1_hand_computed():
    # predicted: add(2), add(4), get()  vs reference add(2), add(3), get()
    result = score("reference", task(), traj([("add", {"n": 2}), ("add", {"n": 4}), ("get", {})], "x"))
    # full-call matches: add(2), get() -> TP=2, P=2/3, R=2/3, F1=2/3
    assert result.value == pytest.approx(2 / 3)
    # names: {add, add, get} both sides -> F1 = 1
    assert result.details["name_f1"] == 1.0


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


def scripted_judge(tokenizer, verdicts):
    from envace.backends.scripted import ScriptedGenerator

    return ScriptedGenerator(tokenizer, lambda text: verdicts if "Checklist" in text else "")


def test_judge_reward_through_a_generator(tokenizer):
    t = task(checklist=[{"item": "adds 5 in total", "weight": 3.0}, {"item": "reports 5", "weight": 1.0}])
    result = score("judge", t, traj([("add", {"n": 5})], "5"), judge=scripted_judge(tokenizer, "1: PASS\n2: FAIL"))
    assert result.value == 0.75 and result.details["verdicts"] == [True, False]


def test_judge_needs_a_model_and_a_checklist(tokenizer):
    checklist = [{"item": "adds 2", "weight": 2.0}, {"item": "adds 3", "weight": 1.0}, {"item": "reports 5", "weight": 1.0}]
    with pytest.raises(ValueError, match="needs a judge model"):
        score("judge", task(checklist=checklist), traj([], "x"))
    judge = scripted_judge(tokenizer, "1: FAIL\n2: PASS\n3: PASS")
    with pytest.raises(ValueError, match="task t has no checklist"):
        score("judge", task(), traj([], "x"), judge=judge)
    # With both: items 2 and 3 pass, weight (1 + 1) of (2 + 1 + 1).
    assert score("judge", task(checklist=checklist), traj([], "x"), judge=judge).value == 0.5


def test_compute_rewards_fills_every_trajectory():
    groups = [[traj([("add", {"n": 5})], "5"), traj([], "0")]]
    compute_rewards("replay", groups, [task()], Context(env=WorldEnvironment()))
    assert [t.reward for t in groups[0]] == [1.0, 0.0]
    assert [t.real_observations for t in groups[0]] == [[{"value": 5}], []]
    assert groups[0][0].reward_details["checks"][0]["ok"]  # the verifier's report, for reading


def pair_reward(task, trajectory, context):
    """A user's reward in the older shape: a (value, details) pair, no replay."""
    return 0.25, {"note": "mine"}


def test_a_reward_that_does_not_replay_still_gives_fidelity_its_reference():
    # Rehearse mode, scored by a reward that never touches the world: compute_rewards replays the
    # committed calls (add 2, add 3; the unanswered add 4 is not committed) for fidelity.
    rehearsed = traj([("add", {"n": 2}), ("add", {"n": 3})], "5")
    rehearsed.tool_calls.append(ToolCall("add", {"n": 4}, status=CallStatus.UNANSWERED))
    real = traj([("add", {"n": 2})], "2", mode="real", status=CallStatus.EXECUTED)
    compute_rewards("tests.test_rewards:pair_reward", [[rehearsed, real]], [task()], Context(env=WorldEnvironment()))
    assert (rehearsed.reward, rehearsed.reward_details) == (0.25, {"note": "mine"})
    assert rehearsed.real_observations == [{"value": 2}, {"value": 5}]
    assert real.real_observations is None  # real mode: nothing rehearsed, nothing replayed


def result_reward(task, trajectory, context):
    """A reward that replayed the calls itself (its made-up response shows it is kept)."""
    return RewardResult(0.5, {}, real_observations=[{"value": 99}])


def test_a_reward_result_carries_its_own_replay():
    [[t]] = groups = [[traj([("add", {"n": 2})], "2")]]
    compute_rewards("tests.test_rewards:result_reward", groups, [task()], Context(env=WorldEnvironment()))
    assert (t.reward, t.real_observations) == (0.5, [{"value": 99}])  # not replayed again over it


def test_user_reward_by_module_path():
    assert REWARDS.get("envace.rewards:replay_reward") is REWARDS.get("replay")


class UnexecutableEnvironment:
    """Worlds that answer every call without running it (as for BFCL single-turn, FinMCP)."""

    def make_world(self, task):
        from envace.benchmarks.base import UnexecutableWorld

        return UnexecutableWorld("scored on the calls alone")


def test_no_fidelity_replay_on_a_world_that_executes_nothing():
    rehearsed = traj([("add", {"n": 2})], "2")
    compute_rewards("tests.test_rewards:pair_reward", [[rehearsed]], [task()], Context(env=UnexecutableEnvironment()))
    assert rehearsed.reward == 0.25 and rehearsed.real_observations is None  # no NOT_EXECUTABLE "reference"
