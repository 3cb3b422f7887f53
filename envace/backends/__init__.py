"""Token-in/token-out generation backends (see docs/backends.md)."""

from __future__ import annotations

from typing import Any

from envace.backends.base import Completion, Generator, GenStats, SamplingParams
from envace.backends.hf import HFGenerator
from envace.backends.lean import decode_settings
from envace.backends.models import (
    ModelNotFoundError,
    check_model_spec,
    default_device,
    load_model,
    load_tokenizer,
    resolve_model,
    tiny_model,
)
from envace.backends.openai_http import BackendUnreachableError, OpenAIGenerator

__all__ = [
    "BackendUnreachableError", "Completion", "GenStats", "Generator", "HFGenerator", "ModelNotFoundError",
    "OpenAIGenerator", "SamplingParams", "check_model_spec", "default_device", "load_model", "load_tokenizer",
    "make_generator", "resolve_model", "tiny_model",
]


def make_generator(spec: str, tokenizer: Any = None, **kw: Any) -> Generator:
    """A generator for a model spec (local: HFGenerator) or an http(s):// base URL (OpenAIGenerator).

    Local keywords: device, dtype (for load_model), sampler_dtype (the sampler's, `lean.decode_settings`:
    auto | f32 | bf16 | int8 | int4), seed, max_batch; `tokenizer` replaces the
    model's own. URL keywords: model (served name; default: the server's only model), api_key,
    timeout, max_concurrency; `tokenizer` is required (the served model's tokenizer, e.g.
    `load_tokenizer("default")`). The URL is checked with `check_reachable` before returning.
    """
    if spec.startswith(("http://", "https://")):
        if tokenizer is None:
            raise ValueError("an http(s) backend needs the served model's tokenizer: pass tokenizer=load_tokenizer(SPEC)")
        generator = OpenAIGenerator(spec, kw.pop("model", None), tokenizer, **kw)
        generator.check_reachable()
        return generator
    model, own_tokenizer = load_model(spec, device=kw.pop("device", None), dtype=kw.pop("dtype", None))
    return HFGenerator(model, tokenizer or own_tokenizer, **decode_settings(kw.pop("sampler_dtype", "f32"), model), **kw)
