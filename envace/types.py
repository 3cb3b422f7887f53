"""Typed contracts shared by every stage: tasks, tool calls, role-tagged trajectories.

Stages hand each other these objects and nothing else: rollout produces `Trajectory`,
rewards read it, algorithms turn a group of them into per-token advantages, training
consumes token ids + role tags + logprobs + advantages.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal


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


class CallStatus(str, enum.Enum):
    """What became of one of ACT's calls. Only committed calls (`COMMITTED`) happened in the
    world the agent acted in, so only they are replayed for a reward or compared for fidelity."""

    PENDING = "pending"  # waiting for its answer (only while rolling out)
    EXECUTED = "executed"  # the real world ran it
    REHEARSED = "rehearsed"  # the policy wrote its response (REHEARSE)
    SIMULATED = "simulated"  # a frozen external simulator wrote its response
    MALFORMED = "malformed"  # its rehearsed/simulated response did not parse: ACT saw an error
    REVISED = "revised"  # the pre-commit guard declined it; ACT saw the reason instead
    STOPPED = "stopped"  # the pre-commit guard ended the episode at it
    UNANSWERED = "unanswered"  # the episode ended before it was answered
    RECORDED = "recorded"  # scored as written, never answered (stop tools, single-response tasks)
    REFERENCE = "reference"  # answered with the response recorded in the task's reference trajectory
    UNRECORDED = "unrecorded"  # the reference recorded no response to it: ACT saw an error


COMMITTED = frozenset({CallStatus.EXECUTED, CallStatus.REHEARSED, CallStatus.SIMULATED, CallStatus.REFERENCE})


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = ""
    user_turn: int = 0  # index of the user turn during which ACT made this call
    status: CallStatus = CallStatus.PENDING

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments}


@dataclass
class AddedTools:
    user_turn: int  # from this user turn on (0 = the first)
    tools: list[dict[str, Any]]  # OpenAI function schemas


@dataclass
class EpisodeRules:
    """How the rollout engine runs one task, beyond the command's `RolloutConfig` (set by
    benchmark adapters, or by a task file's `rules`; docs/benchmarks.md)."""

    # Later user turns come from a user simulator, not `Task.user_turns`.
    simulated_user: bool = False
    user_uses_world: bool = False  # the simulated user acts on the rollout's world (tau2 telecom)
    added_tools: list[AddedTools] = field(default_factory=list)  # tools that appear at a later user turn
    max_steps_per_turn: int | None = None  # ACT turns per user turn (instead of `max_turns` per trajectory)
    stop_after_first_act: bool = False  # the first ACT output ends the rollout; its calls are recorded
    stop_tools: list[str] = field(default_factory=list)  # calling one ends the rollout, recorded, unexecuted

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EpisodeRules:
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown episode rule(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        added = [a if isinstance(a, AddedTools) else AddedTools(int(a["user_turn"]), list(a["tools"])) for a in data.get("added_tools", [])]
        return cls(**{**data, "added_tools": added})


@dataclass
class Task:
    """One task. Serialised one per line in the JSONL task format (docs/tasks.md).

    `world` names a registered environment (or `module:Class`); `initial_state` is handed to
    its `reset`. `success` is the verifier spec understood by that world's `verify`. A task with
    `world=None` is world-free: it carries its `tools`, its `documentation`, and usually a recorded
    `reference` (envace/references.py), and it trains with no executable environment.
    """

    id: str
    world: str | None  # None: a world-free task
    messages: list[dict[str, Any]]  # the task's own opening messages (system optional, then user)
    # Later user messages, replayed in order each time ACT answers without a tool call
    # (multi-turn benchmarks such as BFCL). A user simulator may replace them (see rollout).
    user_turns: list[dict[str, Any]] = field(default_factory=list)
    initial_state: dict[str, Any] = field(default_factory=dict)
    success: dict[str, Any] = field(default_factory=dict)
    reference_calls: list[dict[str, Any]] = field(default_factory=list)  # [{"name", "arguments"}]
    # The reference trajectory as OpenAI-style messages, with the tool responses recorded when it
    # was made (world-free tasks: the grounding, the SFT data and the recorded-reference responder).
    reference: list[dict[str, Any]] | None = None
    checklist: list[dict[str, Any]] = field(default_factory=list)  # [{"item", "weight", "turn"?}] for the judge
    tools: list[dict[str, Any]] | None = None  # OpenAI function schemas; None = the world's own
    documentation: str | None = None  # the rules the agent is told (system prompt); None = the world's description
    split: str = "train"
    difficulty: int = 1
    hidden_state: bool = False  # True when the initial state is not inferable from the prompt/docs
    rules: EpisodeRules = field(default_factory=EpisodeRules)
    # Free-form data for the task's own world or benchmark scorer; envace's stages never read it.
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A recorded reference is the source of the reference calls when none are given (the
        # task-file loader also checks that given ones agree with it).
        if self.reference and not self.reference_calls:
            from envace.references import reference_calls

            self.reference_calls = [{"name": c["name"], "arguments": c["arguments"]} for c in reference_calls(self.reference)]


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

    `tool_calls` are every call ACT wrote, each with its `CallStatus`; `observations[i]` is what
    ACT was shown for `tool_calls[i]` (real, rehearsed or simulated, depending on `mode`; a guard's
    reason for a revised call), for the calls that were answered. `penalties` counts
    malformed/empty outputs per role (each such output is also flagged `Turn.malformed`).
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
    grounding_calls: int = 0  # reference calls executed in a real world to ground its simulator prompt
    end_error: dict[str, Any] | None = None  # the parse error of the output that ended it, if one did
    user_source: Literal["replayed", "simulator", "imagined"] = "replayed"  # who wrote the later user turns
    reward: float | None = None
    # The executable verifier's verdict, when the reward ran it: every check passed (the headline
    # metric), and the partial credit (weighted fraction of its goal checks; 0 on a side effect).
    success: bool | None = None
    partial_credit: float | None = None
    reward_details: dict[str, Any] = field(default_factory=dict)  # the reward's own report, for reading only
    reward_components: dict[str, float] = field(default_factory=dict)  # a weighted reward's value per named reward
    # The real world's responses to `committed_calls`, when a reward replayed them: the reference
    # for rehearsal fidelity.
    real_observations: list[dict[str, Any]] | None = None
    # What a real-mode rollout's world held that the benchmark's scorer needs (`rollout_record`).
    benchmark_record: dict[str, Any] | None = None
    group: int = 0  # index of the rollout within its task group (0..K-1)
    events: list[dict[str, Any]] = field(default_factory=list)  # e.g. pre-commit guard decisions
    side_rows: list[Trajectory] = field(default_factory=list)  # isolated-simulator REHEARSE rows
    seconds: float = 0.0

    @property
    def committed_calls(self) -> list[ToolCall]:
        """The calls that happened in the world the agent acted in (real, rehearsed or simulated)."""
        return [c for c in self.tool_calls if c.status in COMMITTED]

    def committed_exchanges(self) -> list[tuple[ToolCall, dict[str, Any]]]:
        """(call, the observation ACT saw) for every committed call."""
        return [(c, o) for c, o in zip(self.tool_calls, self.observations) if c.status in COMMITTED]

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
