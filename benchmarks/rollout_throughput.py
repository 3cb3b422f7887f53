"""Rollout throughput with and without the cross-turn KV cache, on the same tasks.

    python benchmarks/rollout_throughput.py --model default --n-per-world 2 --batch 8

"cache": each episode keeps its KV cache across turns, a turn encodes only its new tokens.
"no cache": every turn re-encodes the whole transcript (what a stateless engine does); within a
turn decoding still uses a cache. Greedy decoding, so both runs produce the same trajectories up
to numerical noise. Writes benchmarks/results/rollout_throughput.json.

    python benchmarks/rollout_throughput.py --compare prompts --k 4

"--compare prompts": K sampled rollouts per task (as a GRPO step draws them), with the task's
prompt encoded once for its K sessions ("shared") or once per session ("per session"); same seed.
Writes benchmarks/results/rollout_shared_prompts.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from envace.backends import HFGenerator, load_model
from envace.backends.base import Completion, SamplingParams
from envace.envs.environment import WorldEnvironment
from envace.envs.tasks import builtin_tasks
from envace.rollout import RolloutConfig, RolloutEngine
from envace.types import Role


class NoCrossTurnCache:
    """Wraps a generator so that every call re-encodes each session's whole sequence."""

    def __init__(self, inner: HFGenerator):
        self.inner, self.tokenizer = inner, inner.tokenizer
        self.sequences: dict[int, list[int]] = {}
        self.stats = inner.stats

    def open(self, n: int) -> list[int]:
        ids = self.inner.open(n)
        self.inner.close(ids)
        self.sequences.update({i: [] for i in ids})
        return ids

    def close(self, sessions: list[int]) -> None:
        for s in sessions:
            self.sequences.pop(s, None)

    def generate(self, sessions: list[int], new_tokens: list[list[int]], params: SamplingParams) -> list[Completion]:
        for s, new in zip(sessions, new_tokens):
            self.sequences[s].extend(new)
        fresh = self.inner.open(len(sessions))
        outs = self.inner.generate(fresh, [list(self.sequences[s]) for s in sessions], params)
        self.inner.close(fresh)
        for s, out in zip(sessions, outs):
            self.sequences[s].extend(out.token_ids)
        return outs


def run(generator: Any, tasks: list, config: RolloutConfig, k: int = 1) -> dict[str, float]:
    engine = RolloutEngine(generator, WorldEnvironment(), config)
    start = time.perf_counter()
    groups = engine.run(tasks, k=k, progress=False)
    seconds = time.perf_counter() - start
    trajs = [t for g in groups for t in g]
    generated = sum(t.num_tokens(Role.ACT) for t in trajs)
    return {"seconds": seconds, "generated_tokens": generated, "generated_tok_per_s": generated / seconds,
            "prefill_tokens": generator.stats.prefill_tokens, "transcript_tokens": sum(len(t.token_ids) for t in trajs),
            "turns": sum(len(t.outputs(Role.ACT)) for t in trajs), "acts": [[tok for turn in t.outputs(Role.ACT) for tok in turn.token_ids] for t in trajs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--n-per-world", type=int, default=2)
    p.add_argument("--difficulty", type=int, default=2)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-turn-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compare", choices=["cache", "prompts"], default="cache")
    p.add_argument("--k", type=int, default=4, help="rollouts per task (--compare prompts)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    tasks = builtin_tasks("test", args.n_per_world, difficulty=args.difficulty)
    if args.compare == "prompts":
        compare_prompt_sharing(model, tokenizer, tasks, args)
        return
    config = RolloutConfig(mode="real", temperature=0.0, max_turns=args.max_turns, max_turn_tokens=args.max_turn_tokens)
    results = {}
    for name, make in (("cache", lambda: HFGenerator(model, tokenizer)), ("no_cache", lambda: NoCrossTurnCache(HFGenerator(model, tokenizer)))):
        results[name] = run(make(), tasks, config)
        print(f"{name:9s} {results[name]['seconds']:7.1f} s  {results[name]['generated_tok_per_s']:6.2f} generated tok/s  prefill {results[name]['prefill_tokens']} tokens", flush=True)
    same = results["cache"].pop("acts") == results["no_cache"].pop("acts")
    summary = {
        "model": args.model, "tasks": len(tasks), "device": str(model.device), "threads": args.threads, "config": vars(args),
        "cache": results["cache"], "no_cache": results["no_cache"],
        "speedup": results["no_cache"]["seconds"] / results["cache"]["seconds"],
        "prefill_ratio": results["no_cache"]["prefill_tokens"] / max(1, results["cache"]["prefill_tokens"]),
        "identical_actions": same,
    }
    print(f"speed-up with the cross-turn cache: {summary['speedup']:.2f}x; prefill tokens {summary['prefill_ratio']:.2f}x fewer; identical actions: {same}")
    write(summary, args.out or "benchmarks/results/rollout_throughput.json")


def compare_prompt_sharing(model: Any, tokenizer: Any, tasks: list, args: argparse.Namespace) -> None:
    config = RolloutConfig(mode="real", temperature=1.0, max_turns=args.max_turns, max_turn_tokens=args.max_turn_tokens)
    results = {}
    for name, share in (("shared", True), ("per_session", False)):
        results[name] = run(HFGenerator(model, tokenizer, seed=0, share_prompts=share), tasks, config, k=args.k)
        results[name].pop("acts")
        print(f"{name:11s} {results[name]['seconds']:7.1f} s  prefill {results[name]['prefill_tokens']} tokens", flush=True)
    summary = {"model": args.model, "tasks": len(tasks), "k": args.k, "threads": args.threads, "config": vars(args), **results,
               "speedup": results["per_session"]["seconds"] / results["shared"]["seconds"],
               "prefill_ratio": results["per_session"]["prefill_tokens"] / max(1, results["shared"]["prefill_tokens"])}
    print(f"shared prompts: {summary['speedup']:.2f}x faster, {summary['prefill_ratio']:.2f}x fewer prefill tokens")
    write(summary, args.out or "benchmarks/results/rollout_shared_prompts.json")


def write(summary: dict[str, Any], path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
