"""`envace demo`: the whole method on a CPU, top to bottom, with an honest before/after.

  1. evaluate the bundled base model on test tasks of every world (the training worlds, and the
     held-out world);
  2. warm-start it with SFT on trajectories executed in the real world, and evaluate that;
  3. train with world rehearsal (role-level GRPO, rehearse mode, no real environment calls) on
     the verifier's partial credit;
  4. evaluate again on the same tasks, and compare SFT with SFT + GRPO task by task (a paired
     bootstrap on success and on partial credit), so that GRPO's own contribution is visible;
  5. write a Markdown + HTML report with the table, the comparison and the training story plot.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from envace.config import ConfigError, build, field, to_dict
from envace.evaluation.report import markdown_table, pooled_success

BASE, SFT, TRAINED = "base", "SFT", "SFT + rehearsal GRPO"
EVAL_SAMPLER_DTYPES = ("auto", "f32", "bf16")  # a greedy evaluation's numerics (int8 and int4 are speed settings, f16/q8_0 llama.cpp's)
# How each rollout mode's GRPO stage reads in the report (rl_variant's mode: who answers the tools).
MODE_TEXT = {"rehearse": "in rehearse mode", "real": "against the real worlds", "simulator": "answered by a frozen simulator model"}


def trained_label(variant: str) -> str:
    """The report's row of the model the GRPO stage trained: the demo's own, or a baseline variant's."""
    return TRAINED if variant == "envace" else f"SFT + GRPO ({variant})"


