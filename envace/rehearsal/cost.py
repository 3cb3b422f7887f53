"""Cost accounting for rehearsal: tokens and seconds per phase, so the cost of each point of
accuracy is visible next to the result."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from envace.types import SAMPLED_ROLES, Trajectory


@dataclass
class TokenCost:
    generated: int = 0  # tokens the model sampled
    prompt: int = 0  # tokens fed to the model: prompts, forced scaffolding, forced tool responses
    seconds: float = 0.0

    @property
    def tokens(self) -> int:
        return self.generated + self.prompt

    def __add__(self, other: TokenCost) -> TokenCost:
        return TokenCost(self.generated + other.generated, self.prompt + other.prompt, self.seconds + other.seconds)

    @classmethod
    def of_trajectory(cls, traj: Trajectory, start: int = 0) -> TokenCost:
        """Tokens of one rollout: turns from `start` on sampled by the model, every other token fed
        (for a resumed trajectory the turns before `start` are the prefix its session was fed).
        Isolated-simulator side rows are generations of their own and count too."""
        generated = sum(len(t.token_ids) for t in traj.turns[start:] if t.role in SAMPLED_ROLES)
        own = cls(generated, len(traj.token_ids) - generated)
        return sum((cls.of_trajectory(row) for row in traj.side_rows), own)

    @classmethod
    def of_events(cls, events: list[dict[str, Any]]) -> TokenCost:
        """What the events of a trajectory report as spent (the rehearsal guard logs a `cost`)."""
        return sum((cls(**e["cost"]) for e in events if "cost" in e), cls())


EXTRA_PHASES = ("attempts", "evaluations", "summary", "guard")


@dataclass
class RehearsalCost:
    """Tokens and seconds per phase. Everything except `execution` is extra: the price of rehearsing.
    Seconds of a phase batched over several items are split evenly among them."""

    attempts: TokenCost = field(default_factory=TokenCost)  # rehearsal attempts (ACT + REHEARSE)
    evaluations: TokenCost = field(default_factory=TokenCost)  # self-evaluations of the attempts
    summary: TokenCost = field(default_factory=TokenCost)  # writing the rehearsal memory
    guard: TokenCost = field(default_factory=TokenCost)  # pre-commit guard rehearsals during execution
    execution: TokenCost = field(default_factory=TokenCost)  # the committed run itself (guard excluded)

    @property
    def extra(self) -> TokenCost:
        return sum((getattr(self, phase) for phase in EXTRA_PHASES), TokenCost())

    def __add__(self, other: RehearsalCost) -> RehearsalCost:
        return RehearsalCost(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)})

    def as_dict(self) -> dict[str, Any]:
        extra = self.extra
        return {
            "extra_tokens": extra.tokens,
            "extra_generated_tokens": extra.generated,
            "extra_prompt_tokens": extra.prompt,
            "rehearsal_seconds": round(extra.seconds, 3),
            "execution_tokens": self.execution.tokens,
            "execution_seconds": round(self.execution.seconds, 3),
            "phases": {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self)},
        }
