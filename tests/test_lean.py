"""The lean decode path (envace/backends/lean.py) against transformers' own forward."""

from __future__ import annotations

import pytest
import torch

from envace.backends import HFGenerator, SamplingParams, tiny_model
from envace.backends import lean
from envace.backends.lean import QUANT_MAX_ROWS, LeanWeights, decode_settings, lean_support

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def prompts(tokenizer):
    texts = ["Hello there, how are you today?", "Hi", "List three colours: red, green and one more please", "Call get_balance for A1"]
    return [tokenizer.encode(t) for t in texts]


def turns_of(prompts, tokenizer):
    """Three turns for each session: the prompt, then tool-response-like text (one session adds nothing)."""
    follow = [tokenizer.encode(" Tool result: {\"ok\": true}"), [], tokenizer.encode(" and then?"), tokenizer.encode(" x")]
    last = [[1], tokenizer.encode(" more words here"), tokenizer.encode(" go on"), []]
    return [prompts, follow, last]


def run(gen, turns, params):
    ids = gen.open(len(turns[0]))
    outs = [gen.generate(ids, new, params) for new in turns]
    gen.close(ids)
    return outs


@pytest.mark.parametrize("transposed,threads,rows", [(False, 2, (0, 0)), (True, 1, (8, 0)), (True, 2, (8, 4))])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_lean_fp32_decodes_what_transformers_decodes(tokenizer, prompts, arch, transposed, threads, rows, monkeypatch):
    """Multi-turn, batched, each session with its own budget: the lean path (fused projections,
    preallocated cache, grouped-query attention without repeat_kv) gives transformers' tokens and
    logprobs. qwen2 has q/k/v biases, qwen3 per-head q/k norms. `transposed`: few-row matmuls as
    (W @ x^T)^T, as on CPUs where that is faster: the LM head's up to 8 rows, the layers' up to 4
    with a second thread (the 1-4 row decode steps here take that path)."""
    monkeypatch.setattr(lean, "transposed_gemm_is_faster", lambda: transposed)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # what the packed copy is built for
    model = tiny_model(tokenizer, arch=arch)
    assert lean_support(model) is None
    params = [SamplingParams(max_new_tokens=n, temperature=0.0) for n in (12, 3, 9, 6)]
    turns = turns_of(prompts, tokenizer)
    reference = run(HFGenerator(model, tokenizer, lean=False), turns, params)
    fast = HFGenerator(model, tokenizer)
    assert fast.lean is not None
    packed = fast.lean.current()
    assert (packed.lm_head.transposed_rows, packed.layers[0].qkv.transposed_rows) == rows
    got = run(fast, turns, params)
    for ref_turn, got_turn in zip(reference, got):
        for r, g in zip(ref_turn, got_turn):
            assert g.token_ids == r.token_ids
            assert g.finish_reason == r.finish_reason
            assert max(abs(a - b) for a, b in zip(g.logprobs, r.logprobs)) < 1e-4


def test_finished_rows_are_compacted_without_changing_anyone_s_output(tokenizer, prompts):
    """Eight sessions, six of which stop after 1-2 tokens: the cache is compacted once more than a
    quarter of its rows are done, and every session still equals its solo run."""
    model = tiny_model(tokenizer)
    sessions = [prompts[i % 4] + prompts[(i + 1) % 4][: i // 4 + 1] for i in range(8)]
    limits = [1, 2, 1, 2, 1, 2, 16, 16]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0) for n in limits]
    gen = HFGenerator(model, tokenizer, share_prompts=False)
    compactions = []
    original = lean.StaticBatch.keep_rows

    def spy(self, rows):
        before = self.valid.shape[0]
        original(self, rows)
        compactions.append(self.valid.shape[0] < before)

    lean.StaticBatch.keep_rows = spy
    try:
        together = gen.generate(gen.open(8), sessions, params)
    finally:
        lean.StaticBatch.keep_rows = original
    assert any(compactions)
    for prompt, p, out in zip(sessions, params, together):
        solo = HFGenerator(model, tokenizer, lean=False)
        [expected] = solo.generate(solo.open(1), [prompt], p)
        assert out.token_ids == expected.token_ids