@dataclass
class DemoConfig:
    model: str = field("default", help="base model")
    tiny: bool = field(False, help="use a tiny random model (smoke test of the pipeline, not a result)")
    output_dir: str = field("runs/demo", help="where the report and runs go")
    eval_per_world: int = field(8, help="test tasks per world (5 worlds: 40 tasks, the held-out world's included)")
    max_turn_tokens: int = field(96, help="tokens per ACT turn in evaluation and training")
    sft_per_world: int = field(10, help="SFT tasks per training world")
    sft_epochs: int = field(2, help="SFT epochs (2: twice the success and an eighth of the malformed outputs of 1, measured in benchmarks/grpo_sweep.py)")
    sft_lr: float = field(2e-4, help="SFT learning rate")
    sft_rows_per_step: int = field(2, help="trajectories per SFT step (fewer: more updates for the same compute)")
    sft_precision: Literal["auto", "fp32", "bf16"] = field(
        "fp32", help="the SFT stage's forward/backward precision (`envace sft --precision`). fp32: on an AMX Xeon, same seed and "
                     "data, the bf16-autocast warm start wrote 18 malformed calls of 40 test tasks (the fp32 one 1) and 3 GRPO "
                     "steps from it moved no task on 4 seeds; from the fp32 one +6/-0 in one draw, 0/0 in another (docs/training.md)")
    rl_variant: str = field("envace", help="the GRPO stage's training variant (`envace train --variant`; the baselines for "
                                           "benchmarks/variants_experiment.py). The demo trains envace")
    rl_simulator_model: str = field("warm", help="--rl-variant simulator: the frozen model that answers the rollouts' calls: warm (the warm "
                                                 "start, frozen: the rehearser before GRPO) or a model spec (default: the base model, "
                                                 "whose responses overran 128 tokens in every sampled rollout, docs/training.md)")
    rl_steps: int = field(3, help="GRPO steps with world rehearsal")
    rl_tasks_per_step: int = field(3, help="tasks per GRPO step")
    rl_k: int = field(4, help="rollouts per task")
    rl_lr: float = field(2e-5, help="GRPO learning rate (1e-4 lowered tool F1 and success in 3 steps; docs/training.md)")
    rl_temperature: float = field(0.5, help="sampling temperature of the GRPO rollouts (> 0; evaluation is greedy). At 1.0 the 3 steps cost 2 of 40 "
                                            "tasks, at 0.5 none, though greedy malformed outputs rose 1 -> 8 (benchmarks/grpo_sweep.py, docs/training.md)")
    rl_grounding: bool = field(False, help="GRPO rehearsal from the isolated simulator prompt with the task's reference (call, true result) pairs "
                                             "(the reference implementation's privileged grounding; its world runs are counted as grounding)")
    rl_rehearse_sft_coef: float = field(0.5, help="GRPO with the rehearser grounded on the reference trajectories' tool responses "
                                                  "(`envace train --rehearse-sft-coef`; 0 = off). 0.5: +9/-0 of 80 test tasks against the warm "
                                                  "start, 0: +7/-5 (two seeds; 0.5 on four: +9/-1 of 160), benchmarks/grpo_sweep.py, docs/training.md)")
    rl_real_fraction: float = field(0.0, help="share of each GRPO step's tasks rolled out against the real world (the rest rehearsed)")
    rl_filter_groups: bool = field(True, help="GRPO with DAPO's dynamic sampling: up to 3 rounds of rollouts per step until rl_tasks_per_step groups "
                                              "carry a signal (8 x 4 for 6 steps from the 24-per-world warm start: +9/-0 of 120 test tasks with it, "
                                              "+3/-0 without; benchmarks/grpo_sweep.py, docs/training.md)")
    rl_continuous_batching: bool = field(False, help="GRPO rollouts with continuous batching (`envace train --continuous-batching`). Off: "
                                                     "on an AVX2 EPYC it took the stage 482 -> 478 s, and its other draws gave GRPO minus SFT "
                                                     "-0.025 [-0.075, +0.000] where the round schedule's gave +0.150; on an AMX Xeon, four seeds "
                                                     "pooled +0.025 [+0.000, +0.056] against the round schedule's +0.006 (docs/training.md)")
    rl_unseen_tasks: bool = field(True, help="GRPO on training tasks the warm start was not trained on (off: the first ones, the SFT's own among them)")
    rl_reward: str = field("partial", help="GRPO reward: partial (the verifier's partial credit: signal before a task is solved), replay (0/1), "
                                           "or reference (call F1 against the reference calls: no world runs)")
    rl_world_free: bool = field(False, help="GRPO on the world-free form of its training tasks (their references recorded once into the run's "
                                            "task file, counted as task data): no world during the stage; needs --rl-reward reference "
                                            "(benchmarks/variants_experiment.py's world-free row)")
    difficulty: int = field(1, help="task difficulty for training and evaluation")
    eval_sampler_dtype: str = field("f32", help="numerics of the greedy evaluations (f32, bf16, auto). f32: the same trajectories whatever "
                                                "else is in the batch; bf16 changed 25 of 120 with the rollouts in flight, 2 of them in "
                                                "success, so two models' paired comparison would hold noise (benchmarks/eval_noise.py)")
    eval_rehearse: bool = field(False, help="also evaluate the trained model in rehearse mode (fidelity on the test tasks; training logs it per step)")
    seed: int = field(0, help="seed")
    progress: bool = field(True, help="progress bars")

    def validate(self) -> None:
        for name in ("eval_per_world", "max_turn_tokens", "sft_per_world", "sft_epochs", "sft_rows_per_step", "rl_steps", "rl_tasks_per_step"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.rl_k < 2:
            raise ConfigError(f"rl_k must be >= 2 for a group baseline, got {self.rl_k}")
        for name in ("sft_lr", "rl_lr", "rl_temperature"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0.0 <= self.rl_real_fraction <= 1.0:
            raise ConfigError(f"rl_real_fraction must be in [0, 1], got {self.rl_real_fraction}")
        if self.rl_rehearse_sft_coef < 0:
            raise ConfigError(f"rl_rehearse_sft_coef must be >= 0 (0 = off), got {self.rl_rehearse_sft_coef}")
        self._validate_variant()
        if self.rl_grounding and self.rl_rehearse_sft_coef:
            raise ConfigError("rl_grounding rehearses from the isolated simulator prompt, and rl_rehearse_sft_coef (on by default) trains "
                              "tool responses in the agent's transcript: pass --rl-rehearse-sft-coef 0 with --rl-grounding")
        if self.rl_reward not in ("partial", "replay", "reference"):
            raise ConfigError(f"rl_reward must be partial, replay or reference, got {self.rl_reward!r}")
        if self.eval_sampler_dtype not in EVAL_SAMPLER_DTYPES:
            raise ConfigError(f"eval_sampler_dtype must be auto, f32 or bf16, got {self.eval_sampler_dtype!r}")
        if self.difficulty not in (1, 2, 3):
            raise ConfigError(f"difficulty must be 1, 2 or 3, got {self.difficulty}")

    def _validate_variant(self) -> None:
        """The GRPO stage's settings that only some variants read, named by the demo's own flags
        (the train config would name `envace train`'s)."""
        from envace.training.variants import VARIANTS

        if self.rl_variant not in VARIANTS:
            raise ConfigError(f"unknown rl_variant {self.rl_variant!r}; known: {', '.join(VARIANTS.names())}")
        variant = VARIANTS.get(self.rl_variant)
        if self.rl_rehearse_sft_coef and not variant.policy_rehearses:
            raise ConfigError(f"--rl-variant {self.rl_variant} does not train the policy's REHEARSE role, which --rl-rehearse-sft-coef "
                              f"grounds (on by default): pass --rl-rehearse-sft-coef 0 with --rl-variant {self.rl_variant}")
        if self.rl_real_fraction and not variant.allows_real_fraction:
            raise ConfigError(f"rl_real_fraction mixes real-world rollouts into rehearsed ones; --rl-variant {self.rl_variant} does not rehearse")
        if self.rl_grounding and variant.rollout_mode != "rehearse":
            raise ConfigError(f"rl_grounding grounds the rehearser's prompt; --rl-variant {self.rl_variant} does not rehearse")
        if self.rl_simulator_model != "warm" and not variant.needs_simulator_model:
            raise ConfigError(f"rl_simulator_model is read by --rl-variant simulator only; drop it for --rl-variant {self.rl_variant}")
        if self.rl_world_free:
            needs = {f"--rl-reward {self.rl_reward}": self.rl_reward != "reference", f"--rl-variant {self.rl_variant}": variant.rollout_mode == "real",
                     "--rl-real-fraction": bool(self.rl_real_fraction)}
            if used := [flag for flag, runs_world in needs.items() if runs_world]:
                rehearsing = [name for name in VARIANTS.names() if VARIANTS.get(name).rollout_mode != "real"]
                raise ConfigError(f"--rl-world-free trains with no world, and {', '.join(used)} needs one: use --rl-reward reference, "
                                  f"a --rl-variant that does not roll out in the world ({', '.join(rehearsing)}) and no --rl-real-fraction")


def evaluate_model(model: str, cfg: DemoConfig, mode: str, out: Path, max_active: int | None = None) -> dict[str, Any]:
    """Greedy on the test split (the training worlds' test tasks and the held-out world's);
    max_active: rollouts in flight, one padded batch (None: the rollout's default)."""
    from envace.evaluation.runner import EvalConfig, run_eval

    in_flight = {} if max_active is None else {"max_active": max_active}
    return run_eval(build(EvalConfig, dict(model=model, split="test", n_per_world=cfg.eval_per_world, difficulty=cfg.difficulty, seed=cfg.seed,
                                           output_dir=str(out), progress=cfg.progress,
                                           rollout=dict(mode=mode, max_turns=6, max_turn_tokens=cfg.max_turn_tokens, max_rehearse_tokens=128,
                                                        temperature=0.0, sampler_dtype=cfg.eval_sampler_dtype, **in_flight))))


def per_task(eval_dir: Path, key: str) -> dict[str, float]:
    """task id -> `key` ("success" or "partial_credit") from an evaluation's records.jsonl."""
    return {r["task_id"]: float(r[key] or 0.0) for r in _records(eval_dir)}


def per_task_fidelity(eval_dir: Path, key: str) -> dict[str, float]:
    """task id -> the mean `key` ("exact" or "field_f1") of the rehearsed responses of a rehearse-mode
    evaluation's task, for the tasks that rehearsed at least one call (the others have no fidelity)."""
    return {r["task_id"]: sum(f[key] for f in r["fidelity"]) / len(r["fidelity"]) for r in _records(eval_dir) if r.get("fidelity")}


def _records(eval_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (eval_dir / "records.jsonl").read_text().splitlines()]


def compare(before: Path, after: Path) -> dict[str, Any]:
    """SFT + GRPO against SFT on the same tasks: success and partial credit, paired."""
    return compare_pooled([(before, after)])


def compare_pooled(pairs: list[tuple[Path, Path]]) -> dict[str, Any]:
    """Success and partial credit paired over the tasks of several (before, after) evaluations,
    each pair on its own tasks (e.g. one pair per seed): the per-task differences of all pairs are
    one sample, so the CI covers the tasks of every pair."""
    from envace.metrics import paired_comparison

    def pooled(side: int, key: str) -> dict[str, float]:
        return {f"{i}/{task}": v for i, pair in enumerate(pairs) for task, v in per_task(pair[side], key).items()}

    return {key: paired_comparison(pooled(0, key), pooled(1, key)) for key in ("success", "partial_credit")}


def compare_fidelity(before: Path, after: Path) -> dict[str, Any]:
    """Two rehearse-mode evaluations on the same tasks: rehearsal fidelity (exact, field F1) paired
    over the tasks where both rehearsed a call. The calls themselves may differ (each model chose
    its own), so this compares how well each model imagines the responses to its own calls on a task."""
    from envace.metrics import paired_comparison

    return {key: paired_comparison(per_task_fidelity(before, key), per_task_fidelity(after, key)) for key in ("exact", "field_f1")}


def peak_rss_gib() -> float:
    """This process's peak resident memory (VmHWM on Linux; ru_maxrss, which a forked child
    inherits from its parent, elsewhere)."""
    import resource

    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _measured(fn: Any, *args: Any) -> tuple[Any, float]:
    return fn(*args), peak_rss_gib()


def in_fresh_process(fn: Any, *args: Any) -> tuple[Any, float]:
    """fn(*args) in a spawned process: (its result, the process's peak RSS in GiB). Each stage's
    memory goes back to the system when it ends, so the demo's peak is its largest stage's; in one
    process the allocator kept what earlier stages freed, and the demo peaked at 11.3 GB against
    5.8 GB for its largest stage (the SFT) alone."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_measured, fn, *args).result()


def recompute_activations(precision: str) -> bool:
    """Whether a training stage of this precision setting recomputes each decoder layer's
    activations in the backward: where it runs under bf16 autocast, whose saved
    activations hold bf16 copies beside the fp32 residual stream. Measured (docs/performance.md,
    "Memory"): the SFT stage 5.13 -> 3.97 GiB for 1.1-1.24x its seconds (an AMD EPYC with
    avx512_bf16), the GRPO stage 6.23 -> 5.04 GiB for +5% of its update seconds and the same
    weights bit for bit (an Intel Xeon with AMX). In fp32 both stages fit without it."""
    from envace.training.setup import resolve_precision

    return resolve_precision(precision) == "bf16"


def sft_config(cfg: DemoConfig, output_dir: Path) -> Any:
    """The demo's warm start: SFT on trajectories executed in the real training worlds."""
    from envace.training.sft import SFTConfig

    return build(SFTConfig, dict(model=cfg.model, n_per_world=cfg.sft_per_world, epochs=cfg.sft_epochs, lr=cfg.sft_lr, rows_per_step=cfg.sft_rows_per_step,
                                 difficulty=cfg.difficulty, output_dir=str(output_dir), tiny=cfg.tiny, seed=cfg.seed, progress=cfg.progress,
                                 # one trajectory per micro-batch, as in the GRPO stage: the largest stage's peak is the demo's
                                 precision=cfg.sft_precision, micro_batch_tokens=1024, activation_checkpointing=recompute_activations(cfg.sft_precision),
                                 # a checkpoint (weights + AdamW state, 1.6 GB, ~5 s to write here) every 20 of the 40 steps:
                                 # a crash loses at most ~3.5 min of the stage
                                 save_every=20))


def train_config(cfg: DemoConfig, output_dir: Path, init_from: str | None = None) -> Any:
    """The demo's GRPO stage: rl_variant (envace: rehearse mode, both roles trained)."""
    from envace.training.trainer import TrainConfig
    from envace.training.variants import VARIANTS

    variant = VARIANTS.get(cfg.rl_variant)
    # a separate rehearser (no-share) writes from the isolated prompt, as the privileged grounding does
    isolated = cfg.rl_grounding or variant.requires_layout == "isolated"
    # the frozen simulator: the warm start once it exists (before, the base model stands in, for validation)
    simulator = (init_from if cfg.rl_simulator_model == "warm" else cfg.rl_simulator_model) if variant.needs_simulator_model else None
    return build(TrainConfig, dict(model=cfg.model, init_from=init_from, variant=cfg.rl_variant, simulator_model=simulator, steps=cfg.rl_steps, tasks_per_step=cfg.rl_tasks_per_step, k=cfg.rl_k,
                                   lr=cfg.rl_lr, reward=cfg.rl_reward, rehearse_sft_coef=cfg.rl_rehearse_sft_coef, real_fraction=cfg.rl_real_fraction, filter_groups=cfg.rl_filter_groups, unseen_tasks=cfg.rl_unseen_tasks, difficulty=cfg.difficulty, output_dir=str(output_dir), save_every=cfg.rl_steps,
                                   # one task group (~1.5-3k packed tokens) per micro-batch: the GRPO stage peaked at 8.9 GiB with
                                   # 4096, 5.1 GiB with this (measured, docs/training.md), for the same update
                                   micro_batch_tokens=1024, activation_checkpointing=recompute_activations(TrainConfig.precision),
                                   tiny=cfg.tiny, seed=cfg.seed, progress=cfg.progress,
                                   rollout=dict(max_turn_tokens=cfg.max_turn_tokens, max_rehearse_tokens=128, temperature=cfg.rl_temperature,
                                                continuous_batching=cfg.rl_continuous_batching,
                                                rehearse_layout="isolated" if isolated else "transcript", grounding=cfg.rl_grounding)))


def grpo_stage_config(cfg: DemoConfig, output_dir: Path, init_from: str) -> Any:
    """The GRPO stage's config once its warm start exists: train_config, and with rl_world_free the
    training tasks it would draw (built-in, the warm start's own left out) written world-free to
    the run's task file, their references executed once (the file's sidecar; the chain counts it
    as task data)."""
    from envace.envs.export import write_task_file
    from envace.training.trainer import TrainConfig, load_train_tasks

    train = train_config(cfg, output_dir, init_from=init_from)
    if not cfg.rl_world_free:
        return train
    tasks_file = output_dir / "tasks.world-free.jsonl"
    tasks = load_train_tasks(train)
    write_task_file(tasks, tasks_file, world=False, source=f"the demo's GRPO tasks (builtin:train seed={cfg.seed} difficulty={cfg.difficulty}, "
                                                          f"{len(tasks)} not in {init_from}'s training data)")
    return build(TrainConfig, {**to_dict(train), "tasks": str(tasks_file)})


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    from envace.backends.models import machine_facts
    from envace.training.plots import story_plot
    from envace.training.sft import run_sft
    from envace.training.trainer import run_train

    root = Path(cfg.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    peaks: dict[str, float] = {}
    start = time.perf_counter()

    def stage(name: str, fn: Any, *args: Any) -> Any:
        t = time.perf_counter()
        print(f"\n=== {name} ===", flush=True)
        result, peaks[name] = in_fresh_process(fn, *args)
        timings[name] = time.perf_counter() - t
        return result

    def evaluate(name: str, model: str, mode: str = "real") -> dict[str, Any]:
        return stage(f"evaluate {name}", evaluate_model, model, cfg, mode, root / f"eval-{name}")

    sft = sft_config(cfg, root / "sft")
    train_config(cfg, root / "train")  # checked before any model loads; built again once the warm start exists
    stages = {} if cfg.tiny else {BASE: evaluate("base", cfg.model)}  # a tiny model has no base to evaluate
    warm = stage("warm start (SFT on real-world trajectories)", run_sft, sft)["final_model"]
    stages[SFT] = evaluate("sft", warm)
    train = grpo_stage_config(cfg, root / "train", init_from=warm)  # the warm start exists only now
    train_result = stage("train with world rehearsal (role-level GRPO)", run_train, train)
    trained = train_result["final_model"]
    label = trained_label(cfg.rl_variant)
    stages[label] = evaluate("trained", trained)
    if cfg.eval_rehearse:
        stages[f"{label}, rehearse mode"] = evaluate("trained-rehearse", trained, "rehearse")
    summary = {
        "stages": stages,
        "paired": compare(root / "eval-sft", root / "eval-trained"),
        "train": {k: train_result[k] for k in ("run_dir", "world_executions", "chain_world_executions")}
                 | {"story_plot": str(story_plot(Path(train_result["run_dir"]) / "metrics.jsonl", root / "training_story.png"))},
        "timings_s": timings, "peak_rss_gib": peaks, "total_s": time.perf_counter() - start, "machine": machine_facts(), "config": cfg.__dict__,
    }
    write_report(summary, root)
    return summary


def _credit(stage: dict[str, Any]) -> str:
    o = stage["overall"]
    if "partial_credit" not in o:
        return "-"
    low, high = o["partial_credit_ci95"]
    return f"{o['partial_credit']:.2f} [{low:.2f}, {high:.2f}]"


def _paired_line(name: str, p: dict[str, Any]) -> str:
    low, high = p["ci95"]
    verdict = "excludes 0" if low > 0 or high < 0 else "includes 0"
    return (f"| {name} | {p['mean_diff']:+.3f} [{low:+.3f}, {high:+.3f}] ({verdict}) | {p['better']} | {p['worse']} | {p['same']} | {p['n']} |")


def report_markdown(summary: dict[str, Any], root: Path) -> str:
    from envace.backends.models import machine_line
    from envace.envs import HELDOUT_WORLDS, TRAIN_WORLDS
    from envace.training.variants import VARIANTS

    cfg = summary["config"]
    variant = cfg.get("rl_variant", "envace")  # a summary from before the field existed trained envace
    label = trained_label(variant)
    grounded = f", the rehearser grounded on the reference tool responses (weight {cfg['rl_rehearse_sft_coef']})" if cfg.get("rl_rehearse_sft_coef") else ""
    lines = [
        "# envace demo report", "",
        f"Model: `{cfg['model']}`{' (tiny random model: a smoke test of the pipeline, not a result)' if cfg['tiny'] else ''}; "
        f"SFT{'' if cfg.get('sft_precision', 'auto') == 'auto' else ' in ' + cfg['sft_precision']} on {cfg['sft_per_world']} tasks per training world x {cfg['sft_epochs']} epoch{'s' if cfg['sft_epochs'] > 1 else ''}, then {cfg['rl_steps']} GRPO steps "
        f"({cfg['rl_tasks_per_step']} tasks x K={cfg['rl_k']}, reward `{cfg['rl_reward']}`"
        f"{', further rounds of rollouts until that many groups carry a signal' if cfg.get('rl_filter_groups') else ''}{grounded}"
        f"{', continuous batching' if cfg.get('rl_continuous_batching') else ''}"
        f"{'' if variant == 'envace' else f', variant {variant}'}) {MODE_TEXT[VARIANTS.get(variant).rollout_mode]}. Greedy evaluation on "
        f"{cfg['eval_per_world']} test tasks per world (difficulty {cfg['difficulty']}). Total wall time {summary['total_s'] / 60:.1f} min "
        f"on {machine_line(summary['machine'])}.", "",
        f"| stage | success, training worlds ({', '.join(TRAIN_WORLDS)}) | success, held-out world ({', '.join(HELDOUT_WORLDS)}) | partial credit [95% CI] | tool F1 | fidelity exact / field F1 | real env calls | malformed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary["stages"].items():
        o = s["overall"]
        fid = f"{o['fidelity/exact']:.2f} / {o['fidelity/field_f1']:.2f}" if "fidelity/exact" in o else "-"
        lines.append(f"| {name} | {pooled_success(s, set(TRAIN_WORLDS))} | {pooled_success(s, set(HELDOUT_WORLDS))} | {_credit(s)} | "
                     f"{o.get('tool_f1', 0):.2f} | {fid} | {o['real_env_calls']} | {o['malformed']} |")
    lines += ["", f"## What the GRPO steps changed: {label} minus {SFT}, task by task", "",
              "Mean per-task difference with a 95% paired bootstrap interval (10,000 resamples of the tasks), and how many tasks got better, worse or stayed.", "",
              "| metric | mean difference [95% CI] | better | worse | same | tasks |", "|---|---|---|---|---|---|",
              _paired_line("success", summary["paired"]["success"]), _paired_line("partial credit", summary["paired"]["partial_credit"])]
    calls = summary["train"]["world_executions"]
    # rl_world_free: recording its tasks' references is what the stage cost in world access
    task_data = summary["train"]["chain_world_executions"].get("task_data", 0)
    recorded = f", {task_data} recorded the world-free training tasks' references" if task_data else ""
    # what verifying means, where the reward verified anything (a world-free reward does not)
    why = " (the reward re-runs ACT's committed calls on a fresh world to score them; the policy never sees those results)" if calls["verification"] else ""
    lines += ["", f"Real-world executions during the GRPO stage: **{calls['rollout']}** while rolling out, "
              f"**{calls['verification']}** to verify{why}, {calls['grounding']} for grounding; "
              f"{summary['train']['chain_world_executions']['sft_data']} made the warm start's data"
              f"{recorded}.", "",
              "## Per world after training (real world)", "", markdown_table(summary["stages"][label]), "",
              "## Stages", "", "Each stage runs in a fresh process: the demo's peak memory is its largest stage's.", "",
              "| stage | seconds | peak RSS GiB |", "|---|---|---|"]
    lines += [f"| {k} | {v:.0f} | {summary['peak_rss_gib'][k]:.1f} |" for k, v in summary["timings_s"].items()]
    lines += ["", "## Training", "", "Reward per role, success and partial credit, and rehearsal fidelity per GRPO step "
              "(all of a run's metrics: the run's metrics.jsonl and plots/).", "",
              f"![training story]({os.path.relpath(summary['train']['story_plot'], root)})"]
    return "\n".join(lines) + "\n"


def write_report(summary: dict[str, Any], root: Path) -> None:
    import markdown

    md = report_markdown(summary, root)
    (root / "report.md").write_text(md)
    (root / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    body = markdown.markdown(md, extensions=["tables"])
    style = "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px}img{width:480px}"
    (root / "report.html").write_text(f"<!doctype html><meta charset='utf-8'><title>envace demo</title><style>{style}</style>\n{body}\n")
    print(md)
