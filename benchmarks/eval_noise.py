"""How far a greedy evaluation moves a model's score by its own numerics: the same model on the
same test tasks (the demo's evaluation), at several sampler dtypes and batch widths (rollouts in
flight at once, decoded as one padded batch). Per setting, the tasks whose success or partial
credit differ from the first setting's: a paired difference between two models of that many tasks
is not evidence of anything (issue #13).

    python benchmarks/eval_noise.py --model runs/sweep5/train-sft-24-8-tasks-6-steps/final --out runs/eval_noise \\
        --eval-per-world 24 --settings bf16:64,bf16:16,f32:64,f32:16

Each setting runs in a fresh process; rerun the same command to continue (finished settings are
kept in results.json). Writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from envace.demo import EVAL_SAMPLER_DTYPES, DemoConfig, evaluate_model, in_fresh_process, per_task


def parse_settings(text: str) -> list[tuple[str, int]]:
    """"bf16:64,f32:16" -> [("bf16", 64), ("f32", 16)]: sampler dtype, rollouts in flight."""
    settings = []
    for item in text.split(","):
        dtype, _, width = item.partition(":")
        if dtype not in EVAL_SAMPLER_DTYPES or not width.isdigit() or int(width) < 1:
            raise SystemExit(f"--settings: {item!r} is not DTYPE:WIDTH (DTYPE auto, f32 or bf16; WIDTH >= 1), e.g. bf16:64")
        settings.append((dtype, int(width)))
    return settings


def flips(reference: dict[str, float], other: dict[str, float]) -> list[str]:
    """The tasks whose score differs between two evaluations of the same tasks."""
    if reference.keys() != other.keys():
        raise ValueError("the two evaluations ran different tasks")
    return sorted(t for t in reference if reference[t] != other[t])


def table(results: dict, settings: list[str]) -> str:
    lines = ["| sampler dtype : rollouts in flight | success / partial credit | tasks whose success differs from the first row's | "
             "whose partial credit differs | s |", "|---|---|---|---|---|"]
    for name in settings:
        if name not in results:
            continue
        r = results[name]
        lines.append(f"| {name} | {r['success_rate']:.3f} / {r['partial_credit']:.3f} | {len(r['success_flips'])} {r['success_flips']} | "
                     f"{len(r['partial_flips'])} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model directory (e.g. a run's final/) or the default model's name")
    p.add_argument("--out", default="runs/eval_noise")
    p.add_argument("--eval-per-world", type=int, default=DemoConfig().eval_per_world, help="test tasks per world (5 worlds)")
    p.add_argument("--seed", type=int, default=0, help="which test tasks")
    p.add_argument("--settings", default="bf16:64,bf16:16,f32:64,f32:16", help="DTYPE:WIDTH,...; the first is the reference")
    args = p.parse_args()
    settings = parse_settings(args.settings)
    cfg = DemoConfig(eval_per_world=args.eval_per_world, seed=args.seed, progress=False)
    cfg.validate()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    # the flips compare the same tasks of the same model: one model, task count and seed per --out
    for key in ("model", "eval_per_world", "seed"):
        if results.get(key, getattr(args, key)) != getattr(args, key):
            raise SystemExit(f"{out} holds results for {key} {results[key]!r}: pass that --{key.replace('_', '-')} or another --out")
    results.update(model=args.model, eval_per_world=args.eval_per_world, seed=args.seed)
    names = [f"{dtype}:{width}" for dtype, width in settings]
    for (dtype, width), name in zip(settings, names):
        run_dir = out / name.replace(":", "-")
        if name not in results:
            start = time.perf_counter()
            summary, peak = in_fresh_process(evaluate_model, args.model, dataclasses.replace(cfg, eval_sampler_dtype=dtype), "real", run_dir, width)
            results[name] = {**{k: summary["overall"][k] for k in ("success_rate", "partial_credit")}, "seconds": time.perf_counter() - start,
                             "peak_rss_gib": peak, "dir": str(run_dir)}
        first = Path(results[names[0]]["dir"])
        results[name]["success_flips"] = flips(per_task(first, "success"), per_task(run_dir, "success"))
        results[name]["partial_flips"] = flips(per_task(first, "partial_credit"), per_task(run_dir, "partial_credit"))
        path.write_text(json.dumps(results, indent=2))
        (out / "results.md").write_text(table(results, names))
        print(table(results, names), flush=True)


if __name__ == "__main__":
    main()
