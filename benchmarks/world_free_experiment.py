"""Trained in imagination, evaluated in reality: the world-free recipe against the same recipe with
an executable world, all from one warm start, all evaluated greedily in the REAL worlds.

    python benchmarks/world_free_experiment.py --out runs/world-free

Stages (each a plain `envace` command, printed as it runs; rerun the same command to continue
after an interruption: finished stages are kept, a training run resumes from its checkpoint):
  1. tasks      the training worlds' train tasks, once as world tasks and once exported
                world-free (`envace tasks --no-world`: each reference executed once, counted)
  2. sft        warm start on the world-free tasks' recorded references (no world runs)
  3. train      rehearsal GRPO from the warm start, three ways:
                  world-free  world-free tasks, `--reward reference` (call F1 to the recorded
                              reference): no world anywhere in training
                  replay      world tasks, `--reward replay` (the verifier re-runs every call)
                  real-grpo   world tasks, the real world answers during rollouts
  4. eval       base, warm start and the three runs on the test split of the training worlds and
                the held-out world, real mode, greedy; and in rehearse mode on fewer tasks, for
                rehearsal fidelity (evaluation may use the world: it verifies the rehearsals)
Writes results.json and results.md (the table in docs/training.md).
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from pathlib import Path

from envace.cli import main as envace

ROWS = {
    "world-free": ["--tasks", "{free}", "--reward", "reference", "--variant", "envace"],
    "replay": ["--tasks", "{world}", "--reward", "replay", "--variant", "envace"],
    "real-grpo": ["--tasks", "{world}", "--reward", "replay", "--variant", "real-grpo"],
}


def run(argv: list[str]) -> float:
    """Run one envace command; returns its wall time. A failure stops the experiment."""
    print("$ envace " + shlex.join(argv), flush=True)
    start = time.perf_counter()
    if envace(argv) != 0:
        raise SystemExit(f"envace {argv[0]} failed")
    return time.perf_counter() - start


def stage(results: dict, path: Path, name: str, fn) -> dict:
    if name not in results:
        results[name] = fn()
        path.write_text(json.dumps(results, indent=2))
    return results[name]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/world-free")
    p.add_argument("--train-per-world", type=int, default=24)
    p.add_argument("--eval-per-world", type=int, default=20, help="test tasks per world, real mode (5 worlds: 4 training + held-out)")
    p.add_argument("--fidelity-per-world", type=int, default=4, help="test tasks per world in rehearse mode, for rehearsal fidelity")
    p.add_argument("--sft-epochs", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS), help="training rows to run (a subset for a shorter run)")
    p.add_argument("--baselines", nargs="*", default=["sft", "base"], choices=["sft", "base"], help="untrained rows to evaluate")
    p.add_argument("--report", action="store_true", help="only write results.md from what results.json holds so far")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    if args.report:
        (out / "results.md").write_text(table(results, args))
        print(table(results, args))
        return
    files = {"world": str(out / "train-world.jsonl"), "free": str(out / "train-free.jsonl")}
    tasks = ["--split", "train", "--n-per-world", str(args.train_per_world), "--difficulty", "1"]

    def export() -> dict:
        run(["tasks", *tasks, "--output", files["world"]])
        return {"seconds": run(["tasks", *tasks, "--no-world", "--output", files["free"]]),
                "world_executions": json.loads(Path(files["free"] + ".export.json").read_text())["world_executions"]}

    stage(results, path, "tasks", export)
    warm = str(out / "sft" / "final")
    stage(results, path, "sft", lambda: {"seconds": run(["sft", "--tasks", files["free"], "--epochs", str(args.sft_epochs), "--rows-per-step", "4",
                                                         "--lr", "2e-4", "--output-dir", str(out / "sft"), "--no-progress"]),
                                         "manifest": json.loads((out / "sft" / "final" / "data_manifest.json").read_text())["world_executions"]})
    for name in args.rows:
        options, run_dir = ROWS[name], out / name
        argv = ["train", "--init-from", warm, *[o.format(**files) for o in options], "--steps", str(args.steps), "--tasks-per-step", "4",
                "--k", "4", "--lr", str(args.lr), "--output-dir", str(run_dir), "--no-progress", *(["--resume"] if run_dir.exists() else [])]
        stage(results, path, f"train/{name}", lambda: {"seconds": run(argv),
                                                       "world_executions": json.loads((run_dir / "final" / "data_manifest.json").read_text())["world_executions"]})
    # The trained rows first: on an interrupted run the comparison that matters is there first.
    models = {**{name: str(out / name / "final") for name in args.rows}, **{name: {"sft": warm, "base": "default"}[name] for name in args.baselines}}
    for mode, per_world in (("real", args.eval_per_world), ("rehearse", args.fidelity_per_world)):
        for name, model in models.items():
            eval_dir = out / name / f"eval-{mode}"
            argv = ["eval", "--model", model, "--split", "test", "--n-per-world", str(per_world), "--difficulty", "1", "--temperature", "0",
                    "--mode", mode, "--output-dir", str(eval_dir), "--no-progress"]
            stage(results, path, f"eval-{mode}/{name}", lambda: {"seconds": run(argv), "summary": json.loads((eval_dir / "summary.json").read_text())})
    (out / "results.md").write_text(table(results, args))
    print(table(results, args))


def executions(results: dict, name: str) -> dict | None:
    """Every real-world execution behind a row's model (its manifest's chain)."""
    if name == "base":
        return None
    return results["sft"]["manifest"] if name == "sft" else results[f"train/{name}"]["world_executions"]


def table(results: dict, args: argparse.Namespace) -> str:
    from envace.envs import HELDOUT_WORLDS, TRAIN_WORLDS
    from envace.evaluation.report import pooled_success

    lines = [f"`python benchmarks/world_free_experiment.py --out {args.out} --train-per-world {args.train_per_world} --eval-per-world {args.eval_per_world} "
             f"--fidelity-per-world {args.fidelity_per_world} --sft-epochs {args.sft_epochs} --steps {args.steps} --lr {args.lr}`", "",
             "| row | success, training worlds [95% CI] | success, held-out world [95% CI] | success, all | tool F1 | "
             "rehearsal fidelity exact / field F1 | real-world executions to train (rollout / verification / grounding / SFT data / task data) | train wall time |",
             "|---|---|---|---|---|---|---|---|"]
    for name in ("base", "sft", *ROWS):
        if f"eval-real/{name}" not in results:
            lines.append(f"| {name} | not evaluated | | | | | | |")
            continue
        summary, o = results[f"eval-real/{name}"]["summary"], results[f"eval-real/{name}"]["summary"]["overall"]
        rehearsed = results.get(f"eval-rehearse/{name}", {}).get("summary", {}).get("overall", {})
        fidelity = f"{rehearsed['fidelity/exact']:.2f} / {rehearsed['fidelity/field_f1']:.2f}" if "fidelity/exact" in rehearsed else "-"
        calls = executions(results, name)
        cols = " / ".join(str(calls[k]) for k in ("rollout", "verification", "grounding", "sft_data", "task_data")) if calls else "-"
        wall = (results["sft"] if name == "sft" else results.get(f"train/{name}", {})).get("seconds")
        lines.append(f"| {name} | {pooled_success(summary, set(TRAIN_WORLDS))} | {pooled_success(summary, set(HELDOUT_WORLDS))} "
                     f"| {o['success_rate']:.2f} [{o['success_ci95'][0]:.2f}, {o['success_ci95'][1]:.2f}] (n={o['n']}) | {o.get('tool_f1', 0):.2f} "
                     f"| {fidelity} | {cols} | {f'{wall / 60:.1f} min' if wall else '-'} |")
    return "\n".join(lines + paired(Path(args.out))) + "\n"


def paired(out: Path) -> list[str]:
    """Each trained row minus the warm start, task by task on the same real test tasks (paired
    bootstrap of the per-task differences), where both were evaluated."""
    from envace.demo import compare

    warm = out / "sft" / "eval-real"
    rows = [name for name in ROWS if (out / name / "eval-real" / "records.jsonl").is_file()]
    if not (warm / "records.jsonl").is_file() or not rows:
        return []
    lines = ["", "Paired against the SFT warm start (per-task differences on the same tasks, bootstrap 95% CI):", "",
             "| row | success difference [95% CI] | better / worse | partial credit difference [95% CI] | better / worse |", "|---|---|---|---|---|"]
    for name in rows:
        c = compare(warm, out / name / "eval-real")
        cells = [f"{c[k]['mean_diff']:+.2f} [{c[k]['ci95'][0]:+.2f}, {c[k]['ci95'][1]:+.2f}] | {c[k]['better']} / {c[k]['worse']}" for k in ("success", "partial_credit")]
        lines.append(f"| {name} - sft | {cells[0]} | {cells[1]} |")
    return lines


if __name__ == "__main__":
    main()
