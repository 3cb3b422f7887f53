"""`envace eval`: run a model on built-in worlds, a task file or a benchmark, in real or
rehearse mode, and write per-task trajectories plus a summary (JSON + Markdown)."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from envace import config as cfgmod
from envace.config import ConfigError, field
from envace.evaluation.metrics import summarize_by, summarize_records, trajectory_record
from envace.evaluation.report import print_summary, write_summary
from envace.rewards import REWARDS, Context, compute_rewards
from envace.rollout import RolloutConfig, RolloutEngine
from envace.types import Task, Trajectory


@dataclass
class EvalConfig:
    model: str = field("default", help="model: 'default' (bundled SmolLM2-135M-Instruct), a local directory, a .gguf file, or an http(s):// OpenAI-compatible URL")
    tokenizer: str | None = field(None, help="tokenizer spec for an http model (default: the bundled model's)")
    api_model: str | None = field(None, help="model name sent to an OpenAI-compatible server (default: its only model)")
    worlds: list[str] = field([], help="built-in world names or module:Class (default: all worlds of the split)")
    tasks: str | None = field(None, help="JSONL task file (docs/tasks.md) instead of built-in worlds")
    benchmark: str | None = field(None, help="benchmark name (bfcl, tau2, finmcp, vitabench, all)")
    split: str = field("test", help="built-in split: train | val | test | heldout")
    n_per_world: int = field(4, help="built-in tasks per world")
    difficulty: int | None = field(None, help="built-in task difficulty 1-3 (default: mixed)")
    limit: int | None = field(None, help="evaluate at most this many tasks")
    mode: Literal["real", "rehearse", "simulator"] = field("real", help="who answers tool calls")
    rehearse_layout: Literal["transcript", "isolated"] = field("transcript", help="rehearse in the agent's transcript or from a separate simulator prompt")
    simulator: str | None = field(None, help="frozen simulator model for --mode simulator")
    rehearsal: Literal["none", "parallel", "sequential"] = field("none", help="test-time private rehearsal before the committed real run")
    n: int = field(2, help="rehearsal attempts per task")
    rehearser: str | None = field(None, help="model that rehearses (default: the acting model)")
    memory_tokens: int = field(128, help="bound on the rehearsal memory")
    guard: str | None = field(None, help="pre-commit rehearsal guard rule for irreversible calls: goal | no_error | module:function")
    guard_horizon: int = field(2, help="agent turns the guard rehearses after the call")
    reward: str = field("replay", help="reward: replay | reference | judge | module:function")
    judge: str | None = field(None, help="judge model for the 'judge' reward")
    k: int = field(1, help="samples per task")
    temperature: float = field(0.6, help="sampling temperature (0 = greedy)")
    top_p: float = field(0.95, help="nucleus sampling")
    max_turns: int = field(8, help="ACT turns per task")
    max_turn_tokens: int = field(192, help="tokens per ACT turn")
    max_rehearse_tokens: int = field(160, help="tokens per rehearsed tool response")
    max_total_tokens: int = field(3072, help="tokens per trajectory, prompt included")
    accept_fenced_json: bool = field(False, help="also parse ```json tool calls (lenient)")
    seed: int = field(0, help="random seed (task generation and sampling)")
    output_dir: str | None = field(None, help="where to write results (default runs/eval-<time>)")
    progress: bool = field(True, help="show progress bars")
    allow_train_overlap: bool = field(False, help="evaluate even on tasks the checkpoint was trained on (flagged in the summary)")

    def validate(self) -> None:
        sources = [s for s in (self.tasks, self.benchmark) if s]
        if len(sources) > 1:
            raise ConfigError("give either --tasks or --benchmark, not both")
        if self.tasks and not Path(self.tasks).is_file():
            raise ConfigError(f"task file {self.tasks} does not exist")
        if self.split not in ("train", "val", "test", "heldout"):
            raise ConfigError(f"split {self.split!r} must be train, val, test or heldout")
        if self.mode == "simulator" and not self.simulator:
            raise ConfigError("--mode simulator needs --simulator MODEL (the frozen simulator)")
        if self.reward == "judge" and not self.judge:
            raise ConfigError("--reward judge needs --judge MODEL")
        if self.reward not in REWARDS and ":" not in self.reward:
            raise ConfigError(f"unknown reward {self.reward!r}; known: {', '.join(REWARDS.names())} or module:function")
        for name, value in (("k", self.k), ("n_per_world", self.n_per_world), ("max_turns", self.max_turns), ("max_turn_tokens", self.max_turn_tokens)):
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"limit must be >= 1, got {self.limit}")
        if self.difficulty is not None and self.difficulty not in (1, 2, 3):
            raise ConfigError(f"difficulty must be 1, 2 or 3, got {self.difficulty}")
        if not 0 < self.top_p <= 1 or self.temperature < 0:
            raise ConfigError("temperature must be >= 0 and top_p in (0, 1]")
        if self.rehearsal != "none" and self.mode != "real":
            raise ConfigError("--rehearsal rehearses privately, then commits in the real world: use it with --mode real")
        if self.n < 1 or self.memory_tokens < 1 or self.guard_horizon < 0:
            raise ConfigError("n and memory_tokens must be >= 1 and guard_horizon >= 0")
        if self.guard is not None and self.mode != "real":
            raise ConfigError("--guard protects real irreversible calls: use it with --mode real")
        check_models(self.model, self.simulator, self.judge, self.tokenizer, self.rehearser)

    def rollout_config(self) -> RolloutConfig:
        fields = {f.name for f in dataclasses.fields(RolloutConfig)}
        return RolloutConfig(**{k: v for k, v in dataclasses.asdict(self).items() if k in fields})


def load_eval_tasks(cfg: EvalConfig) -> list[Task]:
    """Tasks and their environment, resolved and validated before any model is loaded."""
    from envace.envs import get_world
    from envace.envs.tasks import builtin_tasks, load_tasks

    if cfg.tasks:
        tasks = load_tasks(cfg.tasks)
    else:
        for w in cfg.worlds:
            get_world(w)  # an unknown world fails here, by name
        tasks = builtin_tasks(cfg.split, cfg.n_per_world, worlds=cfg.worlds or None, difficulty=cfg.difficulty, seed=cfg.seed)
    return tasks[: cfg.limit] if cfg.limit else tasks


def output_dir(cfg: EvalConfig, prefix: str = "eval") -> Path:
    path = Path(cfg.output_dir) if cfg.output_dir else Path("runs") / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


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
        "tool_calls": [c.to_dict() | {"user_turn": c.user_turn} for c in traj.tool_calls],
        "observations": traj.observations,
        "final_answer": traj.final_answer,
        "end_reason": traj.end_reason.value if traj.end_reason else None,
        "reward": traj.reward,
        "reward_details": traj.reward_details,
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


def is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def check_models(*specs: str | None) -> None:
    """Fail on a bad local model spec before any work starts (URLs are checked when opened)."""
    from envace.backends.models import check_model_spec

    for spec in specs:
        if spec and not is_url(spec):
            check_model_spec(spec)


def open_generator(spec: str, seed: int, tokenizer: str | None = None, api_model: str | None = None) -> Any:
    """A local model or an OpenAI-compatible server (whose tokenizer must be given or be the default's)."""
    from envace.backends import load_tokenizer, make_generator

    if is_url(spec):
        return make_generator(spec, tokenizer=load_tokenizer(tokenizer or "default"), model=api_model)
    return make_generator(spec, seed=seed)


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
    rehearser = open_generator(cfg.rehearser, cfg.seed) if cfg.rehearser else None
    config = RehearsalConfig(mode=cfg.rehearsal, n=cfg.n, execution=cfg.rollout_config(), memory_tokens=cfg.memory_tokens)
    groups, cost = run_with_rehearsal(policy, env, tasks, config, rehearser=rehearser, progress=cfg.progress, guard=guard)
    compute_rewards(cfg.reward, groups, tasks, ctx)
    records = [trajectory_record(task, traj) for task, group in zip(tasks, groups) for traj in group]
    return groups, records, cost


def check_leakage(model: str, tasks: list[Task], allow: bool) -> list[str]:
    """Refuse to evaluate a checkpoint on tasks its data manifest says it was trained on."""
    from envace.training.manifest import overlap

    if is_url(model) or not Path(model).is_dir():
        return []
    leaked = overlap(model, tasks)
    if leaked and not allow:
        raise ConfigError(f"{model} was trained on {len(leaked)} of these tasks (e.g. {leaked[0]}); evaluate on another split, "
                          "or pass --allow-train-overlap to evaluate anyway (the summary then flags it)")
    if leaked:
        print(f"WARNING: {model} was trained on {len(leaked)} of the {len(tasks)} evaluation tasks; results are flagged")
    return leaked


def run_eval(cfg: EvalConfig) -> dict[str, Any]:
    from envace.envs.environment import WorldEnvironment

    tasks = load_eval_tasks(cfg)
    if not tasks:
        raise ConfigError("no tasks to evaluate (check --tasks / --worlds / --limit)")
    leaked = check_leakage(cfg.model, tasks, cfg.allow_train_overlap)
    policy = open_generator(cfg.model, cfg.seed, cfg.tokenizer, cfg.api_model)
    simulator = open_generator(cfg.simulator, cfg.seed) if cfg.simulator else None
    judge = open_generator(cfg.judge, cfg.seed) if cfg.judge else None
    env = WorldEnvironment()
    out = output_dir(cfg)
    cfgmod.save(cfg, out / "config.yaml")
    started = time.perf_counter()
    ctx = Context(env=env, judge=judge)
    guard = make_guard(cfg, policy, env)
    rehearsal_cost = None
    if cfg.rehearsal == "none":
        engine = RolloutEngine(policy, env, cfg.rollout_config(), simulator=simulator, guard=guard)
        groups, records = evaluate(engine, tasks, cfg.reward, ctx, cfg.k, cfg.progress)
    else:
        groups, records, rehearsal_cost = evaluate_with_rehearsal(cfg, policy, env, tasks, ctx, guard)
    wall = time.perf_counter() - started
    summary = {
        "model": cfg.model,
        "mode": cfg.mode,
        "source": cfg.tasks or cfg.benchmark or f"builtin:{cfg.split}",
        "overall": summarize_records(records, wall),
        "by_world": summarize_by(records, "world", wall),
        "wall_seconds": wall,
        "trained_on_eval_tasks": leaked,
        "rehearsal": {"mode": cfg.rehearsal, "n": cfg.n, "rehearser": cfg.rehearser or cfg.model, "cost": rehearsal_cost} if cfg.rehearsal != "none" else None,
        "guard_events": sum(len(t.events) for g in groups for t in g),
    }
    write_trajectories(out / "trajectories.jsonl", groups)
    with (out / "records.jsonl").open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    write_summary(summary, out)
    print_summary(summary)
    return summary
