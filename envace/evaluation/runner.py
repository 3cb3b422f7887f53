"""`envace eval`: run a model on built-in worlds, a task file or a benchmark, in real or
rehearse mode, and write per-task trajectories plus a summary (JSON + Markdown)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

from envace import config as cfgmod
from envace.backends.open import check_models, is_url, open_generator
from envace.benchmarks import BENCHMARKS, Benchmark, BenchmarkDependencyError
from envace.config import ConfigError, field
from envace.evaluation.report import print_summary, write_summary
from envace.metrics import summarize_by, summarize_records, trajectory_record
from envace.rewards import Context, compute_rewards, judge_missing, reward_names, runs_world
from envace.rollout import RolloutConfig, RolloutEngine
from envace.types import Task, Trajectory

# What `--benchmark all` runs, in the order of the paper's table.
ALL_BENCHMARKS = ("bfcl", "tau2", "vitabench", "finmcp")
# The constructor keyword of the adapters that read user-supplied data (--data-dir).
DATA_ARGUMENT = {"finmcp": "data_path", "vitabench": "data_dir"}


def eval_rollout() -> RolloutConfig:
    """Evaluation's rollout defaults: mildly tempered nucleus sampling, and at most 64 rollouts in
    flight so that a large task set fits in memory."""
    return RolloutConfig(temperature=0.6, top_p=0.95, max_active=64)


@dataclass
class EvalConfig:
    model: str = field("default", help="model: 'default' (bundled SmolLM2-135M-Instruct), 'qwen2.5-coder-0.5b' (make install-qwen), a local directory, a .gguf file, or an http(s):// OpenAI-compatible URL")
    tokenizer: str | None = field(None, help="tokenizer spec for an http model (default: the bundled model's)")
    api_model: str | None = field(None, help="model name sent to an OpenAI-compatible server (default: its only model)")
    worlds: list[str] = field([], help="built-in world names or module:Class (default: all worlds of the split)")
    tasks: str | None = field(None, help="JSONL task file (docs/tasks.md) instead of built-in worlds")
    benchmark: str | None = field(None, help="benchmark: bfcl | tau2 | finmcp | vitabench | all (docs/benchmarks.md)")
    categories: list[str] = field([], help="benchmark categories (default: every one that can run)")
    bench_split: str | None = field(None, help="benchmark split (default: the published one: tau2 'base', the others 'test')")
    data_dir: str | None = field(None, help="user-supplied benchmark data (finmcp, vitabench); with 'all', a folder holding finmcp/ and vitabench/")
    user_model: str | None = field(None, help="the simulated user of tau2/VitaBench: an http(s) OpenAI-compatible URL, or a local model spec served on 127.0.0.1 for the run")
    user_api_model: str | None = field(None, help="model name at the --user-model server (default: its only model)")
    split: str = field("test", help="built-in split: train | val | test | heldout")
    n_per_world: int = field(4, help="built-in tasks per world")
    difficulty: int | None = field(None, help="built-in task difficulty 1-3 (default: mixed)")
    limit: int | None = field(None, help="evaluate at most this many tasks (per category with --benchmark)")
    rollout: RolloutConfig = field(default_factory=eval_rollout, help="how each task rolls out")
    simulator: str | None = field(None, help="frozen simulator model for --mode simulator")
    rehearsal: Literal["none", "parallel", "sequential"] = field("none", help="test-time private rehearsal before the committed real run")
    n: int = field(2, help="rehearsal attempts per task")
    rehearser: str | None = field(None, help="model that rehearses (default: the acting model)")
    memory_tokens: int = field(128, help="bound on the rehearsal memory")
    guard: str | None = field(None, help="pre-commit rehearsal guard rule for irreversible calls: goal | no_error | module:function")
    guard_horizon: int = field(2, help="agent turns the guard rehearses after the call")
    reward: str | None = field(None, help="reward: replay | partial | reference | judge | benchmark | module:function (default: benchmark with --benchmark, else replay)")
    judge: str | None = field(None, help="judge model (local spec or URL): for the 'judge' reward, and for the rubric score of benchmarks judged by an LLM (VitaBench)")
    k: int = field(1, help="samples per task")
    seed: int = field(0, help="random seed (task generation and sampling)")
    output_dir: str | None = field(None, help="where to write results (default runs/eval-<time>, with --benchmark runs/bench-<time>)")
    progress: bool = field(True, help="show progress bars")
    allow_train_overlap: bool = field(False, help="evaluate even on tasks the checkpoint was trained on (flagged in the summary)")

    def validate(self) -> None:
        self.rollout.validate()
        sources = [s for s in (self.tasks, self.benchmark) if s]
        if len(sources) > 1:
            raise ConfigError("give either --tasks or --benchmark, not both")
        if self.tasks and not Path(self.tasks).is_file():
            raise ConfigError(f"task file {self.tasks} does not exist")
        if self.split not in ("train", "val", "test", "heldout"):
            raise ConfigError(f"split {self.split!r} must be train, val, test or heldout")
        if (self.rollout.mode == "simulator") != bool(self.simulator):
            raise ConfigError("--mode simulator needs --simulator MODEL (the frozen simulator)" if self.simulator is None else
                              f"--simulator is read by --mode simulator only; drop it for --mode {self.rollout.mode}")
        judge_missing(self.reward_name, self.judge)
        if self.rollout.sampler_dtype in ("f16", "q8_0"):
            raise ConfigError(f"--sampler-dtype {self.rollout.sampler_dtype} is for train --sampler llamacpp; eval samples local models in auto, f32, bf16, int8 or int4")
        rewards = reward_names(self.reward_name)
        self._validate_benchmark()
        judged = [name for name in BENCHMARKS.names() if BENCHMARKS.get(name).uses_judge]
        if self.judge and "judge" not in rewards and self.benchmark not in (*judged, "all"):
            raise ConfigError(f"--judge is read by --reward judge and by the LLM-judged benchmarks ({', '.join(judged)}, or all); "
                              f"here it would be unused: add --reward judge or drop --judge")
        for name in ("k", "n_per_world", "n", "memory_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.guard_horizon < 0:
            raise ConfigError(f"guard_horizon must be >= 0, got {self.guard_horizon}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"limit must be >= 1, got {self.limit}")
        if self.difficulty is not None and self.difficulty not in (1, 2, 3):
            raise ConfigError(f"difficulty must be 1, 2 or 3, got {self.difficulty}")
        if self.rehearsal != "none" and self.rollout.mode != "real":
            raise ConfigError("--rehearsal rehearses privately, then commits in the real world: use it with --mode real")
        if self.rehearser and self.rehearsal == "none":
            raise ConfigError("--rehearser is read by --rehearsal parallel | sequential only; add --rehearsal or drop --rehearser")
        if self.guard is not None and self.rollout.mode != "real":
            raise ConfigError("--guard protects real irreversible calls: use it with --mode real")
        check_models(self.model, self.simulator, self.judge, self.tokenizer, self.rehearser, self.user_model)

    def _validate_benchmark(self) -> None:
        if self.benchmark is None:
            given = [f for f in ("categories", "bench_split", "data_dir", "user_model") if getattr(self, f)]
            if given:
                raise ConfigError(f"--{given[0].replace('_', '-')} goes with --benchmark")
            return
        if self.benchmark != "all" and self.benchmark not in BENCHMARKS:
            raise ConfigError(f"unknown benchmark {self.benchmark!r}; known: {', '.join(BENCHMARKS.names())} or all")
        if self.data_dir and not Path(self.data_dir).exists():
            raise ConfigError(f"data directory {self.data_dir} does not exist")
        if self.data_dir and self.benchmark not in (*DATA_ARGUMENT, "all"):
            raise ConfigError(f"--data-dir is read by {', '.join(DATA_ARGUMENT)} (or all), not {self.benchmark}")

    @property
    def reward_name(self) -> str:
        return self.reward or ("benchmark" if self.benchmark else "replay")


def load_eval_tasks(cfg: EvalConfig) -> list[Task]:
    """Tasks and their environment, resolved and validated before any model is loaded."""
    from envace.envs import get_world
    from envace.envs.tasks import builtin_tasks, load_tasks, require_worlds

    if cfg.tasks:
        tasks = load_tasks(cfg.tasks)
        require_worlds(tasks, world_needs(cfg))
    else:
        for w in cfg.worlds:
            get_world(w)  # an unknown world fails here, by name
        tasks = builtin_tasks(cfg.split, cfg.n_per_world, worlds=cfg.worlds or None, difficulty=cfg.difficulty, seed=cfg.seed)
    return tasks[: cfg.limit] if cfg.limit else tasks


def world_needs(cfg: EvalConfig) -> dict[str, str]:
    """The options in use that need an executable world, each with what world-free tasks can use instead."""
    needs = {}
    if cfg.rollout.mode == "real":
        needs["--mode real (the default)"] = "use --mode rehearse"
    if runs_world(cfg.reward_name):
        default = " (the default)" if cfg.reward is None else ""
        needs[f"--reward {cfg.reward_name}{default}"] = "use --reward judge --judge MODEL, --reward reference, or module:function"
    if cfg.rehearsal != "none":
        needs[f"--rehearsal {cfg.rehearsal} (it commits in the real world)"] = "drop --rehearsal"
    if cfg.guard is not None:
        needs[f"--guard {cfg.guard}"] = "drop --guard"
    return needs


def evaluate(engine: RolloutEngine, tasks: list[Task], reward: str, ctx: Context, k: int = 1, progress: bool = True, desc: str = "eval") -> tuple[list[list[Trajectory]], list[dict[str, Any]]]:
    """Roll out, score, and flatten to records. Shared by `envace eval`, training validation and the demo."""
    groups = engine.run(tasks, k=k, progress=progress, desc=desc)
    compute_rewards(reward, groups, tasks, ctx)
    records = [trajectory_record(task, traj) for task, group in zip(tasks, groups) for traj in group]
    return groups, records


def trajectory_json(traj: Trajectory, tokenizer: Any | None = None) -> dict[str, Any]:
    d = {
        "task_id": traj.task_id,
        "mode": traj.mode,
        "group": traj.group,
        "messages": traj.messages,
        "tool_calls": [c.to_dict() | {"user_turn": c.user_turn, "status": c.status.value} for c in traj.tool_calls],
        "observations": traj.observations,
        "final_answer": traj.final_answer,
        "end_reason": traj.end_reason.value if traj.end_reason else None,
        "end_error": traj.end_error,
        "user_source": traj.user_source,
        "reward": traj.reward,
        "reward_details": traj.reward_details,
        "real_observations": traj.real_observations,
        "benchmark_record": traj.benchmark_record,
        "penalties": traj.penalties,
        "real_env_calls": traj.real_env_calls,
        "seconds": round(traj.seconds, 3),
        "turns": [{"role": t.role.name, "text": t.text, "tokens": len(t.token_ids)} for t in traj.turns],
    }
    return json.loads(json.dumps(d, default=str))


def write_trajectories(path: Path, groups: list[list[Trajectory]]) -> None:
    with path.open("w") as f:
        for group in groups:
            for traj in group:
                f.write(json.dumps(trajectory_json(traj)) + "\n")


def make_guard(cfg: EvalConfig, policy: Any, env: Any) -> Any:
    if cfg.guard is None:
        return None
    from envace.rehearsal import RehearsalGuard

    return RehearsalGuard(policy, env, rule=cfg.guard, horizon=cfg.guard_horizon)


def evaluate_with_rehearsal(cfg: EvalConfig, policy: Any, env: Any, tasks: list[Task], ctx: Context, guard: Any) -> tuple[list[list[Trajectory]], list[dict[str, Any]], dict[str, Any]]:
    """N private rehearsals per task, a memory, then one committed real run per task."""
    from envace.rehearsal import RehearsalConfig, run_with_rehearsal

    if cfg.k != 1:
        raise ConfigError("--rehearsal commits one execution per task: use --k 1")
    rehearser = open_generator(cfg.rehearser, cfg.seed, sampler_dtype=cfg.rollout.sampler_dtype) if cfg.rehearser else None
    config = RehearsalConfig(mode=cfg.rehearsal, n=cfg.n, execution=cfg.rollout, memory_tokens=cfg.memory_tokens)
    groups, cost = run_with_rehearsal(policy, env, tasks, config, rehearser=rehearser, progress=cfg.progress, guard=guard)
    compute_rewards(cfg.reward_name, groups, tasks, ctx)
    records = [trajectory_record(task, traj) for task, group in zip(tasks, groups) for traj in group]
    return groups, records, cost


def check_leakage(model: str, tasks: list[Task], allow: bool) -> list[str]:
    """Refuse to evaluate a checkpoint on tasks its data manifest says it was trained on."""
    from envace.manifest import overlap

    if is_url(model) or not Path(model).is_dir():
        return []
    leaked = overlap(model, tasks)
    if leaked and not allow:
        raise ConfigError(f"{model} was trained on {len(leaked)} of these tasks (e.g. {leaked[0]}); evaluate on another split, "
                          "or pass --allow-train-overlap to evaluate anyway (the summary then flags it)")
    if leaked:
        print(f"WARNING: {model} was trained on {len(leaked)} of the {len(tasks)} evaluation tasks; results are flagged")
    return leaked


@dataclass
class Outcome:
    """One evaluated task set: trajectories, flat records, wall time, test-time rehearsal cost."""

    groups: list[list[Trajectory]]
    records: list[dict[str, Any]]
    wall: float
    rehearsal_cost: dict[str, Any] | None = None


def run_tasks(cfg: EvalConfig, policy: Any, env: Any, tasks: list[Task], simulator: Any = None, judge: Any = None, desc: str = "eval") -> Outcome:
    """Roll out and score `tasks` in `env` as `cfg` says (with test-time rehearsal or not)."""
    started = time.perf_counter()
    ctx = Context(env=env, judge=judge)
    guard = make_guard(cfg, policy, env)
    if cfg.rehearsal == "none":
        engine = RolloutEngine(policy, env, cfg.rollout, simulator=simulator, guard=guard)
        groups, records = evaluate(engine, tasks, cfg.reward_name, ctx, cfg.k, cfg.progress, desc)
        return Outcome(groups, records, time.perf_counter() - started)
    groups, records, cost = evaluate_with_rehearsal(cfg, policy, env, tasks, ctx, guard)
    return Outcome(groups, records, time.perf_counter() - started, cost)


def dependency_waves(tasks: list[Task]) -> list[list[Task]]:
    """`tasks` in waves: each task after every task its metadata `depends_on` names; the tasks of
    one wave are independent and roll out together."""
    waves: list[list[Task]] = []
    done: set[str] = set()
    left = list(tasks)
    while left:
        ready = [t for t in left if set(t.metadata.get("depends_on", [])) <= done]
        if not ready:
            raise ValueError(f"tasks {', '.join(t.id for t in left[:3])} depend on tasks that are not given or depend on each other in a cycle")
        waves.append(ready)
        done |= {t.id for t in ready}
        left = [t for t in left if t.id not in done]
    return waves


def run_prerequisites(cfg: EvalConfig, policy: Any, bench: Benchmark, tasks: list[Task], desc: str) -> Outcome | None:
    """The unscored tasks `tasks` need first (`Benchmark.prerequisites`, e.g. the conversations in
    which BFCL's memory is written), rolled out once each by the policy under evaluation, wave by
    wave. Always in real mode: they set the real state the scored tasks start from, whatever
    --mode and --rehearsal say about the scored tasks themselves."""
    setup = bench.prerequisites(tasks)
    if not setup:
        return None
    started = time.perf_counter()
    engine = RolloutEngine(policy, bench, dataclasses.replace(cfg.rollout, mode="real"))
    waves = dependency_waves(setup)
    groups = [g for i, wave in enumerate(waves) for g in engine.run(wave, progress=cfg.progress, desc=f"{desc} prerequisites {i + 1}/{len(waves)}")]
    records = [trajectory_record(t, traj) for t, group in zip([t for w in waves for t in w], groups) for traj in group]
    return Outcome(groups, records, time.perf_counter() - started)


def summarize_outcome(cfg: EvalConfig, outcome: Outcome, source: str, by: str, leaked: list[str]) -> dict[str, Any]:
    groups, records, wall = outcome.groups, outcome.records, outcome.wall
    return {
        "model": cfg.model,
        "mode": cfg.rollout.mode,
        "source": source,
        "overall": summarize_records(records, wall),
        f"by_{by}": summarize_by(records, by, wall),
        "wall_seconds": wall,
        "trained_on_eval_tasks": leaked,
        "rehearsal": {"mode": cfg.rehearsal, "n": cfg.n, "rehearser": cfg.rehearser or cfg.model, "cost": outcome.rehearsal_cost} if cfg.rehearsal != "none" else None,
        "guard_events": sum(len(t.events) for g in groups for t in g),
        "end_reasons": dict(Counter(r["end_reason"] for r in records)),
    }


def write_outcome(out: Path, outcome: Outcome, summary: dict[str, Any]) -> None:
    write_trajectories(out / "trajectories.jsonl", outcome.groups)
    with (out / "records.jsonl").open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in outcome.records)
    write_summary(summary, out)
    print_summary(summary)


def run_eval(cfg: EvalConfig) -> dict[str, Any]:
    if cfg.benchmark:
        return run_benchmark_eval(cfg)
    from envace.envs.environment import WorldEnvironment

    tasks = load_eval_tasks(cfg)
    if not tasks:
        raise ConfigError("no tasks to evaluate (check --tasks / --worlds / --limit)")
    leaked = check_leakage(cfg.model, tasks, cfg.allow_train_overlap)
    policy = open_generator(cfg.model, cfg.seed, cfg.tokenizer, cfg.api_model, cfg.rollout.sampler_dtype)
    simulator = open_generator(cfg.simulator, cfg.seed, sampler_dtype=cfg.rollout.sampler_dtype) if cfg.simulator else None
    judge = open_generator(cfg.judge, cfg.seed, sampler_dtype=cfg.rollout.sampler_dtype) if cfg.judge else None
    out = cfgmod.run_dir(cfg.output_dir, "eval")
    cfgmod.save(cfg, out / "config.yaml")
    outcome = run_tasks(cfg, policy, WorldEnvironment(), tasks, simulator, judge)
    summary = summarize_outcome(cfg, outcome, cfg.tasks or f"builtin:{cfg.split}", "world", leaked)
    write_outcome(out, outcome, summary)
    return summary


# ---- benchmarks -----------------------------------------------------------------------------

@dataclass
class BenchmarkPlan:
    """One benchmark's tasks, resolved before any model loads, and what will not run and why."""

    name: str
    split: str = ""
    bench: Benchmark | None = None
    tasks: list[Task] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)  # category (or the name) -> why

    def partial(self, limit: int | None) -> bool:
        """Does a score over these tasks stand for less than the whole benchmark?"""
        return bool(self.skipped) or limit is not None


