"""Batched multi-turn rollouts, written once against the token-in/token-out `Generator`.

Modes (who answers a tool call):
  real       the executable world; tool tokens are forced (role ENV)
  rehearse   the policy itself, in the agent's own transcript (role REHEARSE); with
             `rehearse_layout="isolated"` the policy answers from a separate simulator prompt and
             each answer becomes its own training row (`Trajectory.side_rows`)
  simulator  a separate frozen model, from the simulator prompt (the external-simulator baseline)

Users: later user turns are the task's `user_turns`, replayed, or, for tasks whose metadata sets
`needs_user_simulator`, a `UserSimulator`'s (the engine's own, else the Environment's
`user_simulator`). Other task metadata the engine honours (docs/benchmarks.md): `added_tools`,
`max_steps_per_turn`, `stop_after_first_act`, `stop_tools`.

All K x B episodes advance together: each round, every episode waiting for an ACT turn is
generated in one batch, every episode waiting for a rehearsed response in another. Each
episode owns a generator session, so a round feeds only the tokens appended since its last
generation (the backend keeps the KV cache): the prefix is never encoded again. With
`max_active`, at most that many episodes are in flight; the next starts as soon as one ends.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol

from tqdm.auto import tqdm

from envace.backends.base import Completion, Generator, SamplingParams
from envace.envs.base import ToolWorld
from envace.parsing import ParseError, parse_act, parse_rehearsal
from envace.transcript import Transcript, compact_json, simulator_messages, tool_signature
from envace.rollout.config import RolloutConfig
from envace.types import EndReason, Role, Task, ToolCall, Trajectory, Turn

class Environment(Protocol):
    """Where tasks' worlds come from: built-in worlds, a user's module, or a benchmark adapter."""

    def make_world(self, task: Task) -> ToolWorld: ...

    def describe(self, task: Task) -> tuple[str, list[dict[str, Any]]]:
        """(documentation for the system prompt, OpenAI tool schemas)."""
        ...


class UserSimulator(Protocol):
    """Plays the user of a conversational task (metadata `needs_user_simulator`).

    `start` gives the first user message (it follows `task.messages`), or None when the user ends
    the conversation before it begins (the trajectory ends with `user_ended`); `respond` the next
    one after the agent answered, or None when the user ends the conversation. `messages` is the readable
    chat so far (`Trajectory.messages`). `world` is the rollout's live world (None outside real
    mode), for users who act on it themselves (e.g. a customer toggling settings on their phone)."""

    def start(self, task: Task, world: ToolWorld | None = None) -> str | None: ...

    def respond(self, task: Task, messages: list[dict[str, Any]], world: ToolWorld | None = None) -> str | None: ...


# Tools that become available at a later user turn (metadata `added_tools`) are announced in that
# user message: the system prompt that lists the others is already fed and cannot change.
ADDED_TOOLS = "New tools you can call from now on:\n<tools>\n{tools}\n</tools>"


@dataclass
class GuardDecision:
    """What to do with an irreversible call in real mode: execute it, hand the agent `reason` as
    the call's observation instead (revise), or stop and ask the user."""

    action: Literal["execute", "revise", "stop"]
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)


class CallGuard(Protocol):
    def __call__(self, task: Task, traj: Trajectory, call: ToolCall) -> GuardDecision: ...


@dataclass
class _Episode:
    task: Task
    traj: Trajectory
    session: int
    world: ToolWorld | None
    description: str
    tools: list[dict[str, Any]]
    pending: list[int] = field(default_factory=list)  # tokens appended but not yet fed
    queue: list[ToolCall] = field(default_factory=list)  # calls of the last ACT turn awaiting answers
    act_turns: int = 0
    user_turn: int = 0
    started: float = field(default_factory=time.perf_counter)

    @property
    def length(self) -> int:
        return sum(len(t.token_ids) for t in self.traj.turns)

    def append(self, turn: Turn, fed: bool = False) -> None:
        self.traj.turns.append(turn)
        if not fed:
            self.pending.extend(turn.token_ids)


