"""What SFT and GRPO share: model loading (full or LoRA), optimizer and schedule, accelerate,
micro-batching by token budget, and the run directory (config, checkpoints, metrics)."""

from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import numpy as np
import torch
import yaml

from envace import config as cfgmod
from envace.config import ConfigError, field
from envace.backends.models import native_bf16, warn_if_bf16_is_emulated
from envace.algorithms.losses import PackedRows, Row, budget_micro_batches, collate, lockstep_micro_batches, pack_shared_prefixes


@dataclass
class TrainingOptions:
    """Options every training command has (SFT and GRPO configs inherit them)."""

    model: str = field("default", help="model to train: 'default', a local directory or a .gguf file")
    tiny: bool = field(False, help="train a tiny random model over the model's tokenizer (smoke tests)")
    lora_r: int = field(0, help="LoRA rank; 0 = full fine-tuning")
    lora_alpha: int = field(32, help="LoRA alpha")
    lr: float = field(1e-5, help="AdamW learning rate")
    weight_decay: float = field(0.01, help="AdamW weight decay")
    grad_clip: float = field(1.0, help="max gradient norm")
    schedule: Literal["constant", "cosine"] = field("constant", help="learning-rate schedule")
    warmup_steps: int = field(0, help="linear warm-up steps")
    micro_batch_tokens: int = field(4096, help="padded tokens per micro-batch (gradient accumulation above it)")
    precision: Literal["auto", "fp32", "bf16"] = field(
        "auto", help="forward/backward precision: bf16 autocast over fp32 master weights, fp32, or auto = bf16 where the "
        "hardware computes it natively (a GPU with bf16, a CPU with avx512_bf16 or AMX), fp32 elsewhere")
    sharding: Literal["none", "fsdp2", "deepspeed-zero3"] = field(
        "none", help="none: every process holds the whole model (DDP under accelerate launch); fsdp2: parameters, gradients and "
        "optimizer state sharded over the processes (torch's fully_shard per decoder layer); deepspeed-zero3: the same split by "
        "DeepSpeed ZeRO-3 (pip install 'envace[deepspeed]'); docs/scaling.md")
    activation_checkpointing: bool = field(False, help="recompute each decoder layer's activations in the backward pass (less memory, about 1.3x the compute)")
    seed: int = field(0, help="random seed")
    output_dir: str | None = field(None, help="run directory (default runs/<command>-<time>)")
    resume: bool = field(False, help="continue the run in --output-dir from its last checkpoint")
    save_every: int = field(1, help="checkpoint every N steps")
    keep_last: int = field(2, help="checkpoints to keep")
    tensorboard: bool = field(True, help="write TensorBoard logs")
    wandb: bool = field(False, help="log to Weights & Biases")
    wandb_project: str | None = field(None, help="wandb project")
    progress: bool = field(True, help="show progress bars")

    def validate_training(self) -> None:
        from envace.backends.models import check_model_spec

        check_model_spec(self.model)
        for name in ("lr", "lora_alpha", "grad_clip", "micro_batch_tokens", "save_every", "keep_last"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        # The seed feeds numpy's SeedSequence (per-step sampling seeds), which takes no negatives.
        for name in ("lora_r", "warmup_steps", "weight_decay", "seed"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.resume and not self.output_dir:
            raise ConfigError("--resume needs --output-dir (the run to continue)")
        if self.precision == "bf16":
            warn_if_bf16_is_emulated("--precision bf16")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_precision(precision: str) -> str:
    return ("bf16" if native_bf16() else "fp32") if precision == "auto" else precision


def make_accelerator(precision: str = "auto") -> Any:
    """The accelerate object: bf16 autocast or fp32 (`resolve_precision`), on GPU or CPU;
    multi-GPU when started with `accelerate launch`."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    mixed = {"bf16": "bf16", "fp32": "no"}[resolve_precision(precision)]
    shared = AcceleratorState._shared_state
    if shared and shared.get("_mixed_precision", mixed) != mixed:
        # accelerate keeps one precision per process; a second run in the same process (tests,
        # a benchmark comparing precisions) may choose another. The process group is kept.
        AcceleratorState._reset_state(reset_partial_state=False)
    return Accelerator(mixed_precision=mixed, cpu=not torch.cuda.is_available())


def load_trainable(spec: str, lora_r: int, lora_alpha: int, device: Any, tiny: bool = False,
                   activation_checkpointing: bool = False) -> tuple[Any, Any]:
    """(model, tokenizer) in fp32 master weights; wrapped with a LoRA adapter when lora_r > 0.
    `tiny=True` builds a tiny random model over the spec's tokenizer (tests, smoke runs).
    `activation_checkpointing` keeps only each decoder layer's input for the backward pass."""
    from envace.backends.models import load_model, load_tokenizer, tiny_model

    if tiny:
        tokenizer = load_tokenizer(spec)
        model = tiny_model(tokenizer).to(device)
    else:
        model, tokenizer = load_model(spec, device=device, dtype=torch.float32)
    if lora_r > 0:
        from peft import LoraConfig, get_peft_model

        target = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=lora_r, lora_alpha=lora_alpha, target_modules=target, lora_dropout=0.0, task_type="CAUSAL_LM"))
    if activation_checkpointing:
        # Non-reentrant: works with frozen inputs (LoRA) and with the forward hook sequence_logprobs uses.
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model, tokenizer


