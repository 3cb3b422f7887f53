"""One rollout in flight, and the only code that grows its transcript.

`Episode` is the state of one trajectory being rolled out. `EpisodeWriter` appends to it:
forced turns within the total-token limit, answers to queued calls (each call's `CallStatus`),
penalties, and the end. The engine, the tool responders and the user channels all write through
it, so every rule (token limits, statuses, what a malformed output costs) lives in one place.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from envace.backends.base import Completion, Generator, SamplingParams
from envace.envs.base import ToolWorld
from envace.parsing import ParseError
from envace.rollout.config import RolloutConfig
from envace.transcript import Transcript
from envace.types import CallStatus, EndReason, Role, Task, ToolCall, Trajectory, Turn


@dataclass
class Episode:
    task: Task
    traj: Trajectory
    session: int
    world: ToolWorld | None  # the real world (real mode only)
    description: str
    tools: list[dict[str, Any]]
    pending: list[int] = field(default_factory=list)  # tokens appended but not yet fed
    queue: list[ToolCall] = field(default_factory=list)  # calls of the last ACT turn awaiting answers
    act_turns: int = 0
    user_turn: int = 0
    length: int = 0  # tokens in the transcript so far
    # Continuous batching: the role and params of a generation paused mid-way, resumed next call.
    inflight: tuple[Role, SamplingParams] | None = None
    started: float = field(default_factory=time.perf_counter)

    @property
    def done(self) -> bool:
        return self.traj.end_reason is not None

    def append(self, turn: Turn, fed: bool = False) -> None:
        self.traj.turns.append(turn)
        self.length += len(turn.token_ids)
        if not fed:
            self.pending.extend(turn.token_ids)


class EpisodeWriter:
    """Appends to episodes under one `RolloutConfig` and one transcript layout."""

    def __init__(self, config: RolloutConfig, transcript: Transcript, eos: tuple[int, ...]):
        self.config = config
        self.transcript = transcript
        self.eos = eos

    # ---- ending --------------------------------------------------------------------------
    def end(self, ep: Episode, reason: EndReason, error: dict[str, Any] | None = None) -> None:
        """End the episode; calls still queued were never answered."""
        for call in ep.queue:
            call.status = CallStatus.UNANSWERED
        ep.queue.clear()
        ep.traj.end_reason = reason
        ep.traj.end_error = error

    def penalize(self, ep: Episode, role: str, output: Turn | None, err: ParseError, reason: EndReason) -> bool:
        """Count and flag a malformed output; True when the rollout goes on (`on_malformed`)."""
        ep.traj.penalties[role] = ep.traj.penalties.get(role, 0) + 1
        if output is not None:
            output.malformed = True
        if self.config.on_malformed == "continue" and err.code != "EMPTY_OUTPUT":
            return True
        self.end(ep, EndReason.EMPTY_OUTPUT if err.code == "EMPTY_OUTPUT" else reason, err.observation())
        return False

    def truncated(self, ep: Episode) -> None:
        """A generation used up its token budget before its end marker. One rule for every role
        and layout: the trajectory ends there, as the limit that capped it, with no penalty."""
        full = ep.length >= self.config.max_total_tokens
        self.end(ep, EndReason.MAX_TOTAL_TOKENS if full else EndReason.MAX_TURN_TOKENS)

    # ---- appending -------------------------------------------------------------------------
    def force(self, ep: Episode, *turns: Turn) -> None:
        """Append forced turns, or end the episode if they would break the total-token limit."""
        if ep.length + sum(len(t.token_ids) for t in turns) > self.config.max_total_tokens:
            self.end(ep, EndReason.MAX_TOTAL_TOKENS)
            return
        for t in turns:
            ep.append(t)

    def answer(self, ep: Episode, obs: dict[str, Any], status: CallStatus) -> ToolCall:
        """Record `obs` as the answer to the first queued call (what ACT is shown for it)."""
        call = ep.queue.pop(0)
        call.status = status
        ep.traj.observations.append(obs)
        ep.traj.messages.append({"role": "tool", "name": call.name, "content": obs})
        return call

    def tool_turn(self, ep: Episode, obs: dict[str, Any], status: CallStatus, generated: Turn | None = None) -> None:
        """Answer the first queued call and append its tool-response turn: `generated` (a
        rehearsal, sampled within its budget) or a forced ENV turn, then the scaffolding after it."""
        self.answer(ep, obs, status)
        layout = self.transcript.layout
        following = layout.tool_to_tool if ep.queue else layout.tool_to_act
        if generated is None:
            generated = self.transcript.tool_response(obs, Role.ENV)
            self.force(ep, generated, self.transcript.forced_after(generated.text, following))
        else:
            ep.append(generated, fed=True)
            self.force(ep, self.transcript.forced_after(generated.text, following))

    # ---- generating ------------------------------------------------------------------------
    def params(self, max_new: int, marker: str) -> SamplingParams:
        stops = () if marker == self.transcript.layout.eos_text else (marker,)
        return SamplingParams(max_new_tokens=max_new, temperature=self.config.temperature, top_p=self.config.top_p,
                              stop_token_ids=self.eos, stop_strings=stops)

    def budget(self, ep: Episode, per_turn: int) -> int:
        """Tokens the episode's next generation may use; 0 ends it at the total-token limit."""
        room = self.config.max_total_tokens - ep.length
        if room <= 0:
            self.end(ep, EndReason.MAX_TOTAL_TOKENS)
            return 0
        return min(per_turn, room)

    def request(self, ep: Episode, per_turn: int, marker: str) -> SamplingParams | None:
        """The params of the episode's next generation within its own budget (one episode near the
        total limit never cuts the others short); None when that limit has ended it."""
        budget = self.budget(ep, per_turn)
        return self.params(budget, marker) if budget > 0 else None

    def generate(self, gen: Generator, eps: list[Episode], per_turn: int, marker: str) -> list[tuple[Episode, Completion]]:
        """One batched generation continuing each episode's own session with its pending tokens."""
        requests = [(e, self.request(e, per_turn, marker)) for e in eps]
        live = [(e, p) for e, p in requests if p is not None]
        if not live:
            return []
        outs = gen.generate([e.session for e, _ in live], [e.pending for e, _ in live], [p for _, p in live])
        for e, _ in live:
            e.pending = []
        return [(e, out) for (e, _), out in zip(live, outs)]
