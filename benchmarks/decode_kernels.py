"""Milliseconds per decode step spent in the default model's weight products (SmolLM2-135M: 30
layers' qkv, o, gate/up and down, and the LM head), with every layer's own weights, so that each
step streams them from memory as a real decode step does (`int8_kernels.py` times one projection
over and over, from cache). Per kernel the lean decode path can run at a step's few rows:

    bf16 F.linear           the bf16 GEMM (the lean path above one row, and below QUANT_MAX_ROWS without int8/int4)
    bf16 torch.mv           one row only (`_Proj.one_row_mv`: what the bf16 lean path runs at one row)
    fp32 F.linear           the model's own numerics
    int8 / int4             torch's weight-only kernels with bf16 activations (`lean._Int8`, `lean._Int4`)

and the machine's read bandwidth (a sum over 1 GiB), from which the bf16 weights' read time
bounds a one-row step. These figures choose `lean.QUANT_MAX_ROWS` and `one_row_mv`.

    python benchmarks/decode_kernels.py            # ~20 s on 2 cores
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch
import torch.nn.functional as F

from envace.backends import lean
from int8_kernels import SHAPES, microseconds  # benchmarks/ is on sys.path when a script here runs

LAYERS = 30
LAYER_SHAPES = [SHAPES[name] for name in ("qkv", "o", "gate_up", "down")]  # [out, in]
LM_HEAD = SHAPES["lm_head"]


def best_ms(fn: Callable[[], object], reps: int = 8) -> float:
    return microseconds(fn, reps) / 1e3  # int8_kernels' best of three


def read_gbps() -> float:
    big = torch.ones(256 * 1024 * 1024)  # 1 GiB of fp32
    return big.numel() * 4 / best_ms(lambda: big.sum(), reps=3) / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,6,8,12,16")
    args = p.parse_args()
    torch.manual_seed(0)
    weights = [torch.randn(*shape) for _ in range(LAYERS) for shape in LAYER_SHAPES] + [torch.randn(*LM_HEAD)]
    bf16 = [w.bfloat16() for w in weights]
    int8 = [lean._Int8.of(w) for w in weights]
    int4 = [lean._Int4.of(w) for w in weights]
    bf16_bytes = sum(w.numel() for w in weights) * 2
    gbps = read_gbps()
    print(f"{torch.get_num_threads()} threads; read bandwidth {gbps:.1f} GB/s, so reading the bf16 weights "
          f"({bf16_bytes / 1e6:.0f} MB) takes {bf16_bytes / gbps / 1e6:.2f} ms; ms per step of weight products (best of 3):\n")
    print("| rows | bf16 F.linear | bf16 torch.mv | fp32 F.linear | int8 | int4 |")
    print("|---|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        x = {n: torch.randn(rows, n) for n in (576, 1536)}
        xb = {n: t.bfloat16() for n, t in x.items()}
        cells = [best_ms(lambda: [F.linear(xb[w.shape[1]], w) for w in bf16]),
                 best_ms(lambda: [torch.mv(w, xb[w.shape[1]][0]) for w in bf16]) if rows == 1 else None,
                 best_ms(lambda: [F.linear(x[w.shape[1]], w) for w in weights]),
                 best_ms(lambda: [q(xb[w.shape[1]]) for q, w in zip(int8, weights)]),
                 best_ms(lambda: [q(xb[w.shape[1]]) for q, w in zip(int4, weights)])]
        print(f"| {rows} | " + " | ".join("" if c is None else f"{c:.2f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
