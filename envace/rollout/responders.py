"""Who answers ACT's tool calls: one responder per mode.

  RealWorld           the episode's executable world runs the call (ENV tokens are forced);
                      an optional pre-commit guard may decline irreversible calls first
  TranscriptRehearsal the policy writes the response in the agent's own transcript (REHEARSE)
  IsolatedSimulator   a fresh simulator prompt per call: the policy (REHEARSE, one training row
                      per answer, `Trajectory.side_rows`) or a frozen external simulator
  RecordedReference   the response recorded in the task's reference trajectory (forced, as in
                      real mode): world-free SFT data, and an oracle-tools evaluation

Each `answer(episodes)` answers the first queued call of every given episode, batched where a
model writes the answers; the engine calls it until no episode has a call waiting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from envace.backends.base import Completion, Generator, SamplingParams
from envace.parsing import ParseError, parse_rehearsal
from envace.references import call_key, recorded_exchanges
from envace.rollout.episode import Episode, EpisodeWriter
from envace.transcript import Transcript, simulator_messages
from envace.types import CallStatus, EndReason, Role, Task, ToolCall, Trajectory, Turn


class ToolResponder(Protocol):
    def answer(self, episodes: list[Episode]) -> None: ...


@dataclass
class GuardDecision:
    """What to do with an irreversible call in real mode: execute it, hand the agent `reason` as
    the call's observation instead (revise), or stop and ask the user."""

    action: Literal["execute", "revise", "stop"]
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)


class CallGuard(Protocol):
    def __call__(self, task: Task, traj: Trajectory, call: ToolCall) -> GuardDecision: ...


class RealWorld:
    def __init__(self, writer: EpisodeWriter, guard: CallGuard | None = None):
        self.writer = writer
        self.guard = guard

    def answer(self, episodes: list[Episode]) -> None:
        for ep in episodes:
            call = ep.queue[0]
            if self.guard is not None and call.name in ep.world.irreversible_tools and not self._allowed(ep, call):
                continue
            ep.traj.real_env_calls += 1
            self.writer.tool_turn(ep, ep.world.execute(call), CallStatus.EXECUTED)

    def _allowed(self, ep: Episode, call: ToolCall) -> bool:
        """Ask the guard; a declined call is answered with the reason (revise) or ends the episode (stop)."""
        decision = self.guard(ep.task, ep.traj, call)
        ep.traj.events.append({"event": "guard", "call": call.to_dict(), "action": decision.action, "reason": decision.reason, **decision.details})
        if decision.action == "stop":
            ep.queue.pop(0).status = CallStatus.STOPPED
            self.writer.end(ep, EndReason.STOPPED)
            return False
        if decision.action == "revise":
            self.writer.tool_turn(ep, {"error": {"code": "NOT_EXECUTED", "message": decision.reason}}, CallStatus.REVISED)
            return False
        return True


class RecordedReference:
    """Answers each call with the response the task's reference recorded for the same call (name
    and arguments; the k-th identical call gets the k-th recorded response). A call the reference
    never made gets an UNRECORDED error: nothing can say what the world would have returned."""

    def __init__(self, writer: EpisodeWriter):
        self.writer = writer
        self._recorded: dict[str, dict[str, list[dict[str, Any]]]] = {}

    def answer(self, episodes: list[Episode]) -> None:
        for ep in episodes:
            call = ep.queue[0]
            key = call_key(call.name, call.arguments)
            responses = self._responses(ep.task).get(key, [])
            used = sum(1 for c in ep.traj.tool_calls if c.status == CallStatus.REFERENCE and call_key(c.name, c.arguments) == key)
            if used < len(responses):
                self.writer.tool_turn(ep, responses[used], CallStatus.REFERENCE)
            else:
                message = f"the reference trajectory recorded no response to this {call.name} call"
                self.writer.tool_turn(ep, {"error": {"code": "NOT_RECORDED", "message": message}}, CallStatus.UNRECORDED)

    def _responses(self, task: Task) -> dict[str, list[dict[str, Any]]]:
        if task.id not in self._recorded:
            if not task.reference:
                raise ValueError(f"task {task.id} has no recorded reference: mode 'recorded' answers from Task.reference")
            by_call: dict[str, list[dict[str, Any]]] = {}
            for c, response in recorded_exchanges(task.reference):
                by_call.setdefault(call_key(c["name"], c["arguments"]), []).append(response)
            self._recorded[task.id] = by_call
        return self._recorded[task.id]


