"""Where `envace train`'s update goes (issue #11: the update is at 31% of the bf16 matmul peak), against
the matmul peak of the precision it runs in.

One GRPO step of the demo's settings (2 tasks x K = 4, rehearse mode, the step benchmark's
alternating reward so every group trains), then the trainer's own update of those rollouts,
twice (the first allocates AdamW's state), each phase timed: the forward+backward (the PPO
ratio's old logprobs are its own, detached: no recompute forward), gradient clipping + AdamW. Then
the same forward+backward under torch.profiler, its CPU time split into weight matmuls,
attention and the rest, against this run's own matmul peak:

    python benchmarks/update_profile.py --init-from runs/ws24/sft/final   # ~3 min; writes benchmarks/results/update_profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))  # step_speed (its machine peak and reward)

import step_speed  # noqa: E402
from envace.config import build  # noqa: E402
from envace.training import trainer as trainer_mod  # noqa: E402
from envace.training.setup import resolve_precision  # noqa: E402
from envace.training.trainer import TrainConfig, Trainer  # noqa: E402

RESULTS = Path("benchmarks/results/update_profile.json")
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int8pack_mm")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


class PhaseTimer:
    """Wraps the trainer module's update phases and records each call's seconds."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {}
        self.last_call: dict[str, tuple] = {}

    def wrap(self, name: str, attr: str) -> None:
        fn = getattr(trainer_mod, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds.setdefault(name, []).append(time.perf_counter() - start)
            self.last_call[name] = (fn, args, kwargs)
            return out

        setattr(trainer_mod, attr, timed)


def op_split(prof: Any) -> dict[str, float]:
    """Self CPU seconds of the weight matmuls, the attention kernels and everything else."""
    split = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for event in prof.key_averages():
        kind = "matmul" if event.key in MATMUL_OPS else "attention" if event.key in ATTENTION_OPS else "other"
        split[kind] += event.self_cpu_time_total / 1e6
    return split


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--init-from", default=None)
    p.add_argument("--micro-batch-tokens", type=int, default=1024, help="the demo's")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    timer = PhaseTimer()
    for name, attr in (("forward+backward", "backward_micro_batches"), ("clip+AdamW", "clip_and_step")):
        timer.wrap(name, attr)
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = build(TrainConfig, dict(model=args.model, init_from=args.init_from, variant="envace", tasks_per_step=2, k=4, lr=1e-5, difficulty=1, seed=0,
                                      reward="step_speed:alternating", rollout=dict(max_turn_tokens=96, max_rehearse_tokens=128),
                                      micro_batch_tokens=args.micro_batch_tokens, steps=1, progress=False, tensorboard=False, output_dir=run_dir))
        trainer = Trainer(cfg)
        model = trainer.models.trained["policy"]
        results: dict[str, Any] = {"command": " ".join(["python", *sys.argv]), "machine": step_speed.machine(model)}
        tasks = trainer.stream.take(cfg.tasks_per_step)
        groups = trainer.rollout(tasks)
        trainer.score(tasks, groups)
        updates = []
        for _ in range(2):
            start = time.perf_counter()
            metrics = trainer.update(groups)
            updates.append(time.perf_counter() - start)
        forwarded = metrics["policy/forwarded_tokens"]
        fn, fargs, fkwargs = timer.last_call["forward+backward"]
        from torch.profiler import ProfilerActivity, profile

        model.zero_grad(set_to_none=True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            fn(*fargs, **fkwargs)
            profiled = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
    split = op_split(prof)
    total = sum(split.values())
    # The peak of the numerics the update runs in (bf16 autocast where the CPU has it, else fp32),
    # measured before and after the update: on a shared machine one measurement fell to 0.5x.
    precision = resolve_precision(cfg.precision)
    peaks = [results["machine"][f"matmul_gflops_{precision}"], step_speed.machine(model)[f"matmul_gflops_{precision}"]]
    peak = max(peaks)
    head = model.get_output_embeddings().weight.numel()
    # Forward + backward: 6 FLOPs per matmul parameter per token it runs on: the decoder's on every
    # forwarded token, the LM head's on the trained ones only (`sequence_logprobs(trained_only=True)`).
    flops = 6 * ((results["machine"]["matmul_params"] - head) * forwarded + head * metrics["policy/trained_tokens"])
    results |= {
        "precision": precision, "matmul_peak_gflops_before_after": peaks, "forwarded_tokens": forwarded, "update_seconds": updates, "phase_seconds": timer.seconds,
        "profiled_forward_backward_seconds": profiled, "self_cpu_seconds": split,
        "matmul_gflops_in_kernels": flops / split["matmul"] / 1e9,
        "forward_backward_gflops": flops / min(timer.seconds["forward+backward"]) / 1e9,
        "top_ops": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(results["top_ops"])
    phases = ", ".join(f"{k} {', '.join(f'{s:.2f}' for s in v)} s" for k, v in timer.seconds.items())
    print(f"{precision} matmul peak {peak:.0f} GFLOP/s (before / after: {peaks[0]:.0f} / {peaks[1]:.0f}); update of {forwarded:.0f} forwarded tokens: {', '.join(f'{s:.1f}' for s in updates)} s ({phases})")
    print(f"forward+backward self CPU: " + ", ".join(f"{k} {v:.2f} s ({v / total:.0%})" for k, v in split.items()))
    print(f"matmul kernels at {results['matmul_gflops_in_kernels']:.0f} GFLOP/s ({results['matmul_gflops_in_kernels'] / peak:.0%} of peak); "
          f"forward+backward overall {results['forward_backward_gflops']:.0f} GFLOP/s ({results['forward_backward_gflops'] / peak:.0%})")


if __name__ == "__main__":
    main()
