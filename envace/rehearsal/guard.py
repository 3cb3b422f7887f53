"""The pre-commit rehearsal guard: rehearse an irreversible call before executing it for real.

In real mode the rollout engine asks its guard about every call to a tool the world marks
irreversible (`ToolWorld.irreversible_tools`). `RehearsalGuard` continues the agent's own
transcript in rehearse mode from that point: the policy writes the tool's response to the call,
then plays the agent (and the tools) for up to `horizon` more ACT turns. A rule reads that
rehearsal and decides: execute, revise (the agent gets the reason as the call's observation and the
call is not executed) or stop (the trajectory ends STOPPED, to ask the user).

Rules, by name or as `module:function` (a `GuardRule`: `fn(GuardRehearsal) -> GuardDecision`):
  goal      execute only if the rehearsed continuation ends in an answer and no rehearsed response
            (the call's or a later one) is an error; a broken rehearsal counts as failed
  no_error  execute unless the rehearsed response to the call is an error; a rehearsal that
            produced no valid response gives no evidence, so the call is executed
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable

from envace.backends.base import Generator
from envace.registry import Registry
from envace.rehearsal.cost import TokenCost
from envace.rollout import Environment, GuardDecision, RolloutConfig, RolloutEngine
from envace.transcript import compact_json
from envace.types import EndReason, Task, ToolCall, Trajectory


@dataclass
class GuardRehearsal:
    """What rehearsing a pending irreversible call predicted: the input of a guard rule."""

    task: Task
    call: ToolCall
    continuation: Trajectory  # the trajectory up to the call, then the rehearsed turns
    start: int  # index of the first rehearsed turn in continuation.turns
    first_message: int  # index of the first rehearsed message in continuation.messages
    horizon: int  # ACT turns the rehearsal could play after the call's response

    @property
    def responses(self) -> list[dict[str, Any]]:
        """The rehearsed tool responses in order; the guarded call's comes first."""
        return [m["content"] for m in self.continuation.messages[self.first_message :] if m["role"] == "tool"]

    @property
    def observation(self) -> dict[str, Any] | None:
        """The rehearsed response to the call; None when the policy wrote no valid response."""
        return next(iter(self.responses), None)

    @property
    def answered(self) -> bool:
        return self.continuation.end_reason == EndReason.ANSWERED

    @property
    def text(self) -> str:
        """The rehearsed turns as the policy wrote them (template scaffolding included)."""
        return "".join(t.text for t in self.continuation.turns[self.start :])


GuardRule = Callable[[GuardRehearsal], GuardDecision]
GUARD_RULES: Registry[GuardRule] = Registry("guard rule")


def _describe_error(obs: dict[str, Any]) -> str:
    err = obs["error"]
    return f"{err.get('code', 'ERROR')}: {err.get('message', '')}" if isinstance(err, dict) else compact_json(err)


def revise(rehearsal: GuardRehearsal, why: str) -> GuardDecision:
    """A 'revise' decision whose reason tells the agent what the rehearsal predicted."""
    return GuardDecision("revise", f"Not executed: a private rehearsal of this {rehearsal.call.name} call {why}. Check the call and its arguments, or ask the user.")


@GUARD_RULES.register("no_error")
def no_error_rule(rehearsal: GuardRehearsal) -> GuardDecision:
    obs = rehearsal.observation
    if obs is not None and "error" in obs:
        return revise(rehearsal, f"predicted the error {_describe_error(obs)}")
    return GuardDecision("execute")


@GUARD_RULES.register("goal")
def goal_rule(rehearsal: GuardRehearsal) -> GuardDecision:
    error = next((o for o in rehearsal.responses if "error" in o), None)
    if error is not None:
        return revise(rehearsal, f"predicted the error {_describe_error(error)}")
    if not rehearsal.answered:
        ended = rehearsal.continuation.end_reason.value if rehearsal.continuation.end_reason else "unfinished"
        return revise(rehearsal, f"did not reach an answer within {rehearsal.horizon} turns (rehearsal ended: {ended})")
    return GuardDecision("execute")


class RehearsalGuard:
    """A `CallGuard` (pass it as `RolloutEngine(..., guard=...)` or `Rehearser(..., guard=...)`).

    `policy` rehearses; it continues the agent's token sequence, so it must share the acting
    policy's tokenizer. `config` sets its token limits and sampling (default: greedy); its mode is
    always rehearse and `max_turns` is `horizon`. Every decision's `details` (logged in
    `Trajectory.events`) hold the rule, the rehearsed response, the rehearsed text, how the
    rehearsal ended and its `cost` (a `TokenCost` as a dict)."""

    def __init__(self, policy: Generator, env: Environment, rule: str | GuardRule = "goal", horizon: int = 2, config: RolloutConfig | None = None):
        if horizon < 0:
            raise ValueError(f"horizon must be >= 0, got {horizon}")
        if rule == "goal" and horizon < 1:
            raise ValueError("rule 'goal' needs horizon >= 1: with no ACT turn after the call nothing can end in an answer")
        self.rule_name = rule if isinstance(rule, str) else getattr(rule, "__name__", repr(rule))
        self.rule = GUARD_RULES.get(rule) if isinstance(rule, str) else rule
        self.horizon = horizon
        base = config or RolloutConfig(temperature=0.0)
        self.engine = RolloutEngine(policy, env, dataclasses.replace(base, mode="rehearse", max_turns=horizon))

    def __call__(self, task: Task, traj: Trajectory, call: ToolCall) -> GuardDecision:
        started = time.perf_counter()
        (continuation,) = self.engine.resume(task, traj)
        rehearsal = GuardRehearsal(task, call, continuation, len(traj.turns), len(traj.messages), self.horizon)
        decision = self.rule(rehearsal)
        if not isinstance(decision, GuardDecision):
            raise TypeError(f"guard rule {self.rule_name!r} must return a GuardDecision, got {type(decision).__name__}")
        cost = TokenCost.of_trajectory(continuation, start=rehearsal.start)
        cost.seconds = time.perf_counter() - started
        decision.details.update(
            rule=self.rule_name,
            rehearsed_observation=rehearsal.observation,
            rehearsal=rehearsal.text,
            rehearsal_end=continuation.end_reason.value if continuation.end_reason else None,
            cost=dataclasses.asdict(cost),
        )
        return decision
