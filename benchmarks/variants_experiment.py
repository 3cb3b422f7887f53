"""The CPU experiment (issue #13): every training variant from one shared warm start with the
demo's GRPO recipe, same seeds, each evaluated greedily on the same test tasks (the training
worlds' test split and the held-out world) and compared task by task with the warm start.

    python benchmarks/variants_experiment.py --out runs/experiment                  # every row, 120 test tasks
    python benchmarks/variants_experiment.py --out runs/experiment --warm runs/demo/sft/final --rows envace,act-only
    python benchmarks/variants_experiment.py --out runs/exp120 --warm runs/demo/sft/final --trained runs/exp40 --steps 3   # runs/exp40 (--steps 3 --eval-per-world 8) trained these; evaluated on 120 tasks
    python benchmarks/variants_experiment.py --steps-from runs/exp6,runs/exp12 --rows envace,act-only --out runs/exp12   # one seed at 6 and 12 steps: a learning curve

Rerun the same command to continue after an interruption: finished stages are kept in
results.json, and a GRPO run resumes from its last checkpoint (saved every --save-every steps).

Rows (each the demo's GRPO stage, `envace demo`'s settings, with the one change named):
  envace             the demo's own: shared weights, rehearse mode, ACT and REHEARSE trained, the
                     rehearser grounded on the reference tool responses (--rehearse-sft-coef)
  envace-ungrounded  the same, REHEARSE trained by the task reward alone
  act-only           rehearse mode, only ACT trained
  real-grpo          the real worlds answer the rollouts' calls (GRPO against the environment)
  simulator          the frozen warm start answers the calls (the rehearser as it was before GRPO)
  simulator-base     the frozen base model answers the calls
  no-share           a second trained model rehearses (ACT and REHEARSE in separate weights)
  world-free         envace on the world-free form of its training tasks (their reference
                     responses recorded once, counted), rewarded by call F1 against the reference
                     calls: no world during the GRPO stage (the partial-credit reward replays calls)
The baselines' policies train no REHEARSE role in the agent's transcript, so they have nothing
to ground. The staging (warm start, evaluations, paired comparisons) is benchmarks/grpo_sweep.py's.

Writes results.json, results.md (success with 95% CIs per world group, partial credit, the paired
comparison with the warm start, real-world executions by purpose, wall time; then the sweep's
per-step table) and curves.png (rollout reward per step, and against the real-world executions
spent: the cost axis).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repo root, where `benchmarks` is a package
from benchmarks import grpo_sweep  # noqa: E402
from envace.demo import DemoConfig

UNGROUNDED = {"rl_rehearse_sft_coef": 0.0}
VARIANT_ROWS: dict[str, dict] = {
    "envace": {},
    "envace-ungrounded": UNGROUNDED,
    "act-only": {"rl_variant": "act-only", **UNGROUNDED},
    "real-grpo": {"rl_variant": "real-grpo", **UNGROUNDED},
    "simulator": {"rl_variant": "simulator", **UNGROUNDED},  # the frozen warm start answers
    "simulator-base": {"rl_variant": "simulator", "rl_simulator_model": "default", **UNGROUNDED},  # the frozen base model answers
    "no-share": {"rl_variant": "no-share", **UNGROUNDED},
    "world-free": {"rl_world_free": True, "rl_reward": "reference"},
}
PURPOSES = ("rollout", "verification", "grounding")  # what a GRPO run executes in the real worlds (accounting.WorldExecutions)


def experiment_rows(steps: int) -> dict[str, dict]:
    """The rows' DemoConfig changes, each trained for `steps` GRPO steps."""
    return {name: {**change, "rl_steps": steps} for name, change in VARIANT_ROWS.items()}


