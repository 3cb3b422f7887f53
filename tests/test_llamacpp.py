"""LlamaCppGenerator: the embedded llama.cpp engine against HFGenerator on the real default model.

Skipped without xllamacpp/gguf (`pip install 'envace[llamacpp]'`). The module shares one engine
(4 slots) built from the real SmolLM2-135M weights in f32; tests close every session they open.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("xllamacpp")
gguf = pytest.importorskip("gguf")

from envace.backends.base import PolicyWeights, SamplingParams, StaleSessionsError  # noqa: E402
from envace.backends.hf import HFGenerator  # noqa: E402
from envace.backends.llamacpp import GGUFTemplateError, LlamaCppGenerator, template_gguf, write_gguf  # noqa: E402
from envace.backends.models import load_model, resolve_model  # noqa: E402

# f32 GGUF, f32 KV, no flash attention vs the HF fp32 model: gaps seen are ~1e-4 (llama.cpp sums
# its softmax in float32, which alone biases its logprobs by about +1.4e-4).
LOGPROB_TOL = 1e-3


@pytest.fixture(scope="module")
def real():
    return load_model("default", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def engine(real):
    model, tok = real
    gen = LlamaCppGenerator(model, tok, max_sessions=4, n_ctx_per_session=1024, threads=2)
    yield gen
    gen.shutdown()


def chat(tok, text: str) -> list[int]:
    out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def teacher_forced(model, sequence: list[int], start: int, temperature: float = 1.0) -> list[float]:
    """log softmax(logits / T) of sequence[j] given sequence[:j], j >= start, from one HF forward."""
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0].float()
    logp = torch.log_softmax(logits[start - 1:-1] / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(sequence[start:])[:, None]).squeeze(1).tolist()


def assert_same_tokens(ours, ref, what: str) -> None:
    """Token-identical, or fail naming the first divergence and the logprob gap there."""
    for row, (a, b) in enumerate(zip(ours, ref)):
        if a.token_ids == b.token_ids:
            continue
        n = min(len(a.token_ids), len(b.token_ids))
        d = next((i for i in range(n) if a.token_ids[i] != b.token_ids[i]), n)
        detail = ""
        if d < n:
            detail = (f": llama.cpp {a.token_ids[d]} (logprob {a.logprobs[d]:.5f}) vs HF {b.token_ids[d]} "
                      f"(logprob {b.logprobs[d]:.5f})")
        pytest.fail(f"{what}, row {row}: first divergence at token {d}{detail}")


def test_greedy_matches_hf_including_a_second_turn(real, engine):
    model, tok = real
    hf = HFGenerator(model, tok)
    prompts = [chat(tok, m) for m in ("What is the capital of France?", "Write a haiku about rain.", "Name three colours.")]
    sp = SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=(tok.eos_token_id,))
    ours, ref = engine.open(3), hf.open(3)
    try:
        first, first_ref = engine.generate(ours, prompts, sp), hf.generate(ref, prompts, sp)
        assert_same_tokens(first, first_ref, "first turn")
        assert [c.finish_reason for c in first] == [c.finish_reason for c in first_ref]
        turn = tok.encode("\n<|im_start|>user\nAnd of Germany?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
        second = engine.generate(ours[:1], [turn], sp)
        second_ref = hf.generate(ref[:1], [turn], sp)
        assert_same_tokens(second, second_ref, "second turn")
        for a, b in zip(first + second, first_ref + second_ref):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < LOGPROB_TOL
    finally:
        engine.close(ours)


def test_logprobs_are_the_raw_policy_probabilities(real, engine):
    """Sampled at T=0.7, top_p=0.8, the reported logprobs are the temperature-1, unfiltered ones
    (teacher-forced HF on the same tokens), not the sampling distribution's."""
    model, tok = real
    prompts = [chat(tok, "Tell me a short story about a cat."), chat(tok, "List some fruits.")]
    sp = SamplingParams(max_new_tokens=24, temperature=0.7, top_p=0.8)
    ids = engine.open(2)
    try:
        engine.set_seed(7)
        out = engine.generate(ids, prompts, sp)
    finally:
        engine.close(ids)
    tempered_gaps = []
    for prompt, c in zip(prompts, out):
        assert len(c.logprobs) == len(c.token_ids) == 24
        raw = teacher_forced(model, prompt + c.token_ids, len(prompt))
        gap = max(abs(x - y) for x, y in zip(c.logprobs, raw))
        assert gap < LOGPROB_TOL, f"logprob gap {gap:.2e} vs HF teacher-forced"
        tempered = teacher_forced(model, prompt + c.token_ids, len(prompt), temperature=0.7)
        tempered_gaps.append(max(abs(x - y) for x, y in zip(c.logprobs, tempered)))
    assert max(tempered_gaps) > 1e-2  # so the check above would see tempered probabilities

    # set_seed restarts the stream: the same calls draw the same samples
    again = engine.open(2)
    try:
        engine.set_seed(7)
        assert [c.token_ids for c in engine.generate(again, prompts, sp)] == [c.token_ids for c in out]
    finally:
        engine.close(again)


