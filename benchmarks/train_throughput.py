"""Training throughput: transcript layout (one row per trajectory) vs one row per policy output
(the reference implementation's layout), on the same trajectories; plus the rollout/update split
of real training steps.

    python benchmarks/train_throughput.py --model default --trajectories 8
    python benchmarks/train_throughput.py --layout transcript   # one layout per process (peak RSS)

Trajectories are the built-in tasks' reference solutions executed in the real world, with the
tool responses tagged REHEARSE, i.e. what a rehearse-mode rollout of a good policy looks like.
Each layout runs one forward+backward of the PPO loss over all of them. Writes
benchmarks/results/train_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from envace.algorithms.losses import Row, collate, ppo_loss, sequence_logprobs
from envace.backends import load_model
from envace.envs.environment import WorldEnvironment
from envace.envs.tasks import builtin_tasks
from envace.training.setup import micro_batches
from envace.training.sft import reference_trajectories
from envace.types import SAMPLED_ROLES, Role, Trajectory


def as_rehearsal(traj: Trajectory) -> Trajectory:
    for turn in traj.turns:
        if turn.role == Role.ENV:
            turn.role = Role.REHEARSE
            turn.logprobs = [0.0] * len(turn.token_ids)
    return traj


def transcript_rows(trajs: list[Trajectory]) -> list[Row]:
    rows = []
    for t in trajs:
        mask = [1.0 if r in SAMPLED_ROLES else 0.0 for r in t.roles]
        rows.append(Row(t.token_ids, t.roles, mask, [1.0] * len(mask), t.logprobs))
    return rows


def per_output_rows(trajs: list[Trajectory]) -> list[Row]:
    """One row per ACT/REHEARSE output: its whole prefix, only that output trained."""
    rows = []
    for t in trajs:
        ids, roles, logps = t.token_ids, t.roles, t.logprobs
        start = 0
        for turn in t.turns:
            end = start + len(turn.token_ids)
            if turn.role in SAMPLED_ROLES:
                mask = [0.0] * start + [1.0] * len(turn.token_ids)
                rows.append(Row(ids[:end], roles[:end], mask, [1.0] * end, logps[:end]))
            start = end
    return rows


def measure(model, rows: list[Row], pad_id: int, max_tokens: int) -> dict[str, float]:
    model.train()
    total = sum(sum(r.loss_mask) for r in rows)
    start = time.perf_counter()
    forwarded = 0
    for chunk in micro_batches(rows, max_tokens):
        batch = collate(chunk, pad_id)
        forwarded += int(batch.attention_mask.sum())
        logprobs, _ = sequence_logprobs(model, batch)
        loss, _ = ppo_loss(logprobs, batch.sampler_logprobs, batch.advantages, batch.loss_mask, num_tokens=float(total))
        loss.backward()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return {"rows": len(rows), "trained_tokens": total, "forwarded_tokens": forwarded, "seconds": seconds,
            "trained_tok_per_s": total / seconds, "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def one_layout(args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    tasks = builtin_tasks("train", args.trajectories, difficulty=3)[: args.trajectories]
    trajs = [as_rehearsal(t) for t in reference_trajectories(tasks, tokenizer, WorldEnvironment(), 4096)[0]]
    rows = (transcript_rows if args.layout == "transcript" else per_output_rows)(trajs)
    return measure(model, rows, tokenizer.pad_token_id, args.micro_batch_tokens) | {"trajectories": len(trajs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--trajectories", type=int, default=8)
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layout", choices=["transcript", "per_output"], default=None, help="measure one layout in this process")
    p.add_argument("--out", default="benchmarks/results/train_throughput.json")
    args = p.parse_args()
    if args.layout:
        print(json.dumps(one_layout(args)))
        return
    results = {}
    for layout in ("transcript", "per_output"):
        # A process per layout so that peak memory is each layout's own.
        cmd = [sys.executable, __file__, "--layout", layout] + [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("layout", "out")]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        results[layout] = json.loads(out)
        r = results[layout]
        print(f"{layout:10s} rows {r['rows']:3d}  forwarded {r['forwarded_tokens']:6d} tok  trained {r['trained_tokens']:5.0f} tok  {r['seconds']:6.1f} s  "
              f"{r['trained_tok_per_s']:6.1f} trained tok/s  peak RSS {r['peak_rss_gib']:.2f} GiB", flush=True)
    summary = {"model": args.model, "config": vars(args), **results,
               "speedup": results["per_output"]["seconds"] / results["transcript"]["seconds"],
               "forwarded_ratio": results["per_output"]["forwarded_tokens"] / results["transcript"]["forwarded_tokens"]}
    print(f"transcript layout: {summary['speedup']:.2f}x faster, forwards {summary['forwarded_ratio']:.2f}x fewer tokens")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
