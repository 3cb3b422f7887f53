"""Benchmarks' ground truth through the ENGINE: a scripted policy emits the reference calls, the
RolloutEngine runs them in real mode (user turns, added tools, stop tools, the world's record), and
the `benchmark` reward scores them with the benchmark's own scorer."""

from __future__ import annotations

import dataclasses
import json

import pytest

from envace.backends.scripted import ScriptedGenerator
from envace.benchmarks import BENCHMARKS
from envace.rewards import Context, compute_rewards
from envace.rollout import RolloutConfig, RolloutEngine
from envace.types import EndReason

# litellm's pydantic types warn at import (tau2); not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:.*`ReadOnly` qualifier:UserWarning")

# Room for the benchmarks' long prompts: the scripted policy has no context limit.
ROOMY = RolloutConfig(max_turn_tokens=8192, max_total_tokens=200_000)
MULTI_TURN = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context")
READ_PREFIXES = ("get_", "find_", "search_", "list_", "calculate", "check_", "think")


def tool_calls_text(calls: list[dict]) -> str:
    return "\n".join("<tool_call>" + json.dumps({"name": c["name"], "arguments": c["arguments"]}) + "</tool_call>" for c in calls)


def since_last_user(text: str) -> str:
    return text.rsplit("<|im_start|>user", 1)[-1]


def reference_policy(tokenizer, calls: list[dict], answer: str = "Done.", after_calls: str | None = None) -> ScriptedGenerator:
    """Emits the calls of the current user turn (`user_turn`, default 0) in one ACT output, then
    `after_calls` (default: `answer`); a turn without calls gets `answer`. The session text tells
    the turn: the first user message, if any, opens turn 0 (SmolLM2's ChatML headers)."""

    def reply(text: str) -> str:
        if "<|im_start|>tool" in since_last_user(text):
            return after_calls or answer
        turn = max(0, text.count("<|im_start|>user") - 1)
        return tool_calls_text([c for c in calls if c.get("user_turn", 0) == turn]) or answer

    return ScriptedGenerator(tokenizer, reply)


def run_scored(bench, task, policy):
    [[traj]] = RolloutEngine(policy, bench, ROOMY).run([task], progress=False)
    compute_rewards("benchmark", [[traj]], [task], Context(env=bench))
    return traj


# ---- BFCL multi-turn ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bfcl():
    pytest.importorskip("bfcl_eval", reason="BFCL's package is not installed (make install; docs/benchmarks.md)")
    return BENCHMARKS.get("bfcl")()


@pytest.mark.parametrize("category", MULTI_TURN)
def test_bfcl_ground_truth_through_the_engine_passes_and_a_dropped_call_fails(tokenizer, bfcl, category):
    for task in bfcl.load_tasks(categories=[category], limit=3):
        traj = run_scored(bfcl, task, reference_policy(tokenizer, task.reference_calls))
        assert traj.end_reason == EndReason.ANSWERED and traj.reward == 1.0, (task.id, traj.reward_details)
        assert [c.user_turn for c in traj.tool_calls] == [c["user_turn"] for c in task.reference_calls]
        dropped = run_scored(bfcl, task, reference_policy(tokenizer, task.reference_calls[:-1]))
        assert dropped.reward == 0.0, task.id


def test_bfcl_held_out_functions_are_announced_at_their_turn(tokenizer, bfcl):
    task = bfcl.load_tasks(categories=["multi_turn_miss_func"], limit=1)[0]
    (added,) = task.rules.added_tools
    traj = run_scored(bfcl, task, reference_policy(tokenizer, task.reference_calls))
    users = [m["content"] for m in traj.messages if m["role"] == "user"]
    name = added.tools[0]["function"]["name"]
    assert f"{name}(" in users[added.user_turn] and not any(f"{name}(" in u for u in users[: added.user_turn])


def test_bfcl_single_turn_scores_the_first_response_without_running_it(tokenizer, bfcl):
    task = bfcl.load_tasks(categories=["simple_python"], limit=1)[0]
    traj = run_scored(bfcl, task, reference_policy(tokenizer, task.reference_calls))
    assert traj.reward == 1.0 and traj.real_env_calls == 0 and traj.observations == []


# ---- tau2 ----------------------------------------------------------------------------------------

class CustomerWhoAsksOnce:
    """A UserSimulator: one request (naming the task, as the real user's scenario would), then done."""

    def start(self, task, world=None):
        return f"Hello, I need help with my request ({task.metadata['tau2_id']})."

    def respond(self, task, messages, world=None):
        return None


@pytest.fixture(scope="module")
def tau2():
    pytest.importorskip("tau2", reason="tau2's package is not installed (make install; docs/benchmarks.md)")
    return BENCHMARKS.get("tau2")(user_simulator=CustomerWhoAsksOnce())


def tau2_policy(tokenizer, task, calls):
    """The reference actions, then the task's communicate_info (conversational) or `done` (solo)."""
    criteria = task.metadata["tau2_task"]["evaluation_criteria"] or {}
    answer = " ".join(criteria.get("communicate_info") or []) or "Done."
    done = tool_calls_text([{"name": "done", "arguments": {}}]) if task.metadata["solo"] else None
    return reference_policy(tokenizer, [{k: c[k] for k in ("name", "arguments")} for c in calls], answer, done)


