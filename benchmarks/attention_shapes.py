"""The update's attention at its shapes, three ways (forward + backward, best of 5): SDPA with the
boolean mask the prefix-grouped layout uses, SDPA with a float additive mask, and the explicit
softmax(QK^T)V. SmolLM2-135M's 9 heads x 64; a 600-token causal row, and continuations of 100 and
250 tokens over a 500-token shared prefix (docs/performance.md, "Where the update goes").

    OMP_NUM_THREADS=1 python benchmarks/attention_shapes.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from step_speed import best_of  # noqa: E402

HEADS, HEAD_DIM = 9, 64
SHAPES = ((0, 600), (500, 100), (500, 250))  # (prefix, continuation) tokens
IMPLEMENTATIONS = ("sdpa-bool", "sdpa-float", "math")


def forward_backward_seconds(prefix: int, n: int, implementation: str) -> float:
    q = torch.randn(1, HEADS, n, HEAD_DIM, requires_grad=True)
    k = torch.randn(1, HEADS, prefix + n, HEAD_DIM, requires_grad=True)
    v = torch.randn(1, HEADS, prefix + n, HEAD_DIM, requires_grad=True)
    mask = torch.ones(n, prefix + n, dtype=torch.bool).tril(prefix)  # query i sees the prefix and its own keys <= i

    def step() -> None:
        if implementation == "sdpa-bool":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif implementation == "sdpa-float":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(mask.shape).masked_fill_(~mask, float("-inf")))
        else:
            scores = (q @ k.transpose(-1, -2) * HEAD_DIM**-0.5).masked_fill(~mask, float("-inf"))
            out = scores.softmax(-1) @ v
        out.sum().backward()

    return best_of(5, step)


def main() -> None:
    torch.manual_seed(0)
    for prefix, n in SHAPES:
        for implementation in IMPLEMENTATIONS:
            print(f"prefix {prefix:3d} continuation {n:3d} {implementation:10s} forward+backward {forward_backward_seconds(prefix, n, implementation) * 1e3:7.2f} ms", flush=True)


if __name__ == "__main__":
    main()
