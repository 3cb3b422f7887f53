"""Runs under `python -m torch.distributed.run --nproc_per_node N tests/ddp_worker.py KIND TASKS OUT`
(tests/test_training.py): SFT or GRPO on the tiny model, as `accelerate launch` would run it on
N GPUs, here with N CPU processes (gloo), replicated (DDP) or sharded (FSDP2). GRPO prints each
rank's parameter checksum."""

import sys
from pathlib import Path

import torch

from envace.config import build
from envace.training.sft import SFTConfig, run_sft
from envace.training.trainer import TrainConfig, Trainer


def varied(task, traj, ctx):
    """A reward that differs between rollouts (the tiny model never solves a task), so that
    every GRPO step has advantages and really updates."""
    return float(sum(traj.token_ids) % 2), {}


def varied_on_rank_0(task, traj, ctx):
    """`varied` on process 0, 0 on the others: every other process's groups score alike, so all
    its rows have advantage 0 and are left out of its update, which is then padding only."""
    return varied(task, traj, ctx) if torch.distributed.get_rank() == 0 else (0.0, {})


def main(kind: str, tasks: str, out: str, sharding: str = "none", steps: str = "2", lora_r: str = "0", reward: str = "tests.ddp_worker:varied",
         rehearse_sft_coef: str = "0") -> None:
    """`sharding` (none = DDP, fsdp2); `steps`, `lora_r`, `reward` and `rehearse_sft_coef` apply to GRPO, where a run
    directory that holds checkpoints is resumed. GRPO also prints how many parameter elements this rank holds."""
    if kind == "sft":
        # fp32: the test compares weights at 1e-4, and bf16 rounding depends on how rows split into micro-batches.
        run_sft(build(SFTConfig, dict(tiny=True, tasks=tasks, epochs=2, rows_per_step=4, lr=3e-3, precision="fp32", output_dir=out, sharding=sharding,
                                      progress=False, tensorboard=False)))
        return
    resume = Path(out, "checkpoints").is_dir()
    # fp32 here too: the tests compare weights at 1e-5, and under bf16 autocast (where the CPU has
    # it) ZeRO-3 LoRA ended 1.4e-5 from DDP LoRA after 2 steps, on this code and the code before it.
    cfg = build(TrainConfig, dict(tiny=True, tasks=tasks, steps=int(steps), precision="fp32", sharding=sharding, lora_r=int(lora_r), resume=resume, tasks_per_step=2, k=4, max_turns=2, max_turn_tokens=12, max_rehearse_tokens=8,
                                  max_total_tokens=400, reward=reward, rehearse_sft_coef=float(rehearse_sft_coef), progress=False, tensorboard=False, lr=1e-3, output_dir=out))
    trainer = Trainer(cfg)
    trainer.fit()
    model = trainer._full_models()["policy"]  # the gathered copy when sharded
    with torch.no_grad():
        checksum = float(sum(p.double().sum() for p in model.parameters()))
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in trainer.models.policy.parameters())
    print(f"rank {trainer.accelerator.process_index} checksum {checksum!r} held {held} of {sum(p.numel() for p in model.parameters())}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
