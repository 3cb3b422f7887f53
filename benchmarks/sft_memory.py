"""Resident memory over the demo's SFT stage (`envace demo`'s warm start) under one setting.

Runs the demo's SFT config in this process with a thread sampling VmRSS / VmHWM every 0.5 s,
and prints and writes (OUT/mem.json) the memory at each logged step, the stage's peak, seconds
and last losses. One setting per run, so that each peak is its own process's:

    OMP_NUM_THREADS=1 python benchmarks/sft_memory.py --out /tmp/mem/bf16 --precision bf16 --no-activation-checkpointing
    OMP_NUM_THREADS=1 python benchmarks/sft_memory.py --out /tmp/mem/fp32 --precision fp32 --no-activation-checkpointing
    OMP_NUM_THREADS=1 python benchmarks/sft_memory.py --out /tmp/mem/bf16ac --precision bf16   # the demo's setting
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import threading
import time
from pathlib import Path


def memory_gib() -> dict[str, float]:
    """This process's current (VmRSS) and peak (VmHWM) resident memory."""
    out = {}
    for line in open("/proc/self/status"):
        if line.startswith(("VmRSS", "VmHWM")):
            key, value = line.split(":")
            out[key] = int(value.split()[0]) / 2**20
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--precision", choices=["fp32", "bf16"], required=True)
    p.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args()
    from envace.demo import DemoConfig, sft_config
    from envace.training.sft import run_sft

    out = Path(args.out)
    cfg = dataclasses.replace(sft_config(DemoConfig(output_dir=str(out), progress=False), out / "sft"),
                              precision=args.precision, activation_checkpointing=args.activation_checkpointing)
    samples: list[tuple[float, dict[str, float]]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append((time.time(), memory_gib()))
            time.sleep(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    run_sft(cfg)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    steps = [json.loads(line) for line in (out / "sft" / "metrics.jsonl").read_text().splitlines()]
    per_step = []
    for s in steps:  # the last sample taken before the step was logged
        before = [m for t, m in samples if t <= s["time"]]
        if before:
            per_step.append({"step": s["step"], "rss_gib": round(before[-1]["VmRSS"], 2), "peak_gib": round(before[-1]["VmHWM"], 2)})
    result = {"precision": args.precision, "activation_checkpointing": args.activation_checkpointing, "seconds": round(seconds, 1),
              "peak_gib": round(samples[-1][1]["VmHWM"], 2), "last_losses": [round(s["sft/loss"], 4) for s in steps[-3:]], "per_step": per_step}
    (out / "mem.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "per_step"}))


if __name__ == "__main__":
    main()