def check_sharding(accelerator: Any, sharding: str) -> None:
    """Before any model loads: sharding splits the model over the processes of a distributed
    launch; ZeRO-3 needs the `deepspeed` extra. envace shards with DeepSpeed itself, so a launch
    with accelerate's DeepSpeed integration on (whose engine envace's loop does not drive) is refused."""
    import os

    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        raise ConfigError("this was launched with an accelerate config whose distributed_type is DEEPSPEED; envace runs DeepSpeed "
                          "itself: launch with distributed_type MULTI_GPU (configs/accelerate/deepspeed-zero3.yaml) and pass "
                          "--sharding deepspeed-zero3")
    if sharding == "deepspeed-zero3":
        from envace.training.zero3 import require_deepspeed

        require_deepspeed()
    if sharding != "none" and accelerator.num_processes == 1:
        raise ConfigError(f"--sharding {sharding} splits the model over the processes of a distributed launch, and this is one process: "
                          "start it with `accelerate launch --num_processes N` or `torchrun --nproc_per_node N`, or drop --sharding")


def prepare_trainable(accelerator: Any, model: torch.nn.Module, cfg: TrainingOptions, total_steps: int) -> tuple[Any, Any, Any, Any]:
    """(model, optimizer, scheduler, full copy or None) for a loaded model. Replicated: model and
    optimizer go through accelerate (DDP under `accelerate launch`). Sharded: a full copy is
    taken first, for rollouts and checkpoints; `fsdp2` shards the model in place
    (`envace.training.sharding`), `deepspeed-zero3` returns the ZeRO-3 engine as the model
    (`envace.training.zero3`; its torch optimizer, which the schedule drives, steps the engine's
    fp32 partitions). The scheduler steps once per training step whatever the number of processes."""
    from envace.training import zero3
    from envace.training.sharding import UnshardedCopy, shard

    if cfg.sharding == "fsdp2":
        copy = UnshardedCopy.of(model)  # before sharding: it starts from the same weights
        optimizer = make_optimizer(shard(model), cfg)
        return model, optimizer, make_scheduler(optimizer, cfg, total_steps), copy
    if cfg.sharding == "deepspeed-zero3":
        copy = UnshardedCopy.of(model)
        optimizer = make_optimizer(model, cfg)
        engine = zero3.shard(model, optimizer, cfg.grad_clip)
        return engine, optimizer, make_scheduler(optimizer, cfg, total_steps), copy
    model, optimizer = accelerator.prepare(model, make_optimizer(model, cfg))
    return model, optimizer, make_scheduler(optimizer, cfg, total_steps), None


def make_optimizer(model: torch.nn.Module, cfg: TrainingOptions) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay)


