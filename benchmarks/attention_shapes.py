"""The update's attention at its shapes, three ways (forward + backward, best of 5): SDPA with the
boolean mask the prefix-grouped layout uses, SDPA with a float additive mask, and the explicit
softmax(QK^T)V (its softmax in fp32, as the flash kernel accumulates). SmolLM2-135M's 9 heads x
64; a 600-token causal row, and continuations of 100 and 250 tokens over a 500-token shared
prefix (docs/performance.md, "Where the update goes"). `--dtype bf16` is the update's precision
under bf16 autocast on a CPU with native bf16.

    OMP_NUM_THREADS=1 python benchmarks/attention_shapes.py [--dtype bf16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from step_speed import best_of  # noqa: E402

HEADS, HEAD_DIM = 9, 64
SHAPES = ((0, 600), (500, 100), (500, 250))  # (prefix, continuation) tokens
IMPLEMENTATIONS = ("sdpa-bool", "sdpa-float", "math")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, implementation: str) -> torch.Tensor:
    if implementation == "sdpa-bool":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if implementation == "sdpa-float":
        additive = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=additive)
    scores = (q @ k.transpose(-1, -2)).float().mul_(HEAD_DIM**-0.5).masked_fill_(~mask, float("-inf"))
    return scores.softmax(-1).to(v.dtype) @ v


def seconds(prefix: int, n: int, implementation: str, dtype: torch.dtype, backward: bool) -> float:
    q = torch.randn(1, HEADS, n, HEAD_DIM, dtype=dtype, requires_grad=backward)
    k = torch.randn(1, HEADS, prefix + n, HEAD_DIM, dtype=dtype, requires_grad=backward)
    v = torch.randn(1, HEADS, prefix + n, HEAD_DIM, dtype=dtype, requires_grad=backward)
    mask = torch.ones(n, prefix + n, dtype=torch.bool).tril(prefix)  # query i sees the prefix and its own keys <= i

    def step() -> None:
        out = attention(q, k, v, mask, implementation)
        if backward:
            out.float().sum().backward()

    with torch.set_grad_enabled(backward):
        return best_of(5, step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    dtype = DTYPES[parser.parse_args().dtype]
    torch.manual_seed(0)
    for prefix, n in SHAPES:
        for implementation in IMPLEMENTATIONS:
            forward = seconds(prefix, n, implementation, dtype, backward=False)
            both = seconds(prefix, n, implementation, dtype, backward=True)
            print(f"prefix {prefix:3d} continuation {n:3d} {implementation:10s} forward {forward * 1e3:7.2f} ms  "
                  f"forward+backward {both * 1e3:7.2f} ms", flush=True)


if __name__ == "__main__":
    main()
