"""BFCL-v4 adapter: BFCL's own ground truth, replayed through the adapter, passes BFCL's own checkers."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("bfcl_eval", reason="BFCL's package is not installed (pip install --no-deps bfcl-eval==2026.3.23 mpmath ...; docs/benchmarks.md)")

from envace.benchmarks import BENCHMARKS  # noqa: E402
from envace.benchmarks.bfcl import MULTI_TURN, BFCLWorld, call_strings, openai_tools  # noqa: E402
from envace.types import EndReason, ToolCall, Trajectory  # noqa: E402

SINGLE_TURN_AST = ("simple_python", "multiple", "parallel", "parallel_multiple", "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")


@pytest.fixture(scope="module")
def bench():
    return BENCHMARKS.get("bfcl")()


@pytest.fixture(scope="module")
def multi_turn(bench):
    return {c: bench.load_tasks(categories=[c], limit=5) for c in MULTI_TURN}


def replay(bench, task):
    """BFCL's ground-truth calls, executed in order on the adapter's world, as a trajectory."""
    world = bench.make_world(task)
    calls = [ToolCall(r["name"], r["arguments"], user_turn=r["user_turn"]) for r in task.reference_calls]
    observations = [world.execute(c) for c in calls]
    return Trajectory(task_id=task.id, mode="real", tool_calls=calls, observations=observations, end_reason=EndReason.ANSWERED)


@pytest.mark.parametrize("category", MULTI_TURN)
def test_ground_truth_replay_passes_and_a_dropped_call_fails(bench, multi_turn, category):
    for task in multi_turn[category]:
        traj = replay(bench, task)
        score, details = bench.score(task, traj)
        assert score == 1.0, (task.id, details)
        traj.tool_calls = traj.tool_calls[:-1]
        assert bench.score(task, traj)[0] == 0.0, task.id


def test_multi_turn_task_layout(multi_turn):
    task = multi_turn["multi_turn_miss_func"][0]
    assert task.messages[0]["role"] == "user" and len(task.user_turns) == len(task.metadata["ground_truth"]) - 1
    (added,) = task.rules.added_tools
    turn = added.user_turn
    assert task.user_turns[turn - 1]["content"].startswith("I have updated some more functions")
    held_out = {t["function"]["name"] for t in added.tools}
    assert held_out and not held_out & {t["function"]["name"] for t in task.tools}
    assert all(r["user_turn"] < len(task.metadata["ground_truth"]) for r in task.reference_calls)


def test_world_executes_through_bfcl_and_reports_errors(multi_turn):
    task = multi_turn["multi_turn_base"][0]
    world = BFCLWorld(task)
    first = task.reference_calls[0]
    assert "error" not in world.call(first["name"], first["arguments"])
    assert world.call("no_such_tool", {})["error"]["code"] == "EXECUTION_ERROR"
    assert world.call("__import__('os').system", {})["error"]["code"] == "INVALID_CALL"
    assert set(world.snapshot()) == set(task.metadata["involved_classes"])
    world.reset()  # a fresh world: state back to initial_config
    assert world.snapshot() == BFCLWorld(task).snapshot()


def test_force_terminated_rollout_fails(bench, multi_turn):
    task = multi_turn["multi_turn_base"][0]
    traj = replay(bench, task)
    traj.end_reason = EndReason.MAX_TURNS
    score, details = bench.score(task, traj)
    assert score == 0.0 and details["error_type"] == "multi_turn:force_terminated"


def test_unsafe_call_strings_are_dropped():
    calls = [ToolCall("ls", {"a": True}), ToolCall("x;import os", {}), ToolCall("cd", {"folder=1)#": "x"})]
    assert call_strings(calls) == ["ls(a=True)"]


def test_function_docs_convert_like_bfcl():
    properties = {"n": {"type": "float", "description": "x"}, "m": {"type": "dict", "properties": {}}}
    doc = {"name": "math.factorial", "description": "d", "parameters": {"type": "dict", "properties": properties, "required": ["n"]}}
    (tool,) = openai_tools([doc])
    fn = tool["function"]
    assert tool["type"] == "function" and fn["name"] == "math_factorial"
    assert fn["parameters"]["type"] == "object" and fn["parameters"]["properties"]["n"]["type"] == "number"
    assert fn["parameters"]["properties"]["m"]["type"] == "object"


@pytest.mark.parametrize("category", SINGLE_TURN_AST)
def test_single_turn_ground_truth_passes_and_a_wrong_argument_fails(bench, category):
    for task in bench.load_tasks(categories=[category], limit=3):
        calls = [ToolCall(r["name"], r["arguments"]) for r in task.reference_calls]
        assert bench.score(task, Trajectory(task_id=task.id, mode="real", tool_calls=calls))[0] == 1.0, task.id
        wrong = copy.deepcopy(calls)
        name = next(k for k in wrong[0].arguments)
        value = wrong[0].arguments[name]
        wrong[0].arguments[name] = value + 17 if isinstance(value, (int, float)) and not isinstance(value, bool) else "definitely-wrong-value"
        assert bench.score(task, Trajectory(task_id=task.id, mode="real", tool_calls=wrong))[0] == 0.0, task.id


def test_only_the_first_act_output_is_scored(bench):
    task = bench.load_tasks(categories=["simple_python"], limit=1)[0]
    right = ToolCall(task.reference_calls[0]["name"], task.reference_calls[0]["arguments"])
    later = ToolCall(right.name, right.arguments)
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "c1"}, {"role": "tool", "content": {}},
            {"role": "assistant", "content": "c2"}, {"role": "tool", "content": {}}]
    traj = Trajectory(task_id=task.id, mode="real", tool_calls=[right, later], messages=chat)
    assert bench.score(task, traj)[0] == 1.0  # the second output's call is not part of BFCL's answer


def test_relevance_and_irrelevance(bench):
    irrelevant = bench.load_tasks(categories=["irrelevance"], limit=1)[0]
    relevant = bench.load_tasks(categories=["live_relevance"], limit=1)[0]
    call = ToolCall(relevant.tools[0]["function"]["name"], {})
    assert bench.score(irrelevant, Trajectory(task_id="i", mode="real", final_answer="cannot help"))[0] == 1.0
    assert bench.score(irrelevant, Trajectory(task_id="i", mode="real", tool_calls=[call]))[0] == 0.0
    assert bench.score(relevant, Trajectory(task_id="r", mode="real", tool_calls=[call]))[0] == 1.0
    assert bench.score(relevant, Trajectory(task_id="r", mode="real"))[0] == 0.0


def test_aggregate_uses_bfcl_weighting(bench):
    def results(category, scores):
        return [{"category": category, "score": s} for s in scores]

    rows = (results("simple_python", [1, 0]) + results("simple_java", [1]) + results("multiple", [0, 0])
            + results("live_simple", [1, 1, 1]) + results("live_multiple", [0])
            + results("irrelevance", [1]) + results("live_irrelevance", [0])
            + results("multi_turn_base", [1, 0]) + results("multi_turn_miss_func", [0]))
    summary = bench.aggregate(rows)
    groups = summary["groups"]
    assert groups["non_live"] == pytest.approx(((0.5 + 1.0) / 2 + 0.0) / 2)  # simple = mean(python, java)
    assert groups["live"] == pytest.approx(3 / 4)  # weighted by task count
    assert groups["irrelevance"] == pytest.approx(0.5) and groups["multi_turn"] == pytest.approx(0.25)
    expected = (10 * groups["non_live"] + 10 * groups["live"] + 10 * 0.5 + 30 * 0.25) / 60
    assert summary["overall"] == pytest.approx(expected)
    assert summary["categories"]["simple_python"] == {"accuracy": 0.5, "count": 2}


def test_offline_status_names_what_cannot_run(bench):
    status = bench.offline_status()
    assert status["multi_turn_base"] == "ok" and status["simple_python"] == "ok"
    assert "paid" in status["web_search_base"] and "hub" in status["memory_vector"]
    assert status["memory_kv"] == "ok" and status["memory_rec_sum"] == "ok"
    with pytest.raises(ValueError, match="paid"):
        bench.load_tasks(categories=["web_search_base"])


def test_memory_questions_and_their_prerequisite_chain(bench):
    from envace.evaluation.runner import dependency_waves

    tasks = bench.load_tasks(categories=["memory_kv"])
    assert len(tasks) == 155 and [t.id for t in tasks[:2]] == ["memory_kv_0-customer-0", "memory_kv_1-customer-1"]
    first = tasks[0]
    assert first.messages == [{"role": "user", "content": "What is my first name?"}] and first.metadata["ground_truth"] == ["Michael"]
    assert first.metadata["memory"]["system"].startswith("For your final answer") and not first.metadata["prerequisite"]
    setup = bench.prerequisites(tasks[:3])  # all three are customer questions: one scenario's chain
    assert len(setup) == 10 and all(t.metadata["prerequisite"] and t.metadata["memory"]["scenario"] == "customer" for t in setup)
    assert [len(w) for w in dependency_waves(setup)] == [1] * 10  # each conversation after all earlier ones
    assert len(bench.prerequisites(tasks)) == 37 and bench.prerequisites(bench.load_tasks(categories=["multi_turn_base"], limit=1)) == []


def test_memory_answer_is_bfcls_agentic_check_of_the_last_text(bench):
    [task] = bench.load_tasks(categories=["memory_rec_sum"], limit=1)

    def scored(*assistant):
        chat = [{"role": "user", "content": "q"}] + [{"role": "assistant", "content": a} for a in assistant]
        return bench.score(task, Trajectory(task_id=task.id, mode="real", messages=chat))

    assert scored("{'answer': 'MICHAEL.', 'context': 'memory'}")[0] == 1.0  # case and punctuation ignored
    assert scored("Michael", "{'answer': 'I do not know'}")[0] == 0.0  # only the last message counts
    assert scored("{'answer': 'Michaelson'}")[0] == 0.0  # a whole word
    called = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<tool_call>...</tool_call>"}, {"role": "tool", "content": {}}]
    value, details = bench.score(task, Trajectory(task_id=task.id, mode="real", messages=called))
    assert value == 0.0 and details["error_type"] == "agentic:no_last_message"
    with pytest.raises(ValueError, match="BFCL does not score it"):
        bench.score(bench.prerequisites([task])[0], Trajectory(task_id="p", mode="real"))


def test_aggregate_weighs_memory_as_bfcls_agentic_group(bench):
    rows = [{"category": "memory_kv", "score": s} for s in (1, 0)] + [{"category": "memory_rec_sum", "score": 1}] + [{"category": "multi_turn_base", "score": 0}]
    summary = bench.aggregate(rows)
    assert summary["groups"] == {"multi_turn": 0.0, "agentic": pytest.approx((0.5 + 1.0) / 2)}
    assert summary["overall"] == pytest.approx(40 * 0.75 / (30 + 40))


def test_bfcl_is_never_training_data(bench):
    """BFCL-v4 has no train split: its loader refuses any other split, and every task it gives
    is a test task (nothing in envace converts BFCL into training tasks)."""
    with pytest.raises(ValueError, match="one split, 'test'"):
        bench.load_tasks("train")
    assert {t.split for t in bench.load_tasks(categories=["simple_python", "multi_turn_base"], limit=2)} == {"test"}
