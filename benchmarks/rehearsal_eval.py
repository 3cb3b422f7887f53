"""Evaluate test-time private rehearsal: none / parallel / sequential on built-in held-out tasks.

Prints a Markdown table (success with a 95% interval, extra tokens and seconds per task) and the
command that produced it; `--write-docs docs/rehearsal.md` also puts both under the results
placeholder of that file (re-running replaces them).

    python benchmarks/rehearsal_eval.py --model default --n 2 --n-per-world 8
    python benchmarks/rehearsal_eval.py --model runs/train/final --rehearser default   # trained acts, base rehearses
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from envace.config import ConfigError
from envace.metrics import wilson_interval
from envace.rehearsal import RehearsalConfig, RehearsalGuard, RehearsalPrompts, run_with_rehearsal
from envace.rewards import Context, compute_rewards
from envace.rollout import RolloutConfig

PLACEHOLDER = "<!-- results table: filled by benchmarks/rehearsal_eval.py -->"
END = "<!-- end of results table -->"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="acting model spec (see envace eval --model)")
    p.add_argument("--rehearser", default=None, help="model that rehearses, evaluates and summarises (default: --model)")
    p.add_argument("--modes", nargs="+", default=["none", "parallel", "sequential"], choices=["none", "parallel", "sequential"])
    p.add_argument("--n", type=int, default=2, help="rehearsal attempts per task")
    p.add_argument("--split", default="heldout", help="built-in split: train | val | test | heldout")
    p.add_argument("--n-per-world", type=int, default=4)
    p.add_argument("--worlds", nargs="+", default=None, help="built-in world names (default: the split's)")
    p.add_argument("--difficulty", type=int, default=None, choices=[1, 2, 3])
    p.add_argument("--limit", type=int, default=None, help="evaluate at most this many tasks")
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--max-turn-tokens", type=int, default=128)
    p.add_argument("--max-rehearse-tokens", type=int, default=96)
    p.add_argument("--max-total-tokens", type=int, default=2048)
    p.add_argument("--max-active", type=int, default=64,
                   help="rollouts, evaluations and summaries in flight at once (0 = all; each holds a KV cache)")
    p.add_argument("--temperature", type=float, default=0.0, help="committed run sampling (0 = greedy)")
    p.add_argument("--attempt-temperature", type=float, default=0.8, help="rehearsal attempts' sampling")
    p.add_argument("--evaluation-tokens", type=int, default=96)
    p.add_argument("--memory-tokens", type=int, default=128)
    p.add_argument("--prompts", default=None, help="YAML file overriding rehearsal prompts")
    p.add_argument("--guard", default="none", help="pre-commit guard rule, rehearsed by --rehearser: none | goal | no_error | module:function")
    p.add_argument("--horizon", type=int, default=2, help="guard rehearsal horizon (ACT turns)")
    p.add_argument("--device", default=None, help="torch device for local models (default: cuda if available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write-docs", default=None, help="Markdown file whose results placeholder receives the table")
    return p.parse_args(argv)


def rehearsal_config(args: argparse.Namespace, mode: str) -> RehearsalConfig:
    execution = RolloutConfig(
        max_turns=args.max_turns, max_turn_tokens=args.max_turn_tokens, max_rehearse_tokens=args.max_rehearse_tokens,
        max_total_tokens=args.max_total_tokens, temperature=args.temperature, max_active=args.max_active,
    )
    return RehearsalConfig(
        mode=mode, n=args.n, execution=execution, attempt=dataclasses.replace(execution, temperature=args.attempt_temperature),
        evaluation_tokens=args.evaluation_tokens, memory_tokens=args.memory_tokens,
        prompts=RehearsalPrompts.from_yaml(args.prompts) if args.prompts else RehearsalPrompts(),
    )


def evaluate_mode(args: argparse.Namespace, mode: str, policy: Any, rehearser: Any, env: Any, tasks: list) -> dict[str, Any]:
    """One table row: success and cost per task of one rehearsal mode."""
    config = rehearsal_config(args, mode)
    guard = None if args.guard == "none" else RehearsalGuard(rehearser, env, rule=args.guard, horizon=args.horizon, config=config.execution)
    started = time.perf_counter()
    groups, acc = run_with_rehearsal(policy, env, tasks, config, rehearser=rehearser, guard=guard)
    wall = time.perf_counter() - started
    compute_rewards("replay", groups, tasks, Context(env=env))
    successes = sum(bool(g[0].success) for g in groups)
    low, high = wilson_interval(successes, len(tasks))
    n = len(tasks)
    return {
        "mode": mode, "n": acc["n"], "tasks": n, "success": successes / n, "low": low, "high": high,
        "partial_credit": sum(g[0].partial_credit or 0.0 for g in groups) / n,
        "extra_tokens": acc["extra_tokens"] / n, "rehearsal_seconds": acc["rehearsal_seconds"] / n,
        "execution_seconds": acc["execution_seconds"] / n, "wall_seconds": wall,
    }


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| rehearsal | N | tasks | success (95% CI) | partial credit | extra tokens / task | rehearsal s / task | execution s / task | rehearsal s per point of success gained |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    baseline = next((r["success"] for r in rows if r["mode"] == "none"), None)
    for r in rows:
        # What one percentage point of success over the no-rehearsal row costs in rehearsal time.
        gained = None if baseline is None or r["mode"] == "none" else 100 * (r["success"] - baseline)
        per_point = "-" if gained is None else (f"{r['rehearsal_seconds'] * r['tasks'] / gained:.0f}" if gained > 0 else "no gain")
        lines.append(
            f"| {r['mode']} | {r['n']} | {r['tasks']} | {r['success']:.2f} ({r['low']:.2f}-{r['high']:.2f}) | {r['partial_credit']:.2f} | "
            f"{r['extra_tokens']:.0f} | {r['rehearsal_seconds']:.1f} | {r['execution_seconds']:.1f} | {per_point} |"
        )
    return "\n".join(lines)


def fill_docs(path: Path, block: str) -> None:
    """Put `block` right after the placeholder line, replacing what an earlier run put there."""
    text = path.read_text()
    if PLACEHOLDER not in text:
        raise SystemExit(f"{path} has no line {PLACEHOLDER}")
    head, tail = text.split(PLACEHOLDER, 1)
    if END in tail:
        tail = tail.split(END, 1)[1]
    path.write_text(f"{head}{PLACEHOLDER}\n{block}\n{END}{tail}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        for mode in args.modes:  # a bad limit fails here, before any model loads
            rehearsal_config(args, mode).validate()
    except ConfigError as e:
        raise SystemExit(f"rehearsal_eval.py: {e}") from None
    from envace.backends import make_generator
    from envace.envs.environment import WorldEnvironment
    from envace.envs.tasks import builtin_tasks

    tasks = builtin_tasks(args.split, args.n_per_world, worlds=args.worlds, difficulty=args.difficulty, seed=args.seed)
    tasks = tasks[: args.limit] if args.limit else tasks
    local = {"device": args.device} if args.device else {}
    policy = make_generator(args.model, seed=args.seed, **local)
    rehearser = make_generator(args.rehearser, seed=args.seed, **local) if args.rehearser and args.rehearser != args.model else policy
    if args.guard != "none" and rehearser.tokenizer.get_vocab() != policy.tokenizer.get_vocab():
        raise SystemExit("--guard continues the agent's token sequence: --rehearser must share --model's tokenizer")
    env = WorldEnvironment()
    rows = [evaluate_mode(args, mode, policy, rehearser, env, tasks) for mode in args.modes]
    command = "python benchmarks/rehearsal_eval.py " + shlex.join(argv)
    block = f"{markdown_table(rows)}\n\nProduced by `{command.strip()}`."
    print(block)
    if args.write_docs:
        fill_docs(Path(args.write_docs), block)


if __name__ == "__main__":
    main()
