"""A lean decode path for Llama-family models over a preallocated KV cache (`HFGenerator`'s fast path).

Why
    A 135M-parameter model decodes one token in ~1.5 ms of weight reads, but transformers' eager
    forward spends several times that in per-module Python, mask building, three q/k/v and two
    gate/up matmuls per layer, and a `DynamicCache` that grows by concatenation. Grouped-query
    attention through SDPA's `enable_gqa` (or `repeat_kv`) is also slow on CPU. This module runs the
    same arithmetic with one fused qkv and one fused gate/up matmul per layer, writes keys and values
    in place into a cache allocated once per call, and folds each key/value head's query heads into
    the query axis, so attention never copies the cache. Weights may be kept in bf16 (`dtype`) where
    the CPU multiplies bf16 natively: half the bytes per token and the bf16 matmul units.

What it covers
    Decoder-only models of the Llama layout (`LEAN_MODEL_TYPES`: RMSNorm, rotary q/k, q/k/v/o
    projections with optional bias and per-head q/k norms, SiLU gate/up/down MLP, full attention).
    `lean_support` says why a model is not covered; `HFGenerator` then runs transformers' forward.

Numerics
    At the model's own dtype (fp32) the outputs equal transformers' forward up to float rounding
    (greedy decodes are token-identical; tests compare both), also where few-row matmuls run as
    (W @ x^T)^T (`transposed_gemm_is_faster`: the same product, summed in another order). In bf16 the sampler's distribution is
    the bf16 model's: the logprobs it returns are that distribution's, and a trainer must treat them
    as another policy's (truncated importance weights on the update's own logprobs; `envace.training.trainer`).
    With weight-only quantized copies (`--sampler-dtype int8` or `int4`), matmuls of at most
    `QUANT_MAX_ROWS` rows use the quantized weights (and bf16 activations): each token's logprob is
    that of the weights that drew it.

Weight refresh
    The packed copies are rebuilt whenever any parameter of the live module changed: every in-place
    update (optimizer step, `load_state_dict`, `copy_`) bumps a tensor's version counter, so
    `LeanWeights.current()` compares the counters (O(parameters), no data read) before each call.
    LoRA adapters are merged into the copy (`PolicyWeights.merged_state`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from envace.backends.base import PolicyWeights

LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, kv_heads, seq, head_dim]


# Decode steps of at most this many rows multiply by weight-only quantized copies
# (`--sampler-dtype int8 | int4`). Measured (docs/performance.md, benchmarks/int8_kernels.py):
# torch's int8 kernel reads a quarter of fp32's bytes and beat the bf16 GEMM up to 4-8 rows on
# AVX-512 Xeons, fp32 dense up to 4-8 rows on an AVX2 EPYC (the LM head up to 12); its int4 kernel
# (groups of INT4_GROUP inputs, a scale and a zero each) reads an eighth and beat the bf16 GEMM
# up to 8 rows on an AMX Xeon (at 1 row 4.4 ms per step of weight products against int8's 5.8 and
# bf16's 11.6-16.9; benchmarks/decode_kernels.py).
QUANT_MAX_ROWS = {"int8": 8, "int4": 8}
INT4_GROUP = 32


# fp32 matmuls of at most this many rows run as (W @ x^T)^T where `transposed_gemm_is_faster` says
# so: the LM head (49152 x 576) up to 8 rows; the layers' projections up to 4, with more than one
# thread only (benchmarks/int8_kernels.py).
TRANSPOSED_MAX_ROWS_LM_HEAD = 8
TRANSPOSED_MAX_ROWS = 4


@functools.cache
def transposed_gemm_is_faster() -> bool:
    """Whether a few-row fp32 matmul runs faster as (W @ x^T)^T than as F.linear's x @ W^T here.
    Measured on an AMD EPYC (AVX2, torch's MKL BLAS; benchmarks/int8_kernels.py): at 2-8 rows
    MKL runs x @ W^T on one thread and reads the weights at 5-15 GB/s (37-42 at one row). The
    transposed product took the LM head from 19.6-21.7 ms to 5.2-9.0 at 2 threads (9.3-17.1 at 1);
    the layers' projections at 2-4 rows 1.4-1.9x faster at 2 threads, but 0.75-0.9x at 1 thread
    and 0.9x at 6-8 rows. Intel CPUs were not measured, so they keep F.linear: AMD CPUs only."""
    from envace.backends.models import cpu_name

    return not torch.cuda.is_available() and "AMD" in cpu_name()


def decode_settings(setting: str, model: Any) -> dict[str, Any]:
    """`HFGenerator`'s numerics keywords for a `--sampler-dtype` setting: dtype (None = the
    model's own) and quant (None, "int8" or "int4"). auto picks bf16 where it is fast and close
    enough to train from: native bf16 matmuls (`native_bf16`) and the lean path (transformers'
    forward would need a bf16 model). int8 and int4 (CPU, lean path) add weight-only quantized
    copies for small decode batches (multiplied with bf16 activations), on top of bf16 where the
    CPU multiplies bf16 natively and of the model's own fp32 elsewhere: an emulated bf16 GEMM of a
    prefill or a large batch is 30-80x slower than fp32, while the int8 kernel runs bf16
    activations fast on such CPUs too (docs/performance.md)."""
    from envace.backends.models import native_bf16

    if setting == "auto":
        return {"dtype": torch.bfloat16 if native_bf16() and lean_support(model) is None else None, "quant": None}
    if setting not in ("f32", "bf16", *QUANT_MAX_ROWS):
        raise ValueError(f"a local (transformers) sampler decodes in f32, bf16, int8 or int4, not {setting!r} (f16 and q8_0 are llama.cpp's)")
    quant = setting if setting in QUANT_MAX_ROWS else None
    dtype = torch.float32 if setting == "f32" or (quant and not native_bf16()) else torch.bfloat16
    return {"dtype": None if dtype == model.dtype else dtype, "quant": quant}


def _base(model: Any) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def lean_support(model: Any) -> str | None:
    """None if the lean path runs `model` exactly as transformers does, else why not."""
    config = _base(model).config
    if config.model_type not in LEAN_MODEL_TYPES:
        return f"model type {config.model_type!r} (lean path: {', '.join(LEAN_MODEL_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (lean path: silu)"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    return None  # rotary variants are the model's own module's business (`LeanWeights.rope`)


@dataclass
class _Int8:
    """Symmetric int8 per output channel (`int8_codes`), for torch's CPU int8 weight-only kernel."""

    codes: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out], bf16: the activations' dtype the kernel's fast path takes
    kind: ClassVar[str] = "int8"

    @classmethod
    def of(cls, weight: torch.Tensor) -> "_Int8":
        return cls(*int8_codes(weight))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.codes, self.scales)