@pytest.mark.parametrize("category,limit,n", [("airline", 8, 1), ("retail", 6, 2), ("telecom_solo", 2, 2)])
def test_tau2_reference_actions_through_the_engine_score_one_and_a_dropped_one_less(tokenizer, tau2, category, limit, n):
    tasks = [t for t in tau2.load_tasks("base", limit=limit, categories=[category])
             if t.reference_calls and not t.reference_calls[-1]["name"].startswith(READ_PREFIXES)][:n]
    assert tasks
    for task in tasks:
        traj = run_scored(tau2, task, tau2_policy(tokenizer, task, task.reference_calls))
        assert traj.end_reason == EndReason.ANSWERED and traj.reward == 1.0, (task.id, traj.reward_details)
        assert traj.benchmark_record["tool_log"]  # the world's record reached the scorer
        if not task.metadata["solo"]:
            assert [m["role"] for m in traj.messages[:3]] == ["system", "assistant", "user"]  # greeting, then the user
        perturbed = run_scored(tau2, task, tau2_policy(tokenizer, task, task.reference_calls[:-1]))
        assert perturbed.reward < 1.0, task.id


class UnreachableUser:
    """A UserSimulator that must not be called."""

    def start(self, task, world=None):
        raise AssertionError("the real user simulator was called in a rehearsal")

    respond = start


def test_tau2_telecom_rehearses_with_an_imagined_user(tokenizer, tau2):
    """Telecom's user acts on a phone that only the real world has: in rehearse mode the rehearsing
    model imagines the user instead, so the run neither raises nor calls the benchmark's simulator."""
    bench = BENCHMARKS.get("tau2")(user_simulator=UnreachableUser())
    task = bench.load_tasks("base", limit=1, categories=["telecom"])[0]
    assert task.rules.user_uses_world

    def reply(text: str) -> str:
        if "You play the user" in text:
            return "My mobile data does not work." if "user: " not in text else "###STOP###"
        return '{"status": "ok"}' if text.rsplit("<|im_start|>", 1)[-1].startswith("tool") else "Please restart your phone."

    [[traj]] = RolloutEngine(ScriptedGenerator(tokenizer, reply), bench, dataclasses.replace(ROOMY, mode="rehearse")).run([task], progress=False)
    assert traj.user_source == "imagined" and traj.end_reason == EndReason.ANSWERED
    assert [m["content"] for m in traj.messages if m["role"] == "user"] == ["My mobile data does not work."]


# ---- BFCL memory: the policy writes the memory in prerequisite conversations, then answers ----

ANSWER = "{'answer': '%s', 'context': 'from my memory'}"


def memory_policy(tokenizer, write: dict | None) -> ScriptedGenerator:
    """In a prerequisite conversation: `write` (a memory call) right after the user gives their name,
    else a short reply. In a scored question (BFCL's answer-format prompt): the name if the system
    prompt's memory holds it, else BFCL's "I do not know"."""

    def reply(text: str) -> str:
        system, last = text.split("<|im_start|>user", 1)[0], since_last_user(text)
        if "For your final answer to the user" in system:
            return ANSWER % ("Michael" if "Michael" in system else "I do not know")
        if write and "My name is Michael" in last and "<|im_start|>tool" not in last:
            return tool_calls_text([write])
        return "Thanks, noted."

    return ScriptedGenerator(tokenizer, reply)


def run_memory(bfcl, policy, category, limit=1):
    from envace.config import build
    from envace.evaluation.runner import EvalConfig, run_prerequisites

    cfg = build(EvalConfig, {"benchmark": "bfcl", "progress": False, "max_turn_tokens": 8192, "max_total_tokens": 200_000})
    tasks = bfcl.load_tasks(categories=[category], limit=limit)
    setup = run_prerequisites(cfg, policy, bfcl, tasks, "test")
    groups = RolloutEngine(policy, bfcl, ROOMY).run(tasks, progress=False)
    compute_rewards("benchmark", groups, tasks, Context(env=bfcl))
    return setup, [g[0] for g in groups]


@pytest.mark.parametrize("category,write", [
    ("memory_kv", {"name": "core_memory_add", "arguments": {"key": "user_first_name", "value": "Michael"}}),
    ("memory_rec_sum", {"name": "memory_append", "arguments": {"text": "The user's first name is Michael."}}),
])
def test_bfcl_memory_written_in_prerequisites_answers_the_question(tokenizer, bfcl, category, write):
    setup, [traj] = run_memory(bfcl, memory_policy(tokenizer, write), category)
    assert traj.task_id == f"{category}_0-customer-0" and traj.reward == 1.0, traj.reward_details
    # BFCL's chain: the 10 customer conversations ran in order, each starting from the memory the
    # previous one saved; the first started empty.
    assert len(setup.groups) == 10 and all(g[0].end_reason == EndReason.ANSWERED for g in setup.groups)
    systems = [g[0].messages[0]["content"] for g in setup.groups]
    assert "There is no content in the" in systems[0] and all("Michael" in s for s in systems[1:])
    assert "Michael" in json.dumps(setup.groups[-1][0].benchmark_record["memory"])
    # The question's system message: BFCL's memory prompt with the memory, then the answer format.
    assert traj.messages[0]["content"].index("Michael") < traj.messages[0]["content"].index("For your final answer")


def test_bfcl_memory_question_fails_when_nothing_was_written(tokenizer, bfcl):
    _, [traj] = run_memory(bfcl, memory_policy(tokenizer, None), "memory_kv")
    assert traj.reward == 0.0 and traj.reward_details["answer"] == ANSWER % "I do not know"


def test_bfcl_memory_question_without_its_prerequisites_is_an_error(tokenizer):
    pytest.importorskip("bfcl_eval")
    fresh = BENCHMARKS.get("bfcl")()
    [task] = fresh.load_tasks(categories=["memory_kv"], limit=1)
    with pytest.raises(RuntimeError, match="has not been written yet: roll out bench.prerequisites"):
        RolloutEngine(memory_policy(tokenizer, None), fresh, ROOMY).run([task], progress=False)
