"""envace.training.sharding (FSDP2), envace.training.zero3 (DeepSpeed ZeRO-3) and the lockstep
micro-batches they need. The FSDP2 runs themselves (2 gloo processes, against DDP and one
process) are in tests/test_training.py; the ZeRO-3 ones are here (they need the `deepspeed` extra
and skip without it)."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from envace.algorithms.losses import lockstep_micro_batches
from envace.config import ConfigError, build
from envace.training.setup import check_sharding
from envace.training.sharding import UnshardedCopy, checkpointed_optimizer, decoder_layers, lockstep_count
from envace.training.trainer import TrainConfig, Trainer
from tests.test_algorithms import plain_row, tiny_model
from tests.test_training import SMALL, distributed, final_weights, needs_deepspeed, task_file  # noqa: F401 (task_file: a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


# ---- DeepSpeed ZeRO-3 ------------------------------------------------------------------------------------


def test_zero3_without_deepspeed_fails_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # what `import deepspeed` does when it is not installed
    with pytest.raises(ConfigError, match=r"needs DeepSpeed.*pip install 'envace\[deepspeed\]'.*--sharding fsdp2"):
        check_sharding(SimpleNamespace(num_processes=2), "deepspeed-zero3")


def test_an_accelerate_deepspeed_launch_is_refused(monkeypatch):
    """accelerate's DeepSpeed mode would expect to own the engine (its backward steps the optimizer)."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ConfigError, match="distributed_type is DEEPSPEED.*MULTI_GPU.*--sharding deepspeed-zero3"):
        check_sharding(SimpleNamespace(num_processes=2), "none")


@needs_deepspeed
def test_zero3_in_one_process_is_refused_before_any_model_loads(tmp_path, task_file, monkeypatch):  # noqa: F811
    import envace.training.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "load_trainable", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(ConfigError, match="--sharding deepspeed-zero3 splits the model over the processes.*torchrun"):
        Trainer(build(TrainConfig, dict(SMALL, tasks=task_file, output_dir=str(tmp_path / "run"), sharding="deepspeed-zero3")))


def assert_same(got: torch.Tensor, want: torch.Tensor, case: str, what: str) -> None:
    """fp32: torch's default tolerance; bf16 autocast: one bf16 rounding step of the tensor's largest entry."""
    from tests.zero3_worker import CASES

    tolerance = dict(rtol=0.0, atol=2**-8 * float(want.abs().max())) if CASES[case][2] else {}
    torch.testing.assert_close(got, want, **tolerance, msg=lambda m: f"{case}: {what}: {m}")


@needs_deepspeed
def test_zero3_step_equals_one_unsharded_process(tmp_path):
    """One optimizer step through envace's ZeRO-3 engine on 2 gloo processes (each holding half of
    every parameter; the LM head gathered inside the forward that `sequence_logprobs` runs;
    activation checkpointing; two micro-batches accumulated, plain and packed; clipped) against the
    same step in one unsharded process with torch's AdamW and clip_grad_norm_: logprobs, gradients,
    norm, the weights gathered after the step and AdamW's moments agree, untied, tied, under bf16
    autocast and with LoRA. At fp32 within torch's default tolerance (1.3e-6 relative, 1e-5
    absolute); under bf16 the tied weight's gradient, the sum of the embedding's and every head
    chunk's, is summed in another order (measured: up to 1.2e-3 where the largest entry is 0.77,
    i.e. 1.5e-3 of it; every other gradient equal), so there each tensor must agree within one
    bf16 rounding step of its largest entry (2**-8 of it)."""
    from tests.zero3_worker import CASES, GRAD_CLIP, backward_both, model_for, optimizer

    out = tmp_path / "zero3.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", os.path.join(ROOT, "tests", "zero3_worker.py"), str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    sharded = torch.load(out)
    for case in CASES:
        got = sharded[case]
        model = model_for(case)
        opt = optimizer(model)
        logprobs = backward_both(model, case, lambda loss: loss.backward())
        trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
        grads = {n: p.grad.clone() for n, p in trained.items()}
        norm = float(torch.nn.utils.clip_grad_norm_(list(trained.values()), GRAD_CLIP))
        opt.step()
        assert got["held"] * 2 == got["total"], case  # each process holds half of every parameter
        for mine, theirs in zip(logprobs, got["logprobs"]):
            torch.testing.assert_close(theirs, mine)
        assert got["grads"].keys() == grads.keys()
        for name in grads:
            assert_same(got["grads"][name], grads[name], case, f"gradient of {name}")
        # The step clipped, by the same norm (bf16: measured 6.7e-5 apart, from the tied gradient above).
        assert norm > GRAD_CLIP and got["grad_norm"] == pytest.approx(norm, rel=2**-8 if CASES[case][2] else 1e-5), case
        # AdamW's first step moves a weight by about lr * sign(gradient): where bf16 rounding leaves the tied
        # gradient near 0 that sign can flip (measured: 4 of 4096 embedding entries), so under bf16 the
        # weights are not compared; the gradients and moments that make them are.
        for name, p in model.named_parameters() if not CASES[case][2] else []:
            assert_same(got["weights"][name], p.detach(), case, f"{name} after the step")
        state = opt.state_dict()["state"]
        for i, name in enumerate(trained):
            for key in ("exp_avg", "exp_avg_sq"):
                assert_same(got["optimizer"]["state"][name][key], state[i][key], case, f"{key} of {name}")