def test_tokens_inside_a_utf8_character_get_logprobs_from_the_hf_model(real, engine):
    """llama.cpp sends no probability for a token that ends inside a multi-byte character (CJK,
    emoji): those come from the HF model; ids stay exact and the others stay llama.cpp's."""
    model, tok = real
    prompt = chat(tok, "Say hi in Chinese (你好) and add two emojis.")
    before = dict(engine.stats.extra)
    (s,) = engine.open(1)
    try:
        (c,) = engine.generate([s], [prompt], SamplingParams(max_new_tokens=16, temperature=0.0))
    finally:
        engine.close([s])
    assert "\ufffd" not in c.text and any(ord(ch) > 0x2E80 for ch in c.text), c.text
    assert engine.stats.extra["hf_logprobs"] > before["hf_logprobs"]
    assert engine.stats.extra["logprob_misaligned"] == before["logprob_misaligned"]
    raw = teacher_forced(model, prompt + c.token_ids, len(prompt))
    assert max(abs(x - y) for x, y in zip(c.logprobs, raw)) < LOGPROB_TOL
    hf = HFGenerator(model, tok)
    assert_same_tokens([c], hf.generate(hf.open(1), [prompt], SamplingParams(max_new_tokens=16, temperature=0.0)), "CJK")


def test_per_session_limits_and_stops_in_one_call_equal_each_alone(real, engine):
    model, tok = real
    prompt = chat(tok, "What is the capital of France?")
    probe = engine.open(1)
    try:
        reference = engine.generate(probe, [prompt], SamplingParams(max_new_tokens=16, temperature=0.0))[0].token_ids
    finally:
        engine.close(probe)
    eos = tok.eos_token_id
    assert eos in reference[:-1], "the greedy answer should run past EOS (EOS is no stop unless listed)"
    stop_string = tok.decode(reference[3:5])
    params = [
        SamplingParams(max_new_tokens=3, temperature=0.0),
        SamplingParams(max_new_tokens=16, temperature=0.0, stop_strings=(stop_string,)),
        SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=(reference[6],)),
        SamplingParams(max_new_tokens=16, temperature=0.0),
    ]
    ids = engine.open(4)
    steps = engine.stats.extra["decode_steps"]
    try:
        together = engine.generate(ids, [prompt] * 4, params)
    finally:
        engine.close(ids)
    steps_together, steps = engine.stats.extra["decode_steps"] - steps, engine.stats.extra["decode_steps"]
    alone = []
    for p in params:
        (i,) = engine.open(1)
        try:
            alone.append(engine.generate([i], [prompt], p)[0])
        finally:
            engine.close([i])
    steps_alone = engine.stats.extra["decode_steps"] - steps
    # the sessions of one call were decoded together (the server's own count of llama_decode calls)
    assert steps_together < 0.8 * steps_alone, (steps_together, steps_alone)
    hf = HFGenerator(model, tok)
    ref = hf.generate(hf.open(4), [prompt] * 4, params)
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert_same_tokens(together, ref, "per-session params")
    assert [c.finish_reason for c in together] == ["length", "stop", "stop", "length"] == [c.finish_reason for c in ref]
    assert len(together[0].token_ids) == 3 and together[1].text.endswith(stop_string)
    assert together[2].token_ids[-1] == reference[6] and eos in together[3].token_ids[:-1]


