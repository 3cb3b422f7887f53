"""Typed contracts shared by every stage: tasks, tool calls, role-tagged trajectories.

Stages hand each other these objects and nothing else: rollout produces `Trajectory`,
rewards read it, algorithms turn a group of them into per-token advantages, training
consumes token ids + role tags + logprobs + advantages.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Role(enum.IntEnum):
    """Who produced a token. Stored per token; the integer value is what training tensors hold."""

    PROMPT = 0  # system/user prompt and chat-template scaffolding (never trained)
    ACT = 1  # agent's assistant turn, sampled by the policy
    REHEARSE = 2  # tool response written by the policy playing the environment
    ENV = 3  # tool response forced from a real world or an external simulator (never trained)
    USER = 4  # user messages written into the transcript during rollout (replayed or simulated; never trained)


SAMPLED_ROLES = (Role.ACT, Role.REHEARSE)


class EndReason(str, enum.Enum):
    """Why a trajectory stopped. Recorded on every trajectory."""

    ANSWERED = "answered"  # ACT replied without tool calls: the agent's final answer
    MAX_TURNS = "max_turns"
    MAX_TURN_TOKENS = "max_turn_tokens"  # one generation hit its token limit before its end marker
    MAX_TOTAL_TOKENS = "max_total_tokens"
    MALFORMED_ACT = "malformed_act"  # tool call could not be parsed
    MALFORMED_REHEARSAL = "malformed_rehearsal"  # rehearsed tool response was not a JSON object
    EMPTY_OUTPUT = "empty_output"
    STOPPED = "stopped"  # e.g. the pre-commit guard asked the user instead of executing
    USER_ENDED = "user_ended"  # the simulated user ended the conversation before its first message


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = ""
    user_turn: int = 0  # index of the user turn during which ACT made this call

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments}


@dataclass
class Task:
    """One task. Serialised one per line in the JSONL task format (docs/tasks.md).

    `world` names a registered environment (or `module:Class`); `initial_state` is handed to
    its `reset`. `success` is the verifier spec understood by that world's `verify`.
    """

    id: str
    world: str
    messages: list[dict[str, Any]]  # the task's own opening messages (system optional, then user)
    # Later user messages, replayed in order each time ACT answers without a tool call
    # (multi-turn benchmarks such as BFCL). A user simulator may replace them (see rollout).
    user_turns: list[dict[str, Any]] = field(default_factory=list)
    initial_state: dict[str, Any] = field(default_factory=dict)
    success: dict[str, Any] = field(default_factory=dict)
    reference_calls: list[dict[str, Any]] = field(default_factory=list)  # [{"name", "arguments"}]
    checklist: list[dict[str, Any]] = field(default_factory=list)  # [{"item", "weight"}] for the judge
    tools: list[dict[str, Any]] | None = None  # OpenAI function schemas; None = the world's own
    split: str = "train"
    difficulty: int = 1
    hidden_state: bool = False  # True when the initial state is not inferable from the prompt/docs
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class Turn:
    """One span of the transcript, in order. Sampled spans carry logprobs."""

    role: Role
    token_ids: list[int]
    logprobs: list[float] | None = None  # one per token for ACT/REHEARSE spans
    text: str = ""  # decoded for reading only; never re-tokenised
    malformed: bool = False  # a sampled output that failed to parse (it gets the penalty)


@dataclass
class Trajectory:
    """A finished rollout: one token sequence with a role tag per token.

    `tool_calls`/`observations` are what ACT called and what it saw (real, rehearsed or
    simulated, depending on `mode`). `penalties` counts malformed/empty outputs per role (each
    such output is also flagged `Turn.malformed`).
    """

    task_id: str
    mode: str  # "real" | "rehearse" | "simulator"
    turns: list[Turn] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)  # readable chat (system/user/assistant/tool)
    tool_calls: list[ToolCall] = field(default_factory=list)
    observations: list[dict[str, Any]] = field(default_factory=list)
    final_answer: str | None = None
    end_reason: EndReason | None = None
    penalties: dict[str, int] = field(default_factory=dict)
    real_env_calls: int = 0  # calls executed in a real world while rolling out
    reward: float | None = None
    reward_details: dict[str, Any] = field(default_factory=dict)
    group: int = 0  # index of the rollout within its task group (0..K-1)
    events: list[dict[str, Any]] = field(default_factory=list)  # e.g. pre-commit guard decisions
    side_rows: list[Trajectory] = field(default_factory=list)  # isolated-simulator REHEARSE rows
    seconds: float = 0.0

    @property
    def token_ids(self) -> list[int]:
        return [t for turn in self.turns for t in turn.token_ids]

    @property
    def roles(self) -> list[int]:
        return [int(turn.role) for turn in self.turns for _ in turn.token_ids]

    @property
    def logprobs(self) -> list[float]:
        """Per-token sampling logprobs; 0.0 for forced tokens."""
        out: list[float] = []
        for turn in self.turns:
            out.extend(turn.logprobs if turn.logprobs is not None else [0.0] * len(turn.token_ids))
        return out

    def outputs(self, role: Role) -> list[Turn]:
        """The policy outputs of one role (each a separate output for role-level baselines)."""
        return [t for t in self.turns if t.role == role]

    def num_tokens(self, role: Role | None = None) -> int:
        return sum(len(t.token_ids) for t in self.turns if role is None or t.role == role)