def make_scheduler(optimizer: Any, cfg: TrainingOptions, total_steps: int) -> Any:
    """Linear warm-up, then constant or cosine. Build it on the optimizer that `step()` is called on
    (after accelerate's prepare), so torch's step-order check sees the steps."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if cfg.schedule == "cosine":
            progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def micro_batches(rows: list[Row | PackedRows], max_tokens: int) -> Iterator[list[Row | PackedRows]]:
    """Group rows (longest first) so that rows x padded length stays within `max_tokens`.
    A packed group (`PackedRows`) counts as one row of its packed length; one longer than
    `max_tokens` is split into sub-packs of its continuations, each with the prefix."""
    return budget_micro_batches(rows, max_tokens)


def global_sum(accelerator: Any, value: float) -> float:
    """`value` summed over the processes of an `accelerate launch` (itself in one process)."""
    if accelerator.num_processes == 1:
        return value
    return float(accelerator.reduce(torch.tensor(float(value), device=accelerator.device), "sum"))


def shared_run_dir(accelerator: Any, output_dir: str | None, prefix: str) -> Path:
    """The run directory, named by the main process and broadcast: a timestamped default
    could differ between the processes of one `accelerate launch`."""
    name = [str(cfgmod.run_dir(output_dir, prefix)) if accelerator.is_main_process else None]
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(name)
    return Path(name[0])


def backward_micro_batches(accelerator: Any, model: Any, rows: list[Row | PackedRows], max_tokens: int, pad_id: int,
                           loss_fn: Callable[[Any], tuple[torch.Tensor, dict[str, float]]], share_prefix: bool = False) -> list[dict[str, float]]:
    """Forward and backward `loss_fn(batch) -> (loss, metrics)` over the micro-batches of `rows`;
    returns each micro-batch's metrics. Under DDP the gradients are all-reduced once, with the
    last micro-batch (`no_sync` before it), so processes holding different numbers of
    micro-batches stay in step; a process with no rows backpropagates a zero-loss padding row
    so that it still joins that all-reduce. A sharded model (`--sharding fsdp2`, `deepspeed-zero3`) all-gathers in
    every forward, so every process runs as many micro-batches as the busiest (padding ones of
    zero loss). `share_prefix` packs the rows of each
    `prefix_group` first (`pack_shared_prefixes`): one forward per micro-batch still, the same
    [B, T] batch for `loss_fn`, fewer forwarded tokens."""
    from envace.training.sharding import backward, is_sharded, lockstep_count

    units = pack_shared_prefixes(rows) if share_prefix else rows
    sharded = is_sharded(model)
    chunks = lockstep_micro_batches(units, max_tokens, pad_id, lockstep_count if sharded else None)
    metrics = []
    for i, chunk in enumerate(chunks):
        batch = collate(chunk, pad_id).to(accelerator.device)
        # FSDP2 and ZeRO-3 reduce-scatter after every micro-batch: deferring it would hold unsharded gradients.
        with contextlib.nullcontext() if sharded or i == len(chunks) - 1 else accelerator.no_sync(model):
            with accelerator.autocast():
                loss, m = loss_fn(batch)
            backward(accelerator, model, loss)
        metrics.append(m)
    return metrics


def check_resume(path: Path, cfg: Any, resume: bool) -> Path | None:
    """The checkpoint to resume from. A run dir that already has checkpoints must be resumed
    explicitly, and with the same config, so that nothing is silently overwritten or mixed."""
    from envace.training.checkpoint import latest_checkpoint

    latest = latest_checkpoint(path)
    if latest is None:
        return None
    if not resume:
        raise ConfigError(f"{path} already holds checkpoints; pass --resume to continue that run or choose another --output-dir")
    saved = yaml.safe_load((path / "config.yaml").read_text()) if (path / "config.yaml").is_file() else None
    current = cfgmod.to_dict(cfg)
    if saved is not None:
        # An option the saved run predates counts as its default (a newer envace resumes older runs).
        defaults = cfgmod.to_dict(type(cfg)())
        # Options that change where, how often or how visibly the run saves, not what it trains: a run
        # copied elsewhere resumes there, and --steps extends it (a constant schedule does not depend on it).
        free = {"resume", "progress", "output_dir", "save_every", "keep_last", "tensorboard", "wandb", "wandb_project", "steps"}
        if current.get("schedule") == "cosine":
            free.discard("steps")  # the cosine's learning rate at every step depends on the total
        changed = sorted(k for k in current if k not in free and saved.get(k, defaults.get(k)) != current[k])
        if changed:
            raise ConfigError(f"cannot resume {path}: options differ from the saved run: {', '.join(changed)}")
    return latest


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start
