"""Where a task's later user turns come from: one user channel per source.

  ReplayedUser   the task's own `user_turns`, in order (no user simulator)
  SimulatedUser  a `UserSimulator` (e.g. tau2's LLM user), in real mode: it may act on the world
  ImaginedUser   off real mode, for tasks whose user is simulated: the rehearsing model plays the
                 user too, so a rehearsal never talks to the benchmark's real user simulator and
                 never needs a world (tau2 telecom's user acts on the phone it cannot touch there)

`Trajectory.user_source` records which one wrote a trajectory's user turns.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

from envace.backends.base import Generator, SamplingParams
from envace.envs.base import ToolWorld
from envace.rollout.episode import Episode
from envace.transcript import Transcript
from envace.types import Task


class UserSimulator(Protocol):
    """Plays the user of a conversational task (`EpisodeRules.simulated_user`).

    `start` gives the first user message (it follows `task.messages`), or None when the user ends
    the conversation before it begins (the trajectory ends with `user_ended`); `respond` the next
    one after the agent answered, or None when the user ends the conversation. `messages` is the readable
    chat so far (`Trajectory.messages`). `world` is the rollout's live world (None outside real
    mode), for users who act on it themselves (e.g. a customer toggling settings on their phone)."""

    def start(self, task: Task, world: ToolWorld | None = None) -> str | None: ...

    def respond(self, task: Task, messages: list[dict[str, Any]], world: ToolWorld | None = None) -> str | None: ...


class UserChannel(Protocol):
    source: str  # Trajectory.user_source

    def first(self, ep: Episode) -> str | None:
        """The opening user message written during the rollout (None: the user leaves at once)."""
        ...

    def next(self, ep: Episode) -> str | None:
        """User turn `ep.user_turn + 1` after the agent answered; None ends the conversation."""
        ...


class ReplayedUser:
    source = "replayed"

    def first(self, ep: Episode) -> str | None:
        raise AssertionError("replayed tasks open with their own messages")

    def next(self, ep: Episode) -> str | None:
        turns = ep.task.user_turns
        return turns[ep.user_turn]["content"] if ep.user_turn < len(turns) else None


class SimulatedUser:
    source = "simulator"

    def __init__(self, simulator: UserSimulator):
        self.simulator = simulator

    def first(self, ep: Episode) -> str | None:
        return self.simulator.start(ep.task, ep.world)

    def next(self, ep: Episode) -> str | None:
        return self.simulator.respond(ep.task, ep.traj.messages, ep.world)


IMAGINED_USER = """You play the user in a conversation with an AI assistant. Stay in character and write only the user's next message, in plain text. When the user's request has been handled, or the user has nothing more to ask, write exactly {stop}.

# Conversation so far
{conversation}"""

STOP = "###STOP###"


class ImaginedUser:
    """The rehearsing model writes the user's messages, greedily, from a fresh chat per turn."""

    source = "imagined"

    def __init__(self, generator: Generator, transcript: Transcript, max_tokens: int):
        self.generator = generator
        self.max_tokens = max_tokens
        self.transcript = transcript if generator.tokenizer is transcript.tokenizer else Transcript(generator.tokenizer)

    def first(self, ep: Episode) -> str | None:
        return self._reply(ep)

    def next(self, ep: Episode) -> str | None:
        return self._reply(ep)

    def _reply(self, ep: Episode) -> str | None:
        opening = [m for m in ep.task.messages if m["role"] == "assistant"] if not ep.traj.messages else []
        said = [m for m in [*opening, *ep.traj.messages] if m["role"] in ("user", "assistant") and isinstance(m.get("content"), str) and m["content"]]
        conversation = "\n".join(f"{m['role']}: {m['content']}" for m in said) or "(nothing yet: write the user's first message)"
        prompt = self.transcript.prompt([{"role": "user", "content": IMAGINED_USER.format(stop=STOP, conversation=conversation)}], "", [])
        marker = self.transcript.layout.act_marker
        eos = self.generator.tokenizer.eos_token_id
        params = SamplingParams(max_new_tokens=self.max_tokens, temperature=0.0, stop_token_ids=(eos,) if eos is not None else (),
                                stop_strings=() if marker == self.transcript.layout.eos_text else (marker,))
        (session,) = self.generator.open(1)
        try:
            (out,) = self.generator.generate([session], [prompt.token_ids], params)
        finally:
            self.generator.close([session])
        text = self.transcript.strip_marker(out.text, marker).strip()
        text = re.sub(r"^user:\s*", "", text, flags=re.IGNORECASE)
        return None if not text or STOP in text else text