def _benchmark(name: str, cfg: EvalConfig, within_all: bool) -> Benchmark:
    data = Path(cfg.data_dir) / name if within_all and cfg.data_dir else cfg.data_dir
    kwargs = {DATA_ARGUMENT[name]: data} if name in DATA_ARGUMENT and data and Path(data).exists() else {}
    return BENCHMARKS.get(name)(**kwargs)


def _cannot_run(tasks: list[Task], cfg: EvalConfig) -> str | None:
    """Why tasks that need a service cannot run with this configuration. Off real mode (and in
    private rehearsals) the rehearsing model imagines the user, so only real runs need one."""
    if any(t.rules.simulated_user for t in tasks) and _real_user_needed(cfg) and not cfg.user_model:
        return "needs a simulated user (an LLM): pass --user-model URL or a local model spec"
    return None


def _real_user_needed(cfg: EvalConfig) -> bool:
    return cfg.rollout.mode == "real"


def _selections(name: str, bench: Benchmark, cfg: EvalConfig, strict: bool, skipped: dict[str, str]) -> list[tuple[str, list[str] | None]]:
    """(label, `load_tasks` categories) to load: one per category, or, where the categories come
    from the data (FinMCP), the whole set filtered by --categories. Within `all`, --categories
    picks each benchmark's own; the categories left out are noted in `skipped`."""
    if not bench.categories:
        return [(name, cfg.categories or None)]
    wanted = (cfg.categories or list(bench.categories)) if strict else [c for c in bench.categories if not cfg.categories or c in cfg.categories]
    skipped.update({c: "not in --categories" for c in bench.categories if c not in wanted})
    if not wanted:
        skipped[name] = "none of its categories is in --categories"
    return [(c, [c]) for c in wanted]