@needs_deepspeed
@pytest.mark.slow
def test_zero3_sft_reaches_the_weights_of_one_process(tmp_path, task_file):  # noqa: F811
    distributed(2, "sft", task_file, str(tmp_path / "sharded"), "deepspeed-zero3")
    distributed(1, "sft", task_file, str(tmp_path / "one"))
    a, b = final_weights(tmp_path / "sharded"), final_weights(tmp_path / "one")
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in b) < 1e-4  # measured 2.0e-6


@needs_deepspeed
@pytest.mark.slow
def test_zero3_grpo_reaches_the_weights_of_ddp_through_a_resume(tmp_path, task_file):  # noqa: F811
    """A ZeRO-3 step lands on DDP's weights, and 1 ZeRO-3 step then a resumed 2nd (weights and
    AdamW's state restored from the gathered checkpoint) on 2 uninterrupted ZeRO-3 steps'; with
    LoRA the merged export equals DDP LoRA's.

    Step 2 is not compared with DDP's step 2: DeepSpeed reduces gradients in another order (the
    step-1 grad norms differ by 2e-6 relative), and on an fp32 (AVX2) machine that difference in
    the weights flipped one token the tiny model sampled at step 2 (its distribution is nearly
    flat), so the two runs trained on different rollouts (rewards 0.5 and 0.625) and ended 1.7e-3
    apart, on the code before this test was split as on the code after it."""
    distributed(2, "grpo", task_file, str(tmp_path / "ddp"), "none", "2")
    distributed(2, "grpo", task_file, str(tmp_path / "sharded"), "deepspeed-zero3", "1")
    distributed(2, "grpo", task_file, str(tmp_path / "sharded"), "deepspeed-zero3", "2")
    distributed(2, "grpo", task_file, str(tmp_path / "whole"), "deepspeed-zero3", "2")
    a, b = (load_file(tmp_path / run / "checkpoints" / "step-00000001" / "model-policy" / "model.safetensors") for run in ("sharded", "ddp"))
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in b) < 1e-5  # one step: as DDP
    a, b = final_weights(tmp_path / "sharded"), final_weights(tmp_path / "whole")
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in b) < 1e-5  # resumed = uninterrupted
    steps = [json.loads(line) for line in open(tmp_path / "sharded" / "metrics.jsonl")]
    assert [m["step"] for m in steps] == [1, 2] and all(m["policy/skipped_update"] == 0.0 for m in steps)
    distributed(2, "grpo", task_file, str(tmp_path / "ddp-lora"), "none", "2", "4")
    distributed(2, "grpo", task_file, str(tmp_path / "lora"), "deepspeed-zero3", "2", "4")
    a, b = final_weights(tmp_path / "lora"), final_weights(tmp_path / "ddp-lora")
    assert max(float((a[k] - b[k]).abs().max()) for k in b) < 1e-5  # measured 0.0