def test_prefill_counts_only_new_tokens_and_evicted_sessions_reencode(real, engine):
    model, tok = real
    hf = HFGenerator(model, tok)
    # a prefix no other test's prompt shares, so no slot holds a cached prefix of it
    prompt = tok.encode("zq7 xv9 kk3. ", add_special_tokens=False) + chat(tok, "Count to five.")
    turn = tok.encode("\n<|im_start|>user\nAgain, slower.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    sp = SamplingParams(max_new_tokens=8, temperature=0.0)
    (s,), (r,) = engine.open(1), hf.open(1)
    try:
        p0, d0 = engine.stats.prefill_tokens, engine.stats.extra["decode_tokens"]
        first = engine.generate([s], [prompt], sp)[0]
        assert engine.stats.prefill_tokens - p0 == len(prompt)
        p1 = engine.stats.prefill_tokens
        second = engine.generate([s], [turn], sp)[0]
        # the server evaluated the pending last token plus the new ones: the prefix came from the slot
        assert engine.stats.prefill_tokens - p1 == len(turn) + 1
        total = engine.stats.prefill_tokens - p0 + engine.stats.extra["decode_tokens"] - d0
        assert total == len(prompt) + 8 + len(turn) + 8 - 1  # nothing encoded twice
        hf.generate([r], [prompt], sp), hf.generate([r], [turn], sp)
        assert engine.stats.prefill_tokens - p0 == hf.stats.prefill_tokens  # same count as HFGenerator
        assert first.token_ids and second.token_ids
    finally:
        engine.close([s])

    # five sessions on four slots: the fifth takes the least recently used slot; the evicted
    # session re-encodes its sequence on its next call, counted as prefill, and still continues right
    ids, ref = engine.open(5), hf.open(5)
    try:
        prompts = [tok.encode(f"{k} ", add_special_tokens=False) + chat(tok, f"Say {k}.") for k in range(5)]
        sp = SamplingParams(max_new_tokens=4, temperature=0.0)
        engine.generate(ids[:4], prompts[:4], sp), hf.generate(ref[:4], prompts[:4], sp)
        p0 = engine.stats.prefill_tokens
        engine.generate(ids[:4], [turn] * 4, sp), hf.generate(ref[:4], [turn] * 4, sp)
        assert engine.stats.prefill_tokens - p0 == 4 * (len(turn) + 1)  # each kept its own slot's cache
        evictions = engine.stats.extra["evictions"]
        engine.generate(ids[4:], prompts[4:], sp), hf.generate(ref[4:], prompts[4:], sp)
        assert engine.stats.extra["evictions"] == evictions + 1
        p0 = engine.stats.prefill_tokens
        again = engine.generate(ids[:4], [turn] * 4, sp)
        assert engine.stats.prefill_tokens - p0 > 4 * (len(turn) + 1)  # one session re-encoded its prefix
        assert_same_tokens(again, hf.generate(ref[:4], [turn] * 4, sp), "after eviction")
    finally:
        engine.close(ids)


def test_sync_weights_serves_the_new_weights(real):
    base, tok = real
    model = copy.deepcopy(base)
    prompt = chat(tok, "What is the capital of France?")
    sp = SamplingParams(max_new_tokens=8, temperature=0.0)
    gen = LlamaCppGenerator(model, tok, max_sessions=1, n_ctx_per_session=256, threads=2)
    try:
        (s,) = gen.open(1)
        before = gen.generate([s], [prompt], sp)[0].token_ids
        with pytest.raises(StaleSessionsError):
            gen.sync_weights(PolicyWeights(model, 1))
        gen.close([s])

        # make " banana" the first answer token: raise its (tied) output row along the final hidden state
        target = tok.encode(" banana", add_special_tokens=False)[0]
        with torch.no_grad():
            hidden = model.model(torch.tensor([prompt])).last_hidden_state[0, -1]
            model.lm_head.weight[target] += 50 * hidden / hidden.dot(hidden)
        assert before[0] != target

        gen.sync_weights(PolicyWeights(model, 1))
        assert gen.weights_version == 1
        (s,) = gen.open(1)
        after = gen.generate([s], [prompt], sp)
        gen.close([s])
        hf = HFGenerator(model, tok)
        ref = hf.generate(hf.open(1), [prompt], sp)
        assert after[0].token_ids[0] == target
        assert_same_tokens(after, ref, "after sync")
        assert after[0].token_ids != before
    finally:
        gen.shutdown()


def test_written_gguf_is_the_template_bit_for_bit(real, tmp_path):
    """HF weights (dequantised from the template by transformers) written back in f32 equal the
    template's dequantised tensors exactly: names, shapes and the q/k permutation are right; every
    metadata key is copied but the file type. (Values are compared on every tensor kind of the
    first and last block and the global tensors; dequantising all of Q4_1 in numpy takes seconds.)"""
    model, _ = real
    template = template_gguf("default")
    out = tmp_path / "w.gguf"
    write_gguf(PolicyWeights(model, 0).merged_state(), template, out, "f32")
    src, dst = gguf.GGUFReader(str(template)), gguf.GGUFReader(str(out))
    ours = {t.name: t for t in dst.tensors}
    assert sorted(ours) == sorted(t.name for t in src.tensors)
    last = max(int(t.name.split(".")[1]) for t in src.tensors if t.name.startswith("blk."))
    for t in src.tensors:
        assert list(t.shape) == list(ours[t.name].shape), t.name
        assert ours[t.name].tensor_type == gguf.GGMLQuantizationType.F32
        if not t.name.startswith("blk.") or t.name.startswith(("blk.0.", f"blk.{last}.")):
            expected = gguf.quants.dequantize(t.data, t.tensor_type).astype("float32")
            assert (expected == ours[t.name].data).all(), t.name
    fields = {f.name: f for f in dst.fields.values()}
    assert sorted(fields) == sorted(f.name for f in src.fields.values())
    for f in src.fields.values():
        if f.name != "general.file_type":
            assert f.types == fields[f.name].types and f.contents() == fields[f.name].contents(), f.name
    assert fields["general.file_type"].contents() == int(gguf.LlamaFileType.ALL_F32)


def test_a_spec_not_of_gguf_origin_gets_a_clear_error(real, tmp_path):
    model, tok = real
    hf_dir = resolve_model("default")  # the converted HF checkpoint: no GGUF behind it
    with pytest.raises(GGUFTemplateError, match=r"not of GGUF origin.*'default'"):
        LlamaCppGenerator(model, tok, template=hf_dir)
    with pytest.raises(GGUFTemplateError, match="does not exist"):
        template_gguf(tmp_path / "missing.gguf")
    other = tmp_path / "qwen.gguf"
    writer = gguf.GGUFWriter(str(other), "qwen2")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFTemplateError, match="architecture 'qwen2'.*supported"):
        write_gguf(PolicyWeights(model, 0).merged_state(), other, tmp_path / "out.gguf")