def test_a_decode_step_drops_its_mask_only_where_no_row_has_padding(tokenizer, prompts):
    """Rows of equal lengths need no mask at one new token (`StaticBatch.dense`); a row left alone
    by compaction can still hold padding between its past and its new chunk, and keeps its mask:
    its logits equal the same row decoded on its own."""
    weights = LeanWeights(tiny_model(tokenizer), torch.float32).current()

    def past(tokens):
        batch = lean.StaticBatch(weights, [tokens], [None], 0, torch.device("cpu"), 1)
        batch.forward()
        return batch.row_kv(0)

    equal = lean.StaticBatch(weights, [prompts[0][:5], prompts[2][:5]], [None, None], 0, torch.device("cpu"), 2)
    assert equal.dense
    # Row 0: 5 past tokens and a 2-token chunk; row 1: 3 past tokens and a 4-token chunk. The
    # shared layout gives row 0 two padding columns between its past and its chunk.
    row0, row1 = (past(prompts[2][:5]), prompts[3][:2]), (past(prompts[0][:3]), prompts[3][:4])
    mixed = lean.StaticBatch(weights, [row0[1], row1[1]], [row0[0], row1[0]], 0, torch.device("cpu"), 3)
    solo = lean.StaticBatch(weights, [row0[1]], [row0[0]], 0, torch.device("cpu"), 3)
    assert not mixed.dense and solo.dense
    first, alone = mixed.forward(), solo.forward()
    torch.testing.assert_close(first[:1], alone, rtol=1e-5, atol=1e-5)
    mixed.keep_rows([0])  # one of two rows done: more than a quarter, so the cache is compacted
    assert mixed.valid.shape[0] == 1 and not mixed.dense
    for _ in range(2):
        token = alone.argmax(-1)
        mixed.feed(token)
        solo.feed(token)
        alone = solo.forward()
        torch.testing.assert_close(mixed.forward(), alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quant", [None, "int4"])
def test_in_place_weight_updates_reach_the_packed_copy(tokenizer, prompts, quant):
    """An optimizer-style in-place update of the live module shows in the next generation (the
    packed bf16 copy, and its int4 copies, are rebuilt from the parameters' version counters), and
    only then. The second token is a one-row decode step: with int4 it reads the int4 copies."""
    model = tiny_model(tokenizer, seed=3)
    gen = HFGenerator(model, tokenizer, dtype=torch.bfloat16, quant=quant)
    two = SamplingParams(max_new_tokens=2, temperature=0.0)
    [before] = gen.generate(gen.open(1), [prompts[0]], two)
    builds = gen.lean.rebuilds
    [again] = gen.generate(gen.open(1), [prompts[0]], two)
    assert gen.lean.rebuilds == builds and again.token_ids == before.token_ids  # nothing changed: no rebuild
    target = (max(before.token_ids) + 7) % model.config.vocab_size
    with torch.no_grad():
        model.lm_head.weight[target] += 50 * model.model.norm.weight.sign()  # the argmax after any hidden state of ~positive sign
        model.model.norm.weight.abs_()
    [after] = gen.generate(gen.open(1), [prompts[0]], two)
    assert gen.lean.rebuilds == builds + 1
    assert after.token_ids == [target, target]


def test_lora_adapters_are_merged_into_the_packed_copy(tokenizer, prompts):
    from peft import LoraConfig, get_peft_model

    base = tiny_model(tokenizer, seed=1)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # a nonzero delta (B starts at 0)
    reference = run(HFGenerator(model, tokenizer, lean=False), [prompts], GREEDY)
    got = run(HFGenerator(model, tokenizer), [prompts], GREEDY)
    assert [c.token_ids for c in got[0]] == [c.token_ids for c in reference[0]]


def test_bf16_logprobs_are_the_bf16_models_own_and_close_to_fp32(tokenizer, prompts):
    """In bf16 the sampler records the logprobs of the distribution that drew the tokens (the bf16
    model's, checked against uncached lean forwards of each prefix), and they stay within
    a stated bound of the fp32 model's: the mismatch a trainer then corrects (TIS)."""
    model = tiny_model(tokenizer, seed=2)
    gen = HFGenerator(model, tokenizer, dtype=torch.bfloat16)
    [s] = gen.open(1)
    [out] = gen.generate([s], [prompts[2]], SamplingParams(max_new_tokens=10, temperature=1.0))
    sequence = prompts[2] + out.token_ids
    weights = LeanWeights(model, torch.bfloat16).current()
    rows = []
    for j in range(len(prompts[2]), len(sequence)):  # each position alone: the logits of its last token
        batch = lean.StaticBatch(weights, [sequence[:j]], [None], 0, torch.device("cpu"), max_new_tokens=0)
        rows.append(torch.log_softmax(batch.forward()[0], -1)[sequence[j]].item())
    # bf16 rounding depends on the computation's shape (a cached decode step vs a whole prompt).
    assert max(abs(a - b) for a, b in zip(out.logprobs, rows)) < 5e-3
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0, len(prompts[2]) - 1:-1]
    fp32 = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
    assert (fp32 - torch.tensor(out.logprobs)).abs().max() < 0.05