@dataclass
class _Int4:
    """Asymmetric int4 per group of INT4_GROUP inputs (`int4_codes`), packed for torch's CPU int4
    weight-only kernel (the layout torchao's int4 weight-only CPU path uses)."""

    packed: torch.Tensor  # torch's CPU int4 pack of the codes
    scales_zeros: torch.Tensor  # [in / group, out, 2] bf16: (scale, zero) per group and output
    kind: ClassVar[str] = "int4"

    @classmethod
    def of(cls, weight: torch.Tensor) -> "_Int4 | None":
        """None where the kernel cannot take the shape: it needs outputs a multiple of 16 and inputs a
        multiple of INT4_GROUP."""
        out, inputs = weight.shape
        if out % 16 or inputs % INT4_GROUP:
            return None
        codes, scales, zeros = int4_codes(weight, INT4_GROUP)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        return cls(packed, torch.stack([scales, zeros], -1).transpose(0, 1).contiguous().to(torch.bfloat16))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales_zeros)


QUANTIZED = {cls.kind: cls for cls in (_Int8, _Int4)}  # the weight-only copies a `quant` setting names


@dataclass
class _Proj:
    """A projection's weight [out, in] (and bias) in the decode dtype, with a weight-only quantized
    copy (`_Int8`, `_Int4`) that decode steps of at most `QUANT_MAX_ROWS[kind]` rows multiply by instead."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    quantized: _Int8 | _Int4 | None = None
    transposed_rows: int = 0  # fp32 matmuls of at most this many rows run as (W @ x^T)^T (`transposed_gemm_is_faster`)
    one_row_mv: bool = False  # a one-row bf16 CPU product runs as torch.mv (`LeanWeights._build`)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, in] -> [tokens, out]. Every call is on a decode step's path, so it issues no op
        it does not need: a batch-1 token is ~1,000 dispatched ops (it was 1,700), each microseconds."""
        rows = x.shape[0]
        if self.quantized is not None and rows <= QUANT_MAX_ROWS[self.quantized.kind]:
            # The kernels' fast path takes bf16 activations, also on CPUs without native bf16; with
            # fp32 activations int8 was measured 10-40x slower than fp32 dense (AVX2 EPYC).
            if x.dtype == torch.bfloat16:
                y = self.quantized(x)
            else:
                y = self.quantized(x.to(torch.bfloat16)).to(x.dtype)
        elif rows == 1 and self.one_row_mv:
            y = torch.mv(self.weight, x[0])[None]
        elif rows <= self.transposed_rows:
            y = (self.weight @ x.T).T
        else:
            return F.linear(x, self.weight, self.bias)
        return y if self.bias is None else y + self.bias


