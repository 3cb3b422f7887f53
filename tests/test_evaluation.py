import re

import pytest

from envace.backends.models import ModelNotFoundError
from envace.config import ConfigError, build
from envace.evaluation.report import markdown_table
from envace.evaluation.runner import EvalConfig, check_leakage, load_eval_tasks
from envace.manifest import build_manifest, write_manifest
from envace.metrics import summarize_by, summarize_records, trajectory_record
from envace.registry import RegistryError
from envace.types import Task
from tests.test_metrics import scored_traj


def test_markdown_table_has_a_row_per_world_and_overall():
    task = Task(id="t", world="bank", messages=[])
    records = [trajectory_record(task, scored_traj(1.0, []))]
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


@pytest.mark.parametrize("values,error,match", [
    ({"tasks": "/nope.jsonl"}, ConfigError, "task file /nope.jsonl does not exist"),
    ({"split": "dev"}, ConfigError, "split 'dev' must be train, val, test or heldout"),
    ({"mode": "simulator"}, ConfigError, "--mode simulator needs --simulator MODEL"),
    ({"model": "/no/model"}, ModelNotFoundError, "unknown model '/no/model'"),
    ({"worlds": ["nowhere"]}, RegistryError, "unknown environment 'nowhere'"),
    ({"k": 0}, ConfigError, "k must be >= 1, got 0"),
])
def test_bad_eval_input_fails_before_work(values, error, match):
    with pytest.raises(error, match=re.escape(match)):
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


def test_trajectory_json_writes_the_typed_fields():
    from envace.evaluation.runner import trajectory_json
    from envace.types import CallStatus, ToolCall, Trajectory

    traj = Trajectory(task_id="t", mode="rehearse", tool_calls=[ToolCall("add", {"n": 2}, status=CallStatus.REHEARSED),
                                                                 ToolCall("add", {"n": 3}, status=CallStatus.UNANSWERED)],
                      observations=[{"value": 2}], real_observations=[{"value": 2}], benchmark_record={"tool_log": []},
                      end_error={"code": "NOT_JSON"}, user_source="imagined")
    d = trajectory_json(traj)
    assert [c["status"] for c in d["tool_calls"]] == ["rehearsed", "unanswered"]
    assert (d["real_observations"], d["benchmark_record"], d["end_error"], d["user_source"]) == ([{"value": 2}], {"tool_log": []}, {"code": "NOT_JSON"}, "imagined")


def test_eval_reads_weighted_rewards_and_their_judge_before_any_model_loads():
    with pytest.raises(ConfigError, match=r"judge:0.5,reference:0.5 has a judge component: give --judge"):
        build(EvalConfig, {"reward": "judge:0.5,reference:0.5"})
    with pytest.raises(ConfigError, match="unknown reward 'nope'"):
        build(EvalConfig, {"reward": "nope:1,reference:1"})
    assert build(EvalConfig, {"reward": "reference:0.3,replay:0.7"}).reward_name == "reference:0.3,replay:0.7"
