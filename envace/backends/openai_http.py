"""`Generator` over an OpenAI-compatible completions server (vLLM, SGLang, llama.cpp, envace's own).

Sessions live client-side as their full token sequence (`ClientSessions`, which vLLM's colocated
engine shares, envace/backends/vllm.py); every call sends the whole sequence as a
token-id prompt (the server's prefix cache avoids re-encoding it), so `stats.prefill_tokens`
counts tokens *sent*, not tokens the server actually recomputed. The sessions of a call are sent
as concurrent requests from a thread pool; the server batches them.

Token ids come back exactly when the server honours vLLM's `return_tokens_as_token_ids` (logprob
tokens of the form "token_id:123": vLLM, envace's server). Otherwise the returned text is
re-tokenised locally, which may not reproduce the sampled tokens (and drops special tokens); such
completions get logprobs 0.0 when the counts disagree and are counted in stats.extra["retokenized"].
The request asks for the stop string to stay in the output (`include_stop_str_in_output`) and for
EOS to be ignored (`ignore_eos`; the protocol stops only on `stop_token_ids`); a server that does
not support these may drop the stop string or stop at EOS.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from envace.backends.base import Completion, GenStats, ParamsArg, PolicyWeights, SamplingParams, per_session
from envace.backends.models import ModelNotFoundError

TOKEN_ID = re.compile(r"^token_id:(\d+)$")


class BackendUnreachableError(ConnectionError):
    """The generation server cannot be reached; raised before any work starts."""


def _unreachable(url: str, tried: str, err: object) -> BackendUnreachableError:
    hint = "" if url.rstrip("/").endswith("/v1") else " (base_url usually ends in /v1)"
    return BackendUnreachableError(
        f"cannot reach the OpenAI-compatible server at {url}{hint}: tried {tried}: {err}. "
        "Start a server (e.g. `vllm serve MODEL`, or `envace serve --model default --port 8000` for a "
        "local model) or fix the URL."
    )


class ClientSessions:
    """Sessions kept client-side as their full token sequence, re-sent whole on every call: the
    bookkeeping every engine with its own prefix cache shares (this module's HTTP client, vLLM's
    server and colocated modes). `generate` checks the call, builds each session's full prompt and
    its seed, hands them to `_complete_batch` (the engine) and records the result; `stats`
    counts tokens sent as `prefill_tokens`."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.stats = GenStats()
        self.seed: int | None = None  # set_seed: each request then carries its own seed
        self._requests = 0
        self._sessions: dict[int, list[int]] = {}
        self._next_id = 0

    def open(self, n: int) -> list[int]:
        ids = list(range(self._next_id, self._next_id + n))
        self._next_id += n
        for i in ids:
            self._sessions[i] = []
        return ids

    def close(self, sessions: list[int]) -> None:
        """Forget the sessions; unknown or already closed ids are ignored."""
        for i in sessions:
            self._sessions.pop(i, None)

    def set_seed(self, seed: int) -> None:
        self.seed, self._requests = seed, 0

    def generate(self, sessions: list[int], new_tokens: list[list[int]], params: ParamsArg) -> list[Completion]:
        if len(sessions) != len(new_tokens):
            raise ValueError(f"{len(sessions)} sessions but {len(new_tokens)} token lists")
        if len(set(sessions)) != len(sessions):
            raise ValueError("a session may appear only once per generate call")
        unknown = [i for i in sessions if i not in self._sessions]
        if unknown:
            raise KeyError(f"sessions {unknown} are not open")
        self._before_call()
        start = time.perf_counter()
        prompts = [self._sessions[i] + list(new) for i, new in zip(sessions, new_tokens)]
        # The API's seed is a signed 64-bit integer (vLLM rejects more); the trainer's seeds are unsigned 64-bit.
        seeds = [None if self.seed is None else (self.seed + self._requests + row) % 2**63 for row in range(len(prompts))]
        self._requests += len(prompts)
        completions = self._complete_batch(prompts, per_session(params, len(prompts)), seeds)
        for i, prompt, completion in zip(sessions, prompts, completions):
            self._sessions[i] = prompt + completion.token_ids
        self.stats.prefill_tokens += sum(len(p) for p in prompts)
        self.stats.generated_tokens += sum(len(c.token_ids) for c in completions)
        self.stats.calls += 1
        self.stats.seconds += time.perf_counter() - start
        return completions

    def _before_call(self) -> None:
        """Runs once a call's arguments are checked, before its clock starts."""

    def _complete_batch(self, prompts: list[list[int]], params: list[SamplingParams], seeds: list[int | None]) -> list[Completion]:
        """One completion per (full prompt, params, seed)."""
        raise NotImplementedError

    def _completion(self, ids: list[int], logprobs: list[float], finish_reason: str | None) -> Completion:
        """The Completion of sampled token ids (logprobs 0.0 where their count disagrees);
        "length" stays "length", every other reason is a stop."""
        if len(logprobs) != len(ids):
            logprobs = [0.0] * len(ids)
        return Completion(token_ids=ids, logprobs=logprobs, finish_reason="length" if finish_reason == "length" else "stop",
                          text=self.tokenizer.decode(ids, skip_special_tokens=False))


