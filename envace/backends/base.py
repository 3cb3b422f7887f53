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


def per_session(params: ParamsArg, n: int) -> list[SamplingParams]:
    """The params of each of `n` sessions."""
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"{n} sessions but {len(params)} SamplingParams")
    return params


@dataclass
class Completion:
    token_ids: list[int]  # as sampled, stop token/string included
    logprobs: list[float]  # log p(token) under the sampling distribution's model (temperature 1 logits)
    finish_reason: str  # "stop" (stop token/string) or "length"
    text: str = ""


@dataclass
class GenStats:
    prefill_tokens: int = 0  # prompt tokens actually encoded by the model
    generated_tokens: int = 0
    calls: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Generator(Protocol):
    """Token-in/token-out generation with sessions.

    `generate(sessions, new_tokens, params)`: new_tokens[i] are the tokens appended to session
    i's sequence since its previous call (the whole prompt on the first call). A session's full
    sequence is the concatenation of everything fed and everything returned to it, in order.
    All listed sessions advance together as one batch. `params` is shared, or one per session:
    each session stops at its own `max_new_tokens` and stop tokens/strings (`per_session`).
    """

    tokenizer: Any
    stats: GenStats

    def open(self, n: int) -> list[int]: ...

    def generate(self, sessions: list[int], new_tokens: list[list[int]], params: ParamsArg) -> list[Completion]: ...

    def close(self, sessions: list[int]) -> None: ...
