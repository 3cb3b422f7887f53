"""Test-time private rehearsal: rehearse a task N times in imagination, keep notes, then act once.

The rehearsing model plays both the agent and the tools (rehearse mode): the real environment is
never called and no world is created. Each attempt gets a self-evaluation written by the model
(did the plan reach the goal, which call looked wrong, what to do differently). Modes:

  parallel    N independent attempts from the same context, in one batch
  sequential  attempt k sees attempts 1..k-1 and their evaluations (the `revise` section)
  none        no rehearsal: the committed run alone (the baseline)

The model then summarises all attempts and evaluations into a rehearsal memory of at most
`memory_tokens` tokens, and ONE committed execution runs in the real environment with that memory
in its system message (the `memory` section). Every result carries its cost (`RehearsalCost`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, TypeVar

from envace.backends.base import Generator, SamplingParams
from envace.config import ConfigError
from envace.rehearsal.cost import RehearsalCost, TokenCost
from envace.rehearsal.prompts import RehearsalPrompts, render_attempt, task_text
from envace.rollout import CallGuard, Environment, RolloutConfig, RolloutEngine
from envace.transcript import Transcript
from envace.types import Task, Trajectory

T = TypeVar("T")


@dataclass
class RehearsalConfig:
    mode: Literal["none", "parallel", "sequential"] = "parallel"
    n: int = 2  # rehearsal attempts per task
    execution: RolloutConfig = field(default_factory=RolloutConfig)  # the committed run (mode forced to real)
    # Limits and sampling of each attempt (mode forced to rehearse); None = the execution's. Its
    # `max_active` also bounds the evaluation and summary batches: N attempts of many tasks would
    # otherwise all hold a KV cache at once (40 tasks x N = 4 went past 17 GB on the default model).
    attempt: RolloutConfig | None = None
    evaluation_tokens: int = 96  # per self-evaluation
    memory_tokens: int = 128  # bound on the rehearsal memory, in the acting policy's tokens
    temperature: float = 0.0  # sampling of evaluations and the summary (0 = greedy)
    prompts: RehearsalPrompts = field(default_factory=RehearsalPrompts)

    def validate(self) -> None:
        if self.mode not in ("none", "parallel", "sequential"):
            raise ConfigError(f"rehearsal mode must be none, parallel or sequential, got {self.mode!r}")
        for name in ("n", "evaluation_tokens", "memory_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        self.execution.validate()
        if self.attempt is not None:
            self.attempt.validate()

    def attempt_config(self) -> RolloutConfig:
        return dataclasses.replace(self.attempt or self.execution, mode="rehearse")

    def execution_config(self) -> RolloutConfig:
        return dataclasses.replace(self.execution, mode="real")


@dataclass
class RehearsalResult:
    task_id: str
    memory: str = ""  # the notes the committed run saw ('' in mode none)
    attempts: list[Trajectory] = field(default_factory=list)  # rehearse-mode trajectories, in order
    evaluations: list[str] = field(default_factory=list)  # one self-evaluation per attempt
    cost: RehearsalCost = field(default_factory=RehearsalCost)
    committed: Trajectory | None = None  # the real run; None after `rehearse_batch` alone


def with_system_note(task: Task, note: str) -> Task:
    """A copy of `task` whose system message ends with `note` (one is added if the task has none);
    the rollout appends the world's documentation after it."""
    messages = [dict(m) for m in task.messages]
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{note}"
    else:
        messages.insert(0, {"role": "system", "content": note})
    return dataclasses.replace(task, messages=messages)