def int8_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: weight ~= int8 * scale[:, None], from the fp32 weight;
    the scales in bf16, the activations' dtype the kernel will see (`_Int8`)."""
    scales = weight.float().abs().amax(dim=1).clamp(min=1e-12) / 127
    return (weight.float() / scales[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous(), scales.to(torch.bfloat16)


def int4_codes(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of `group` inputs of each output: scale = (max - min) / 15, codes
    round((w - min) / scale) in 0..15, and the kernel's dequantisation (code - 8) * scale + zero, so
    zero = min + 8 * scale. Returns codes [out, in] int32, scales and zeros [out, in / group] fp32."""
    out, inputs = weight.shape
    groups = weight.float().view(out, inputs // group, group)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low) / 15).clamp(min=1e-12)
    codes = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.int32).view(out, inputs)
    return codes, scales, low + 8 * scales


@dataclass
class _Layer:
    norm_in: torch.Tensor
    qkv: _Proj  # q, k and v projections stacked: [(heads + 2 kv_heads) * head_dim, hidden]
    q_norm: torch.Tensor | None  # per-head RMSNorm weights (Qwen3)
    k_norm: torch.Tensor | None
    o: _Proj
    norm_post: torch.Tensor
    gate_up: _Proj  # gate and up stacked: [2 * intermediate, hidden]
    down: _Proj


class LeanWeights:
    """The packed, `dtype` copy of a live module's weights, rebuilt when any parameter changed."""

    def __init__(self, model: Any, dtype: torch.dtype, quant: str | None = None):
        if quant is not None and quant not in QUANT_MAX_ROWS:
            raise ValueError(f"quant is one of {', '.join(QUANT_MAX_ROWS)} or None, not {quant!r}")
        if quant and (dtype not in (torch.bfloat16, torch.float32) or next(model.parameters()).device.type != "cpu"):
            raise ValueError(f"{quant} decode runs torch's CPU {quant} weight-only kernel: a CPU model, and dtype bf16 or fp32 for the rest")
        self.model = model
        self.dtype = dtype
        self.quant = quant
        base = _base(model)
        config = base.config
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.rotary = base.model.rotary_emb
        self.scaling = base.model.layers[0].self_attn.scaling
        self._stamp: tuple[int, ...] | None = None
        self.rebuilds = 0

    def _versions(self) -> tuple[int, ...]:
        return tuple(p._version for p in self.model.parameters())

    def current(self) -> "LeanWeights":
        """Self, with the copy rebuilt first if the live weights changed since it was made."""
        stamp = self._versions()
        if stamp != self._stamp:
            self._build()
            self._stamp = stamp
        return self

    @torch.no_grad()
    def _build(self) -> None:
        state = PolicyWeights(self.model, version=0).merged_state()
        cast: dict[int, torch.Tensor] = {}  # tied tensors (embeddings = LM head) are cast once

        def get(name: str) -> torch.Tensor | None:
            t = state.get(name)
            if t is None:
                return None
            key = t.data_ptr()
            if key not in cast:
                cast[key] = t.to(self.dtype).contiguous()
            return cast[key]

        def cat(*names: str) -> torch.Tensor | None:
            parts = [state.get(n) for n in names]
            if any(p is None for p in parts):
                return None
            return torch.cat(parts).to(self.dtype).contiguous()

        transposed = self.dtype == torch.float32 and transposed_gemm_is_faster()
        # A one-row bf16 product runs as torch.mv: on an AMX Xeon the GEMM path read the weights at
        # 17 GB/s, torch.mv at 25 (of ~31 measured for a plain read), 1.2x the batch-1 decode rate
        # (docs/performance.md). Multi-row products stay GEMMs (a loop of mv reads the weights per row).
        one_row_mv = self.dtype == torch.bfloat16 and next(self.model.parameters()).device.type == "cpu"
        # Read at each rebuild: the layers gain from the transposed product only with a second thread.
        layer_rows = TRANSPOSED_MAX_ROWS if torch.get_num_threads() > 1 else 0

        def proj(*names: str, bias: tuple[str, ...] = (), transposed_rows: int = layer_rows, quant: str | None = self.quant) -> _Proj:
            full = torch.cat([state[n] for n in names]) if len(names) > 1 else state[names[0]]
            out = _Proj(get(names[0]) if len(names) == 1 else full.to(self.dtype).contiguous(), cat(*bias) if bias else None,
                        transposed_rows=transposed_rows if transposed else 0, one_row_mv=one_row_mv)
            if quant is not None:
                out.quantized = QUANTIZED[quant].of(full)
            return out

        self.embed = get("model.embed_tokens.weight")
        head = "lm_head.weight" if "lm_head.weight" in state else "model.embed_tokens.weight"  # a tied head is stored once
        # The LM head gets int8 copies under int4 too: int4 there (9% weight error on the default
        # model's embedding) raised the mismatch of sampled tokens' logprobs 6x (0.20 against
        # 0.035 in bf16), int8 costs no measurable speed (docs/performance.md).
        self.lm_head = proj(head, transposed_rows=TRANSPOSED_MAX_ROWS_LM_HEAD, quant="int8" if self.quant == "int4" else self.quant)
        self.norm = get("model.norm.weight")
        self.layers = []
        for i in range(len(_base(self.model).model.layers)):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            self.layers.append(_Layer(
                norm_in=get(p + "input_layernorm.weight"),
                qkv=proj(*(attn + f"{x}_proj.weight" for x in "qkv"), bias=tuple(attn + f"{x}_proj.bias" for x in "qkv")),
                q_norm=get(attn + "q_norm.weight"), k_norm=get(attn + "k_norm.weight"),
                o=proj(attn + "o_proj.weight"),
                norm_post=get(p + "post_attention_layernorm.weight"),
                gate_up=proj(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=proj(p + "mlp.down_proj.weight"),
            ))
        self.rebuilds += 1

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [batch, seq, 1, head_dim] for position ids [batch, seq] (`_rotate`), from
        the model's own rotary module (so every rope variant it implements)."""
        cos, sin = self.rotary(self.embed[:1], positions)
        half = sin.shape[-1] // 2
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return cos.to(self.dtype)[:, :, None], signed_sin.to(self.dtype)[:, :, None]


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1), as x * cos +
    (x2, x1) * (-sin1, sin2): the same products to the bit, in four elementwise ops instead of
    seven, each ~2-5 us of dispatch on a decode step's few values (CPU)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class StaticBatch:
    """The sessions of one call in one preallocated KV cache, with the same interface as
    `hf._Batch` (forward / feed / row_kv / keep_rows).

    Layout: like `_Batch`, rows are left-padded so that every row's newest token sits in the same
    column; past caches end at column `width_past`, the pending chunks fill the next `width_new`
    columns, and each decode step writes one more column in place. `valid[b, c]` marks real
    tokens; a row's positions are its count of real tokens. The cache holds width_past +
    width_new + max_new_tokens columns, so no step ever reallocates.

    Finished rows stay in the cache, masked out of the logits, until they are more than a quarter
    of it; then the live rows are compacted into a smaller cache (one copy, not one per finished row).
    """

    def __init__(self, weights: LeanWeights, chunks: list[list[int]], kvs: list[KV | None], pad_id: int,
                 device: torch.device, max_new_tokens: int):
        w = self.w = weights
        past = [0 if kv is None else kv[0][0].shape[2] for kv in kvs]
        width_past, width_new = max(past), max(len(c) for c in chunks)
        columns = width_past + width_new + max_new_tokens
        rows = len(chunks)
        self.valid = torch.zeros(rows, columns, dtype=torch.bool, device=device)
        self.input_ids = torch.full((rows, width_new), pad_id, dtype=torch.long, device=device)
        self.cache = torch.empty(2, len(w.layers), rows, w.kv_heads, columns, w.head_dim, dtype=w.dtype, device=device)
        # Attention reads every column up to the newest, masked or not, and a masked value still
        # meets a zero weight in the product (0 x NaN = NaN): the padding before each row's past
        # must hold numbers. Later columns are written for every row before anything reads them.
        self.cache[..., :width_past, :].zero_()
        for row, (n_past, chunk, kv) in enumerate(zip(past, chunks, kvs)):
            self.valid[row, width_past - n_past:width_past] = True
            self.valid[row, width_past + width_new - len(chunk):width_past + width_new] = True
            self.input_ids[row, width_new - len(chunk):] = torch.tensor(chunk, device=device)
            if kv is not None:
                for layer, (k, v) in enumerate(kv):
                    self.cache[0, layer, row, :, width_past - n_past:width_past] = k[0]
                    self.cache[1, layer, row, :, width_past - n_past:width_past] = v[0]
        self.length = width_past  # columns written so far
        # No padding anywhere (one row, or rows of equal lengths): a decode step needs no mask.
        self.dense = all(n_past == width_past for n_past in past) and all(len(c) == width_new for c in chunks)
        self.pad_id = pad_id
        self.live = list(range(rows))  # internal row of each row the caller sees

    def forward(self) -> torch.Tensor:
        """Run the pending input; returns float32 next-token logits [live rows, vocab]."""
        start, n = self.length, self.input_ids.shape[1]
        end = start + n
        valid = self.valid[:, :end]
        positions = (valid.cumsum(-1) - 1).clamp(min=0)[:, start:]
        # Query column q sees valid keys up to q; a padded query sees itself (never an empty row).
        if n == 1:
            mask = valid[:, None, :].clone()
            mask[:, :, start] = True
        else:
            causal = torch.ones(n, end, dtype=torch.bool, device=valid.device).tril(start)
            mask = valid[:, None, :] & causal[None]
            mask[:, :, start:] |= torch.eye(n, dtype=torch.bool, device=valid.device)
        logits = self._forward(self.input_ids, positions, mask, start)
        self.length = end
        return logits.float()

    @torch.inference_mode()
    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, start: int) -> torch.Tensor:
        w = self.w
        rows, n = ids.shape
        end = start + n
        group = w.heads // w.kv_heads
        q_size, kv_size = w.heads * w.head_dim, w.kv_heads * w.head_dim
        cos, sin = w.rope(positions)
        # Each key/value head's `group` query heads become `group` query rows (q head h uses kv
        # head h // group, as transformers' repeat_kv), so attention reads the cache once, uncopied.
        # An additive mask made once per forward: SDPA would convert a boolean one in every layer.
        # Without padding a decode step's mask is all True: none at all, one op less per layer.
        if n == 1 and self.dense:
            attn_mask = None
        else:
            bias = torch.zeros(mask.shape, dtype=w.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
            attn_mask = bias[:, None, :, None, :].expand(rows, 1, n, group, end).reshape(rows, 1, n * group, end) if n > 1 else bias[:, None]
        # Every layer's cache up to the newest column, as views made once per forward (not two
        # indexing ops per layer and tensor): the decode step's op count is its cost at few rows.
        cache = self.cache[..., :end, :]
        layer_keys, layer_values = cache[0].unbind(0), cache[1].unbind(0)
        x = F.embedding(ids.view(-1), w.embed)  # [rows * n, hidden]: the products take it as is
        hidden = x.shape[-1]
        for layer, keys, values in zip(w.layers, layer_keys, layer_values):
            h = F.rms_norm(x, (hidden,), layer.norm_in, w.eps)
            qkv = layer.qkv(h).view(rows, n, -1)
            if layer.q_norm is None:  # q and k rotate as one tensor: half the elementwise calls
                qk = _rotate(qkv[..., :q_size + kv_size].view(rows, n, w.heads + w.kv_heads, w.head_dim), cos, sin)
                q, k = qk[:, :, :w.heads], qk[:, :, w.heads:]
            else:
                q, k = qkv[..., :q_size].view(rows, n, w.heads, w.head_dim), qkv[..., q_size:q_size + kv_size].view(rows, n, w.kv_heads, w.head_dim)
                q = _rotate(F.rms_norm(q, (w.head_dim,), layer.q_norm, w.eps), cos, sin)
                k = _rotate(F.rms_norm(k, (w.head_dim,), layer.k_norm, w.eps), cos, sin)
            v = qkv[..., q_size + kv_size:].view(rows, n, w.kv_heads, w.head_dim)
            if n == 1:  # a decode step: one column per row, and no axis to transpose
                keys[:, :, start] = k[:, 0]
                values[:, :, start] = v[:, 0]
                q = q.view(rows, w.kv_heads, group, w.head_dim)
            else:
                keys[:, :, start:end] = k.transpose(1, 2)
                values[:, :, start:end] = v.transpose(1, 2)
                q = q.view(rows, n, w.kv_heads, group, w.head_dim).transpose(1, 2).reshape(rows, w.kv_heads, n * group, w.head_dim)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, scale=w.scaling)
            if n > 1:
                out = out.view(rows, w.kv_heads, n, group, w.head_dim).transpose(1, 2)
            x = x + layer.o(out.reshape(rows * n, q_size))
            h = F.rms_norm(x, (hidden,), layer.norm_post, w.eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        # The LM head (a fifth of the weights, ~40% of a few-row decode step) only for live rows.
        x = x.view(rows, n, hidden)
        last = x[:, -1] if len(self.live) == rows else x[self.live, -1]
        return w.lm_head(F.rms_norm(last, (hidden,), w.norm, w.eps))

    def feed(self, tokens: torch.Tensor) -> None:
        """Queue one sampled token per live row for the next forward (finished rows get padding)."""
        ids = torch.full((self.valid.shape[0], 1), self.pad_id, dtype=torch.long, device=self.valid.device)
        ids[self.live, 0] = tokens
        self.input_ids = ids
        self.valid[self.live, self.length] = True
        # A finished row's new column stays invalid: nothing attends to it, and its row_kv is taken.

    def row_kv(self, row: int) -> KV:
        """Live row `row`'s cache without padding, copied out of the batch's cache (compact form)."""
        internal = self.live[row]
        keep = self.valid[internal, :self.length].nonzero().squeeze(1)
        keys = self.cache[0, :, internal:internal + 1][:, :, :, keep]
        values = self.cache[1, :, internal:internal + 1][:, :, :, keep]
        return [(keys[layer], values[layer]) for layer in range(keys.shape[0])]

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only these live rows; compact the cache once finished rows exceed a quarter of it."""
        self.live = [self.live[r] for r in rows]
        total = self.valid.shape[0]
        self.dense = self.dense and len(self.live) == total  # a finished row's next columns stay invalid
        if total - len(self.live) <= total // 4:
            return
        index = torch.tensor(self.live, device=self.valid.device)
        valid = self.valid[index]
        start = int(valid[:, :self.length].any(0).int().argmax())  # leading columns that hold only padding
        self.valid = valid[:, start:]
        self.cache = self.cache[:, :, index, :, start:].contiguous()
        self.input_ids = self.input_ids[index]
        self.length -= start
        self.live = list(range(len(index)))
        self.dense = bool(self.valid[:, :self.length].all())
