"""Sharded training with DeepSpeed ZeRO-3 (`--sharding deepspeed-zero3`, the `deepspeed` extra):
parameters, gradients and AdamW's moments split over the processes of an `accelerate launch` or
`torchrun`, each module's parameters all-gathered for its own forward and backward (DeepSpeed's
hooks on every submodule, the LM head's among them: `sequence_logprobs` calls the head as a
module inside the forward, so its hooks gather it there).

envace builds the engine itself (`deepspeed.initialize`) rather than through accelerate's
DeepSpeed plugin, for the reason it applies FSDP2 itself (envace/training/sharding.py):
accelerate turns DeepSpeed on only for GPU-like devices (`Accelerator(cpu=True)` ignores it),
and its DeepSpeed `backward` steps the optimizer inside the last micro-batch's backward, where
envace runs a number of micro-batches that varies per step and clips and steps once after them.
So the code that runs on GPUs (NCCL) is the code the CPU tests (gloo) run.

What the ZeRO-3 engine does differently from the FSDP2 path, and what this module provides:
- precision: the engine keeps fp32 parameters (no DeepSpeed `bf16` section) and envace's own
  autocast computes in bf16, as for every other `--sharding`, so the sharded run computes what
  the unsharded one does;
- gradients live in the engine's partitions, not in `.grad`: the engine reduce-scatters after
  every backward (accumulating into its partitions), clips by the global norm in its `step()`
  (`gradient_clipping`) and reports that norm (`step`);
- parameters and optimizer states are read and written whole through DeepSpeed's
  `safe_get/set_full_*` calls (`full_value`, `set_full_value`, `ZeroOptimizerState`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from envace.config import ConfigError

INSTALL = "pip install 'envace[deepspeed]' (deepspeed==0.19.8)"


def require_deepspeed() -> None:
    """Fail before any model loads when DeepSpeed, an optional extra, cannot be imported."""
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"--sharding deepspeed-zero3 needs DeepSpeed, which is not importable here ({e}): {INSTALL}, "
                          "or shard with --sharding fsdp2 (torch only)") from e


def is_zero3(model: Any) -> bool:
    """Whether `model` is a DeepSpeed engine. DeepSpeed is imported only by `shard`, so a run
    that never sharded with it does not pay for its import here."""
    deepspeed = sys.modules.get("deepspeed")
    return deepspeed is not None and isinstance(model, deepspeed.DeepSpeedEngine)


def engine_config(grad_clip: float) -> dict[str, Any]:
    return {
        # envace forms micro-batches by tokens and steps once per training step: DeepSpeed's
        # batch sizes only feed its own counters. With one accumulation step every backward
        # reduce-scatters its gradients into the partitions, and the backwards of one training
        # step accumulate there until `step()` (DeepSpeed's micro-step counter).
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": 3},
        "steps_per_print": sys.maxsize,  # envace logs its own metrics
    }


def shard(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float) -> Any:
    """The ZeRO-3 engine over `model` (partitioned in place over the default process group) and
    `optimizer` (built on the full parameters; the engine re-points it at its fp32 partitions)."""
    import deepspeed
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("--sharding deepspeed-zero3 needs a distributed launch (accelerate launch or torchrun)")
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=engine_config(grad_clip))
    return engine


def step(engine: Any) -> float:
    """Clip (by the norm over every partition) and step; the norm before clipping."""
    engine.step()
    return float(engine.get_global_grad_norm())


def is_partitioned(param: torch.nn.Parameter) -> bool:
    return hasattr(param, "ds_id")


def local_numel(param: torch.nn.Parameter) -> int:
    """How many of the parameter's elements this process holds."""
    return param.ds_tensor.numel() if is_partitioned(param) else param.numel()


@torch.no_grad()
def full_value(param: torch.nn.Parameter) -> torch.Tensor:
    """A trained parameter's whole fp32 value (its master copy in the optimizer). A collective."""
    from deepspeed.utils import safe_get_full_fp32_param

    return safe_get_full_fp32_param(param)


@torch.no_grad()
def set_full_value(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Write a whole value into a partitioned parameter: the module's partition (read by the
    forward) and, for a trained one, the optimizer's fp32 master (which `step` copies back into
    the module). A collective."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param

    with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
        param.copy_(value)
    if param.requires_grad:
        safe_set_full_fp32_param(param, value.to(torch.float32))


class ZeroOptimizerState:
    """A ZeRO-3 engine's optimizer state in one piece, laid out as `FullOptimizerState` writes
    FSDP2's (state by parameter name, `param_groups` naming them): `state_dict()` gathers it (the
    main process gets it, the others an empty dict), `load_state_dict(state)` partitions it back.
    Both are collectives."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.inner = engine.optimizer.optimizer  # the torch optimizer, stepping the fp32 partitions

    def _trained(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.engine.module.named_parameters() if p.requires_grad]

    def state_dict(self) -> dict[str, Any]:
        import torch.distributed as dist
        from deepspeed.utils import safe_get_full_optimizer_state

        flat_states = list(self.inner.state.values())
        keys = sorted(k for k in flat_states[0] if k != "step")
        step = flat_states[0]["step"]
        state = {name: {"step": step.clone()} | {k: safe_get_full_optimizer_state(p, k).cpu() for k in keys} for name, p in self._trained()}
        names = [name for name, _ in self._trained()]
        groups = [{k: v for k, v in g.items() if k != "params"} | {"params": names} for g in self.inner.param_groups]
        return {"state": state, "param_groups": groups} if dist.get_rank() == 0 else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from deepspeed.utils import safe_set_full_optimizer_state

        saved = state["state"]
        first = next(iter(saved.values()))
        keys = [k for k in first if k != "step"]
        # torch's AdamW creates its state at its first step; before that ZeRO-3's setters have
        # nothing to write into, so the state of each fp32 partition is made here as AdamW makes it.
        for flat in self.engine.optimizer.fp32_partitioned_groups_flat:
            self.inner.state[flat] = {"step": first["step"].clone()} | {k: torch.zeros_like(flat) for k in keys}
        for name, p in self._trained():
            for k in keys:
                safe_set_full_optimizer_state(p, saved[name][k].to(torch.float32), k)
        for group, saved_group in zip(self.inner.param_groups, state["param_groups"]):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
