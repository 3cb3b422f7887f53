"""Rollout settings: one dataclass, declared once; every command that rolls out nests it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

Mode = Literal["real", "rehearse", "simulator"]


@dataclass
class RolloutConfig:
    mode: Mode = "real"
    rehearse_layout: Literal["transcript", "isolated"] = "transcript"
    max_turns: int = 8  # ACT turns per trajectory
    max_turn_tokens: int = 192  # tokens per ACT turn
    max_rehearse_tokens: int = 160  # tokens per rehearsed/simulated tool response
    max_total_tokens: int = 3072  # whole transcript, prompt included
    temperature: float = 1.0
    top_p: float = 1.0
    accept_fenced_json: bool = False  # see parsing.parse_act
    grounding: bool = False  # isolated prompt shows the task's reference (call, true result) pairs
    # A malformed tool call or rehearsal is penalised; "end" stops the rollout there, "continue"
    # shows the error (ACT) or the broken response (REHEARSE) as the tool's answer and goes on.
    # An empty output always ends it.
    on_malformed: Literal["end", "continue"] = "end"
    # Rollouts in flight at once (None: all). Each holds a world and a KV cache until it ends, so
    # this bounds memory on large task sets; the next rollout starts when one finishes.
    max_active: int | None = None


def rollout_config_from(options: Any, **overrides: Any) -> RolloutConfig:
    """The RolloutConfig fields of a command's config (eval, train) plus overrides."""
    names = {f.name for f in dataclasses.fields(RolloutConfig)}
    values = {name: getattr(options, name) for name in names if hasattr(options, name)}
    return RolloutConfig(**(values | overrides))
