"""Checkpoints: exact resume (weights, optimizer, scheduler, RNGs), retention, kill mid-save."""

import random

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from envace.training import checkpoint
from envace.training.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint


def tiny_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=True))


def trainer(seed: int):
    model = tiny_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step))
    return model, opt, sched


def train_step(model, opt, sched) -> None:
    # The batch depends on all three global RNGs, so a step after a bad RNG restore differs.
    length = 4 + random.randrange(3) + int(np.random.randint(0, 3))
    ids = torch.randint(1, 128, (2, length))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def save(run_dir, step, model, opt=None, sched=None, **kw):
    return save_checkpoint(run_dir, step, {"policy": model}, {"policy": opt.state_dict()} if opt else None,
                           {"policy": sched} if sched else None, **kw)


def test_resume_continues_exactly(tmp_path):
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    model, opt, sched = trainer(seed=0)
    train_step(model, opt, sched)
    save(tmp_path, 1, model, opt, sched, data_state={"epoch": 0, "index": 2}, config={"lr": 0.01})
    train_step(model, opt, sched)  # uses the Adam moments, the decayed lr and the RNGs

    random.seed(99), np.random.seed(99), torch.manual_seed(99)  # the new process's RNGs differ
    resumed, opt2, sched2 = trainer(seed=1)  # and so do its freshly initialised weights
    state = load_checkpoint(latest_checkpoint(tmp_path), {"policy": resumed}, {"policy": opt2}, {"policy": sched2})
    assert (state.step, state.data_state, state.config) == (1, {"epoch": 0, "index": 2}, {"lr": 0.01})
    train_step(resumed, opt2, sched2)
    assert sched2.state_dict() == sched.state_dict()
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    assert resumed.lm_head.weight is resumed.model.embed_tokens.weight  # still tied after loading


def test_peft_adapter_round_trip(tmp_path):
    model = get_peft_model(tiny_model(0), LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    saved = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    path = save(tmp_path, 1, model)
    assert (path / "model-policy" / "adapter_model.safetensors").is_file()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1.0)
    load_checkpoint(path, {"policy": model})
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, saved[n]), n


def test_keeps_the_last_n(tmp_path):
    model = tiny_model(0)
    for step in range(1, 5):
        save(tmp_path, step, model, keep_last=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000003", "step-00000004"]
    assert latest_checkpoint(tmp_path).name == "step-00000004"
    assert latest_checkpoint(tmp_path / "elsewhere") is None


def test_kill_mid_save_leaves_previous_checkpoint_usable(tmp_path, monkeypatch):
    model, opt, sched = trainer(seed=0)
    train_step(model, opt, sched)
    save(tmp_path, 1, model, opt, sched)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_step(model, opt, sched)

    def killed(*args, **kwargs):  # dies after the weights were written, before the rename
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 2, model, opt, sched)
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path).name == "step-00000001"

    fresh, opt2, sched2 = trainer(seed=1)
    assert load_checkpoint(latest_checkpoint(tmp_path), {"policy": fresh}, {"policy": opt2}, {"policy": sched2}).step == 1
    for n, p in fresh.named_parameters():
        assert torch.equal(p, expected[n]), n

    save(tmp_path, 2, model, opt, sched)  # the next save clears the half-written folder
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000001", "step-00000002"]


def test_bad_state_fails_before_writing(tmp_path):
    with pytest.raises(TypeError):
        save(tmp_path, 1, tiny_model(0), data_state={"sampler": object()})
    assert latest_checkpoint(tmp_path) is None and not list((tmp_path / "checkpoints").iterdir())
