"""envace.training.sharding and the lockstep micro-batches it needs. The sharded runs themselves
(2 gloo processes, against DDP and one process) are in tests/test_training.py."""

import pytest
import torch

from envace.algorithms.losses import lockstep_micro_batches
from envace.config import ConfigError
from envace.training.sharding import UnshardedCopy, checkpointed_optimizer, decoder_layers, lockstep_count
from tests.test_algorithms import plain_row, tiny_model


def test_lockstep_pads_with_micro_batches_that_train_nothing():
    # Longest first within 10 padded tokens: [6] (6 + 5 would be 2 x 6 = 12), then [5, 2] (2 x 5 = 10).
    rows = [plain_row(list(range(1, n + 1)), 1) for n in (6, 5, 2)]
    alone = lockstep_micro_batches(rows, 10, pad_id=0)
    assert [[len(r.input_ids) for r in chunk] for chunk in alone] == [[6], [5, 2]]
    padded = lockstep_micro_batches(rows, 10, pad_id=0, lockstep=lambda n: 4)  # the busiest process has 4
    assert padded[:2] == alone and len(padded) == 4
    for (pad,) in padded[2:]:
        assert pad.input_ids == [0, 0] and pad.loss_mask == [0.0, 0.0] and pad.advantages == [0.0, 0.0]
    # A process with no rows still runs one micro-batch (it must join the gradient all-reduce).
    assert [[r.input_ids for r in chunk] for chunk in lockstep_micro_batches([], 10, pad_id=7)] == [[[7, 7]]]


def test_lockstep_count_of_a_single_process_is_its_own():
    assert lockstep_count(3) == 3


def test_decoder_layers_are_the_blocks_hugging_face_keeps_whole():
    from peft import LoraConfig, get_peft_model

    model = tiny_model()
    assert [type(m).__name__ for m in decoder_layers(model)] == ["LlamaDecoderLayer"] * 2
    wrapped = get_peft_model(tiny_model(), LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    assert len(decoder_layers(wrapped)) == 2
    with pytest.raises(ConfigError, match="_no_split_modules.*without --sharding"):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_unsharded_copy_takes_the_trained_parameters_only():
    """refresh copies what trains (frozen weights, a LoRA model's base, never change) and records
    the version; load_into goes the other way, for every parameter."""
    model = tiny_model()
    model.model.embed_tokens.weight.requires_grad_(False)
    copy = UnshardedCopy.of(model)
    assert not any(p.requires_grad for p in copy.module.parameters())
    with torch.no_grad():
        model.model.norm.weight.fill_(2.0)
        model.model.embed_tokens.weight.fill_(3.0)
    copy.refresh(model, version=5)
    assert copy.version == 5
    assert torch.equal(copy.module.model.norm.weight, torch.full((32,), 2.0))
    assert not torch.equal(copy.module.model.embed_tokens.weight, model.model.embed_tokens.weight)  # frozen: not copied
    with torch.no_grad():
        copy.module.model.norm.weight.fill_(-1.0)
    copy.load_into(model)
    assert torch.equal(model.model.norm.weight, torch.full((32,), -1.0))
    assert torch.equal(model.model.embed_tokens.weight, copy.module.model.embed_tokens.weight)


def test_an_unsharded_model_checkpoints_its_optimizer_as_is():
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters())
    assert checkpointed_optimizer(model, optimizer) is optimizer
