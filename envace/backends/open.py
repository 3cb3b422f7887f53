"""Opening the generators a command names by spec (policy, simulator, judge, rehearser): a local
model spec or an http(s):// OpenAI-compatible URL. Shared by `envace eval` and `envace train`,
which may not import each other (tests/test_layering.py)."""

from __future__ import annotations

from typing import Any


def is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def check_models(*specs: str | None) -> None:
    """Fail on a bad local model spec before any work starts (URLs are checked when opened)."""
    from envace.backends.models import check_model_spec

    for spec in specs:
        if spec and not is_url(spec):
            check_model_spec(spec)


def open_generator(spec: str, seed: int, tokenizer: str | None = None, api_model: str | None = None, sampler_dtype: str = "auto") -> Any:
    """A local model (sampling in `sampler_dtype`, `lean.decode_settings`) or an OpenAI-compatible
    server (whose tokenizer must be given or be the default's)."""
    from envace.backends import load_tokenizer, make_generator

    if is_url(spec):
        return make_generator(spec, tokenizer=load_tokenizer(tokenizer or "default"), model=api_model)
    return make_generator(spec, seed=seed, sampler_dtype=sampler_dtype)