class OpenAIGenerator(ClientSessions):
    def __init__(self, base_url: str, model: str | None, tokenizer: Any, api_key: str | None = None,
                 timeout: float = 300.0, max_concurrency: int = 64):
        """`model` is the served model name; None = the server's only model (found by check_reachable)."""
        super().__init__(tokenizer)
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.max_concurrency = max_concurrency
        self.stats.extra["retokenized"] = 0
        self.weights_version = 0
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=timeout, headers=headers)

    def check_reachable(self, timeout: float = 5.0) -> None:
        """GET /models; raise BackendUnreachableError if that fails, ModelNotFoundError if the model is not served."""
        url = f"{self.base_url}/models"
        try:
            response = self.client.get(url, timeout=timeout)
            response.raise_for_status()
            served = [m["id"] for m in response.json().get("data", [])]
        except (httpx.HTTPError, ValueError, KeyError, AttributeError) as err:
            raise _unreachable(self.base_url, f"GET {url}", err) from err
        if self.model is None:
            if len(served) != 1:
                raise ModelNotFoundError(f"{self.base_url} serves {served}: pass the model name to use")
            self.model = served[0]
        elif served and self.model not in served:
            raise ModelNotFoundError(f"model {self.model!r} is not served at {self.base_url}; it serves {served}")

    def sync_weights(self, weights: PolicyWeights) -> None:
        raise NotImplementedError(
            f"{self.base_url} holds its own copy of the weights and this client cannot push new ones to it yet; "
            "train with the local backend (a local model spec), which samples from the trainer's weights"
        )

    def _before_call(self) -> None:
        if self.model is None:
            self.check_reachable()

    def _complete_batch(self, prompts: list[list[int]], params: list[SamplingParams], seeds: list[int | None]) -> list[Completion]:
        """The sessions of a call as concurrent requests (vLLM, SGLang, llama.cpp honour each one's seed); the server batches them."""
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrency, len(prompts)))) as pool:
            return list(pool.map(self._complete, prompts, params, seeds))

    def request_body(self, prompt: list[int], params: SamplingParams, seed: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model, "prompt": prompt, "max_tokens": params.max_new_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "logprobs": 1,
            # vLLM/SGLang extensions, ignored by servers that do not know them
            "return_tokens_as_token_ids": True, "include_stop_str_in_output": True,
            "skip_special_tokens": False, "ignore_eos": True,
        }
        if seed is not None:
            body["seed"] = seed
        if params.stop_strings:
            body["stop"] = list(params.stop_strings)
        if params.stop_token_ids:
            body["stop_token_ids"] = list(params.stop_token_ids)
        return body

    def _complete(self, prompt: list[int], params: SamplingParams, seed: int | None = None) -> Completion:
        return self._parse(self._post_completion(prompt, params, seed)["choices"][0])

    def _post_completion(self, prompt: list[int], params: SamplingParams, seed: int | None = None) -> dict[str, Any]:
        """The server's JSON answer to one /completions request."""
        url = f"{self.base_url}/completions"
        try:
            response = self.client.post(url, json=self.request_body(prompt, params, seed))
        except httpx.TransportError as err:
            raise _unreachable(self.base_url, f"POST {url}", err) from err
        if response.status_code != 200:
            raise RuntimeError(f"POST {url} returned {response.status_code}: {response.text[:500]}")
        return response.json()

    def _parse(self, choice: dict[str, Any]) -> Completion:
        text = choice.get("text") or ""
        logprobs = choice.get("logprobs") or {}
        tokens = logprobs.get("tokens") or []
        values = [lp if lp is not None else 0.0 for lp in logprobs.get("token_logprobs") or []]
        matches = [TOKEN_ID.match(t) for t in tokens]
        if tokens and all(matches):
            ids = [int(m.group(1)) for m in matches]
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            self.stats.extra["retokenized"] += 1
        return self._completion(ids, values, choice.get("finish_reason"))
