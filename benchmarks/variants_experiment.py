"""The CPU experiment: every training variant from one shared SFT warm start, same seeds, then
evaluation on held-out tasks (test split of the training worlds, and the held-out world).

    python benchmarks/variants_experiment.py --config configs/cpu-experiment.yaml --out runs/experiment

Writes runs/experiment/results.md (the table quoted in docs/training.md) and results.json; rerun
the same command to continue after an interruption (finished rows are kept, a variant resumes from
its last checkpoint). Rows: the untrained model, the SFT warm start, then one per variant.
Variants: envace (shared weights, rehearse, both roles trained), act-only, real-grpo (real world),
simulator (frozen base model answers tools), no-share (separate ACT and REHEARSE models).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import yaml

from envace.config import build
from envace.evaluation.runner import EvalConfig, run_eval
from envace.training.sft import SFTConfig, run_sft
from envace.training.trainer import TrainConfig, run_train
from envace.training.variants import VARIANTS

# The table's row order (the registry sorts by name).
ROWS = ("envace", "act-only", "real-grpo", "simulator", "no-share")


def variant_options(name: str) -> dict[str, str]:
    """What a variant needs beyond the preset: the layout it requires, if any."""
    layout = VARIANTS.get(name).requires_layout
    return {"rehearse_layout": layout} if layout else {}


def evaluate(model: str, out: Path, args: argparse.Namespace) -> dict[str, dict]:
    """Greedy, on the test split: the training worlds' test tasks and the held-out world's."""
    cfg = build(EvalConfig, dict(model=model, split="test", n_per_world=args.eval_per_world, difficulty=1, temperature=0.0,
                                 max_turns=6, max_turn_tokens=96, output_dir=str(out / "eval-test"), progress=False))
    return {"test": run_eval(cfg)["overall"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/cpu-experiment.yaml")
    p.add_argument("--out", default="runs/experiment")
    p.add_argument("--variants", nargs="+", default=list(ROWS), choices=VARIANTS.names())
    p.add_argument("--sft-per-world", type=int, default=8)
    p.add_argument("--eval-per-world", type=int, default=2)
    p.add_argument("--steps", type=int, default=None, help="override the preset's steps")
    p.add_argument("--sft-from", default=None, help="reuse this SFT model directory (e.g. runs/demo/sft/final) instead of training one")
    args = p.parse_args()
    out = Path(args.out)
    preset = yaml.safe_load(Path(args.config).read_text()) | ({"steps": args.steps} if args.steps else {})
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else {}

    if "base" not in results:  # the untrained model, on the same evaluation tasks
        results["base"] = {"seconds": 0.0, "world_executions": 0, "eval": evaluate("default", out / "base", args)}
        (out / "results.json").write_text(json.dumps(results, indent=2))
    sft_dir = out / "sft"
    warm = args.sft_from or str(sft_dir / "final")
    if "sft" not in results:
        start = time.perf_counter()
        sft = {"world_executions": "reused", "seconds": None}
        if not args.sft_from:
            done = run_sft(build(SFTConfig, dict(n_per_world=args.sft_per_world, epochs=1, rows_per_step=8, lr=2e-4, difficulty=1, output_dir=str(sft_dir), progress=False)))
            sft = {"world_executions": done["world_executions"]["total"], "seconds": time.perf_counter() - start}
        results["sft"] = sft | {"eval": evaluate(warm, out / "sft", args)}
        (out / "results.json").write_text(json.dumps(results, indent=2))
    for variant in args.variants:
        if variant in results:
            continue  # finished in an earlier invocation
        run = out / variant
        start = time.perf_counter()
        train = run_train(build(TrainConfig, preset | variant_options(variant) | dict(variant=variant, init_from=warm,
                                                                                     output_dir=str(run), resume=run.exists(), progress=False)))
        seconds = time.perf_counter() - start
        results[variant] = {"seconds": seconds, "world_executions": train["world_executions"]["total"], "eval": evaluate(train["final_model"], run, args),
                            "last_metrics": {k: v for k, v in train["last_metrics"].items() if k.startswith(("reward", "success", "fidelity", "env/"))}}
        (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(table(results, preset, args))
    print(table(results, preset, args))


def table(results: dict, preset: dict, args: argparse.Namespace) -> str:
    from envace.envs import HELDOUT_WORLDS, TRAIN_WORLDS
    from envace.evaluation.report import pooled_success

    out = Path(args.out)
    lines = [f"Command: `python benchmarks/variants_experiment.py {shlex.join(sys.argv[1:])}`", "",
             f"Preset: {preset['steps']} steps x {preset['tasks_per_step']} tasks x K={preset['k']}, difficulty {preset['difficulty']}, from one shared SFT warm start.", "",
             f"| row | success, training worlds ({', '.join(TRAIN_WORLDS)}) [95% CI] | success, held-out world ({', '.join(HELDOUT_WORLDS)}) [95% CI] "
             "| tool F1 | real-world executions in training (all purposes) | train wall time |",
             "|---|---|---|---|---|---|"]
    for name, r in results.items():
        summary = json.loads((out / name / "eval-test" / "summary.json").read_text())
        calls = r.get("world_executions", "-")
        wall = f"{r['seconds'] / 60:.1f} min" if r.get("seconds") is not None else "reused"
        lines.append(f"| {name} | {pooled_success(summary, set(TRAIN_WORLDS))} | {pooled_success(summary, set(HELDOUT_WORLDS))} "
                     f"| {summary['overall'].get('tool_f1', 0):.2f} | {calls} | {wall} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