def fit_tokens(text: str, tokenizer: Any, limit: int) -> str:
    """`text` cut to at most `limit` tokens of `tokenizer`. Generation already stops at the limit;
    this holds it when the rehearser's tokenizer differs or decoding does not re-encode exactly."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(tokenizer.encode(text, add_special_tokens=False)) > limit:
        ids = ids[: min(limit, len(ids) - 1)]
        text = tokenizer.decode(ids)
    return text


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    started = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started


def _charge(phase: str, results: list[RehearsalResult], costs: list[TokenCost], seconds: float) -> None:
    """Add item i's tokens and an equal share of the batched phase's wall time to results[i]."""
    for result, cost in zip(results, costs):
        share = dataclasses.replace(cost, seconds=seconds / len(results))
        setattr(result.cost, phase, getattr(result.cost, phase) + share)


class Rehearser:
    """Private rehearsal followed by one committed run.

    `rehearser` (default: `policy`) writes the attempts, evaluations and memory; `policy` acts in
    the committed run. They may be different models (e.g. rehearse with the base model, act with
    the trained one): only the memory's text passes between them. `guard` (e.g. a
    `RehearsalGuard`) checks irreversible calls of the committed run; its cost is accounted too."""

    def __init__(self, policy: Generator, env: Environment, config: RehearsalConfig | None = None, rehearser: Generator | None = None, guard: CallGuard | None = None):
        self.policy = policy
        self.env = env
        self.config = config or RehearsalConfig()
        self.config.validate()
        self.rehearser = rehearser or policy
        self.guard = guard
        self.transcript = Transcript(self.rehearser.tokenizer)

    # ---- public ----------------------------------------------------------------------
    def run(self, task: Task) -> RehearsalResult:
        return self.run_batch([task])[0]

    def run_batch(self, tasks: list[Task], progress: bool = False) -> list[RehearsalResult]:
        """Rehearse every task, then commit each once in its real world; all tasks batched together."""
        results = self.rehearse_batch(tasks, progress)
        self._commit(tasks, results, progress)
        return results

    def rehearse_batch(self, tasks: list[Task], progress: bool = False) -> list[RehearsalResult]:
        """The rehearsal alone (memory, attempts, evaluations, cost): no real world is created."""
        results = [RehearsalResult(task.id) for task in tasks]
        if self.config.mode == "none" or not tasks:
            return results
        engine = RolloutEngine(self.rehearser, self.env, self.config.attempt_config())
        if self.config.mode == "parallel":
            self._attempt_round(engine, tasks, results, tasks, self.config.n, progress, "rehearse")
        else:
            for i in range(self.config.n):
                contexts = [self._with_history(task, result) for task, result in zip(tasks, results)]
                self._attempt_round(engine, tasks, results, contexts, 1, progress, f"rehearse {i + 1}/{self.config.n}")
        self._summarize(tasks, results)
        return results

    # ---- phases ----------------------------------------------------------------------
    def _attempt_round(self, engine: RolloutEngine, tasks: list[Task], results: list[RehearsalResult], contexts: list[Task], k: int, progress: bool, desc: str) -> None:
        """k attempts per task from `contexts` (the tasks, possibly with earlier attempts), then their evaluations."""
        groups, seconds = _timed(lambda: engine.run(contexts, k=k, progress=progress, desc=desc))
        items = [(task, result, traj) for task, result, group in zip(tasks, results, groups) for traj in group]
        for _, result, traj in items:
            result.attempts.append(traj)
        _charge("attempts", [r for _, r, _ in items], [TokenCost.of_trajectory(t) for _, _, t in items], seconds)
        self._evaluate(items)

    def _evaluate(self, items: list[tuple[Task, RehearsalResult, Trajectory]]) -> None:
        prompts = self.config.prompts
        chats = [prompts.evaluate.format(task=task_text(task), documentation=self._documentation(task), attempt=render_attempt(traj)) for task, _, traj in items]
        outs, seconds = _timed(lambda: self._complete(chats, self.config.evaluation_tokens))
        for (_, result, _), (text, _) in zip(items, outs):
            result.evaluations.append(text)
        _charge("evaluations", [r for _, r, _ in items], [c for _, c in outs], seconds)

    def _summarize(self, tasks: list[Task], results: list[RehearsalResult]) -> None:
        limit = self.config.memory_tokens
        chats = [
            self.config.prompts.summarize.format(task=task_text(task), documentation=self._documentation(task), attempts=self._records(result), memory_tokens=limit)
            for task, result in zip(tasks, results)
        ]
        outs, seconds = _timed(lambda: self._complete(chats, limit))
        for result, (text, _) in zip(results, outs):
            result.memory = fit_tokens(text, self.policy.tokenizer, limit)
        _charge("summary", results, [c for _, c in outs], seconds)

    def _commit(self, tasks: list[Task], results: list[RehearsalResult], progress: bool) -> None:
        contexts = [with_system_note(task, self.config.prompts.memory.format(memory=r.memory)) if r.memory else task for task, r in zip(tasks, results)]
        engine = RolloutEngine(self.policy, self.env, self.config.execution_config(), guard=self.guard)
        groups, seconds = _timed(lambda: engine.run(contexts, k=1, progress=progress, desc="commit"))
        committed = [group[0] for group in groups]
        guard_costs = [TokenCost.of_events(traj.events) for traj in committed]
        for result, traj, guard_cost in zip(results, committed, guard_costs):
            result.committed = traj
            result.cost.guard += guard_cost
        # Guard rehearsals ran inside the committed phase: its own time is what remains.
        own_seconds = seconds - sum(c.seconds for c in guard_costs)
        _charge("execution", results, [TokenCost.of_trajectory(t) for t in committed], own_seconds)

    # ---- helpers ---------------------------------------------------------------------
    def _with_history(self, task: Task, result: RehearsalResult) -> Task:
        """The task as sequential attempt k sees it: earlier attempts and evaluations in its system message."""
        if not result.attempts:
            return task
        return with_system_note(task, self.config.prompts.revise.format(attempts=self._records(result)))

    def _records(self, result: RehearsalResult) -> str:
        record = self.config.prompts.attempt_record
        return "\n\n".join(
            record.format(index=i + 1, transcript=render_attempt(traj), evaluation=evaluation)
            for i, (traj, evaluation) in enumerate(zip(result.attempts, result.evaluations))
        )

    def _documentation(self, task: Task) -> str:
        return self.env.describe(task)[0]

    def _complete(self, user_messages: list[str], max_new_tokens: int) -> list[tuple[str, TokenCost]]:
        """One single-turn chat per message, generated by the rehearser in batches of at most the
        attempts' `max_active` (all at once when unset)."""
        prompts = [self.transcript.prompt([{"role": "user", "content": m}], "", []) for m in user_messages]
        marker = self.transcript.layout.act_marker
        eos = self.rehearser.tokenizer.eos_token_id
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=self.config.temperature,
            stop_token_ids=(eos,) if eos is not None else (),
            stop_strings=() if marker == self.transcript.layout.eos_text else (marker,),
        )
        step = self.config.attempt_config().max_active or max(1, len(prompts))
        outs = []
        for lo in range(0, len(prompts), step):
            batch = prompts[lo:lo + step]
            sessions = self.rehearser.open(len(batch))
            try:
                outs += self.rehearser.generate(sessions, [p.token_ids for p in batch], params)
            finally:
                self.rehearser.close(sessions)
        return [(self.transcript.strip_marker(o.text, marker).strip(), TokenCost(len(o.token_ids), len(p.token_ids))) for p, o in zip(prompts, outs)]