def summary_table(results: dict, rows: list[str]) -> str:
    """One line per model: the untrained one, the warm start, and each finished row."""
    from envace.envs import HELDOUT_WORLDS, TRAIN_WORLDS
    from envace.evaluation.report import pooled_success

    lines = [f"| row | success, training worlds ({', '.join(TRAIN_WORLDS)}) [95% CI] | success, held-out world ({', '.join(HELDOUT_WORLDS)}) [95% CI] "
             "| partial credit | episodes ended: answered / turn limit / other (tool calls per task) "
             "| success vs warm start [95% CI] (better/worse) | partial credit vs warm start "
             f"| real-world executions in training ({' / '.join(PURPOSES)} / recording world-free tasks) | train min |",
             "|---|---|---|---|---|---|---|---|---|"]
    models = [("base (untrained)", "eval-base", None), ("warm start (SFT)", "eval-warm", None)]
    models += [(row, f"eval-{row}", row) for row in rows if f"compare-{row}" in results]
    for label, stage, row in models:
        if stage not in results:
            continue
        ev = results[stage]["result"]
        if row is None:
            versus, calls, minutes = "", "", ""
            if stage == "eval-warm":
                calls = warm_start_executions(results, rows)
        else:
            cmp, train = results[f"compare-{row}"], results[f"train-{row}"]
            versus = f"{grpo_sweep.paired(cmp['success'])} | {grpo_sweep.paired(cmp['partial_credit'])}"
            calls = " / ".join([*(str(train["result"]["world_executions"][p]) for p in PURPOSES), str(recorded(train))])
            minutes = f"{train['seconds'] / 60:.1f}"
        lines.append(f"| {label} | {pooled_success(ev, set(TRAIN_WORLDS))} | {pooled_success(ev, set(HELDOUT_WORLDS))} | "
                     f"{ev['overall']['partial_credit']:.3f} | {episode_ends(ev)} | {versus or ' | '} | {calls} | {minutes} |")
    return "\n".join(lines) + "\n"


def episode_ends(ev: dict) -> str:
    """How a model's test episodes ended, and how many tool calls it made per task: what GRPO
    changed in its behaviour (a row that learns to answer instead of looping to the turn limit can
    still lose success by answering before the task's last call)."""
    ends, n = ev.get("end_reasons"), ev["overall"].get("n")
    if not ends or not n:
        return "-"
    answered, limit = ends.get("answered", 0), ends.get("max_turns", 0)
    return f"{answered} / {limit} / {n - answered - limit} ({ev['overall']['real_env_calls'] / n:.2f})"


def recorded(train: dict) -> int:
    """What recording a row's world-free training tasks executed (its chain's task data; 0 for world tasks)."""
    return train["result"].get("chain_world_executions", {}).get("task_data", 0)


def warm_start_executions(results: dict, rows: list[str]) -> str:
    """What making the warm start's SFT data executed in the real worlds: its own stage's count, or
    (a --warm warm start) the count a trained row's manifest chain carries from it."""
    if "sft" in results:
        return f"{results['sft']['result']['world_executions']['total']} (its SFT data)"
    chains = [results[f"train-{row}"]["result"]["chain_world_executions"] for row in rows if f"train-{row}" in results]
    return f"{chains[0]['sft_data']} (its SFT data)" if chains else ""


def curves_plot(results: dict, rows: list[str], path: Path) -> Path | None:
    """Per finished row: the rollouts' mean reward per GRPO step, against the step and against the
    real-world executions the run had spent by then (rollouts, verification and grounding, after
    what recording its world-free tasks cost up front)."""
    from matplotlib.figure import Figure

    curves = {row: results[f"curve-{row}"] for row in rows if f"curve-{row}" in results}
    if not curves:
        return None
    fig = Figure(figsize=(10, 4))
    by_step, by_cost = fig.subplots(1, 2)
    for row, curve in curves.items():
        reward = [c["reward/mean"] for c in curve]
        # a row rewarded otherwise (world-free: call F1) is on another scale: its label says so
        other = VARIANT_ROWS.get(row, {}).get("rl_reward")
        label = f"{row} (reward: {other})" if other else row
        by_step.plot([c["step"] for c in curve], reward, marker="o", label=label)
        up_front = recorded(results[f"train-{row}"]) if f"train-{row}" in results else 0
        by_cost.plot([up_front + (c.get("env/total_total") or 0) for c in curve], reward, marker="o", label=label)
    ylabel = "rollout reward (partial credit unless named)"
    by_step.set(xlabel="GRPO step", ylabel=ylabel, title="reward per step")
    by_cost.set(xlabel="real-world executions spent in training", ylabel=ylabel, title="reward per real-world cost")
    return grpo_sweep.save_plot(fig, (by_step, by_cost), path)


def greedy_outcomes(evaluation: Path) -> list[tuple]:
    """What a greedy evaluation decided per task (its tokens, calls, ending and scores), without its
    timings: equal for two evaluations of the same model on the same tasks."""
    keys = ("task_id", "total_tokens", "num_calls", "end_reason", "success", "partial_credit")
    return [tuple(r[k] for k in keys) for r in map(json.loads, (evaluation / "records.jsonl").read_text().splitlines())]


