"""Rewards, pluggable by name. Each returns a `RewardResult`: a value in [0, 1] plus details.

  replay     run ACT's committed calls on a fresh executable world (verification only: the policy
             never sees these observations) and apply the task's verifier
  reference  tool-call match against the task's reference calls (name and full-call F1)
  judge      a weighted checklist scored by an LLM judge through any Generator backend

A user's own reward is any `fn(task, trajectory, context)` returning a `RewardResult` or a
`(value, details)` pair, named as `mypkg.rewards:my_reward`. Details are for reading
(`Trajectory.reward_details`): what other stages need travels in typed fields.
"""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from envace.backends.base import Generator, SamplingParams
from envace.envs.base import ToolWorld
from envace.registry import Registry
from envace.types import Task, ToolCall, Trajectory


@dataclass
class Context:
    """What a reward may use besides the task and trajectory."""

    env: Any  # a rollout.Environment (make_world / describe)
    judge: Generator | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def make_world(self, task: Task) -> ToolWorld:
        return self.env.make_world(task)

    @functools.cached_property
    def judge_transcript(self) -> Any:
        from envace.transcript import Transcript

        return Transcript(self.judge.tokenizer)

    def judge_reply(self, prompt: str, max_new_tokens: int) -> str:
        """The judge's greedy answer to one user message (through any Generator backend)."""
        if self.judge is None:
            raise ValueError("this reward needs a judge model (--judge MODEL or URL)")
        ids = self.judge_transcript.prompt([{"role": "user", "content": prompt}], "", []).token_ids
        (session,) = self.judge.open(1)
        eos = self.judge.tokenizer.eos_token_id
        try:
            (out,) = self.judge.generate([session], [ids], SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=(eos,) if eos is not None else ()))
        finally:
            self.judge.close([session])
        return out.text


@dataclass
class RewardResult:
    """A reward's score. `real_observations`: the real world's responses to the trajectory's
    committed calls, when the reward replayed them (they become `Trajectory.real_observations`)."""

    value: float
    details: dict[str, Any] = field(default_factory=dict)  # for reading only
    real_observations: list[dict[str, Any]] | None = None


RewardFn = Callable[[Task, Trajectory, Context], "RewardResult | tuple[float, dict[str, Any]]"]
REWARDS: Registry[RewardFn] = Registry("reward")