# ---- functions for applications and the CLI -------------------------------------------------


def rehearse_memory(policy: Generator, env: Environment, task: Task, config: RehearsalConfig | None = None, rehearser: Generator | None = None) -> str:
    """For applications with their own agent loop: rehearse `task` privately and return the notes as
    a ready-to-prepend system-prompt section (the `memory` template), or '' if there are none."""
    config = config or RehearsalConfig()
    memory = Rehearser(policy, env, config, rehearser).rehearse_batch([task])[0].memory
    return config.prompts.memory.format(memory=memory) if memory else ""


def accounting(results: list[RehearsalResult], config: RehearsalConfig) -> dict[str, Any]:
    """Totals over all tasks (`RehearsalCost.as_dict`) plus each task's memory, evaluations and cost."""
    total = sum((r.cost for r in results), RehearsalCost())
    per_task = [{"task_id": r.task_id, "memory": r.memory, "evaluations": r.evaluations, **r.cost.as_dict()} for r in results]
    return {"mode": config.mode, "n": config.n if config.mode != "none" else 0, "tasks": len(results), **total.as_dict(), "per_task": per_task}


def run_with_rehearsal(
    policy: Generator,
    env: Environment,
    tasks: list[Task],
    config: RehearsalConfig,
    rehearser: Generator | None = None,
    progress: bool = True,
    guard: CallGuard | None = None,
) -> tuple[list[list[Trajectory]], dict[str, Any]]:
    """`envace eval --rehearsal`: one committed trajectory per task (groups of one, as
    `RolloutEngine.run` returns them, ready for `compute_rewards`) and the cost `accounting`."""
    results = Rehearser(policy, env, config, rehearser, guard).run_batch(tasks, progress)
    return [[r.committed] for r in results], accounting(results, config)
