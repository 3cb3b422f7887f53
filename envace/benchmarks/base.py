"""The interface between a public benchmark and envace's engine.

A `Benchmark` turns the benchmark's own data into `Task`s, builds a fresh executable world per
task (it is an `rollout.Environment`: `make_world` + `describe`), and scores a finished
`Trajectory` with the benchmark's own scorer. `envace eval --benchmark NAME` drives it:

    bench = BENCHMARKS.get("bfcl")()
    tasks = bench.load_tasks("test", limit=20, categories=["multi_turn_base"])
    groups = RolloutEngine(policy, bench).run(tasks)   # real mode: traj.benchmark_record = bench.rollout_record(task, world)
    compute_rewards("benchmark", groups, tasks, Context(env=bench))   # bench.score, per trajectory
    summary = bench.aggregate([{"task_id": t.id, "category": t.metadata["category"], "score": traj.reward,
                                "details": traj.reward_details}, ...])

Task metadata keys every adapter sets (others are documented per adapter, docs/benchmarks.md):
  benchmark            the adapter's registered name
  category             the category `aggregate` groups by
How the engine runs an adapter's tasks (a simulated user, tools added later, step limits, stop
tools) is the task's typed `rules` (`types.EpisodeRules`), not metadata.

Trajectory fields the scorers read: `tool_calls` (with `user_turn`), `messages` (the readable
chat: assistant texts), `final_answer`, `end_reason`, and `benchmark_record` (what
`rollout_record` returned for the rollout's world; None off real mode).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any, Callable, ClassVar, Iterator

from envace.envs.base import ToolWorld, error
from envace.registry import Registry
from envace.rewards import REWARDS, Context, RewardResult
from envace.rollout import UserSimulator
from envace.types import EndReason, Task, Trajectory

BENCHMARKS: Registry[type["Benchmark"]] = Registry("benchmark")


class BenchmarkDependencyError(ImportError):
    """A benchmark's own package is missing; the message names the pip command."""


@contextlib.contextmanager
def requirements(pip: str) -> Iterator[None]:
    """Wraps a benchmark's lazy imports (envace never depends on its packages): an ImportError
    inside becomes one that names the pip command."""
    try:
        yield
    except ImportError as exc:
        raise BenchmarkDependencyError(f"this benchmark needs packages that are not installed: {pip} ({exc})") from exc


class Benchmark:
    """Base class: subclasses implement loading, worlds, scoring and offline status."""

    name: ClassVar[str] = ""
    categories: ClassVar[tuple[str, ...]] = ()  # what load_tasks/aggregate group by (FinMCP: from the data)
    default_split: ClassVar[str] = "test"  # the split published results use
    # Set by users of conversational benchmarks; None where later user turns are replayed.
    user_simulator: UserSimulator | None = None
    # Benchmarks scored by an LLM judge (VitaBench's rubrics) take `judge(prompt) -> reply`;
    # `envace eval --judge MODEL` sets it from any backend, with at most `judge_tokens` per reply.
    uses_judge: ClassVar[bool] = False
    judge_tokens: ClassVar[int] = 0
    judge: Callable[[str], str] | None = None

    def load_tasks(self, split: str = "test", limit: int | None = None, categories: list[str] | None = None) -> list[Task]:
        raise NotImplementedError

    def make_world(self, task: Task) -> ToolWorld:
        """A fresh executable world for this task (real mode and replay)."""
        raise NotImplementedError

    def prerequisites(self, tasks: list[Task]) -> list[Task]:
        """Unscored tasks the policy under evaluation must roll out before `tasks` can run, in real
        mode and in the order their metadata `depends_on` (ids) gives: their worlds leave state
        (`rollout_record`) that the scored tasks' worlds read (BFCL memory: the policy first writes
        the memory in earlier conversations). `envace eval` runs them (`run_prerequisites`). Most
        benchmarks have none."""
        return []

    def describe(self, task: Task) -> tuple[str, list[dict[str, Any]]]:
        """(documentation for the system prompt, OpenAI tool schemas): the benchmark's own
        instructions already live in `task.messages`, so the documentation is empty."""
        return "", list(task.tools or [])

    def score(self, task: Task, trajectory: Trajectory) -> tuple[float, dict[str, Any]]:
        """The benchmark's own scorer: a value in [0, 1] and its details."""
        raise NotImplementedError

    def offline_status(self) -> dict[str, str]:
        """Category -> "ok", or the reason it cannot run offline."""
        raise NotImplementedError

    def make_user_simulator(self, base_url: str, model: str) -> UserSimulator | None:
        """The benchmark's simulated user, played by `model` at an OpenAI-compatible `base_url`;
        None for benchmarks without one."""
        return None

    def rollout_record(self, task: Task, world: ToolWorld) -> dict[str, Any]:
        """What a real-mode rollout's world holds that scoring needs (stored by the engine in
        `trajectory.benchmark_record`). Most benchmarks need nothing."""
        return {}

    def aggregate(self, results: list[dict[str, Any]]) -> dict[str, Any]:
        """Per-category accuracy and the overall over tasks. `results`: one dict per scored
        trajectory with "category", "score" and "details" (what `score` returned; FinMCP's F1
        summaries read it); other keys are ignored."""
        per_category = category_accuracy(results)
        total = sum(c["count"] for c in per_category.values())
        overall = sum(c["accuracy"] * c["count"] for c in per_category.values()) / total if total else 0.0
        return {"categories": per_category, "overall": overall, "weighting": "mean over tasks"}


