"""Runs under `python -m torch.distributed.run --nproc_per_node 2 tests/zero3_worker.py OUT`
(tests/test_sharding.py): one optimizer step of the training loss path (`sequence_logprobs` +
`ppo_loss`, a plain and a prefix-packed micro-batch accumulated, activation checkpointing on)
through envace's DeepSpeed ZeRO-3 engine (`envace.training.zero3.shard`) on CPU processes (gloo).
Every process trains on the same rows, so the averaged gradients are one process's. Rank 0 writes,
per case, what the test compares with one unsharded process taking the same step: logprobs, the
full gradients before the step, the gradient norm, the weights after it (gathered into an
`UnshardedCopy`) and AdamW's state in one piece (`ZeroOptimizerState`)."""

import contextlib
import sys

import torch
import torch.distributed as dist

from envace.algorithms.losses import collate, pack_shared_prefixes, ppo_loss, sequence_logprobs
from tests.fsdp_worker import rows
from tests.test_algorithms import tiny_model
from tests.worker_exit import leave_together

# name -> (tiny_model overrides, LoRA rank, bf16 autocast)
CASES = {"untied": ({}, 0, False), "tied": ({"tie_word_embeddings": True}, 0, False), "tied-bf16": ({"tie_word_embeddings": True}, 0, True),
         "lora": ({}, 4, False)}
GRAD_CLIP = 0.05  # below the gradients' norm (the test checks), so that the step clips
LR = 1e-2


def model_for(case: str) -> torch.nn.Module:
    overrides, lora_r, _ = CASES[case]
    torch.manual_seed(0)
    model = tiny_model(**overrides)
    if lora_r:
        from peft import LoraConfig, get_peft_model

        # init_lora_weights=False: both adapter matrices random, so both get gradients.
        model = get_peft_model(model, LoraConfig(r=lora_r, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def backward_both(model: torch.nn.Module, case: str, backward) -> list[torch.Tensor]:
    """Forward and `backward(loss)` over two micro-batches (plain rows, then the same rows packed),
    accumulating; their logprobs."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if CASES[case][2] else contextlib.nullcontext()
    out = []
    for batch in (collate(rows(), pad_id=0), collate(pack_shared_prefixes(rows()), pad_id=0)):
        with autocast:
            logprobs, _ = sequence_logprobs(model, batch, chunk_size=4, temperature=0.7)
            loss, _ = ppo_loss(logprobs, batch.sampler_logprobs, batch.advantages, batch.loss_mask, dual_clip=3.0)
        backward(loss)
        out.append(logprobs.detach().float())
    return out


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)


def sharded_step(case: str) -> dict:
    from deepspeed.utils import safe_get_full_grad

    from envace.training import zero3
    from envace.training.sharding import UnshardedCopy, backward, checkpointed_optimizer, clip_and_step

    model = model_for(case)
    copy = UnshardedCopy.of(model)
    opt = optimizer(model)
    engine = zero3.shard(model, opt, GRAD_CLIP)
    logprobs = backward_both(engine, case, lambda loss: backward(None, engine, loss))
    trained = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    grads = {n: safe_get_full_grad(p).clone() for n, p in trained}
    norm = clip_and_step(engine, opt, GRAD_CLIP)
    copy.refresh(engine, version=1)
    held = sum(zero3.local_numel(p) for p in engine.module.parameters())
    return {"logprobs": logprobs, "grads": grads, "grad_norm": norm, "weights": {n: p.clone() for n, p in copy.module.named_parameters()},
            "optimizer": checkpointed_optimizer(engine, opt).state_dict(), "held": held, "total": sum(p.numel() for p in copy.module.parameters())}


def main(out: str) -> None:
    dist.init_process_group("gloo")
    results = {case: sharded_step(case) for case in CASES}
    if dist.get_rank() == 0:
        torch.save(results, out)
    leave_together()


if __name__ == "__main__":
    main(*sys.argv[1:])