def test_shutdown_stops_the_engine_and_deletes_its_gguf(real):
    model, tok = real
    gen = LlamaCppGenerator(model, tok, dtype="q8_0", max_sessions=1, n_ctx_per_session=128, threads=2)
    (s,) = gen.open(1)
    assert len(gen.generate([s], [chat(tok, "Hi")], SamplingParams(max_new_tokens=2))[0].token_ids) == 2
    folder = gen._engine.dir
    assert any(folder.glob("*.gguf"))
    gen.shutdown()
    assert not folder.exists() and gen._engine.server is None
    with pytest.raises(RuntimeError, match="shut down"):
        gen.generate([s], [[]], SamplingParams(max_new_tokens=2))
    gen.shutdown()  # idempotent


def test_interpreter_exit_with_a_running_engine_does_not_hang():
    script = textwrap.dedent("""
        from envace.backends.base import SamplingParams
        from envace.backends.llamacpp import LlamaCppGenerator
        gen = LlamaCppGenerator.from_spec("default", dtype="q8_0", max_sessions=2, n_ctx_per_session=128, threads=1)
        (s,) = gen.open(1)
        assert len(gen.generate([s], [[1, 9690, 198]], SamplingParams(max_new_tokens=2))[0].token_ids) == 2
        print(gen._engine.dir)  # then exit with the engine running and a session open
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not Path(done.stdout.split()[-1]).exists(), "the GGUF directory should be gone after exit"


@pytest.mark.slow
def test_the_trainer_samples_with_llamacpp_and_pushes_the_weights_after_each_update(tmp_path):
    """`envace train --sampler llamacpp`: the rollout engine is llama.cpp, synced to every
    optimizer step's weights, and the update's own logprobs are the ratio's (the sampler's only
    weight the loss, their mismatch reported)."""
    from envace.config import build
    from envace.training.trainer import TrainConfig, Trainer

    trainer = Trainer(build(TrainConfig, dict(steps=2, tasks_per_step=1, k=2, max_turns=2, max_turn_tokens=24, max_rehearse_tokens=16,
                                              max_total_tokens=1200, difficulty=1, n_per_world=2, progress=False, tensorboard=False,
                                              output_dir=str(tmp_path), sampler="llamacpp", precision="fp32",
                                              reward="tests.training_rewards:rollout_index")))
    metrics = [trainer.train_step() for _ in range(2)]
    (generator,) = trainer.generators.values()
    assert isinstance(generator, LlamaCppGenerator)
    assert generator.weights_version == 1 and generator.stats.extra["syncs"] == 2  # built at step 0, pushed after update 1
    assert all(0 < m["policy/logprob_mismatch"] < 0.01 for m in metrics)  # f32 engine vs the fp32 update: float noise only
    assert all(m["policy/approx_kl"] == pytest.approx(0.0, abs=1e-9) for m in metrics)


def test_the_llamacpp_sampler_is_checked_before_any_model_loads():
    from envace.config import ConfigError, build
    from envace.training.trainer import TrainConfig

    with pytest.raises(ConfigError, match="a --tiny model has none"):
        build(TrainConfig, dict(tiny=True, sampler="llamacpp"))