def test_models_outside_the_lean_layout_run_transformers_forward(tokenizer, prompts, monkeypatch):
    model = tiny_model(tokenizer, hidden_act="gelu")
    assert "activation" in lean_support(model)
    gen = HFGenerator(model, tokenizer)
    assert gen.lean is None
    assert run(gen, [prompts], GREEDY)[0][0].token_ids  # runs, through transformers
    with pytest.raises(ValueError, match="needs the lean decode path.*activation.*model's own dtype"):
        HFGenerator(model, tokenizer, dtype=torch.bfloat16)
    monkeypatch.setattr("envace.backends.models.native_bf16", lambda: True)
    assert decode_settings("auto", model) == {"dtype": None, "quant": None}  # auto never asks for what cannot run


def test_sampler_dtype_settings(tokenizer, monkeypatch):
    model = tiny_model(tokenizer)
    monkeypatch.setattr("envace.backends.models.native_bf16", lambda: True)
    assert decode_settings("auto", model) == {"dtype": torch.bfloat16, "quant": None}
    assert decode_settings("int8", model) == {"dtype": torch.bfloat16, "quant": "int8"}
    assert decode_settings("int4", model) == {"dtype": torch.bfloat16, "quant": "int4"}
    monkeypatch.setattr("envace.backends.models.native_bf16", lambda: False)
    assert decode_settings("auto", model) == {"dtype": None, "quant": None}  # emulated bf16 is slower than fp32
    assert decode_settings("f32", model) == {"dtype": None, "quant": None}
    assert decode_settings("bf16", model) == {"dtype": torch.bfloat16, "quant": None}
    assert decode_settings("int8", model) == {"dtype": None, "quant": "int8"}  # over the model's own fp32 there
    assert decode_settings("int4", model) == {"dtype": None, "quant": "int4"}
    with pytest.raises(ValueError, match="f32, bf16, int8 or int4.*llama.cpp"):
        decode_settings("q8_0", model)


