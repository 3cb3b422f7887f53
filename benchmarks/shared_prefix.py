"""Shared-prefix forward (Prefix Grouper): one GRPO group's K rows forwarded separately vs
packed into one row [prefix | cont_1 | ... | cont_K], on the real default model.

    python benchmarks/shared_prefix.py                      # K=4, 700-token prefix, 500-token continuations
    python benchmarks/shared_prefix.py --k 8 --reps 5
    python benchmarks/shared_prefix.py --precision bf16     # under torch.autocast(bfloat16), fp32 master weights

Tokens are real text (the repository's docs, tokenized), the prefix untrained and every
continuation token trained, as in a group of rollouts of one task. Each repetition times one
forward+backward of the PPO loss over the group both ways, alternating which goes first; the
script also checks, in the same run, that both give the same logprobs and gradients.
Prints one JSON object (and writes it with --out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

from envace.algorithms.losses import (Row, collate, forwarded_tokens, pack_shared_prefixes, ppo_loss, sequence_logprobs,
                                      unit_length, unit_rows)
from envace.backends import load_model
from envace.training.setup import micro_batches

ROOT = Path(__file__).resolve().parents[1]


def group_rows(tokenizer, k: int, prefix: int, cont: int) -> list[Row]:
    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = tokenizer.encode(text)
    if len(ids) < prefix + k * cont:
        ids = ids * (1 + (prefix + k * cont) // len(ids))
    head = ids[:prefix]
    rows = []
    for i in range(k):
        tail = ids[prefix + i * cont : prefix + (i + 1) * cont]
        n = prefix + cont
        mask = [0.0] * prefix + [1.0] * cont
        rows.append(Row(head + tail, [0] * n, mask, [(1.0 if i % 2 else -1.0) * m for m in mask], [0.0] * n, prefix_group=0))
    return rows


def step(model, units, pad_id: int, max_tokens: int, total: float, autocast, keep: bool = False):
    """One forward+backward over `units`; seconds, each row's logprobs by id, and (with keep) the grads."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    logprobs = {}
    for chunk in micro_batches(units, max_tokens):
        batch = collate(chunk, pad_id)
        with autocast():
            lp, _ = sequence_logprobs(model, batch)
            loss, _ = ppo_loss(lp, lp.detach(), batch.advantages, batch.loss_mask, num_tokens=total)  # the trainer's on-policy ratio
        loss.backward()
        logprobs |= {id(r): lp[i, 1 : len(r.input_ids)].detach() for i, r in enumerate(unit_rows(chunk))}
    seconds = time.perf_counter() - start
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None} if keep else None
    return seconds, logprobs, grads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--prefix", type=int, default=700)
    p.add_argument("--cont", type=int, default=500)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="bf16: forward under torch.autocast(bfloat16), fp32 weights")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, device="cpu", dtype=torch.float32)
    pad = tokenizer.pad_token_id
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if args.precision == "bf16" else contextlib.nullcontext
    rows = group_rows(tokenizer, args.k, args.prefix, args.cont)
    packed = pack_shared_prefixes(rows)
    total = float(sum(sum(r.loss_mask) for r in rows))
    model.train()
    # Correctness in the same run: the same per-token logprobs and parameter gradients.
    _, plain_lp, plain_grads = step(model, rows, pad, args.micro_batch_tokens, total, autocast, keep=True)
    _, packed_lp, packed_grads = step(model, packed, pad, args.micro_batch_tokens, total, autocast, keep=True)
    max_lp_diff = max((plain_lp[i] - packed_lp[i]).abs().max().item() for i in plain_lp)
    max_grad_rel = max(((plain_grads[n] - packed_grads[n]).abs().max() / plain_grads[n].abs().max().clamp(min=1e-30)).item() for n in plain_grads)
    times: dict[str, list[float]] = {"separate": [], "packed": []}
    for rep in range(args.reps):
        order = [("separate", rows), ("packed", packed)]
        for name, units in order if rep % 2 == 0 else order[::-1]:
            times[name].append(step(model, units, pad, args.micro_batch_tokens, total, autocast)[0])
    sep, pk = statistics.median(times["separate"]), statistics.median(times["packed"])
    padded = lambda units: sum(len(mb) * max(map(unit_length, mb)) for mb in micro_batches(units, args.micro_batch_tokens))  # noqa: E731
    result = {
        "model": args.model, "precision": args.precision, "k": args.k, "prefix_tokens": args.prefix, "continuation_tokens": args.cont, "threads": args.threads,
        "micro_batch_tokens": args.micro_batch_tokens,
        "forwarded_tokens": {"separate": forwarded_tokens(rows), "packed": forwarded_tokens(packed)},
        "padded_tokens": {"separate": padded(rows), "packed": padded(packed)},
        "seconds_fwd_bwd": {k: [round(t, 3) for t in v] for k, v in times.items()},
        "median_s": {"separate": round(sep, 3), "packed": round(pk, 3)},
        "speedup": round(sep / pk, 3),
        "forwarded_ratio": round(forwarded_tokens(rows) / forwarded_tokens(packed), 3),
        "max_abs_logprob_diff": max_lp_diff, "max_rel_grad_diff": max_grad_rel,
    }
    print(f"shared-prefix forward ({args.precision}): {result['forwarded_ratio']:.2f}x fewer forwarded tokens at K={args.k} "
          f"({result['forwarded_tokens']['separate']} -> {result['forwarded_tokens']['packed']}), "
          f"forward+backward {result['speedup']:.2f}x faster ({sep:.2f} s -> {pk:.2f} s, median of {args.reps})")
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