class TranscriptRehearsal:
    """The policy continues the agent's transcript with the tool's response."""

    def __init__(self, writer: EpisodeWriter, policy: Generator, max_tokens: int):
        self.writer = writer
        self.policy = policy
        self.max_tokens = max_tokens

    def answer(self, episodes: list[Episode]) -> None:
        marker = self.writer.transcript.layout.rehearse_marker
        for ep, out in self.writer.generate(self.policy, episodes, self.max_tokens, marker):
            self.take(ep, out)

    def request(self, ep: Episode) -> SamplingParams | None:
        """The params of the episode's REHEARSE generation, for a caller that batches it with other
        work (continuous batching); None when the total-token limit has ended the episode."""
        return self.writer.request(ep, self.max_tokens, self.writer.transcript.layout.rehearse_marker)

    def take(self, ep: Episode, out: Completion) -> None:
        """Answer the episode's first queued call with the REHEARSE output `out`."""
        w = self.writer
        marker = w.transcript.layout.rehearse_marker
        turn = Turn(Role.REHEARSE, out.token_ids, out.logprobs, out.text)
        if out.finish_reason == "length":
            ep.append(turn, fed=True)
            w.truncated(ep)
            return
        try:
            obs, status = parse_rehearsal(w.transcript.strip_marker(out.text, marker)), CallStatus.REHEARSED
        except ParseError as err:
            call = ep.queue[0]
            if not w.penalize(ep, "rehearse", turn, err, EndReason.MALFORMED_REHEARSAL):
                call.status = CallStatus.MALFORMED
                ep.append(turn, fed=True)
                return
            obs, status = err.observation(), CallStatus.MALFORMED  # ACT reads the broken response as generated
        w.tool_turn(ep, obs, status, turn)


class IsolatedSimulator:
    """A fresh two-message simulator chat per call (the reference's isolated layout).

    `trained` (rehearse mode): the answers are the policy's REHEARSE outputs, each kept as its own
    training row. Otherwise a frozen simulator answers (the external-simulator baseline). ACT sees
    either as forced ENV tokens: the answer was written outside its transcript."""

    def __init__(self, writer: EpisodeWriter, simulator: Generator, env: Any, trained: bool, max_tokens: int, grounding: bool):
        self.writer = writer
        self.simulator = simulator
        self.env = env
        self.trained = trained
        self.max_tokens = max_tokens
        self.grounding = grounding
        self.transcript = writer.transcript if simulator.tokenizer is writer.transcript.tokenizer else Transcript(simulator.tokenizer)
        self._grounding_cache: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {}

    def answer(self, episodes: list[Episode]) -> None:
        w = self.writer
        prompts = [self.transcript.prompt(self._chat(e), "", []) for e in episodes]
        marker = self.transcript.layout.act_marker  # the simulator answers as an assistant
        sessions = self.simulator.open(len(episodes))
        try:
            outs = self.simulator.generate(sessions, [p.token_ids for p in prompts], w.params(self.max_tokens, marker))
        finally:
            self.simulator.close(sessions)
        role = "rehearse" if self.trained else "simulator"
        for ep, prompt, out in zip(episodes, prompts, outs):
            output = self._keep_row(ep, prompt, out) if self.trained else None
            if out.finish_reason == "length":
                w.truncated(ep)
                continue
            try:
                obs = parse_rehearsal(self.transcript.strip_marker(out.text, marker))
                status = CallStatus.REHEARSED if self.trained else CallStatus.SIMULATED
            except ParseError as err:
                call = ep.queue[0]
                if not w.penalize(ep, role, output, err, EndReason.MALFORMED_REHEARSAL):
                    call.status = CallStatus.MALFORMED
                    continue
                obs, status = err.observation(), CallStatus.MALFORMED  # ACT sees the error, not the broken text
            w.tool_turn(ep, obs, status)

    def _keep_row(self, ep: Episode, prompt: Turn, out: Any) -> Turn:
        output = Turn(Role.REHEARSE, out.token_ids, out.logprobs, out.text)
        row = Trajectory(task_id=ep.task.id, mode="rehearse-isolated", group=ep.traj.group, turns=[prompt, output])
        ep.traj.side_rows.append(row)
        return output

    def _grounding(self, ep: Episode) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """Privileged (call, true result) pairs, as the reference implementation grounds its
        simulator in the reference trajectory: the task's recorded reference, else (a world task
        without one) its reference calls run once on a fresh world, charged to the trajectory
        that needed them (`Trajectory.grounding_calls`)."""
        task = ep.task
        if task.id not in self._grounding_cache:
            if task.reference:
                pairs = recorded_exchanges(task.reference)
            else:
                world = self.env.make_world(task)
                pairs = [(c, world.call(c["name"], c.get("arguments", {}))) for c in task.reference_calls]
                ep.traj.grounding_calls += len(pairs)
            self._grounding_cache[task.id] = pairs
        return self._grounding_cache[task.id]

    def _chat(self, ep: Episode) -> list[dict[str, Any]]:
        history = [(c, o) for c, o in zip(ep.traj.tool_calls, ep.traj.observations)]
        grounding = self._grounding(ep) if self.grounding else None
        task_text = next((m["content"] for m in ep.task.messages if m["role"] == "user"), "")
        return simulator_messages(ep.description, ep.tools, history, ep.queue[0], task_text, grounding)