@REWARDS.register("benchmark")
def benchmark_reward(task: Task, trajectory: Trajectory, ctx: Context) -> RewardResult:
    """The benchmark's own scorer (`ctx.env` is the Benchmark); the details are what it returned.
    Off real mode `compute_rewards` replays the committed calls on a fresh world for rehearsal
    fidelity, as it does for every reward that does not replay them itself."""
    value, details = ctx.env.score(task, trajectory)
    return RewardResult(value, dict(details))


def category_accuracy(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """{category: {"accuracy": mean score, "count": n}}; repeated trials of a task all count."""
    scores: dict[str, list[float]] = defaultdict(list)
    for r in results:
        scores[r["category"]].append(float(r["score"]))
    return {c: {"accuracy": sum(v) / len(v), "count": len(v)} for c, v in sorted(scores.items())}


def completed(trajectory: Trajectory) -> bool:
    """Did the conversation end normally (the agent answered and no user turn was left, or the
    simulated user ended it)? Hand-built trajectories (no end reason) count as complete."""
    return trajectory.end_reason in (None, EndReason.ANSWERED, EndReason.USER_ENDED)


def assistant_texts(trajectory: Trajectory) -> list[str]:
    """The agent's messages to the user, in order: assistant messages not followed by a tool
    result. Falls back to the final answer for trajectories without a readable chat."""
    msgs = trajectory.messages
    texts = [
        m["content"] for i, m in enumerate(msgs)
        if m["role"] == "assistant" and m.get("content") and (i + 1 == len(msgs) or msgs[i + 1]["role"] != "tool")
    ]
    if not texts and trajectory.final_answer:
        texts = [trajectory.final_answer]
    return texts


class UnexecutableWorld(ToolWorld):
    """The world of tasks scored on the calls alone (BFCL single-turn, FinMCP): nothing is
    executed, every call is answered with a NOT_EXECUTABLE error saying why."""

    name = "unexecutable"
    executable = False

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__()

    def call(self, name: str, arguments: Any) -> dict[str, Any]:
        return error("NOT_EXECUTABLE", self.reason)


ChatFn = Callable[[list[dict[str, str]]], str]


def openai_chat(base_url: str, model: str, api_key: str = "EMPTY", temperature: float = 0.0, timeout: float = 120.0) -> ChatFn:
    """A chat function (messages -> reply text) over any OpenAI-compatible server's
    /chat/completions: what simulated users and judges call (a local server keeps runs offline)."""
    import httpx

    url = base_url.rstrip("/") + "/chat/completions"

    def chat(messages: list[dict[str, str]]) -> str:
        body = {"model": model, "messages": messages, "temperature": temperature}
        response = httpx.post(url, json=body, headers={"Authorization": f"Bearer {api_key}"}, timeout=timeout)
        response.raise_for_status()
        return response.json()["choices"][0]["message"]["content"] or ""

    return chat