def plan_benchmark(name: str, cfg: EvalConfig, strict: bool) -> BenchmarkPlan:
    """Load the tasks of every category that can run. `strict` (a named benchmark): a requested
    category that cannot run is an error; otherwise (`all`) it is skipped with the reason."""
    plan = BenchmarkPlan(name)

    def refuse(what: str, why: str) -> None:
        if strict:
            raise ConfigError(f"{name if what == name else f'{name} {what}'}: {why}")
        plan.skipped[what] = why

    try:
        bench = _benchmark(name, cfg, within_all=not strict)
        plan.bench, plan.split = bench, cfg.bench_split or bench.default_split
        status = bench.offline_status()
        plan.skipped.update({c: f"cannot run offline: {why}" for c, why in status.items() if why != "ok" and c not in cfg.categories})
        for label, categories in _selections(name, bench, cfg, strict, plan.skipped):
            why = status.get(label, status.get(name, "ok"))
            if why != "ok":
                refuse(label, f"cannot run offline: {why}")
                continue
            tasks = bench.load_tasks(plan.split, cfg.limit, categories)
            why = _cannot_run(tasks, cfg) or (None if tasks else "no tasks (check --categories, --bench-split and the data)")
            if why:
                refuse(label, why)
            else:
                plan.tasks.extend(tasks)
    except ConfigError:
        raise
    except (BenchmarkDependencyError, FileNotFoundError, ValueError) as exc:
        # A missing package or data set, or a category or split the adapter does not know.
        refuse(name, str(exc))
    return plan


