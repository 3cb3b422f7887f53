"""Runs under `python -m torch.distributed.run --nproc_per_node 2 tests/fsdp_worker.py OUT`
(tests/test_algorithms.py): the training loss path (`sequence_logprobs` + `ppo_loss`, plain and
prefix-packed rows) through torch's FSDP2 `fully_shard` on CPU processes (gloo), the way
accelerate's FSDP2 plugin shards a model: each decoder layer, then the root, with
`reshard_after_forward=True` (so the root's parameters, the LM head among them, are sharded
again once the forward returns). Rank 0 writes the logprobs and the full gradients to OUT for
the test to compare with one unsharded process."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from envace.algorithms.losses import collate, pack_shared_prefixes, ppo_loss, sequence_logprobs
from tests.test_algorithms import plain_row, tiny_model
from tests.worker_exit import leave_together

CASES = {"untied": {}, "tied": {"tie_word_embeddings": True}}


def rows() -> list:
    """Two rows sharing a 6-token prompt (one prefix group, packed) and a row of its own."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(1, 128, (6,), generator=g).tolist()
    tails = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (5, 3, 9)]
    return [plain_row(prompt + tails[0], 6, group=0, adv=1.0, old=-4.8), plain_row(prompt + tails[1], 6, group=0, adv=-0.5, old=-4.9),
            plain_row(tails[2], 2, adv=0.7, old=-4.85)]


def loss_and_grads(model: torch.nn.Module, packed: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    batch = collate(pack_shared_prefixes(rows()) if packed else rows(), pad_id=0)
    logprobs, _ = sequence_logprobs(model, batch, chunk_size=4, temperature=0.7)
    loss, _ = ppo_loss(logprobs, batch.sampler_logprobs, batch.advantages, batch.loss_mask, dual_clip=3.0)
    loss.backward()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return logprobs.detach(), grads


def main(out: str) -> None:
    dist.init_process_group("gloo")
    results = {}
    for name, overrides in CASES.items():
        model = tiny_model(**overrides)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        for layer in model.model.layers:
            fully_shard(layer, reshard_after_forward=True)
        fully_shard(model, reshard_after_forward=True)
        for packed in (False, True):
            results[f"{name}/{'packed' if packed else 'plain'}"] = loss_and_grads(model, packed)
    if dist.get_rank() == 0:
        torch.save(results, out)
    leave_together()


if __name__ == "__main__":
    main(*sys.argv[1:])
