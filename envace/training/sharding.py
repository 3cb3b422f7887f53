"""Sharded training (`--sharding fsdp2`): torch's FSDP2 `fully_shard` over the processes of an
`accelerate launch` or `torchrun`, each decoder layer and then the root, as accelerate's FSDP2
plugin wraps a model. Parameters, gradients and AdamW's moments are split over the processes;
each layer's weights are all-gathered for its forward and backward and resharded after.

envace shards the model itself rather than through accelerate's plugin, because accelerate
turns FSDP on only for GPU-like devices: the same code then runs on CPU processes (gloo), where
it is tested, and on GPUs (NCCL). What a sharded trainer cannot do with its own module, and what
this module does instead:
- sample rollouts: every forward is a collective, so all processes would have to decode in
  lockstep. Each process samples from a full copy (`UnshardedCopy`, unsharded, no gradients),
  brought to the trained weights after every optimizer step (gathered parameter by parameter);
  the copy is what `Generator.sync_weights` receives, as an unsharded trainer's own module is;
- run different numbers of micro-batches per process: forward and backward all-gather, so
  every process runs as many as the busiest (`lockstep_count`, padding micro-batches of zero
  loss);
- save or load `save_pretrained` files and optimizer states directly: the copy (gathered)
  writes the model files in an unsharded run's layout, and `FullOptimizerState` gathers
  AdamW's state to the main process (and scatters it back on resume).

`--sharding deepspeed-zero3` (envace/training/zero3.py) uses the same copy, lockstep and
checkpoint layout; the functions here pick per model (`is_zero3`) or per parameter
(`zero3.is_partitioned`) what differs: DeepSpeed's engine, backward, step and full-value calls.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from envace.config import ConfigError


def is_sharded(model: Any) -> bool:
    """FSDP2 (`fully_shard`) or a DeepSpeed ZeRO-3 engine (`envace.training.zero3`)."""
    from torch.distributed.fsdp import FSDPModule

    from envace.training.zero3 import is_zero3

    return isinstance(model, FSDPModule) or is_zero3(model)


def _module(model: Any) -> torch.nn.Module:
    """The model a sharding wrapper holds: a ZeRO-3 engine's module (fully_shard shards in place)."""
    from envace.training.zero3 import is_zero3

    return model.module if is_zero3(model) else model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer blocks: the modules whose class Hugging Face marks as not to be
    split (`_no_split_modules`, e.g. LlamaDecoderLayer), under a PEFT wrapper too."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ConfigError(f"--sharding fsdp2: {type(base).__name__} names no decoder layer class (_no_split_modules); "
                          "shard it yourself or train without --sharding")
    return layers


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """Shard `model` in place over the default process group: each decoder layer is one FSDP
    unit (its weights gathered for its own forward/backward only), the root holds the rest
    (embeddings, final norm, LM head). Parameters must already be on this process's device."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("--sharding fsdp2 needs a distributed launch (accelerate launch or torchrun)")
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
    return model


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    from envace.training import zero3

    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    return zero3.full_value(tensor) if zero3.is_partitioned(tensor) else tensor


def _set_full(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    from envace.training import zero3

    if isinstance(param, DTensor):
        param.copy_(distribute_tensor(value.to(param.device), param.device_mesh, param.placements))
    elif zero3.is_partitioned(param):
        zero3.set_full_value(param, value)
    else:
        param.copy_(value)


class UnshardedCopy:
    """A full, unsharded, gradient-free copy of a sharded model for the rollout engines.

    Made before sharding (`UnshardedCopy.of(model)`), so both hold the same weights; afterwards
    `refresh(sharded, version)` all-gathers the trainable parameters into it (frozen ones, e.g. the base
    of a LoRA model, never change). It is a collective: every process calls it at the same point.
    `load_into(sharded)` goes the other way, after a checkpoint was loaded into the copy."""

    def __init__(self, module: torch.nn.Module, version: int = 0):
        self.module = module
        self.version = version  # the optimizer steps behind the copy's weights

    @classmethod
    def of(cls, model: torch.nn.Module) -> "UnshardedCopy":
        module = copy.deepcopy(model)
        module.requires_grad_(False)
        module.eval()
        return cls(module)

    def _pairs(self, sharded: torch.nn.Module) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        # fully_shard and ZeRO-3 keep the module tree and parameter names, so the two enumerate alike.
        mine, theirs = dict(self.module.named_parameters()), dict(_module(sharded).named_parameters())
        if mine.keys() != theirs.keys():
            raise RuntimeError("the rollout copy no longer matches the sharded model's parameters")
        return [(mine[name], theirs[name]) for name in theirs]

    @torch.no_grad()
    def refresh(self, sharded: torch.nn.Module, version: int) -> None:
        for mine, theirs in self._pairs(sharded):
            if theirs.requires_grad:
                mine.copy_(_full(theirs))
        self.version = version

    @torch.no_grad()
    def load_into(self, sharded: torch.nn.Module) -> None:
        for mine, theirs in self._pairs(sharded):
            _set_full(theirs, mine.detach())


class FullOptimizerState:
    """A sharded model's optimizer state in one piece, for checkpoints: `state_dict()` gathers it
    onto the main process (parameters named, as `torch.distributed.checkpoint` writes them;
    the other processes get an empty dict), `load_state_dict(state)` shards it back. Both are
    collectives."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state, options=StateDictOptions(full_state_dict=True))


def checkpointed_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """What a checkpoint saves and restores for `optimizer` (`state_dict` / `load_state_dict`):
    the optimizer itself, or for a sharded model its state in one piece."""
    from envace.training.zero3 import ZeroOptimizerState, is_zero3

    if is_zero3(model):
        return ZeroOptimizerState(model)
    return FullOptimizerState(model, optimizer) if is_sharded(model) else optimizer


def backward(accelerator: Any, model: Any, loss: torch.Tensor) -> None:
    """One micro-batch's backward: through the ZeRO-3 engine, which reduce-scatters the gradients
    into its partitions, or through accelerate (DDP, FSDP2)."""
    from envace.training.zero3 import is_zero3

    if is_zero3(model):
        model.backward(loss)
    else:
        accelerator.backward(loss)


def clip_and_step(model: Any, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
    """Clip the trained parameters' gradients by their global norm and step the optimizer; the
    norm before clipping. Over every shard: torch computes the norm on FSDP2's DTensors (each
    process's partial norm, reduced); a ZeRO-3 engine clips in its own step."""
    from envace.training import zero3

    if zero3.is_zero3(model):
        return zero3.step(model)
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_norm)
    optimizer.step()
    return float(_full(norm))


def lockstep_count(count: int) -> int:
    """The largest `count` over the processes: how many forwards each must run so that none
    waits in an all-gather the others never join."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return count
    value = torch.tensor([count], dtype=torch.long, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())
