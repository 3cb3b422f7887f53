"""Does torch.compile of the lean decode forward beat eager at batch 1? (docs/performance.md,
"Batch-1 decode"). One process, one generator: `lean.StaticBatch._forward` compiled with
`dynamic=True` for decode steps (prefill stays eager), alternated with the eager forward over the
same 437-token tool prompt, then the greedy tokens of both compared.

    python benchmarks/decode_compile.py                    # 1-3 min on 2 cores (compiling: ~45 s with Inductor's cache warm, ~2 min cold)
    python benchmarks/decode_compile.py --products linear  # the one-row products as F.linear, not torch.mv
    python benchmarks/decode_compile.py --products opaque --sampler-dtype int4  # the products as opaque custom ops: Inductor compiles only the rest
"""

from __future__ import annotations

import argparse
import time

import torch

from envace.backends import SamplingParams, lean
from step_speed import decode_rate, probe_setup  # benchmarks/ is on sys.path when a script here runs


PRODUCTS: list = []  # the lean projections the custom op below runs, by index


@torch.library.custom_op("envace_bench::product", mutates_args=())
def product(x: torch.Tensor, index: int) -> torch.Tensor:
    return PRODUCTS[index](x)


@product.register_fake
def _(x: torch.Tensor, index: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], PRODUCTS[index].weight.shape[0])


class OpaqueProduct:
    """A lean projection called through `product`: to Dynamo and Inductor one opaque op."""

    def __init__(self, proj) -> None:  # type: ignore[no-untyped-def]
        self.index = len(PRODUCTS)
        PRODUCTS.append(proj)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.envace_bench.product(x, self.index)


def make_products_opaque(weights) -> None:  # type: ignore[no-untyped-def]
    weights.lm_head = OpaqueProduct(weights.lm_head)
    for layer in weights.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(layer, name, OpaqueProduct(getattr(layer, name)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sampler-dtype", default="bf16", choices=["f32", "bf16", "int8", "int4"])
    p.add_argument("--products", default="mv", choices=["mv", "linear", "opaque"],
                   help="how one-row bf16 products run (lean's default: mv); opaque: every product (as lean runs it) is a custom op "
                        "Inductor calls but cannot look into, so it fuses only the work between the products")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    generator, prompt = probe_setup(args.sampler_dtype)
    if args.products == "linear":
        weights = generator.lean.current()
        for proj in [weights.lm_head, *(p for layer in weights.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down))]:
            proj.one_row_mv = False

    if args.products == "opaque":
        make_products_opaque(generator.lean.current())

    eager = lean.StaticBatch._forward
    compiled = torch.compile(eager.__wrapped__, dynamic=True)  # the forward without its inference_mode wrapper

    def compiled_forward(self, ids, positions, mask, start):  # type: ignore[no-untyped-def]
        if ids.shape[1] > 1:
            return eager(self, ids, positions, mask, start)
        with torch.inference_mode():
            return compiled(self, ids, positions, mask, start)

    def rate(forward, label: str, new_tokens: int = 64) -> None:  # type: ignore[no-untyped-def]
        lean.StaticBatch._forward = forward
        start = time.perf_counter()
        tok_per_s = decode_rate(generator, prompt, 1, new_tokens)["tok_per_s"]
        print(f"{label}: {tok_per_s:.1f} tok/s (call {time.perf_counter() - start:.1f} s)", flush=True)

    def greedy(forward) -> list[int]:  # type: ignore[no-untyped-def]
        lean.StaticBatch._forward = forward
        session = generator.open(1)
        try:
            return generator.generate(session, [list(prompt)], SamplingParams(max_new_tokens=64, temperature=0.0))[0].token_ids
        finally:
            generator.close(session)

    try:
        rate(compiled_forward, "compiled, first call (compiles)", new_tokens=4)
        for _ in range(args.rounds):
            rate(eager, "eager")
            rate(compiled_forward, "compiled")
        a, b = greedy(eager), greedy(compiled_forward)
    finally:
        lean.StaticBatch._forward = eager
    first = next((i + 1 for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    print("greedy tokens identical" if a == b else f"greedy tokens differ from the {first}th of {len(a)}")


if __name__ == "__main__":
    main()