def replay_calls(world: ToolWorld, calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Execute calls in order on a world; returns the real observations."""
    return [world.execute(c) for c in calls]


@REWARDS.register("replay")
def replay_reward(task: Task, traj: Trajectory, ctx: Context) -> RewardResult:
    # Only committed calls happened: a call the guard revised or the episode's end left
    # unanswered must not change the world the verifier checks.
    world = ctx.make_world(task)
    observations = replay_calls(world, traj.committed_calls)
    value, details = world.verify(task, traj.final_answer)
    return RewardResult(value, details, observations)


def prf(tp: int, n_pred: int, n_ref: int) -> tuple[float, float, float]:
    """Precision, recall, F1 from counts; two empty sides agree perfectly (1, 1, 1)."""
    if n_pred == 0 and n_ref == 0:
        return 1.0, 1.0, 1.0
    p = tp / n_pred if n_pred else 0.0
    r = tp / n_ref if n_ref else 0.0
    return p, r, (2 * p * r / (p + r) if p + r else 0.0)


def _canonical(call: dict[str, Any] | ToolCall) -> str:
    d = call.to_dict() if isinstance(call, ToolCall) else {"name": call["name"], "arguments": call.get("arguments", {})}
    return json.dumps(d, sort_keys=True)


def multiset_f1(predicted: list[str], reference: list[str]) -> tuple[float, float, float]:
    """Precision/recall/F1 of two multisets of strings."""
    tp = sum((Counter(predicted) & Counter(reference)).values())
    return prf(tp, len(predicted), len(reference))


@REWARDS.register("reference")
def reference_reward(task: Task, traj: Trajectory, ctx: Context) -> RewardResult:
    if not task.reference_calls:
        raise ValueError(f"task {task.id} has no reference_calls; the 'reference' reward needs them")
    ref = task.reference_calls
    name_p, name_r, name_f1 = multiset_f1([c.name for c in traj.tool_calls], [c["name"] for c in ref])
    call_p, call_r, call_f1 = multiset_f1([_canonical(c) for c in traj.tool_calls], [_canonical(c) for c in ref])
    details = {"name_precision": name_p, "name_recall": name_r, "name_f1": name_f1, "call_precision": call_p, "call_recall": call_r, "call_f1": call_f1}
    return RewardResult(call_f1, details)


JUDGE_PROMPT = """You grade an AI agent's work against a checklist.

# Task
{task}

# What the agent did
{transcript}

# Checklist
{items}

For each item answer on its own line exactly "<number>: PASS" or "<number>: FAIL"."""

_VERDICT = re.compile(r"^\s*(\d+)\s*[:.)-]\s*(PASS|FAIL)", re.IGNORECASE | re.MULTILINE)


def judge_prompt(task: Task, traj: Trajectory) -> str:
    task_text = "\n".join(f"{m['role']}: {m['content']}" for m in task.messages)
    lines = []
    for m in traj.messages:
        if m["role"] in ("assistant", "tool"):
            content = m["content"] if isinstance(m["content"], str) else json.dumps(m["content"])
            lines.append(f"{m['role']}: {content}")
    items = "\n".join(f"{i + 1}. {c['item']}" for i, c in enumerate(task.checklist))
    return JUDGE_PROMPT.format(task=task_text, transcript="\n".join(lines) or "(nothing)", items=items)


def parse_verdicts(text: str, n_items: int) -> list[bool]:
    """Item i passes only if the judge wrote "i: PASS"; a missing verdict counts as FAIL."""
    verdicts = [False] * n_items
    for num, word in _VERDICT.findall(text):
        i = int(num) - 1
        if 0 <= i < n_items:
            verdicts[i] = word.upper() == "PASS"
    return verdicts


def score_checklist(checklist: list[dict[str, Any]], verdicts: list[bool]) -> float:
    total = sum(float(c.get("weight", 1.0)) for c in checklist)
    passed = sum(float(c.get("weight", 1.0)) for c, ok in zip(checklist, verdicts) if ok)
    return passed / total if total else 0.0


@REWARDS.register("judge")
def judge_reward(task: Task, traj: Trajectory, ctx: Context) -> RewardResult:
    if ctx.judge is None:
        raise ValueError("the 'judge' reward needs a judge model (--judge MODEL or URL)")
    if not task.checklist:
        raise ValueError(f"task {task.id} has no checklist; the 'judge' reward needs one")
    text = ctx.judge_reply(judge_prompt(task, traj), max_new_tokens=16 * len(task.checklist) + 32)
    verdicts = parse_verdicts(text, len(task.checklist))
    return RewardResult(score_checklist(task.checklist, verdicts), {"verdicts": verdicts, "judge_output": text})


def as_result(returned: RewardResult | tuple[float, dict[str, Any]]) -> RewardResult:
    """A reward's return value as a `RewardResult` (users' rewards may return `(value, details)`)."""
    if isinstance(returned, RewardResult):
        return returned
    value, details = returned
    return RewardResult(value, dict(details))


def score_trajectory(fn: RewardFn, task: Task, traj: Trajectory, ctx: Context) -> None:
    """Set `reward`, `reward_details` and `real_observations` of one trajectory.

    Off real mode, when the reward did not replay the committed calls, they are replayed here on
    a fresh executable world so that rehearsal fidelity has its reference whatever the reward;
    records count those executions as `verification_calls`, as they count the replay reward's."""
    result = as_result(fn(task, traj, ctx))
    traj.reward, traj.reward_details = result.value, result.details
    traj.real_observations = result.real_observations
    if traj.real_observations is None and traj.mode != "real":
        world = ctx.make_world(task)
        if world.executable:
            traj.real_observations = replay_calls(world, traj.committed_calls)


def compute_rewards(reward_name: str, groups: list[list[Trajectory]], tasks: list[Task], ctx: Context) -> None:
    """Score every trajectory in place (`score_trajectory`)."""
    fn = REWARDS.get(reward_name)
    for task, group in zip(tasks, groups):
        for traj in group:
            score_trajectory(fn, task, traj, ctx)
