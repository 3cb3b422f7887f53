"""The token-in/token-out generation interface every rollout is written against.

A backend keeps per-session state (for the local backend: the KV cache), so a multi-turn
rollout feeds only the tokens appended since its previous call, never the whole prefix again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, Union, runtime_checkable


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()  # generation ends once the decoded output ends with one of these


# One SamplingParams for every session of a call, or one per session (e.g. each rollout's own
# remaining token budget).
ParamsArg = Union[SamplingParams, Sequence[SamplingParams]]


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def per_session(params: ParamsArg, n: int) -> list[SamplingParams]:
    """The params of each of `n` sessions."""
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"{n} sessions but {len(params)} SamplingParams")
    return params


def check_call(sessions: list[int], new_tokens: list[list[int]], params: list[SamplingParams], open_sessions: dict[int, Any]) -> list[Any]:
    """The states of a `generate` call's sessions (`open_sessions[i]`, each with its `tokens`),
    after the checks every local backend makes: one token list per session, no session twice,
    max_new_tokens >= 1, one sampling distribution per call (limits and stops may differ), only
    open sessions, and something to condition on."""
    if len(sessions) != len(new_tokens):
        raise ValueError(f"{len(sessions)} sessions but {len(new_tokens)} token lists")
    if len(set(sessions)) != len(sessions):
        raise ValueError("a session may appear only once per generate call")
    if any(p.max_new_tokens < 1 for p in params):
        raise ValueError(f"max_new_tokens must be >= 1, got {min(p.max_new_tokens for p in params)}")
    # The rows of a batch share one softmax(logits / T) and nucleus.
    if len({(p.temperature, p.top_p) for p in params}) > 1:
        raise ValueError("the sessions of one generate call must share temperature and top_p (limits and stops may differ)")
    unknown = [i for i in sessions if i not in open_sessions]
    if unknown:
        raise KeyError(f"sessions {unknown} are not open")
    states = [open_sessions[i] for i in sessions]
    empty = [i for i, s, new in zip(sessions, states, new_tokens) if not s.tokens and not new]
    if empty:
        raise ValueError(f"sessions {empty} have no tokens to condition on: pass the prompt")
    return states


@dataclass
class Completion:
    token_ids: list[int]  # as sampled, stop token/string included
    # log p(token) under softmax(logits / T), T the call's temperature (the raw logits when greedy),
    # before any top_p cut (HFGenerator, envace's server). llama.cpp, and vLLM in its default logprobs
    # mode, report the raw logits' (T = 1) probabilities whatever T is: training refuses them at T != 1.
    logprobs: list[float]
    finish_reason: str  # "stop" (stop token/string), "length", or "paused" (HFGenerator.generate(pause_at=...): call again to go on)
    text: str = ""


@dataclass
class GenStats:
    prefill_tokens: int = 0  # prompt tokens actually encoded by the model
    generated_tokens: int = 0
    calls: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def counters(self) -> dict[str, float]:
        """Every cumulative count, the engine's own extras included (weight syncs, prefix-cache
        tokens), so that a caller can report what one stretch of work did by difference; a rate
        (`*_rate`) is not a count and is left out."""
        extras = {k: float(v) for k, v in self.extra.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.endswith("_rate")}
        return {"prefill_tokens": float(self.prefill_tokens), "generated_tokens": float(self.generated_tokens),
                "calls": float(self.calls), "seconds": self.seconds, **extras}


@dataclass(frozen=True)
class PolicyWeights:
    """The trainer's current policy, as `Generator.sync_weights` receives it after an optimizer step.

    `model` is the trainer's live module (unwrapped from DDP; a PEFT model when training LoRA).
    A generator that samples from that same module in-process needs nothing copied; an engine
    that holds its own copy of the weights (llama.cpp, vLLM, a remote server) takes
    `merged_state()` (full weights under the base model's Hugging Face names, LoRA deltas added)
    or, where it can apply adapters itself, `adapter()`. `version` is the number of optimizer
    steps behind these weights; the generator reports the version it samples from
    (`weights_version`), so a trainer can check it never samples from stale weights.
    """

    model: Any
    version: int

    def adapter(self) -> tuple[dict[str, Any], Any] | None:
        """(LoRA tensors by PEFT name, the adapter's PeftConfig), or None for a full model."""
        config = getattr(self.model, "peft_config", None)
        if not config:
            return None
        from peft import get_peft_model_state_dict

        name = getattr(self.model, "active_adapter", "default")
        return get_peft_model_state_dict(self.model, adapter_name=name), config[name]

    def merged_state(self) -> dict[str, Any]:
        """Full weights under the base model's names (`model.layers.0.self_attn.q_proj.weight`, ...),
        detached; with LoRA, W + the adapter's delta (the model itself is left unmerged)."""
        import torch

        if self.adapter() is None:
            return {k: v.detach() for k, v in self.model.state_dict().items()}
        from peft.tuners.lora import LoraLayer

        base = self.model.get_base_model()
        with torch.no_grad():
            state = {k: v.detach() for k, v in base.state_dict().items() if "lora_" not in k}
            for prefix, module in base.named_modules():
                if isinstance(module, LoraLayer):
                    delta = sum(module.get_delta_weight(a) for a in module.active_adapters if a in module.lora_A)
                    state[f"{prefix}.base_layer.weight"] = module.get_base_layer().weight.detach() + delta
        # PEFT renames a wrapped layer's own weight to `<layer>.base_layer.weight`.
        return {k.replace(".base_layer.", "."): v for k, v in state.items()}


class StaleSessionsError(RuntimeError):
    """Weights were synced while sessions were open: their KV caches hold the old policy's keys and values."""


@runtime_checkable
class Generator(Protocol):
    """Token-in/token-out generation with sessions.

    `generate(sessions, new_tokens, params)`: new_tokens[i] are the tokens appended to session
    i's sequence since its previous call (the whole prompt on the first call). A session's full
    sequence is the concatenation of everything fed and everything returned to it, in order.
    All listed sessions advance together as one batch. `params` is shared, or one per session:
    each session stops at its own `max_new_tokens` and stop tokens/strings (`per_session`).

    `sync_weights(weights)` brings the sampler to the trainer's current policy (`PolicyWeights`);
    the trainer calls it after every optimizer step, with no session open (an open session's KV
    cache was computed by the old weights: raise `StaleSessionsError`). `set_seed(seed)` restarts
    the sampling stream, so a step's samples depend on (seed, step) only and a resumed run draws
    the same ones.
    """

    tokenizer: Any
    stats: GenStats
    weights_version: int  # PolicyWeights.version last synced (0 = the weights it was built with; -1 = unknown until the first sync)

    def open(self, n: int) -> list[int]: ...

    def generate(self, sessions: list[int], new_tokens: list[list[int]], params: ParamsArg) -> list[Completion]: ...

    def close(self, sessions: list[int]) -> None: ...

    def sync_weights(self, weights: PolicyWeights) -> None: ...

    def set_seed(self, seed: int) -> None: ...
