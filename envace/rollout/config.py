"""Rollout settings: one dataclass, declared once; every command that rolls out nests it
(`EvalConfig.rollout`, `TrainConfig.rollout`, `RehearsalConfig.execution`), with its own
defaults from a default_factory, and its fields are that command's flat flags (envace/config.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from envace.config import ConfigError, field

# recorded: the task's recorded reference answers (world-free SFT data, in the real-mode layout).
Mode = Literal["real", "rehearse", "simulator", "recorded"]


@dataclass
class RolloutConfig:
    mode: Mode = field("real", help="who answers tool calls: the real world, the policy itself (rehearse), a frozen simulator, or the task's recorded reference (recorded)")
    rehearse_layout: Literal["transcript", "isolated"] = field(
        "transcript", help="REHEARSE in the agent's transcript (one row per trajectory) or from a separate simulator prompt (one row per output)")
    max_turns: int = field(8, help="ACT turns per trajectory (tasks with their own limit per user turn, e.g. BFCL multi-turn's 20, use theirs)")
    max_turn_tokens: int = field(192, help="tokens per ACT turn")
    max_rehearse_tokens: int = field(160, help="tokens per rehearsed or simulated tool response")
    max_total_tokens: int = field(3072, help="tokens per trajectory, prompt included")
    temperature: float = field(1.0, help="sampling temperature (0 = greedy)")
    top_p: float = field(1.0, help="nucleus sampling")
    accept_fenced_json: bool = field(False, help="also parse ```json tool calls (lenient; see parsing.parse_act)")
    grounding: bool = field(False, help="the isolated rehearse prompt shows the task's reference (call, true result) pairs")
    # An empty output always ends the rollout, whatever on_malformed says.
    on_malformed: Literal["end", "continue"] = field(
        "end", help="after a malformed tool call/rehearsal (penalised either way): end the rollout, or show the error (ACT) or the broken response (REHEARSE) as the tool's answer and go on")
    # Each rollout in flight holds a world and a KV cache until it ends: this bounds memory.
    max_active: int | None = field(None, help="rollouts in flight at once; the next starts when one ends (0 or empty = all at once)")
    continuous_batching: bool = field(
        False, help="one batch for ACT turns and rehearsed responses alike, in which rows that finish start their next turn while "
                    "the others are still generating (the local transformers sampler; docs/performance.md)")
    sampler_dtype: Literal["auto", "f32", "bf16", "int8", "int4", "f16", "q8_0"] = field(
        "auto", help="weights and KV cache a local model samples with: auto = bf16 where the CPU/GPU computes bf16 natively and the lean "
                     "decode path covers the model (docs/performance.md), else the model's own; f32 = the model's own numerics; "
                     "int8 = int8 weight copies for decode steps of <= 8 rows, over bf16 where the CPU has native bf16 and fp32 elsewhere "
                     "(CPU; faster, larger logprob mismatch); int4 = the same with int4 copies of the layers (groups of 32 inputs; int8 "
                     "for the LM head): fastest, close to the policy only for weights already near a 4-bit grid (the shipped default model, a dequantised Q4_1), "
                     "~0.7 nats per sampled token on trained ones, so not for training at this size (docs/performance.md); "
                     "f16 and q8_0 only for train --sampler llamacpp (whose auto is f32)")

    def validate(self) -> None:
        for name in ("max_turns", "max_turn_tokens", "max_rehearse_tokens", "max_total_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.sampler_dtype in ("int8", "int4") and torch.cuda.is_available():
            raise ConfigError(f"--sampler-dtype {self.sampler_dtype} runs torch's CPU {self.sampler_dtype} kernel, and this machine samples on its GPU: "
                              "use bf16 (or auto)")
        if self.sampler_dtype == "bf16":  # int8 and int4 keep fp32 weights where bf16 is emulated
            from envace.backends.models import warn_if_bf16_is_emulated

            warn_if_bf16_is_emulated(f"--sampler-dtype {self.sampler_dtype}")
        if self.max_active is not None and self.max_active < 0:
            raise ConfigError(f"max_active must be >= 1, or 0 for all at once, got {self.max_active}")
