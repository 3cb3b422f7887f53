import pytest

from envace.config import ConfigError, build
from envace.evaluation.metrics import summarize_by, summarize_records, trajectory_record, wilson_interval
from envace.evaluation.report import markdown_table
from envace.evaluation.runner import EvalConfig, check_leakage, load_eval_tasks
from envace.training.manifest import build_manifest, write_manifest
from envace.types import EndReason, Role, Task, ToolCall, Trajectory, Turn


def test_wilson_interval_hand_computed():
    # p=0.5, n=4, z=1.96: centre 0.5, half = 1.96*sqrt(0.0625+0.0600)/1.9604 = 0.3498
    low, high = wilson_interval(2, 4)
    assert low == pytest.approx(0.1500, abs=1e-3) and high == pytest.approx(0.8500, abs=1e-3)
    assert wilson_interval(0, 0) == (0.0, 0.0)


def _traj(reward, calls, mode="real", obs=None):
    t = Trajectory(task_id="t", mode=mode, turns=[Turn(Role.PROMPT, [1, 2, 3]), Turn(Role.ACT, [4, 5], [0.0, 0.0])],
                   tool_calls=[ToolCall(c, {}) for c in calls], observations=obs or [], reward=reward, end_reason=EndReason.ANSWERED)
    return t


def test_records_and_summary_hand_computed():
    task = Task(id="t", world="bank", messages=[], reference_calls=[{"name": "a"}, {"name": "b"}])
    good = trajectory_record(task, _traj(1.0, ["a", "b"]))
    half = trajectory_record(task, _traj(0.0, ["a"]))
    assert (good["tool_f1"], half["tool_precision"], half["tool_recall"]) == (1.0, 1.0, 0.5)
    s = summarize_records([good, half], wall_seconds=10.0)
    assert s["success_rate"] == 0.5 and s["seconds_per_task"] == 5.0
    assert s["tool_f1"] == pytest.approx((1.0 + 2 / 3) / 2)
    assert s["tokens_per_task"] == 5


def test_fidelity_in_rehearse_records():
    task = Task(id="t", world="bank", messages=[])
    traj = _traj(1.0, ["a"], mode="rehearse", obs=[{"x": 1}])
    traj.reward_details = {"real_observations": [{"x": 2}]}
    s = summarize_records([trajectory_record(task, traj)])
    assert s["fidelity/exact"] == 0.0 and s["fidelity/calls"] == 1


def test_markdown_table_has_a_row_per_world_and_overall():
    task = Task(id="t", world="bank", messages=[])
    records = [trajectory_record(task, _traj(1.0, []))]
    table = markdown_table({"overall": summarize_records(records), "by_world": summarize_by(records, "world")})
    assert table.splitlines()[2].startswith("| bank | 1 | 1.000") and table.splitlines()[-1].startswith("| overall")


def test_eval_refuses_tasks_the_checkpoint_was_trained_on(tmp_path):
    tasks = load_eval_tasks(build(EvalConfig, {"split": "test", "n_per_world": 1, "worlds": ["bank"]}))
    write_manifest(build_manifest(tasks, None), tmp_path)
    with pytest.raises(ConfigError, match="trained on 1 of these tasks"):
        check_leakage(str(tmp_path), tasks, allow=False)
    assert check_leakage(str(tmp_path), tasks, allow=True) == [tasks[0].id]
    other = load_eval_tasks(build(EvalConfig, {"split": "val", "n_per_world": 1, "worlds": ["bank"]}))
    assert check_leakage(str(tmp_path), other, allow=False) == []


def test_manifest_inherits_from_init_checkpoint(tmp_path):
    a = [Task(id="a", world="bank", messages=[])]
    b = [Task(id="b", world="bank", messages=[])]
    write_manifest(build_manifest(a, None), tmp_path / "sft")
    assert build_manifest(b, str(tmp_path / "sft"))["task_ids"] == ["a", "b"]


@pytest.mark.parametrize("values,match", [
    ({"tasks": "/nope.jsonl"}, "does not exist"), ({"split": "dev"}, "split"), ({"mode": "simulator"}, "--simulator"),
    ({"model": "/no/model"}, "model"), ({"worlds": ["nowhere"]}, "unknown environment"), ({"k": 0}, "k must be"),
])
def test_bad_eval_input_fails_before_work(values, match):
    with pytest.raises(Exception, match=match):
        load_eval_tasks(build(EvalConfig, values))


def test_eval_with_private_rehearsal_reports_cost(tokenizer):
    from envace.envs.environment import WorldEnvironment
    from envace.evaluation.report import rehearsal_line
    from envace.evaluation.runner import evaluate_with_rehearsal
    from envace.rewards import Context
    from tests.test_rehearsal import Model
    from tests.test_rollout import counter_task

    policy = Model().generator(tokenizer)
    cfg = build(EvalConfig, {"rehearsal": "parallel", "n": 2})
    env = WorldEnvironment()
    groups, records, cost = evaluate_with_rehearsal(cfg, policy, env, [counter_task()], Context(env=env), None)
    assert len(groups) == 1 and groups[0][0].mode == "real"
    assert records[0]["reward"] == 1.0 and records[0]["real_env_calls"] == 1
    assert cost["extra_tokens"] > 0 and cost["n"] == 2
    line = rehearsal_line({"rehearsal": {"mode": "parallel", "n": 2, "rehearser": "m", "cost": cost}, "overall": {"n": 1}})
    assert "extra tokens" in line


def test_rehearsal_needs_real_mode():
    with pytest.raises(ConfigError, match="--mode real"):
        build(EvalConfig, {"rehearsal": "parallel", "mode": "rehearse"})


def test_dependency_waves_order_tasks_after_what_they_depend_on():
    from envace.evaluation.runner import dependency_waves

    def task(i, *deps):
        return Task(id=i, world="w", messages=[], metadata={"depends_on": list(deps)})

    waves = dependency_waves([task("d", "b", "c"), task("b", "a"), task("a"), task("c", "a"), task("e")])
    assert [[t.id for t in w] for w in waves] == [["a", "e"], ["b", "c"], ["d"]]
    with pytest.raises(ValueError, match="not given or depend on each other in a cycle"):
        dependency_waves([task("x", "y"), task("y", "x")])
    with pytest.raises(ValueError, match="tasks z depend on tasks that are not given"):
        dependency_waves([task("z", "missing")])
