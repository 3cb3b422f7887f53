"""Microseconds per projection of the default model (SmolLM2-135M) at a decode step's few rows:
fp32 dense as F.linear computes it (x @ W^T) and transposed ((W @ x^T)^T), against torch's int8
weight-only kernel (`torch._weight_int8pack_mm`, what `--sampler-dtype int8` runs for matmuls of
<= 8 rows), the latter fed bf16 and fp32 activations.
Why it exists: on a CPU without native bf16 the kernel's fp32-activation path is 10-40x slower than fp32 dense,
its bf16-activation path is fast, so the lean decode path casts activations to bf16 around it; and
on the AMD EPYC measured, MKL's x @ W^T at 2-8 rows is several times slower than the transposed
product, which the lean path therefore runs there (`lean.transposed_gemm_is_faster`; docs/performance.md).

    OMP_NUM_THREADS=1 python benchmarks/int8_kernels.py            # ~3 min
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

# [out, in] of the default model's projections; the LM head is the tied embedding (vocab x hidden).
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def microseconds(fn: Callable[[], object], calls: int) -> float:
    """The best of three timings of `calls` calls: a shared machine's noise only ever adds time."""
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,8,12")
    args = p.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"{torch.get_num_threads()} threads; microseconds per call, fp32 x @ W^T / fp32 (W @ x^T)^T / int8 with bf16 activations / "
          "int8 with fp32 activations (best of 3)\n")
    print("| projection | " + " | ".join(f"{r} rows" for r in rows_list) + " |")
    print("|---|" + "---|" * len(rows_list))
    for name, (out, inp) in SHAPES.items():
        weight = torch.randn(out, inp)
        scales = weight.abs().amax(dim=1) / 127
        q = (weight / scales[:, None]).round().to(torch.int8)
        calls = 20 if name == "lm_head" else 200
        cells = []
        for rows in rows_list:
            x = torch.randn(rows, inp)
            dense = microseconds(lambda: x @ weight.T, calls)
            transposed = microseconds(lambda: (weight @ x.T).T, calls)
            bf16 = microseconds(lambda: torch._weight_int8pack_mm(x.to(torch.bfloat16), q, scales.to(torch.bfloat16)).float(), calls)
            fp32 = microseconds(lambda: torch._weight_int8pack_mm(x, q, scales), max(2, calls // 10))
            cells.append(f"{dense:.0f} / {transposed:.0f} / {bf16:.0f} / {fp32:.0f}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
