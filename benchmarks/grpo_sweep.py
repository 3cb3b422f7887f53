"""Which settings let the demo's GRPO stage move the agent: one setting changed per row (of the
GRPO stage, or of the warm start it starts from), each evaluated like the demo and compared task
by task with its own warm start (issue #13, "search before guessing").

    python benchmarks/grpo_sweep.py --out runs/sweep                      # every row
    python benchmarks/grpo_sweep.py --out runs/sweep --rows demo,lr-5e-5   # some rows
    python benchmarks/grpo_sweep.py --out runs/sweep --warm runs/demo/sft/final   # reuse a warm start
    python benchmarks/grpo_sweep.py --out runs/sweep4 --rows sft-24-8-tasks-6-steps --warm runs/ws24/sft/final
    python benchmarks/grpo_sweep.py --out runs/sweep4 --rows sft-24-8-tasks-6-steps,sft-24-8-tasks-12-steps,sft-24-8-tasks-18-steps,sft-24-8-tasks-24-steps --warm runs/ws24/sft/final
    python benchmarks/grpo_sweep.py --out runs/sweep6 --eval-per-world 24 --trained runs/sweep5 --rows sft-24-8-tasks-6-steps   # sweep5's models on 120 test tasks
    python benchmarks/grpo_sweep.py --pool runs/g0,runs/s1a --rows current-demo,rehearse-sft-0.5   # two seeds' sweeps, pooled

Stages (each in a fresh process, as in the demo; rerun the same command to continue: finished
stages are kept in results.json):
  1. the demo's SFT warm start (`envace demo`'s defaults; --warm names an existing one instead),
     and one more per distinct SFT setting that a row changes
  2. each warm start's greedy evaluation on the demo's 40 test tasks (8 per world, the held-out
     world's included; --eval-per-world 24: 120, the 40 among them)
  3. per row: the demo's GRPO stage with the row's settings (envace variant, rehearse mode, the
     partial-credit reward), evaluated on the same 40 tasks, compared with its warm start task by
     task (paired bootstrap, success and partial credit)
Writes results.json, results.md (the table in docs/training.md), fidelity.png (the rehearser's
fidelity per step, and the grounding loss where one was trained) and, for runs evaluated at several
step counts (continued rows), steps.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from pathlib import Path

import yaml

from envace.config import to_dict
from envace.demo import EVAL_SAMPLER_DTYPES, DemoConfig, compare, compare_fidelity, compare_pooled, evaluate_model, grpo_stage_config, in_fresh_process, sft_config
from envace.training.checkpoint import latest_checkpoint
from envace.training.sft import run_sft
from envace.training.trainer import run_train
from envace.training.variants import VARIANTS

# The rows measured before GRPO drew unseen tasks by default: they trained on the first training
# tasks, the warm start's SFT tasks among them (rl_unseen_tasks off), and rerun as they were.
SEEN = {"rl_unseen_tasks": False}
# The rows measured before GRPO filtered groups by default (DAPO's dynamic sampling) rolled out one
# round of tasks per step, and rerun as they were.
ONE_ROUND = {"rl_filter_groups": False}
# The rows measured before the demo grounded its rehearser (--rehearse-sft-coef) trained it with the task reward only, and rerun as they were.
UNGROUNDED = {"rl_rehearse_sft_coef": 0.0}

# Each row changes DemoConfig fields of the GRPO stage or of its warm start; "demo" is the demo as it was.
# Measured on 2026-12-03 (docs/training.md): demo, temp-1.0, sft-1-epoch-temp-1.0 (the demo before);
# grounding (stopped after 2 steps), real-third; the sft-24-* rows (sft-24-temp-1.0-12-steps stopped after 1 step).
ROWS: dict[str, dict] = {
    "demo": {**UNGROUNDED, **ONE_ROUND, **SEEN},
    "temp-1.0": {**UNGROUNDED, **ONE_ROUND, **SEEN, "rl_temperature": 1.0},
    "sft-1-epoch-temp-1.0": {**UNGROUNDED, **ONE_ROUND, **SEEN, "sft_epochs": 1, "rl_temperature": 1.0},
    "lr-5e-5": {**UNGROUNDED, **ONE_ROUND, **SEEN, "rl_lr": 5e-5},
    "lr-1e-4": {**UNGROUNDED, **ONE_ROUND, **SEEN, "rl_lr": 1e-4},
    "6-steps": {**UNGROUNDED, **ONE_ROUND, **SEEN, "rl_steps": 6},
    "k-8": {**UNGROUNDED, **ONE_ROUND, **SEEN, "rl_k": 8, "rl_tasks_per_step": 2},
    "replay-reward": {**UNGROUNDED, **ONE_ROUND, **SEEN, "rl_reward": "replay"},
    "grounding": {**UNGROUNDED, **ONE_ROUND, **SEEN, "rl_grounding": True},
    "real-third": {**UNGROUNDED, **ONE_ROUND, **SEEN, "rl_real_fraction": 1 / 3},
    "sft-24-per-world-4-steps": {**UNGROUNDED, **ONE_ROUND, **SEEN, "sft_per_world": 24, "rl_steps": 4},
    "sft-24-lr-1e-4-8-steps": {**UNGROUNDED, **ONE_ROUND, **SEEN, "sft_per_world": 24, "rl_lr": 1e-4, "rl_steps": 8},
    "sft-24-12-steps": {**UNGROUNDED, **ONE_ROUND, **SEEN, "sft_per_world": 24, "rl_steps": 12},
    "sft-24-temp-1.0-12-steps": {**UNGROUNDED, **ONE_ROUND, **SEEN, "sft_per_world": 24, "rl_temperature": 1.0, "rl_steps": 12},
    # More rows with a signal per Adam step: 8 tasks x K = 4 (32 rows) per step instead of 3 x 4.
    "sft-24-8-tasks-6-steps": {**UNGROUNDED, **ONE_ROUND, **SEEN, "sft_per_world": 24, "rl_tasks_per_step": 8, "rl_steps": 6},
    "sft-24-8-tasks-12-steps": {**UNGROUNDED, **ONE_ROUND, **SEEN, "sft_per_world": 24, "rl_tasks_per_step": 8, "rl_steps": 12},
    "sft-24-8-tasks-18-steps": {**UNGROUNDED, **ONE_ROUND, **SEEN, "sft_per_world": 24, "rl_tasks_per_step": 8, "rl_steps": 18},
    "sft-24-8-tasks-24-steps": {**UNGROUNDED, **ONE_ROUND, **SEEN, "sft_per_world": 24, "rl_tasks_per_step": 8, "rl_steps": 24},
    # At T = 0.5 that warm start samples its ACT tokens at 0.000-0.040 nats of entropy: its K rollouts mostly repeat each other.
    "sft-24-8-tasks-temp-1.0-6-steps": {**UNGROUNDED, **ONE_ROUND, **SEEN, "sft_per_world": 24, "rl_tasks_per_step": 8, "rl_temperature": 1.0, "rl_steps": 6},
    "sft-24-8-tasks-temp-1.0-12-steps": {**UNGROUNDED, **ONE_ROUND, **SEEN, "sft_per_world": 24, "rl_tasks_per_step": 8, "rl_temperature": 1.0, "rl_steps": 12},
    # The same 32 rows per step as 8 tasks x K = 4, spent on more rollouts per task at T = 0.5: a
    # near-deterministic policy more often samples one differing trajectory in 8 than in 4.
    "sft-24-k-8-6-steps": {**UNGROUNDED, **ONE_ROUND, **SEEN, "sft_per_world": 24, "rl_tasks_per_step": 4, "rl_k": 8, "rl_steps": 6},
    # The control: the 8 x 4 row's GRPO against the real worlds (no rehearsal), so that a row that does
    # not learn says whether rehearsal or the GRPO stage itself is what fails.
    "sft-24-8-tasks-real-6-steps": {**UNGROUNDED, **ONE_ROUND, **SEEN, "sft_per_world": 24, "rl_tasks_per_step": 8, "rl_real_fraction": 1.0, "rl_steps": 6},
    # GRPO on training tasks the warm start has not seen (the default since 2026-12-04): every row
    # above drew the first 16 training tasks per world, the warm start's SFT tasks among them (10 of
    # the 16 for the demo's warm start, all 16 for the 24-per-world one).
    "unseen-8-tasks-6-steps": {**UNGROUNDED, **ONE_ROUND, "sft_per_world": 24, "rl_tasks_per_step": 8, "rl_steps": 6},
    "unseen-8-tasks-12-steps": {**UNGROUNDED, **ONE_ROUND, "sft_per_world": 24, "rl_tasks_per_step": 8, "rl_steps": 12},
    "unseen-8-tasks-real-6-steps": {**UNGROUNDED, **ONE_ROUND, "sft_per_world": 24, "rl_tasks_per_step": 8, "rl_real_fraction": 1.0, "rl_steps": 6},
    # DAPO's dynamic sampling: up to 3 rounds of 8 tasks per step until 8 groups carry a signal (about a
    # third of the groups did above), so that each update has 32 rows of signal rather than about 10.
    "unseen-8-tasks-filter-6-steps": {**UNGROUNDED, "sft_per_world": 24, "rl_tasks_per_step": 8, "rl_filter_groups": True, "rl_steps": 6},
    # The demo's GRPO stage as it is (filtered groups, unseen tasks), without and with the rehearser
    # grounded on the step's reference trajectories (--rehearse-sft-coef): rehearsal fidelity fell
    # during every GRPO run above, since only the task reward trains REHEARSE.
    "current-demo": {**UNGROUNDED},
    "rehearse-sft-0.5": {"rl_rehearse_sft_coef": 0.5},
    # The same with its rollouts continuously batched (`--rl-continuous-batching`): the same
    # trajectories under greedy decoding, other draws when sampling; does that change what GRPO learns?
    "rehearse-sft-0.5-continuous": {"rl_rehearse_sft_coef": 0.5, "rl_continuous_batching": True},
}

# A continued row resumes the finished run of the row it names for its further steps: with the
# constant schedule that is the same run as training it from the start (tests/test_training.py,
# test_resume_reaches_the_same_weights_as_an_uninterrupted_run), so a curve evaluated at 6, 12, 18 and
# 24 steps costs 24 steps of training, not 60. Its "train s" counts its own steps only.
CONTINUES: dict[str, str] = {
    "sft-24-8-tasks-12-steps": "sft-24-8-tasks-6-steps",
    "sft-24-8-tasks-18-steps": "sft-24-8-tasks-12-steps",
    "sft-24-8-tasks-24-steps": "sft-24-8-tasks-18-steps",
    "sft-24-8-tasks-temp-1.0-12-steps": "sft-24-8-tasks-temp-1.0-6-steps",
    "unseen-8-tasks-12-steps": "unseen-8-tasks-6-steps",
}


SFT_FIELDS = ("sft_per_world", "sft_epochs", "sft_lr", "sft_rows_per_step")


def warm_name(cfg: DemoConfig) -> str:
    """The warm start a row starts from, named by the SFT settings it changes ("warm": the demo's)."""
    changed = [f"{f}={getattr(cfg, f)}" for f in SFT_FIELDS if getattr(cfg, f) != getattr(DemoConfig(), f)]
    return "-".join(["warm", *changed])


def check_continued(rows: list[str], base: DemoConfig, results: dict) -> None:
    """A continued row differs from the row it continues in more steps only, and that row has
    trained already or comes before it in --rows."""
    for i, row in enumerate(rows):
        if (parent := CONTINUES.get(row)) is None:
            continue
        if f"train-{parent}" not in results and parent not in rows[:i]:
            raise SystemExit(f"row {row} continues row {parent}'s run: put {parent} before it in --rows")
        mine, theirs = dataclasses.replace(base, **ROWS[row]), dataclasses.replace(base, **ROWS[parent])
        if dataclasses.replace(mine, rl_steps=theirs.rl_steps) != theirs or mine.rl_steps <= theirs.rl_steps:
            raise SystemExit(f"row {row} must differ from {parent}, which it continues, in more rl_steps only")


def start_as_copy(parent_dir: Path, run_dir: Path) -> None:
    """run_dir starts as a copy of parent_dir's run (checkpoints, config, metrics; not its final
    model) unless it holds a checkpoint already: an interrupted continuation resumes where it stopped."""
    if latest_checkpoint(run_dir) is None:
        shutil.copytree(parent_dir, run_dir, ignore=shutil.ignore_patterns("final"), dirs_exist_ok=True)


def take_trained(results: dict, other: Path) -> None:
    """The finished training stages (warm starts and GRPO runs) of the sweep in `other` become this
    sweep's, so that its models are evaluated again (on more test tasks) rather than retrained:
    training depends on the seed and the rows' settings, not on the evaluation's size."""
    theirs = json.loads((other / "results.json").read_text())
    if theirs.get("seed", 0) != results["seed"]:
        raise SystemExit(f"--trained {other} was trained with seed {theirs.get('seed', 0)}, this sweep uses seed {results['seed']}")
    for name, value in theirs.items():
        if name.startswith(("sft", "train-")):
            results.setdefault(name, value)


# What a finished GRPO run may differ in from the row that reuses it: where it was written, and how
# it checkpointed and logged, none of which changes the weights it trained.
NOT_TRAINING = ("output_dir", "resume", "save_every", "keep_last", "progress", "tensorboard", "wandb", "wandb_project")


def effective_settings(flat: dict) -> dict:
    """A TrainConfig's options as config.yaml writes them (lists, not tuples), with the simulator a
    run without one named used: TrainConfig's default, the base --model."""
    flat = yaml.safe_load(yaml.safe_dump(flat, sort_keys=False))
    if flat.get("simulator_model") is None and VARIANTS.get(flat["variant"]).needs_simulator_model:
        flat["simulator_model"] = flat["model"]
    return flat


def check_reused(results: dict, row: str, train) -> None:
    """A finished GRPO run kept in results.json (a rerun of the sweep, or --trained) stands for `row`
    only if it trained with the row's settings (its config.yaml against `train`, the row's TrainConfig
    now): a rerun with other --steps, say, would otherwise report the old run under the new setting."""
    saved = Path(results[f"train-{row}"]["result"]["run_dir"]) / "config.yaml"
    if not saved.is_file():
        raise SystemExit(f"row {row}'s finished GRPO run has no {saved}: it cannot be checked against the row; use another --out")
    theirs, mine = (effective_settings(c) for c in (yaml.safe_load(saved.read_text()), to_dict(train)))
    # a key the run's config predates had that option's behaviour before it existed: not compared
    differ = [k for k in mine if k not in NOT_TRAINING and k in theirs and theirs[k] != mine[k]]
    if differ:
        was, now = (", ".join(f"{k}={c[k]!r}" for k in differ) for c in (theirs, mine))
        raise SystemExit(f"row {row}'s finished GRPO run {saved.parent} trained with {was}; the row now asks for {now}: "
                         f"use another --out (or --trained), or delete train-{row} from results.json to retrain it")


def stage(results: dict, path: Path, name: str, fn) -> dict:
    """results[name], computed once: a finished stage is kept across reruns."""
    if name not in results:
        start = time.perf_counter()
        value, peak = in_fresh_process(*fn)
        results[name] = {"result": value, "seconds": time.perf_counter() - start, "peak_rss_gib": peak}
        path.write_text(json.dumps(results, indent=2, default=str))
    return results[name]


def evaluation_stage(results: dict, out: Path, name: str, model: str, cfg: DemoConfig, mode: str = "real", max_active: int | None = None) -> dict:
    """The stage `name`: `model` evaluated under cfg's settings in `mode`, written to out/name."""
    return stage(results, out / "results.json", name, (evaluate_model, model, cfg, mode, out / name, max_active))


def training_curve(run_dir: str) -> list[dict]:
    """Per step: the rollouts' mean reward, success, partial credit, malformed outputs and rehearsal
    fidelity (rehearse mode), the grounding loss where --rehearse-sft-coef trained one, and the
    real-world executions the run had made so far (every purpose)."""
    keys = ("reward/mean", "success_rate", "partial_credit", "malformed", "fidelity/exact", "fidelity/field_f1", "policy/grounding_nll", "env/total_total")
    return [{k: m.get(k) for k in ("step", *keys)} for m in map(json.loads, Path(run_dir, "metrics.jsonl").read_text().splitlines())]


def chains(rows: list[str]) -> list[list[str]]:
    """The rows as runs: each continued row after the row it continues, one list per run."""
    runs: list[list[str]] = []
    for row in rows:
        run = next((r for r in runs if r[-1] == CONTINUES.get(row)), None)
        if run is None:
            runs.append([row])
        else:
            run.append(row)
    return runs


def save_plot(fig, axes, path: Path) -> Path:
    """Legends on `axes`, then `fig` written to `path` as PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(str(path))
    return path


def steps_plot(results: dict, rows: list[str], path: Path) -> Path | None:
    """Per run evaluated at more than one step count (continued rows): the change in greedy
    success and partial credit against its warm start, task by task (the paired mean difference
    with its 95% bootstrap CI), against GRPO steps."""
    runs = [[r for r in run if f"compare-{r}" in results] for run in chains(rows)]
    points = {", ".join(f"{k}={v}" for k, v in ROWS[run[0]].items() if k != "rl_steps"): [(ROWS[r]["rl_steps"], results[f"compare-{r}"]) for r in run]
              for run in runs if len(run) > 1}
    return paired_steps_plot(points, path)


def paired_steps_plot(runs: dict[str, list[tuple[int, dict]]], path: Path) -> Path | None:
    """`runs`: per label, (GRPO steps, that model's paired comparisons with the warm start:
    {"success": ..., "partial_credit": ...}) at each step count evaluated. Draws the paired mean
    difference with its 95% CI against the steps, from 0 at the warm start."""
    from matplotlib.figure import Figure

    if not runs:
        return None
    fig = Figure(figsize=(10, 4))
    for ax, metric in zip(fig.subplots(1, 2), ("success", "partial_credit")):
        for label, points in runs.items():
            paired = [cmp[metric] for _, cmp in points]
            diff = [0.0] + [p["mean_diff"] for p in paired]
            low = [0.0] + [p["mean_diff"] - p["ci95"][0] for p in paired]
            high = [0.0] + [p["ci95"][1] - p["mean_diff"] for p in paired]
            ax.errorbar([0] + [steps for steps, _ in points], diff, yerr=[low, high], marker="o", capsize=3, label=label)
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.set(xlabel="GRPO steps", ylabel=f"{metric.replace('_', ' ')} - the warm start's", title=f"{metric.replace('_', ' ')} vs warm start (paired, 95% CI)")
    return save_plot(fig, fig.axes, path)


def fidelity_plot(results: dict, rows: list[str], path: Path) -> Path | None:
    """Per row whose rollouts logged it: the rehearser's fidelity in the training rollouts
    (exact match with the real world's response, per step) and, where --rehearse-sft-coef
    trained one, the grounding loss (NLL of the reference responses before each step's update)."""
    from matplotlib.figure import Figure

    curves = {r: results[f"curve-{r}"] for r in rows if any(c.get("fidelity/exact") is not None for c in results.get(f"curve-{r}", []))}
    if not curves:
        return None
    fig = Figure(figsize=(10, 4))
    fidelity, nll = fig.subplots(1, 2)
    for row, curve in curves.items():
        fidelity.plot([c["step"] for c in curve], [c.get("fidelity/exact") for c in curve], marker="o", label=row)
        if any(c.get("policy/grounding_nll") is not None for c in curve):
            nll.plot([c["step"] for c in curve], [c.get("policy/grounding_nll") for c in curve], marker="o", label=row)
    fidelity.set(xlabel="GRPO step", ylabel="exact", title="rehearsal fidelity in the training rollouts", ylim=(0, 1))
    nll.set(xlabel="GRPO step", ylabel="nats per token", title="grounding loss (reference tool responses)")
    return save_plot(fig, (fidelity, nll), path)


def paired(p: dict, tasks: bool = False) -> str:
    """A paired comparison (`envace.metrics.paired_comparison`) as "+d [low, high] (better/worse)",
    with its task count when `tasks`."""
    count = f", {p['n']} tasks" if tasks else ""
    return f"{p['mean_diff']:+.3f} [{p['ci95'][0]:+.3f}, {p['ci95'][1]:+.3f}] ({p['better']}/{p['worse']}{count})"


def table(results: dict, rows: list[str], defs: dict[str, dict] = ROWS) -> str:
    """The sweep's table: per row of `rows` (its settings in `defs`) that has finished."""
    def overall(name: str) -> dict:
        return results[name]["result"]["overall"]

    lines = ["| row | changed | warm start success / partial credit | after GRPO success / partial credit | success vs warm start [95% CI] (better/worse) "
             "| partial credit vs warm start | rollout reward per step | malformed in rollouts per step | rehearsal fidelity (exact) per step "
             "| test-task fidelity, rehearse mode: warm start -> after (exact / field F1) | train s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if f"compare-{row}" not in results:
            continue
        cmp, warm, after = results[f"compare-{row}"], overall(f"eval-{results[f'warm-of-{row}']}"), overall(f"eval-{row}")
        curve = ", ".join(f"{c['reward/mean']:.2f}" for c in results[f"curve-{row}"])
        malformed = ", ".join(f"{c['malformed']:.0f}" for c in results[f"curve-{row}"])
        fidelity = ", ".join("-" if c.get("fidelity/exact") is None else f"{c['fidelity/exact']:.2f}" for c in results[f"curve-{row}"])
        # "-" for a side not evaluated in rehearse mode, so that a lone figure is never read as the row's
        measured = [overall(f"eval-rehearse-{n}") if f"eval-rehearse-{n}" in results else {} for n in (results[f"warm-of-{row}"], row)]
        sides = [f"{o['fidelity/exact']:.2f} / {o['fidelity/field_f1']:.2f}" if "fidelity/exact" in o else "-" for o in measured]
        test_fidelity = "-" if sides == ["-", "-"] else " -> ".join(sides)
        if f"compare-rehearse-{row}" in results:
            f1 = results[f"compare-rehearse-{row}"]["field_f1"]
            test_fidelity += f"; field F1 paired over {f1['n']} tasks {paired(f1)}"
        changed = ", ".join(f"{k}={v}" for k, v in defs[row].items()) or "(the demo's settings)"
        lines.append(f"| {row} | {changed} | {warm['success_rate']:.3f} / {warm['partial_credit']:.3f} | {after['success_rate']:.3f} / {after['partial_credit']:.3f} | "
                     f"{paired(cmp['success'])} | {paired(cmp['partial_credit'])} | {curve} | {malformed} | {fidelity} | {test_fidelity} | {results[f'train-{row}']['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def finished_sweep(out: Path, rows: list[str], option: str) -> dict:
    """The results.json of a sweep `option` (a flag that reads finished sweeps) was given, refused
    unless every row of `rows` ran to the end there."""
    finished = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else {}
    if missing := [row for row in rows if f"compare-{row}" not in finished]:
        raise SystemExit(f"{option} {out}: no finished rows {missing} there (results.json); give sweeps that ran these --rows to the end")
    return finished


def pooled_table(outs: list[Path], rows: list[str]) -> str:
    """The rows over several finished sweeps of the same rows (one per seed, each on its own test
    tasks): each row against its warm start, and each row against the first, paired over the
    tasks of all the sweeps."""
    for out in outs:
        finished_sweep(out, rows, "--pool")

    def evals(row: str) -> list[Path]:
        return [out / f"eval-{row}" for out in outs]

    def warm(out: Path, row: str) -> Path:
        return out / f"eval-{json.loads((out / 'results.json').read_text())[f'warm-of-{row}']}"

    lines = [f"Pooled over {', '.join(map(str, outs))}:", "", "| row | against | success [95% CI] (better/worse) | partial credit |", "|---|---|---|---|"]
    for row in rows:
        against = [("its warm start", [(warm(out, row), out / f"eval-{row}") for out in outs])]
        if row != rows[0]:
            against.append((rows[0], list(zip(evals(rows[0]), evals(row)))))
        for name, pairs in against:
            cmp = compare_pooled(pairs)
            lines.append(f"| {row} | {name} | {paired(cmp['success'], tasks=True)} | {paired(cmp['partial_credit'], tasks=True)} |")
    return "\n".join(lines) + "\n"


# Settings of a whole sweep (one per --out), with what a results.json from before each existed used.
SETTINGS = {"seed": 0, "eval_per_world": DemoConfig().eval_per_world, "eval_sampler_dtype": "auto"}


def run(out: Path, rows: list[str], settings: dict, defs: dict[str, dict] = ROWS, warm: str | None = None, eval_rehearse: bool = False,
        trained: str | None = None, save_every: int | None = None, eval_max_active: int | None = None) -> dict:
    """Train and evaluate `rows` (their DemoConfig changes in `defs`) under the sweep's `settings`
    (SETTINGS' keys) in `out`, keeping every finished stage in out/results.json; returns it.
    warm: an existing warm start instead of training one; eval_rehearse: also evaluate in
    rehearse mode; trained: take another sweep's trained stages; save_every: checkpoint each GRPO
    run every N steps, so that a run interrupted mid-way resumes from its last checkpoint (by
    default a run saves once, at its end); eval_max_active: rollouts in flight per evaluation (None:
    the rollout's default, every task at once)."""
    if unknown := [r for r in rows if r not in defs]:
        raise SystemExit(f"unknown rows {unknown}: choose from {list(defs)}")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else dict(settings)
    for key, default in SETTINGS.items():
        if results.get(key, default) != settings[key]:
            raise SystemExit(f"{out} holds a sweep with {key} {results.get(key, default)}: pass that --{key.replace('_', '-')} or another --out")
    if trained:
        take_trained(results, Path(trained))
    base = DemoConfig(output_dir=str(out), progress=False, **settings)
    base.validate()
    configs = {row: dataclasses.replace(base, **defs[row]) for row in rows}
    for cfg in configs.values():
        cfg.validate()  # every row fails here, before any model loads
    check_continued(rows, base, results)

    def evaluate(name: str, model: str, cfg: DemoConfig) -> None:
        """eval-<name> and, with eval_rehearse, eval-rehearse-<name>."""
        evaluation_stage(results, out, f"eval-{name}", model, cfg, "real", eval_max_active)
        if eval_rehearse:
            evaluation_stage(results, out, f"eval-rehearse-{name}", model, cfg, "rehearse", eval_max_active)

    needed = sorted({warm_name(cfg) for cfg in configs.values()})
    if warm and len(needed) > 1:
        raise SystemExit(f"--warm is one warm start, but these rows need different ones: {needed}")
    warm_starts: dict[str, str] = {}
    for row, cfg in configs.items():
        name = warm_name(cfg)
        if name not in warm_starts:
            sft_stage = "sft" if name == "warm" else f"sft-{name}"
            warm_starts[name] = warm or stage(results, path, sft_stage, (run_sft, sft_config(cfg, out / sft_stage)))["result"]["final_model"]
            evaluate(name, warm_starts[name], cfg)
        run_dir = out / f"train-{row}"
        train = grpo_stage_config(cfg, run_dir, init_from=warm_starts[name])
        if save_every:
            train.save_every = save_every
        if (parent := CONTINUES.get(row)) and f"train-{row}" not in results:
            start_as_copy(Path(results[f"train-{parent}"]["result"]["run_dir"]), run_dir)
        # a run that has checkpoints (interrupted, or a continued row's copy) goes on from the last one
        train.resume = latest_checkpoint(run_dir) is not None
        if f"train-{row}" in results:
            check_reused(results, row, train)
        trained_row = stage(results, path, f"train-{row}", (run_train, train))["result"]
        evaluate(row, trained_row["final_model"], cfg)
        results[f"warm-of-{row}"] = name
        results[f"compare-{row}"] = compare(out / f"eval-{name}", out / f"eval-{row}")
        if f"eval-rehearse-{name}" in results and f"eval-rehearse-{row}" in results:
            results[f"compare-rehearse-{row}"] = compare_fidelity(out / f"eval-rehearse-{name}", out / f"eval-rehearse-{row}")
        results[f"curve-{row}"] = training_curve(trained_row["run_dir"])
        path.write_text(json.dumps(results, indent=2, default=str))
        (out / "results.md").write_text(table(results, rows, defs))
        steps_plot(results, rows, out / "steps.png")
        fidelity_plot(results, rows, out / "fidelity.png")
        print(table(results, rows, defs), flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_options(p, "runs/sweep", ROWS)
    p.add_argument("--pool", default=None, help="comma-separated finished sweeps' --out (e.g. one per --seed): print --rows' comparisons "
                   "pooled over their test tasks, and run nothing")
    args = p.parse_args()
    if args.pool:
        print(pooled_table([Path(o) for o in args.pool.split(",")], args.rows.split(",")))
        return
    run(Path(args.out), args.rows.split(","), {key: getattr(args, key) for key in SETTINGS}, warm=args.warm, eval_rehearse=args.eval_rehearse,
        trained=args.trained, eval_max_active=args.eval_max_active)


def add_sweep_options(p: argparse.ArgumentParser, out: str, defs: dict[str, dict], eval_per_world: int = DemoConfig().eval_per_world) -> None:
    """The options every sweep over the demo's GRPO stage takes (this one, benchmarks/variants_experiment.py)."""
    p.add_argument("--out", default=out)
    p.add_argument("--rows", default=",".join(defs), help=f"comma-separated rows of {list(defs)}")
    p.add_argument("--warm", default=None, help="an existing warm start trained with the rows' SFT settings (e.g. runs/demo/sft/final for "
                   "the demo's) instead of training it; every row must share those settings")
    p.add_argument("--seed", type=int, default=0, help="every stage's seed (SFT, GRPO sampling and tasks, the test tasks); one per --out")
    p.add_argument("--eval-per-world", type=int, default=eval_per_world,
                   help="test tasks per world (5 worlds); one per --out. 8 (the demo's): a task moves success by 0.025")
    p.add_argument("--eval-sampler-dtype", default=DemoConfig().eval_sampler_dtype, choices=EVAL_SAMPLER_DTYPES,
                   help="numerics of the evaluations; one per --out (benchmarks/eval_noise.py: how far each moves a score by batch width alone)")
    p.add_argument("--eval-rehearse", action="store_true", help="also evaluate each warm start and row in rehearse mode on the same test "
                   "tasks: the rehearser's fidelity on tasks no stage trained on (rerun with it to add these to a finished sweep)")
    p.add_argument("--eval-max-active", type=int, default=None, help="rollouts in flight per evaluation (default: every test task at once; "
                   "120 test tasks all at once peaked at 9.7 GiB, 40 at a time at 6.3-7.3; docs/training.md). With --eval-sampler-dtype f32 the trajectories do not depend on it")
    p.add_argument("--trained", default=None, help="another sweep's --out (same seed): its finished warm starts and GRPO runs are this "
                   "sweep's, evaluated here rather than retrained (e.g. with a larger --eval-per-world); each run is checked against its row's settings")


if __name__ == "__main__":
    main()