class RolloutEngine:
    def __init__(
        self,
        policy: Generator,
        env: Environment,
        config: RolloutConfig | None = None,
        simulator: Generator | None = None,
        user_simulator: UserSimulator | None = None,
        guard: CallGuard | None = None,
    ):
        self.policy = policy
        self.env = env
        self.config = config or RolloutConfig()
        if self.config.mode == "simulator" and simulator is None:
            raise ValueError("mode 'simulator' needs a simulator generator (--simulator MODEL)")
        if simulator is not None and self.config.mode == "rehearse" and self.config.rehearse_layout == "transcript":
            raise ValueError("a separate rehearser needs rehearse_layout='isolated' (it cannot share the agent's transcript)")
        # Isolated layout: the policy answers from the simulator prompt unless a separate
        # rehearser (no-share variant) or frozen simulator is given.
        self.simulator = simulator or policy
        self.user_simulator = user_simulator  # None: the Environment's own `user_simulator`, if any
        self.guard = guard
        self._grounding_cache: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
        self.transcript = Transcript(policy.tokenizer)
        self.sim_transcript = self.transcript if self.simulator is policy else Transcript(self.simulator.tokenizer)
        self._eos = tuple(i for i in {policy.tokenizer.eos_token_id} if i is not None)

    # ---- public ----------------------------------------------------------------------
    def run(self, tasks: list[Task], k: int = 1, progress: bool = True, desc: str = "rollout") -> list[list[Trajectory]]:
        """K rollouts of every task, advancing together (at most `config.max_active` at a time).
        Returns one group of K per task."""
        slots = [(task, g) for task in tasks for g in range(k)]
        trajs = [e.traj for e in self._drive(lambda i: self._start(*slots[i]), len(slots), progress, desc)]
        return [trajs[i * k : (i + 1) * k] for i in range(len(tasks))]

    def resume(self, task: Task, prefix: Trajectory, k: int = 1, progress: bool = False, desc: str = "resume") -> list[Trajectory]:
        """K continuations of `prefix`, an unfinished trajectory of `task` (e.g. the pre-commit guard
        rehearsing a pending call). Each continuation starts in a fresh session fed the whole prefix;
        the prefix's unanswered calls (those past its observations) are answered first, then ACT goes
        on, with `max_turns` counting only the ACT turns after the prefix. The returned trajectories
        hold the prefix followed by the new turns; the prefix itself is not modified. Not in real
        mode: a fresh world would not hold the effects of the prefix's calls."""
        if self.config.mode == "real":
            raise ValueError("resume needs mode 'rehearse' or 'simulator': a fresh real world lacks the prefix's effects")
        if prefix.end_reason is not None:
            raise ValueError(f"cannot resume a finished trajectory (ended: {prefix.end_reason.value})")
        return [e.traj for e in self._drive(lambda g: self._resume(task, prefix, g), k, progress, desc)]

    def _drive(self, start: Callable[[int], _Episode], n: int, progress: bool, desc: str) -> list[_Episode]:
        """Start episodes 0..n-1 (`start(i)`) and advance them together to their ends. At most
        `config.max_active` run at once; the next one starts when one finishes, so a large task set
        holds only that many worlds and KV caches. Returns the episodes in order."""
        limit = self.config.max_active or n
        bar = tqdm(total=n, desc=desc, disable=not progress, leave=False)
        episodes: list[_Episode] = []
        active: list[_Episode] = []
        while active or len(episodes) < n:
            while len(active) < limit and len(episodes) < n:
                episodes.append(start(len(episodes)))
                active.append(episodes[-1])
            self._answer_tools(active)
            acting = [e for e in active if e.traj.end_reason is None and not e.queue]
            if acting:
                self._generate_act(acting)
            finished = [e for e in active if e.traj.end_reason is not None]
            for e in finished:
                self._finish(e)
            bar.update(len(finished))
            active = [e for e in active if e.traj.end_reason is None]
        bar.close()
        return episodes

    # ---- episode lifecycle -------------------------------------------------------------
    def _open(self, task: Task, traj: Trajectory) -> _Episode:
        description, tools = self.env.describe(task)
        world = self.env.make_world(task) if self.config.mode == "real" else None
        (session,) = self.policy.open(1)
        return _Episode(task, traj, session, world, description, tools)

    def _start(self, task: Task, group: int) -> _Episode:
        ep = self._open(task, Trajectory(task_id=task.id, mode=self.config.mode, group=group))
        messages = task.messages
        first = self._user(task).start(task, ep.world) if _simulated(task) else None
        if first is None:
            self._prompt(ep, messages)
            if _simulated(task):
                # The simulated user left before saying anything: the conversation is over, and
                # the benchmark scores it as it stands.
                self._end(ep, EndReason.USER_ENDED)
        elif messages and messages[-1]["role"] == "assistant":
            # The task's opening agent message (e.g. "Hi! How can I help you today?") is an
            # assistant turn the agent continues from; the simulated user answers it.
            self._prompt(ep, messages[:-1])
            opening = messages[-1]["content"]
            ep.append(Turn(Role.PROMPT, self.transcript.encode(opening), text=opening))
            ep.traj.messages.append(dict(messages[-1]))
            self._user_turn(ep, first, opening)
        else:
            self._prompt(ep, [*messages, {"role": "user", "content": first}])
        return ep

    def _prompt(self, ep: _Episode, messages: list[dict[str, Any]]) -> None:
        ep.append(self.transcript.prompt(messages, ep.description, ep.tools))
        ep.traj.messages = self.transcript.prompt_messages(messages, ep.description, ep.tools)

    def _resume(self, task: Task, prefix: Trajectory, group: int) -> _Episode:
        # Copies of the lists only: the engine appends to them and never mutates their items.
        traj = Trajectory(
            task_id=task.id, mode=self.config.mode, group=group, turns=list(prefix.turns), messages=list(prefix.messages),
            tool_calls=list(prefix.tool_calls), observations=list(prefix.observations), penalties=dict(prefix.penalties),
        )
        ep = self._open(task, traj)
        ep.pending = list(prefix.token_ids)  # the new session has seen nothing yet
        # Every answered call has exactly one observation, in order: the rest still await answers.
        ep.queue = list(prefix.tool_calls[len(prefix.observations) :])
        # A simulated user's first message is a USER turn too, but it opens user turn 0.
        ep.user_turn = sum(t.role == Role.USER for t in prefix.turns) - int(_simulated(task))
        return ep

    def _finish(self, ep: _Episode) -> None:
        self.policy.close([ep.session])
        ep.traj.seconds = time.perf_counter() - ep.started
        record = getattr(self.env, "rollout_record", None)
        if ep.world is not None and record is not None:
            # What the world saw that the trajectory does not hold (e.g. the user's own tool
            # calls), for the scorer: the world is dropped here.
            ep.traj.reward_details["benchmark"] = record(ep.task, ep.world)

    def _end(self, ep: _Episode, reason: EndReason) -> None:
        ep.traj.end_reason = reason

    def _penalize(self, ep: _Episode, role: str, output: Turn | None, err: ParseError, reason: EndReason) -> bool:
        """Count and flag a malformed output; True when the rollout goes on (`on_malformed`)."""
        ep.traj.penalties[role] = ep.traj.penalties.get(role, 0) + 1
        if output is not None:
            output.malformed = True
        if self.config.on_malformed == "continue" and err.code != "EMPTY_OUTPUT":
            return True
        ep.traj.observations.append(err.observation())
        self._end(ep, EndReason.EMPTY_OUTPUT if err.code == "EMPTY_OUTPUT" else reason)
        return False

    def _budget(self, ep: _Episode, per_turn: int) -> int:
        """Tokens this generation may use; 0 ends the episode for the total-token limit."""
        room = self.config.max_total_tokens - ep.length
        if room <= 0:
            self._end(ep, EndReason.MAX_TOTAL_TOKENS)
            return 0
        return min(per_turn, room)

    def _hit_length(self, ep: _Episode) -> None:
        """A generation ran out of tokens: the total budget if that is what capped it."""
        full = ep.length >= self.config.max_total_tokens
        self._end(ep, EndReason.MAX_TOTAL_TOKENS if full else EndReason.MAX_TURN_TOKENS)

    def _params(self, max_new: int, marker: str) -> SamplingParams:
        stops = () if marker == self.transcript.layout.eos_text else (marker,)
        return SamplingParams(
            max_new_tokens=max_new,
            temperature=self.config.temperature,
            top_p=self.config.top_p,
            stop_token_ids=self._eos,
            stop_strings=stops,
        )

    def _generate(self, gen: Generator, eps: list[_Episode], sessions: list[int], feeds: list[list[int]], per_turn: int, marker: str) -> list[tuple[_Episode, Completion]]:
        budgets = [self._budget(e, per_turn) for e in eps]
        keep = [i for i, b in enumerate(budgets) if b > 0]
        if not keep:
            return []
        # One batch per round; the smallest remaining budget keeps every row within its limit.
        params = self._params(min(budgets[i] for i in keep), marker)
        outs = gen.generate([sessions[i] for i in keep], [feeds[i] for i in keep], params)
        return [(eps[i], out) for i, out in zip(keep, outs)]

    # ---- ACT --------------------------------------------------------------------------
    def _act_limit(self, task: Task) -> int:
        """ACT turns allowed: per trajectory, or per user turn where the task sets its own limit."""
        return task.metadata.get("max_steps_per_turn", self.config.max_turns)

    def _generate_act(self, eps: list[_Episode]) -> None:
        over = [e for e in eps if e.act_turns >= self._act_limit(e.task)]
        for e in over:
            self._end(e, EndReason.MAX_TURNS)
        eps = [e for e in eps if e not in over]
        feeds = [e.pending for e in eps]
        results = self._generate(self.policy, eps, [e.session for e in eps], feeds, self.config.max_turn_tokens, self.transcript.layout.act_marker)
        for ep, out in results:
            ep.pending = []
            self._after_act(ep, out)

    def _after_act(self, ep: _Episode, out: Completion) -> None:
        layout = self.transcript.layout
        ep.act_turns += 1
        output = Turn(Role.ACT, out.token_ids, out.logprobs, out.text)
        ep.append(output, fed=True)
        # The last sampled token was never fed to the model; the backend feeds it next call.
        content = self.transcript.strip_marker(out.text, layout.act_marker)
        ep.traj.messages.append({"role": "assistant", "content": content})
        if out.finish_reason == "length":
            self._hit_length(ep)
            return
        try:
            parsed = parse_act(content, self.config.accept_fenced_json)
        except ParseError as err:
            if self._penalize(ep, "act", output, err, EndReason.MALFORMED_ACT):
                self._show_act_error(ep, out.text, err)
            return
        if parsed.calls:
            for call in parsed.calls:
                call.user_turn = ep.user_turn
            meta = ep.task.metadata
            stops = [c for c in parsed.calls if c.name in meta.get("stop_tools", ())]
            if stops or meta.get("stop_after_first_act"):
                # Recorded, never executed: a stop tool's call stands for its whole output, and
                # single-response tasks are scored on the calls of that one output.
                ep.traj.tool_calls.extend(stops or parsed.calls)
                self._end(ep, EndReason.ANSWERED)
                return
            ep.traj.tool_calls.extend(parsed.calls)
            ep.queue = list(parsed.calls)
            self._force(ep, self.transcript.forced_after(out.text, layout.act_to_tool))
            return
        ep.traj.final_answer = parsed.text
        next_user = self._next_user_message(ep)
        if next_user is None:
            self._end(ep, EndReason.ANSWERED)
            return
        ep.user_turn += 1
        if "max_steps_per_turn" in ep.task.metadata:
            ep.act_turns = 0
        self._user_turn(ep, next_user, out.text)

    def _show_act_error(self, ep: _Episode, after: str, err: ParseError) -> None:
        """The parse error answers the malformed ACT output as a tool response (no call was made,
        so nothing joins `tool_calls`/`observations`); ACT then tries again."""
        layout = self.transcript.layout
        obs = err.observation()
        ep.traj.messages.append({"role": "tool", "name": "", "content": obs})
        turn = self.transcript.tool_response(obs, Role.ENV)
        self._force(ep, self.transcript.forced_after(after, layout.act_to_tool), turn, self.transcript.forced_after(turn.text, layout.tool_to_act))

    def _user_turn(self, ep: _Episode, content: str, after: str) -> None:
        """Append user turn `ep.user_turn` after the assistant text `after` (generated or forced)."""
        layout = self.transcript.layout
        content = self._announce_added_tools(ep, content)
        ep.traj.messages.append({"role": "user", "content": content})
        user = self.transcript.user_message(content)
        self._force(ep, self.transcript.forced_after(after, layout.act_to_user), user, self.transcript.scaffold(layout.user_to_act))

    def _announce_added_tools(self, ep: _Episode, content: str) -> str:
        """Tools the task adds at this user turn join the episode's tools and are listed in the
        user message: as signatures (the fallback format), or as JSON schemas for native templates."""
        added = [t for a in ep.task.metadata.get("added_tools", []) if a["user_turn"] == ep.user_turn for t in a["tools"]]
        if not added:
            return content
        ep.tools = [*ep.tools, *added]
        line = compact_json if self.transcript.layout.native_tools else tool_signature
        return f"{content}\n\n" + ADDED_TOOLS.format(tools="\n".join(line(t) for t in added))

    def _user(self, task: Task) -> UserSimulator:
        user = self.user_simulator or getattr(self.env, "user_simulator", None)
        if user is None:
            raise ValueError(f"task {task.id} needs a user simulator: give the Environment a `user_simulator` or pass one to RolloutEngine")
        return user

    def _next_user_message(self, ep: _Episode) -> str | None:
        if _simulated(ep.task):
            return self._user(ep.task).respond(ep.task, ep.traj.messages, ep.world)
        turns = ep.task.user_turns
        return turns[ep.user_turn]["content"] if ep.user_turn < len(turns) else None

    # ---- tool responses ---------------------------------------------------------------
    def _answer_tools(self, active: list[_Episode]) -> None:
        """Answer every queued call: real worlds at once, rehearsals/simulations in batches."""
        while True:
            waiting = [e for e in active if e.queue and e.traj.end_reason is None]
            if not waiting:
                return
            if self.config.mode == "real":
                for ep in waiting:
                    self._execute_real(ep)
            elif self.config.mode == "rehearse" and self.config.rehearse_layout == "transcript":
                self._rehearse_in_transcript(waiting)
            else:
                self._simulate_isolated(waiting)

    def _execute_real(self, ep: _Episode) -> None:
        call = ep.queue[0]
        if self.guard is not None and call.name in ep.world.irreversible_tools:
            decision = self.guard(ep.task, ep.traj, call)
            ep.traj.events.append({"event": "guard", "call": call.to_dict(), "action": decision.action, "reason": decision.reason, **decision.details})
            if decision.action == "stop":
                ep.queue.clear()
                self._end(ep, EndReason.STOPPED)
                return
            if decision.action == "revise":
                self._record_observation(ep, {"error": {"code": "NOT_EXECUTED", "message": decision.reason}}, Role.ENV)
                return
        ep.traj.real_env_calls += 1
        self._record_observation(ep, ep.world.execute(call), Role.ENV)

    def _record_observation(self, ep: _Episode, obs: dict[str, Any], role: Role, turn: Turn | None = None) -> None:
        """Append one tool response (forced or already generated) and the scaffolding after it."""
        layout = self.transcript.layout
        call = ep.queue.pop(0)
        ep.traj.observations.append(obs)
        ep.traj.messages.append({"role": "tool", "name": call.name, "content": obs})
        following = layout.tool_to_tool if ep.queue else layout.tool_to_act
        if turn is None:
            turn = self.transcript.tool_response(obs, role)
            self._force(ep, turn, self.transcript.forced_after(turn.text, following))
        else:  # a rehearsal, already generated within the budget
            ep.append(turn, fed=True)
            self._force(ep, self.transcript.forced_after(turn.text, following))

    def _force(self, ep: _Episode, *turns: Turn) -> None:
        """Append forced turns, or end the episode if they would break the total-token limit."""
        if ep.length + sum(len(t.token_ids) for t in turns) > self.config.max_total_tokens:
            ep.queue.clear()
            self._end(ep, EndReason.MAX_TOTAL_TOKENS)
            return
        for t in turns:
            ep.append(t)

    def _rehearse_in_transcript(self, eps: list[_Episode]) -> None:
        marker = self.transcript.layout.rehearse_marker
        results = self._generate(self.policy, eps, [e.session for e in eps], [e.pending for e in eps], self.config.max_rehearse_tokens, marker)
        for ep, out in results:
            ep.pending = []
            turn = Turn(Role.REHEARSE, out.token_ids, out.logprobs, out.text)
            if out.finish_reason == "length":
                ep.traj.turns.append(turn)
                self._hit_length(ep)
                continue
            try:
                obs = parse_rehearsal(self.transcript.strip_marker(out.text, marker))
            except ParseError as err:
                if not self._penalize(ep, "rehearse", turn, err, EndReason.MALFORMED_REHEARSAL):
                    ep.traj.turns.append(turn)
                    continue
                obs = err.observation()  # ACT reads the broken response as generated
            self._record_observation(ep, obs, Role.REHEARSE, turn)

    def _simulate_isolated(self, eps: list[_Episode]) -> None:
        """Answer from a fresh simulator prompt per call (the reference's isolated layout)."""
        prompts = [self.sim_transcript.prompt(self._simulator_chat(e), "", []) for e in eps]
        sessions = self.simulator.open(len(eps))
        marker = self.sim_transcript.layout.act_marker  # the simulator answers as an assistant
        params = self._params(self.config.max_rehearse_tokens, marker)
        outs = self.simulator.generate(sessions, [p.token_ids for p in prompts], params)
        self.simulator.close(sessions)
        trained = self.config.mode == "rehearse"
        for ep, prompt, out in zip(eps, prompts, outs):
            output = None
            if trained:
                row = Trajectory(task_id=ep.task.id, mode="rehearse-isolated", group=ep.traj.group)
                output = Turn(Role.REHEARSE, out.token_ids, out.logprobs, out.text)
                row.turns = [prompt, output]
                ep.traj.side_rows.append(row)
            try:
                if out.finish_reason == "length":
                    raise ParseError("MALFORMED_REHEARSAL", "the simulated response hit its token limit")
                obs = parse_rehearsal(self.sim_transcript.strip_marker(out.text, marker))
            except ParseError as err:
                if not self._penalize(ep, "rehearse" if trained else "simulator", output, err, EndReason.MALFORMED_REHEARSAL):
                    continue
                obs = err.observation()  # ACT sees the error, not the simulator's broken text
            self._record_observation(ep, obs, Role.ENV)

    def _grounding(self, task: Task) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """Privileged (call, true result) pairs: the task's reference calls run on a fresh world,
        as the reference implementation grounds its simulator in the reference trajectory."""
        if task.id not in self._grounding_cache:
            world = self.env.make_world(task)
            self._grounding_cache[task.id] = [(c, world.call(c["name"], c.get("arguments", {}))) for c in task.reference_calls]
        return self._grounding_cache[task.id]

    def _simulator_chat(self, ep: _Episode) -> list[dict[str, Any]]:
        done = len(ep.traj.observations)
        history = list(zip(ep.traj.tool_calls[:done], ep.traj.observations))
        grounding = self._grounding(ep.task) if self.config.grounding else None
        task_text = next((m["content"] for m in ep.task.messages if m["role"] == "user"), "")
        return simulator_messages(ep.description, ep.tools, history, ep.queue[0], task_text, grounding)


def _simulated(task: Task) -> bool:
    """Later user turns come from a user simulator, not `task.user_turns`."""
    return bool(task.metadata.get("needs_user_simulator"))