def test_a_transposed_few_row_matmul_equals_f_linear():
    """(W @ x^T)^T for up to `transposed_rows` rows, F.linear beyond: the same product, bias
    included."""
    torch.manual_seed(0)
    proj = lean._Proj(torch.randn(7, 5), torch.randn(7), transposed_rows=4)
    for shape in [(1, 5), (3, 5), (4, 5), (6, 5)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(proj(x), torch.nn.functional.linear(x, proj.weight, proj.bias), rtol=1e-5, atol=1e-5)


def test_a_one_row_bf16_product_runs_as_mv_and_equals_f_linear(monkeypatch):
    """One row: torch.mv (faster on CPU for bf16 weights); more rows: F.linear. The same product
    to bf16 rounding (the sums run in another order), bias included."""
    torch.manual_seed(0)
    proj = lean._Proj(torch.randn(48, 32).bfloat16(), torch.randn(48).bfloat16(), one_row_mv=True)
    calls = []
    real = torch.mv
    monkeypatch.setattr(torch, "mv", lambda w, x: calls.append(x.shape) or real(w, x))
    for shape in [(1, 32), (2, 32), (3, 32)]:
        x = torch.randn(*shape).bfloat16()
        torch.testing.assert_close(proj(x), torch.nn.functional.linear(x, proj.weight, proj.bias), rtol=1.6e-2, atol=2e-2)
    assert calls == [torch.Size([32])]  # the one-row input only


def test_bf16_lean_copies_take_the_one_row_mv_path_and_fp32_ones_do_not(tokenizer):
    model = tiny_model(tokenizer)
    assert LeanWeights(model, torch.bfloat16).current().layers[0].gate_up.one_row_mv
    assert not LeanWeights(model, torch.float32).current().layers[0].gate_up.one_row_mv


def test_int8_weights_by_hand():
    """Per output channel: scale = max |w| / 127, w ~= round(w / scale) * scale."""
    weight = torch.tensor([[0.5, -1.0, 0.25], [2.0, 1.0, -0.5]])
    q, scales = lean.int8_codes(weight)
    torch.testing.assert_close(scales, torch.tensor([1.0 / 127, 2.0 / 127], dtype=torch.bfloat16))  # the kernel's activation dtype
    assert q.tolist() == [[64, -127, 32], [127, 64, -32]]  # 63.5 -> 64, 31.75 -> 32 (round half to even only at .5 exactly)


def test_int4_codes_by_hand():
    """Per group of inputs: scale = (max - min) / 15, code = round((w - min) / scale), and zero =
    min + 8 * scale, so that (code - 8) * scale + zero gives back w to within scale / 2."""
    weight = torch.tensor([[-1.0, 0.5, 0.0, 3.0], [0.0, 0.0, 1.5, 0.0]])
    codes, scales, zeros = lean.int4_codes(weight, group=2)
    torch.testing.assert_close(scales, torch.tensor([[0.1, 0.2], [0.0, 0.1]]).clamp(min=1e-12))
    assert codes.tolist() == [[0, 15, 0, 15], [0, 0, 15, 0]]  # a constant group has all codes 0
    torch.testing.assert_close(zeros, torch.tensor([[-0.2, 1.6], [0.0, 0.8]]))
    torch.testing.assert_close((codes.view(2, 2, 2) - 8) * scales[..., None] + zeros[..., None], weight.view(2, 2, 2))
    codes, scales, _ = lean.int4_codes(torch.tensor([[0.0, 0.3, 1.5]]), group=3)  # 0.3 / 0.1 = 3; 1.5 = 15 steps
    assert codes.tolist() == [[0, 3, 15]]


def test_the_int4_kernel_multiplies_by_the_dequantised_weights():
    """torch's packed int4 product equals x @ W_dq^T with W_dq rebuilt from `int4_codes` by hand
    (bf16 activations, scales and zeros; the kernel's rounding only); shapes it cannot take get no copy."""
    torch.manual_seed(0)
    weight = torch.randn(32, 64)
    packed = lean._Int4.of(weight)
    codes, scales, zeros = lean.int4_codes(weight, lean.INT4_GROUP)
    groups = codes.view(32, 2, lean.INT4_GROUP).float()
    dequantised = ((groups - 8) * scales.bfloat16().float()[..., None] + zeros.bfloat16().float()[..., None]).view(32, 64)
    assert (dequantised - weight).abs().max() <= scales.max() / 2 + 0.02  # the quantisation error bound
    x = torch.randn(3, 64).bfloat16()
    torch.testing.assert_close(packed(x).float(), x.float() @ dequantised.T, rtol=2e-2, atol=5e-2)
    assert lean._Int4.of(torch.randn(40, 64)) is None and lean._Int4.of(torch.randn(32, 48)) is None


@pytest.mark.parametrize("quant,kernel", [("int8", "torch._weight_int8pack_mm"), ("int4", "torch.ops.aten._weight_int4pack_mm_for_cpu")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantized_decode_uses_the_copies_for_small_batches_only(tokenizer, prompts, monkeypatch, dtype, quant, kernel):
    """Matmuls over <= QUANT_MAX_ROWS rows (decode steps, the LM head of a few rows) run the int8 or
    int4 kernel with bf16 activations (their fast path), a prompt's prefill the `dtype` weights;
    logprobs stay near the `dtype` path's. fp32 is the quantized settings' base on CPUs that emulate bf16."""
    model = tiny_model(tokenizer, seed=4)
    calls = []
    owner, name = kernel.rsplit(".", 1)
    owner = {"torch": torch, "torch.ops.aten": torch.ops.aten}[owner]
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda x, *rest: calls.append((x.shape[0], x.dtype)) or real(x, *rest))
    gen = HFGenerator(model, tokenizer, dtype=dtype, quant=quant)
    ids = gen.open(2)
    long_prompts = [prompts[2] * 2, prompts[0] * 2]
    outs = gen.generate(ids, long_prompts, SamplingParams(max_new_tokens=6, temperature=0.0))
    assert calls and max(rows for rows, _ in calls) <= QUANT_MAX_ROWS[quant]  # the 2-row decode steps went through it ...
    assert {x_dtype for _, x_dtype in calls} == {torch.bfloat16}
    assert sum(map(len, long_prompts)) > QUANT_MAX_ROWS[quant]  # ... and the prefill (more rows) did not
    plain = HFGenerator(model, tokenizer, dtype=dtype)
    ref = plain.generate(plain.open(2), long_prompts, SamplingParams(max_new_tokens=1, temperature=0.0))
    # The first token: `dtype` prefill, then the 2-row LM head quantized; close to the plain path's.
    bound = {"int8": 0.05, "int4": 0.5}[quant]
    assert all(abs(o.logprobs[0] - r.logprobs[0]) < bound for o, r in zip(outs, ref))
    with pytest.raises(ValueError, match="lean decode path"):
        HFGenerator(tiny_model(tokenizer, hidden_act="gelu"), tokenizer, dtype=torch.bfloat16, quant=quant)


@pytest.mark.slow
def test_lean_path_on_the_default_model_matches_transformers():
    """The real SmolLM2-135M: fp32 lean greedy decodes equal transformers' on a batch; the bf16
    model's logprobs of those tokens stay near fp32's (mean |difference| < 0.05)."""
    from envace.backends import load_model

    model, tokenizer = load_model("default")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
               for text in ("What is the capital of France?", "Write a haiku about tools.", "List two prime numbers.")]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    reference = run(HFGenerator(model, tokenizer, lean=False), [prompts], params)[0]
    fast = run(HFGenerator(model, tokenizer), [prompts], params)[0]
    assert [c.token_ids for c in fast] == [c.token_ids for c in reference]
    # The fp32 greedy tokens scored by the bf16 lean model, position by position.
    weights = LeanWeights(model, torch.bfloat16).current()
    gaps = []
    for prompt, ref in zip(prompts, reference):
        sequence = prompt + ref.token_ids
        for j, expected in zip(range(len(prompt), len(sequence)), ref.logprobs):
            batch = lean.StaticBatch(weights, [sequence[:j]], [None], 0, torch.device("cpu"), max_new_tokens=0)
            gaps.append(abs(torch.log_softmax(batch.forward()[0], -1)[sequence[j]].item() - expected))
    # docs/performance.md measured 0.018 mean, 0.134 max on 10 rollouts
    assert sum(gaps) / len(gaps) < 0.05 and max(gaps) < 0.4


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_sampling_on_a_gpu_machine_fails_at_validation(monkeypatch, quant):
    from envace.config import ConfigError
    from envace.rollout import RolloutConfig

    RolloutConfig(sampler_dtype=quant).validate()  # this CPU machine: fine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match=f"{quant} runs torch's CPU {quant} kernel.*use bf16"):
        RolloutConfig(sampler_dtype=quant).validate()
