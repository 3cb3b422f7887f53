"""The training variants (`envace train --variant`), each one record: validation, model
building, rollout and the loss rows all read it, so a variant is described in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from envace.registry import Registry
from envace.rollout.config import Mode
from envace.types import Role


@dataclass(frozen=True)
class Variant:
    name: str
    help: str
    rollout_mode: Mode  # who answers tool calls in the variant's rollouts
    # Trained model ("policy", and "rehearser" for a separate one) -> the roles whose tokens it
    # learns. Real and simulated tool responses are tagged ENV, never trained.
    trained_roles: Mapping[str, tuple[Role, ...]]

    @property
    def separate_rehearser(self) -> bool:
        """A second trained model writes the REHEARSE turns."""
        return "rehearser" in self.trained_roles

    @property
    def needs_simulator_model(self) -> bool:
        """A frozen model answers the tool calls (--simulator-model)."""
        return self.rollout_mode == "simulator"

    @property
    def policy_rehearses(self) -> bool:
        """The policy itself learns REHEARSE, in the agent's transcript: what grounding trains."""
        return Role.REHEARSE in self.trained_roles.get("policy", ())

    @property
    def requires_layout(self) -> str | None:
        """Two models cannot share one transcript's KV cache: a separate rehearser writes from
        the isolated simulator prompt."""
        return "isolated" if self.separate_rehearser else None

    @property
    def allows_real_fraction(self) -> bool:
        """Only a rehearse variant has something to mix real-world rollouts into."""
        return self.rollout_mode == "rehearse"

    @property
    def all_roles(self) -> tuple[Role, ...]:
        """The roles trained by any of the variant's models (the advantage estimator's roles)."""
        return tuple(sorted({r for roles in self.trained_roles.values() for r in roles}))


VARIANTS: Registry[Variant] = Registry("variant")


def _register(*variants: Variant) -> None:
    for variant in variants:
        VARIANTS.register(variant.name)(variant)


_register(
    Variant("envace", "the policy rehearses the tools with shared weights, ACT and REHEARSE trained", "rehearse",
            {"policy": (Role.ACT, Role.REHEARSE)}),
    Variant("act-only", "the policy rehearses the tools, only ACT trained", "rehearse", {"policy": (Role.ACT,)}),
    Variant("real-grpo", "the real world answers (the GRPO baseline), ACT trained", "real", {"policy": (Role.ACT,)}),
    Variant("simulator", "a frozen simulator model answers (--simulator-model), ACT trained", "simulator", {"policy": (Role.ACT,)}),
    Variant("no-share", "a second trained model rehearses the tools (needs --rehearse-layout isolated), ACT and REHEARSE trained in separate models", "rehearse",
            {"policy": (Role.ACT,), "rehearser": (Role.REHEARSE,)}),
)


def variants_help() -> str:
    return "; ".join(f"{v.name}: {v.help}" for v in map(VARIANTS.get, VARIANTS.names()))