def pair_metrics(comparison: dict) -> tuple[dict, dict]:
    """A model's paired comparisons (`envace.demo.compare`): success's, then partial credit's."""
    return comparison["success"], comparison["partial_credit"]


def steps_from(outs: list[Path], rows: list[str], png: Path) -> str:
    """Finished runs of one seed that differ only in --steps, as points of one learning curve per
    row: with a constant learning rate and per-step seeds, a longer run's first steps are the
    shorter run's (checked here only as far as the warm starts: their test records must match).
    Returns a table of greedy test success / partial credit per step count, each model paired
    with the warm start and with the previous step count, and draws the paired differences."""
    from envace.demo import compare

    runs = [(out, grpo_sweep.finished_sweep(out, rows, "--steps-from")) for out in outs]
    warm_records = [greedy_outcomes(out / "eval-warm") for out, _ in runs]
    if any(records != warm_records[0] for records in warm_records[1:]):
        raise SystemExit(f"--steps-from: {', '.join(map(str, outs))} have different warm starts (their eval-warm records differ): "
                         "they are not points of one learning curve (same --seed and SFT settings, --steps only)")
    runs.sort(key=lambda run: run[1][f"curve-{rows[0]}"][-1]["step"])
    lines = ["| row | GRPO steps | success / partial credit | vs warm start: success / partial credit [95% CI] (better/worse) "
             "| vs the previous step count: success / partial credit |", "|---|---|---|---|---|"]
    points: dict[str, list[tuple[int, dict]]] = {}
    for row in rows:
        before = runs[0][0] / "eval-warm"
        warm = runs[0][1]["eval-warm"]["result"]["overall"]
        lines.append(f"| {row} | 0 (warm start) | {warm['success_rate']:.3f} / {warm['partial_credit']:.3f} | | |")
        for out, results in runs:
            steps, after = results[f"curve-{row}"][-1]["step"], results[f"eval-{row}"]["result"]["overall"]
            versus_warm = results[f"compare-{row}"]
            # the first count's previous is the warm start: already the column before
            previous = "" if before.name == "eval-warm" else " / ".join(map(grpo_sweep.paired, pair_metrics(compare(before, out / f"eval-{row}"))))
            lines.append(f"| {row} | {steps} | {after['success_rate']:.3f} / {after['partial_credit']:.3f} | "
                         f"{' / '.join(map(grpo_sweep.paired, pair_metrics(versus_warm)))} | {previous} |")
            points.setdefault(row, []).append((steps, versus_warm))
            before = out / f"eval-{row}"
    grpo_sweep.paired_steps_plot(points, png)
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    grpo_sweep.add_sweep_options(p, "runs/experiment", VARIANT_ROWS, eval_per_world=24)
    p.add_argument("--steps", type=int, default=6, help="GRPO steps per row (the demo's rl_tasks_per_step tasks x rl_k rollouts each)")
    p.add_argument("--save-every", type=int, default=2, help="checkpoint each GRPO run every N steps: an interrupted run resumes from there")
    p.add_argument("--steps-from", default=None, help="comma-separated finished runs of one seed that differ only in --steps: print --rows' "
                   "test success per step count (paired with the warm start and the previous count), draw it to --out/steps.png, and run nothing")
    args = p.parse_args()
    if args.steps_from:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        print(steps_from([Path(o) for o in args.steps_from.split(",")], args.rows.split(","), Path(args.out) / "steps.png"))
        return
    if args.steps < 1 or args.save_every < 1:
        raise SystemExit("--steps and --save-every must be >= 1")
    out, rows = Path(args.out), args.rows.split(",")
    settings = {key: getattr(args, key) for key in grpo_sweep.SETTINGS}
    results = grpo_sweep.run(out, rows, settings, defs=experiment_rows(args.steps), warm=args.warm, eval_rehearse=args.eval_rehearse,
                             trained=args.trained, save_every=args.save_every, eval_max_active=args.eval_max_active)
    base = DemoConfig(output_dir=str(out), progress=False, **settings)
    grpo_sweep.evaluation_stage(results, out, "eval-base", base.model, base, max_active=args.eval_max_active)
    curves_plot(results, rows, out / "curves.png")
    text = (f"Command: `python benchmarks/variants_experiment.py {shlex.join(sys.argv[1:])}`\n\n{summary_table(results, rows)}\n"
            f"Per step (benchmarks/grpo_sweep.py's table):\n\n{grpo_sweep.table(results, rows, experiment_rows(args.steps))}")
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    print(text)


if __name__ == "__main__":
    main()
