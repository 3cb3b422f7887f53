"""Batched multi-turn rollouts, written once against the token-in/token-out `Generator`.

The engine schedules episodes and drives ACT; the rest is delegated, one object per job:
  tool answers   a responder per mode (`responders.py`): real world | rehearsal in the agent's
                 transcript | isolated simulator prompt (the policy's, or a frozen simulator's)
  user turns     a user channel per task (`users.py`): replayed | simulated | imagined
  per-task rules the task's typed `EpisodeRules` (tools added later, step limits, stop tools)
  transcript     `EpisodeWriter` (`episode.py`): token limits, call statuses, penalties, ends

All K x B episodes advance together: each round, every episode waiting for an ACT turn is
generated in one batch, every episode waiting for a model-written tool response in another,
each row within its own token budget. Each episode owns a generator session, so a round feeds
only the tokens appended since its last generation (the backend keeps the KV cache): the prefix
is never encoded again. With `max_active`, at most that many episodes are in flight; the next
starts as soon as one ends.

A round's batch waits for its longest row, so on a CPU most decode forwards run a few rows.
With `continuous_batching` (a generator that `pauses_rows`), every episode that needs the policy
next, for an ACT turn or a REHEARSE response, joins one batch, which returns once PAUSE_AT of its
rows finished; the unfinished rows are resumed in the next batch beside the next turns of those
that finished. Each episode's transcript is the same either way; only the schedule (and with
sampling, the random draws) differs.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Protocol

from tqdm.auto import tqdm

from envace.backends.base import Completion, Generator, SamplingParams
from envace.envs.base import ToolWorld
from envace.parsing import ParseError, parse_act
from envace.rollout.config import RolloutConfig
from envace.rollout.episode import Episode, EpisodeWriter
from envace.rollout.responders import CallGuard, GuardDecision, IsolatedSimulator, RealWorld, RecordedReference, ToolResponder, TranscriptRehearsal
from envace.rollout.users import ImaginedUser, ReplayedUser, SimulatedUser, UserChannel, UserSimulator
from envace.transcript import Transcript, compact_json, tool_signature
from envace.types import CallStatus, EndReason, Role, Task, ToolCall, Trajectory, Turn

__all__ = ["CallGuard", "Environment", "GuardDecision", "RolloutEngine", "UserSimulator"]


class Environment(Protocol):
    """Where tasks' worlds come from: built-in worlds, a user's module, or a benchmark adapter."""

    def make_world(self, task: Task) -> ToolWorld: ...

    def describe(self, task: Task) -> tuple[str, list[dict[str, Any]]]:
        """(documentation for the system prompt, OpenAI tool schemas)."""
        ...


# Tools that become available at a later user turn (`EpisodeRules.added_tools`) are announced in
# that user message: the system prompt that lists the others is already fed and cannot change.
ADDED_TOOLS = "New tools you can call from now on:\n<tools>\n{tools}\n</tools>"
REPLAYED = ReplayedUser()
# Continuous batching: a generate call returns once this fraction of its rows has finished; the
# others are paused and go on in the next call beside the next turns of those that finished.
# Not tuned: the quarter at which a batch compacts its finished rows (lean.StaticBatch.keep_rows).
PAUSE_AT = 0.25


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
        self.transcript = Transcript(policy.tokenizer)
        eos = policy.tokenizer.eos_token_id
        self.writer = EpisodeWriter(self.config, self.transcript, (eos,) if eos is not None else ())
        self.responder = self._responder(simulator, guard)
        if self.config.continuous_batching and not getattr(policy, "pauses_rows", False):
            raise ValueError(f"continuous batching pauses rows inside the sampler's batches, which {type(policy).__name__} cannot: "
                             "use the local transformers sampler, or drop --continuous-batching")
        # Off real mode the model that writes the tools' responses imagines the user as well
        # (recorded mode replays the reference's user turns: its tasks have no simulated user).
        self._imagined_user = None if self.config.mode in ("real", "recorded") else ImaginedUser(simulator or policy, self.transcript, self.config.max_turn_tokens)
        self.user_simulator = user_simulator  # None: the Environment's own `user_simulator`, if any

    def _responder(self, simulator: Generator | None, guard: CallGuard | None) -> ToolResponder:
        cfg = self.config
        if cfg.mode == "simulator" and simulator is None:
            raise ValueError("mode 'simulator' needs a simulator generator (--simulator MODEL)")
        if guard is not None and cfg.mode != "real":
            raise ValueError("a pre-commit guard protects real calls: use it in mode 'real'")
        if cfg.mode == "real":
            return RealWorld(self.writer, guard)
        if cfg.mode == "recorded":
            return RecordedReference(self.writer)
        if cfg.mode == "rehearse" and cfg.rehearse_layout == "transcript":
            if simulator is not None:
                raise ValueError("a separate rehearser needs rehearse_layout='isolated' (it cannot share the agent's transcript)")
            return TranscriptRehearsal(self.writer, self.policy, cfg.max_rehearse_tokens)
        # Isolated layout: the policy answers from the simulator prompt unless a separate
        # rehearser (no-share variant) or frozen simulator is given.
        return IsolatedSimulator(self.writer, simulator or self.policy, self.env, cfg.mode == "rehearse", cfg.max_rehearse_tokens, cfg.grounding)

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

    def _drive(self, start: Callable[[int], Episode], n: int, progress: bool, desc: str) -> list[Episode]:
        """Start episodes 0..n-1 (`start(i)`) and advance them together to their ends. At most
        `config.max_active` run at once; the next one starts when one finishes, so a large task set
        holds only that many worlds and KV caches. Returns the episodes in order."""
        limit = self.config.max_active or n
        bar = tqdm(total=n, desc=desc, disable=not progress, leave=False)
        episodes: list[Episode] = []
        active: list[Episode] = []
        while active or len(episodes) < n:
            while len(active) < limit and len(episodes) < n:
                episodes.append(start(len(episodes)))
                active.append(episodes[-1])
            if self.config.continuous_batching:
                self._advance_together(active)
            else:
                self._answer_tools(active)
                acting = [e for e in active if not e.done and not e.queue]
                if acting:
                    self._generate_act(acting)
            finished = [e for e in active if e.done]
            for e in finished:
                self._finish(e)
            bar.update(len(finished))
            active = [e for e in active if not e.done]
        bar.close()
        return episodes

    def _answer_tools(self, active: list[Episode]) -> None:
        """Answer every queued call (the responder batches model-written answers)."""
        while waiting := [e for e in active if e.queue and not e.done]:
            self.responder.answer(waiting)

    def _advance_together(self, active: list[Episode]) -> None:
        """Continuous batching: one generate call for every episode that needs the policy next (an
        ACT turn, a REHEARSE response in its transcript, or either one paused mid-way), returning
        once PAUSE_AT of its rows finished; so rows that finish early start their next turn while
        the others are still generating, instead of waiting for the longest row of the round.
        Responders that do not write in the policy's sessions (real world, recorded, isolated
        simulator) answer first, as in the rounds of `_drive`."""
        inline = isinstance(self.responder, TranscriptRehearsal)
        if not inline:
            self._answer_tools(active)
        rows = []
        for ep in active:
            if not ep.done and ep.inflight is None:
                ep.inflight = self._next_generation(ep)
            if not ep.done and ep.inflight is not None:
                rows.append(ep)
        if not rows:
            return
        outs = self.policy.generate([e.session for e in rows], [e.pending for e in rows], [e.inflight[1] for e in rows], pause_at=PAUSE_AT)
        for ep, out in zip(rows, outs):
            ep.pending = []
            if out.finish_reason == "paused":
                continue
            role, _ = ep.inflight
            ep.inflight = None
            if role == Role.ACT:
                self._after_act(ep, out)
            else:
                self.responder.take(ep, out)

    def _next_generation(self, ep: Episode) -> tuple[Role, SamplingParams] | None:
        """The role and params of the episode's next generation; None when a limit has ended it."""
        if ep.queue:  # only transcript rehearsal leaves calls queued here: the policy answers them
            params = self.responder.request(ep)
            return None if params is None else (Role.REHEARSE, params)
        if not self._may_act(ep):
            return None
        params = self.writer.request(ep, self.config.max_turn_tokens, self.transcript.layout.act_marker)
        return None if params is None else (Role.ACT, params)

    # ---- episode lifecycle -------------------------------------------------------------
    def _open(self, task: Task, traj: Trajectory) -> Episode:
        description, tools = self.env.describe(task)
        world = self.env.make_world(task) if self.config.mode == "real" else None
        (session,) = self.policy.open(1)
        traj.user_source = self._user(task).source
        return Episode(task, traj, session, world, description, tools)

    def _start(self, task: Task, group: int) -> Episode:
        ep = self._open(task, Trajectory(task_id=task.id, mode=self.config.mode, group=group))
        messages = task.messages
        first = self._user(task).first(ep) if task.rules.simulated_user else None
        if first is None:
            self._prompt(ep, messages)
            if task.rules.simulated_user:
                # The simulated user left before saying anything: the conversation is over, and
                # the benchmark scores it as it stands.
                self.writer.end(ep, EndReason.USER_ENDED)
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

    def _prompt(self, ep: Episode, messages: list[dict[str, Any]]) -> None:
        ep.append(self.transcript.prompt(messages, ep.description, ep.tools))
        ep.traj.messages = self.transcript.prompt_messages(messages, ep.description, ep.tools)

    def _resume(self, task: Task, prefix: Trajectory, group: int) -> Episode:
        # Copies of the lists and of the calls still to answer: the continuation sets their status.
        queue = [dataclasses.replace(c) for c in prefix.tool_calls[len(prefix.observations) :]]
        traj = Trajectory(
            task_id=task.id, mode=self.config.mode, group=group, turns=list(prefix.turns), messages=list(prefix.messages),
            tool_calls=prefix.tool_calls[: len(prefix.observations)] + queue, observations=list(prefix.observations),
            penalties=dict(prefix.penalties),
        )
        ep = self._open(task, traj)
        ep.pending = list(prefix.token_ids)  # the new session has seen nothing yet
        ep.length = len(ep.pending)
        # Every answered call has exactly one observation, in order: the rest still await answers.
        ep.queue = queue
        # A simulated user's first message is a USER turn too, but it opens user turn 0.
        ep.user_turn = sum(t.role == Role.USER for t in prefix.turns) - int(task.rules.simulated_user)
        return ep

    def _finish(self, ep: Episode) -> None:
        self.policy.close([ep.session])
        ep.traj.seconds = time.perf_counter() - ep.started
        record = getattr(self.env, "rollout_record", None)
        if ep.world is not None and record is not None:
            # What the world saw that the trajectory does not hold (e.g. the user's own tool
            # calls), for the scorer: the world is dropped here.
            ep.traj.benchmark_record = record(ep.task, ep.world)

    # ---- ACT --------------------------------------------------------------------------
    def _act_limit(self, task: Task) -> int:
        """ACT turns allowed: per trajectory, or per user turn where the task sets its own limit."""
        return task.rules.max_steps_per_turn or self.config.max_turns

    def _may_act(self, ep: Episode) -> bool:
        """False (and the episode ended) once it used its ACT turns."""
        if ep.act_turns >= self._act_limit(ep.task):
            self.writer.end(ep, EndReason.MAX_TURNS)
            return False
        return True

    def _generate_act(self, eps: list[Episode]) -> None:
        eps = [e for e in eps if self._may_act(e)]
        for ep, out in self.writer.generate(self.policy, eps, self.config.max_turn_tokens, self.transcript.layout.act_marker):
            self._after_act(ep, out)

    def _after_act(self, ep: Episode, out: Completion) -> None:
        layout = self.transcript.layout
        ep.act_turns += 1
        output = Turn(Role.ACT, out.token_ids, out.logprobs, out.text)
        ep.append(output, fed=True)
        # The last sampled token was never fed to the model; the backend feeds it next call.
        content = self.transcript.strip_marker(out.text, layout.act_marker)
        ep.traj.messages.append({"role": "assistant", "content": content})
        if out.finish_reason == "length":
            self.writer.truncated(ep)
            return
        try:
            parsed = parse_act(content, self.config.accept_fenced_json)
        except ParseError as err:
            if self.writer.penalize(ep, "act", output, err, EndReason.MALFORMED_ACT):
                self._show_act_error(ep, out.text, err)
            return
        if parsed.calls:
            self._queue_calls(ep, parsed.calls, out.text)
            return
        ep.traj.final_answer = parsed.text
        next_user = self._user(ep.task).next(ep)
        if next_user is None:
            self.writer.end(ep, EndReason.ANSWERED)
            return
        ep.user_turn += 1
        if ep.task.rules.max_steps_per_turn:
            ep.act_turns = 0
        self._user_turn(ep, next_user, out.text)

    def _queue_calls(self, ep: Episode, calls: list[ToolCall], after: str) -> None:
        for call in calls:
            call.user_turn = ep.user_turn
        rules = ep.task.rules
        stops = [c for c in calls if c.name in rules.stop_tools]
        if stops or rules.stop_after_first_act:
            # Recorded, never executed: a stop tool's call stands for its whole output, and
            # single-response tasks are scored on the calls of that one output.
            for call in stops or calls:
                call.status = CallStatus.RECORDED
            ep.traj.tool_calls.extend(stops or calls)
            self.writer.end(ep, EndReason.ANSWERED)
            return
        ep.traj.tool_calls.extend(calls)
        ep.queue = list(calls)
        self.writer.force(ep, self.transcript.forced_after(after, self.transcript.layout.act_to_tool))

    def _show_act_error(self, ep: Episode, after: str, err: ParseError) -> None:
        """The parse error answers the malformed ACT output as a tool response (no call was made,
        so nothing joins `tool_calls`/`observations`); ACT then tries again."""
        layout = self.transcript.layout
        obs = err.observation()
        ep.traj.messages.append({"role": "tool", "name": "", "content": obs})
        turn = self.transcript.tool_response(obs, Role.ENV)
        self.writer.force(ep, self.transcript.forced_after(after, layout.act_to_tool), turn, self.transcript.forced_after(turn.text, layout.tool_to_act))

    # ---- users ------------------------------------------------------------------------
    def _user(self, task: Task) -> UserChannel:
        if not task.rules.simulated_user:
            return REPLAYED
        if self._imagined_user is not None:
            return self._imagined_user
        user = self.user_simulator or getattr(self.env, "user_simulator", None)
        if user is None:
            raise ValueError(f"task {task.id} needs a user simulator: give the Environment a `user_simulator` or pass one to RolloutEngine")
        return SimulatedUser(user)

    def _user_turn(self, ep: Episode, content: str, after: str) -> None:
        """Append user turn `ep.user_turn` after the assistant text `after` (generated or forced)."""
        layout = self.transcript.layout
        content = self._announce_added_tools(ep, content)
        ep.traj.messages.append({"role": "user", "content": content})
        user = self.transcript.user_message(content)
        self.writer.force(ep, self.transcript.forced_after(after, layout.act_to_user), user, self.transcript.scaffold(layout.user_to_act))

    def _announce_added_tools(self, ep: Episode, content: str) -> str:
        """Tools the task adds at this user turn join the episode's tools and are listed in the
        user message: as signatures (the fallback format), or as JSON schemas for native templates."""
        added = [t for a in ep.task.rules.added_tools if a.user_turn == ep.user_turn for t in a.tools]
        if not added:
            return content
        ep.tools = [*ep.tools, *added]
        line = compact_json if self.transcript.layout.native_tools else tool_signature
        return f"{content}\n\n" + ADDED_TOOLS.format(tools="\n".join(line(t) for t in added))