def plan_benchmarks(cfg: EvalConfig) -> list[BenchmarkPlan]:
    if cfg.benchmark != "all":
        plans = [plan_benchmark(cfg.benchmark, cfg, strict=True)]
    else:
        plans = [plan_benchmark(name, cfg, strict=False) for name in ALL_BENCHMARKS]
    if not any(p.tasks for p in plans):
        reasons = "; ".join(f"{w}: {why}" for p in plans for w, why in p.skipped.items())
        raise ConfigError(f"no benchmark task can run ({reasons})")
    return plans


def served_model_name(url: str, name: str | None) -> str:
    """The model to request at an OpenAI-compatible server: `name`, checked, else its only model."""
    from envace.backends.openai_http import OpenAIGenerator

    server = OpenAIGenerator(url, name, tokenizer=None)
    server.check_reachable()
    return server.model


@contextlib.contextmanager
def user_model_endpoint(cfg: EvalConfig) -> Iterator[tuple[str, str]]:
    """(base URL, model name) of the simulated user's LLM for the run. tau2's simulator calls it
    through litellm, i.e. over HTTP, so a local spec is served by envace's own server on a free
    127.0.0.1 port until the run ends (one generation at a time; no tool calls)."""
    if is_url(cfg.user_model):
        yield cfg.user_model, served_model_name(cfg.user_model, cfg.user_api_model)
        return
    from envace.backends.hf import HFGenerator
    from envace.backends.models import load_model
    from envace.backends.server import CompletionService, make_server

    model, tokenizer = load_model(cfg.user_model)
    server = make_server(CompletionService(HFGenerator(model, tokenizer, seed=cfg.seed), cfg.user_model), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", cfg.user_model
    finally:
        server.shutdown()
        server.server_close()


def benchmark_results(tasks: list[Task], outcome: Outcome) -> list[dict[str, Any]]:
    """What `Benchmark.aggregate` reads: one row per trajectory."""
    return [{"task_id": t.id, "category": t.metadata["category"], "score": traj.reward or 0.0, "details": traj.reward_details}
            for t, group in zip(tasks, outcome.groups) for traj in group]


def run_benchmark(cfg: EvalConfig, plan: BenchmarkPlan, policy: Any, out: Path, simulator: Any = None, judge: Any = None,
                  user: tuple[str, str] | None = None, leaked: list[str] | None = None) -> dict[str, Any]:
    """Evaluate one planned benchmark; its summary holds the benchmark's own `aggregate`."""
    bench = plan.bench
    if user is not None:
        bench.user_simulator = bench.make_user_simulator(*user)
    if judge is not None and bench.uses_judge:
        bench.judge = functools.partial(Context(env=bench, judge=judge).judge_reply, max_new_tokens=bench.judge_tokens)
    prerequisites = run_prerequisites(cfg, policy, bench, plan.tasks, plan.name)
    outcome = run_tasks(cfg, policy, bench, plan.tasks, simulator, judge, desc=plan.name)
    category = {t.id: t.metadata["category"] for t in plan.tasks}
    for record in outcome.records:
        record["category"] = category[record["task_id"]]
    leaked = [i for i in leaked or [] if i in category]
    summary = summarize_outcome(cfg, outcome, f"benchmark:{plan.name} ({plan.split})", "category", leaked)
    # The benchmark weights its own scores; any other reward's values are not its scores.
    aggregate = bench.aggregate(benchmark_results(plan.tasks, outcome)) if cfg.reward_name == "benchmark" else None
    summary["benchmark"] = {"name": plan.name, "split": plan.split, "aggregate": aggregate, "skipped": plan.skipped,
                            "limit": cfg.limit, "partial": plan.partial(cfg.limit)}
    out.mkdir(parents=True, exist_ok=True)
    if prerequisites is not None:
        # Not scored and not in wall_seconds: what the scored tasks needed first, and its cost.
        cost = summarize_records(prerequisites.records, prerequisites.wall)
        summary["prerequisites"] = {**{k: cost[k] for k in ("n", "tokens_per_task", "seconds_per_task", "real_env_calls", "malformed")},
                                    "wall_seconds": prerequisites.wall, "end_reasons": dict(Counter(r["end_reason"] for r in prerequisites.records))}
        write_trajectories(out / "prerequisites.jsonl", prerequisites.groups)
    write_outcome(out, outcome, summary)
    return summary


def run_benchmark_eval(cfg: EvalConfig, policy: Any = None) -> dict[str, Any]:
    """`envace eval --benchmark NAME|all`: every check before the models load; `all` also writes
    the paper-shaped table (benchmark_table.md/.json). `policy` replaces `cfg.model` (tests)."""
    from envace.evaluation.benchmark_table import benchmark_table, write_table

    plans = plan_benchmarks(cfg)
    tasks = [t for p in plans for t in p.tasks]
    leaked = check_leakage(cfg.model, tasks, cfg.allow_train_overlap)
    needs_user = _real_user_needed(cfg) and any(t.rules.simulated_user for t in tasks)
    # Entered first: an unreachable user-model URL fails before the policy loads.
    with user_model_endpoint(cfg) if needs_user else contextlib.nullcontext() as user:
        policy = policy or open_generator(cfg.model, cfg.seed, cfg.tokenizer, cfg.api_model, cfg.rollout.sampler_dtype)
        simulator = open_generator(cfg.simulator, cfg.seed, sampler_dtype=cfg.rollout.sampler_dtype) if cfg.simulator else None
        judge = open_generator(cfg.judge, cfg.seed, sampler_dtype=cfg.rollout.sampler_dtype) if cfg.judge else None
        out = cfgmod.run_dir(cfg.output_dir, "bench")
        cfgmod.save(cfg, out / "config.yaml")
        summaries = {
            p.name: run_benchmark(cfg, p, policy, out if cfg.benchmark != "all" else out / p.name, simulator, judge, user, leaked)
            for p in plans if p.tasks
        }
    if cfg.benchmark != "all":
        return summaries[cfg.benchmark]
    table = benchmark_table(cfg, plans, summaries)
    write_table(table, out)
    return table
