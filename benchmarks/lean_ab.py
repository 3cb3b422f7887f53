"""The lean decode path of this tree against the one of an earlier commit, alternated in ONE
process over the same prompt (docs/performance.md, "Batch-1 decode"): the way to measure a
change to envace/backends/lean.py on a shared machine, where two separate runs differ by more than
most such changes gain. The earlier lean.py is loaded from git as its own module, and the generator
runs its `StaticBatch` and `LeanWeights`; everything else (sampling, the session code) is this
tree's. Greedy tokens of the two are compared too.

    python benchmarks/lean_ab.py --before ba7ac07 --sampler-dtype int4   # ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

from envace.backends import HFGenerator, SamplingParams, hf, lean
from step_speed import decode_rate, probe_setup  # benchmarks/ is on sys.path when a script here runs


def lean_at(revision: str):  # type: ignore[no-untyped-def]
    """envace/backends/lean.py as committed at `revision`, imported as a module of its own."""
    source = subprocess.run(["git", "show", f"{revision}:envace/backends/lean.py"], capture_output=True, text=True)
    if source.returncode != 0:
        sys.exit(f"cannot read envace/backends/lean.py at {revision!r}: {source.stderr.strip()} (give a commit of this repository)")
    path = Path(tempfile.mkdtemp()) / f"lean_{revision}.py"
    path.write_text(source.stdout)
    spec = importlib.util.spec_from_file_location(f"lean_{revision}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def use(generator: HFGenerator, version) -> None:  # type: ignore[no-untyped-def]
    """Make `generator` (and every HF generator) decode with a version's lean path: its module's
    batch class and the packed weights it built (once: packing int4 copies takes seconds)."""
    module, weights = version
    hf.StaticBatch = module.StaticBatch
    generator.lean = weights


def greedy(generator: HFGenerator, prompt: list[int], tokens: int) -> list[int]:
    sessions = generator.open(1)
    try:
        return generator.generate(sessions, [list(prompt)], SamplingParams(max_new_tokens=tokens, temperature=0.0))[0].token_ids
    finally:
        generator.close(sessions)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="the commit whose lean.py is the baseline")
    p.add_argument("--sampler-dtype", default="bf16", choices=["f32", "bf16", "int8", "int4"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    generator, prompt = probe_setup(args.sampler_dtype)
    modules = {f"before ({args.before})": lean_at(args.before), "this tree": lean}
    versions = {name: (module, module.LeanWeights(generator.model, generator.lean.dtype, quant=generator.lean.quant).current())
                for name, module in modules.items()}
    rates: dict[str, dict[int, list[float]]] = {name: {b: [] for b in args.batches} for name in versions}
    outputs = {}
    for name, version in versions.items():  # warm-up, and the greedy tokens of each
        use(generator, version)
        outputs[name] = greedy(generator, prompt, args.new_tokens)
    for round_ in range(args.rounds):
        for name, version in versions.items():
            use(generator, version)
            for batch in args.batches:
                rates[name][batch].append(decode_rate(generator, prompt, batch, args.new_tokens)["tok_per_s"])
        print(f"round {round_ + 1}: " + "; ".join(f"{name} " + ", ".join(f"b{b} {rates[name][b][-1]:.1f}" for b in args.batches) for name in versions), flush=True)
    print(f"\n{args.sampler_dtype}, {args.new_tokens} new tokens after a {len(prompt)}-token prompt, aggregate tok/s per round (alternated):\n")
    print("| lean.py | " + " | ".join(f"batch {b}" for b in args.batches) + " |")
    print("|---|" + "---|" * len(args.batches))
    for name in versions:
        print(f"| {name} | " + " | ".join(" / ".join(f"{r:.1f}" for r in rates[name][b]) for b in args.batches) + " |")
    (before, after) = versions
    print("\nthis tree / before, per round: " + "; ".join(
        f"batch {b}: " + ", ".join(f"{a / r:.2f}x" for a, r in zip(rates[after][b], rates[before][b])) for b in args.batches))
    same = next((i for i, (x, y) in enumerate(zip(outputs[before], outputs[after])) if x != y), None)
    print(f"greedy tokens: {'identical' if same is None else f'differ from the {same + 1}th'} ({len(outputs[after])} tokens)")


if __name__ == "__main__":
    main()
