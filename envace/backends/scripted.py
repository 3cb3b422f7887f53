"""A deterministic `Generator` that replies from a script: for tests and for replaying reference
trajectories through the real rollout engine (so benchmarks' ground truth runs the same code path)."""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable

from envace.backends.base import Completion, GenStats, ParamsArg, PolicyWeights, per_session

# reply(session_text) -> the text the "model" writes next (its end marker is appended if missing)
Reply = Callable[[str], str]


class ScriptedGenerator:
    def __init__(self, tokenizer: Any, reply: Reply, end_marker: str | None = None):
        self.tokenizer = tokenizer
        self.reply = reply
        self.end_marker = end_marker if end_marker is not None else (tokenizer.eos_token or "")
        self.stats = GenStats()
        self.weights_version = 0
        self.sequences: dict[int, list[int]] = {}
        self._ids = itertools.count()
        # Paused generations (`pause_at`): per session, the output returned so far, the rest, its finish.
        self._paused: dict[int, tuple[list[int], list[int], str]] = {}

    # Like HFGenerator, it can pause rows (continuous batching): a script "samples" one token per
    # step, so the rows of a call finish in the order of their outputs' lengths.
    pauses_rows = True

    def open(self, n: int) -> list[int]:
        ids = [next(self._ids) for _ in range(n)]
        self.sequences.update({i: [] for i in ids})
        return ids

    def close(self, sessions: list[int]) -> None:
        for s in sessions:
            self.sequences.pop(s, None)
            self._paused.pop(s, None)

    def set_seed(self, seed: int) -> None:
        """A script draws nothing at random."""

    def sync_weights(self, weights: PolicyWeights) -> None:
        """A script has no weights; it records the version, as a real engine would."""
        self.weights_version = weights.version

    def generate(self, sessions: list[int], new_tokens: list[list[int]], params: ParamsArg, pause_at: float | None = None) -> list[Completion]:
        self.stats.calls += 1
        planned = []  # per row: output returned before this call, output still to come, finish reason
        for s, new, params in zip(sessions, new_tokens, per_session(params, len(sessions))):
            if s in self._paused:
                if new:
                    raise ValueError(f"session {s} was paused mid-generation: resume it with no new tokens")
                planned.append(self._paused.pop(s))
                continue
            seq = self.sequences[s]
            seq.extend(new)
            self.stats.prefill_tokens += len(new)
            text = self.reply(self.tokenizer.decode(seq))
            if self.end_marker and not text.endswith(self.end_marker):
                text += self.end_marker
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            finish = "stop"
            if len(ids) > params.max_new_tokens:
                ids, finish = ids[: params.max_new_tokens], "length"
            planned.append(([], ids, finish))
        # The call lasts until `pause_at` of its rows finished (all of them without pause_at).
        lengths = sorted(len(rest) for _, rest, _ in planned)
        steps = lengths[-1] if pause_at is None else lengths[max(1, math.ceil(pause_at * len(planned))) - 1]
        outs = []
        for s, (done, rest, finish) in zip(sessions, planned):
            now = rest[:steps]
            self.sequences[s].extend(now)
            self.stats.generated_tokens += len(now)
            ids = done + now
            if len(rest) > steps:
                self._paused[s] = (ids, rest[steps:], finish)
                finish = "paused"
            outs.append(Completion(ids, [0.0] * len(ids), finish, self.tokenizer.decode(ids)))
        return outs


def sequence_reply(replies: list[str]) -> Reply:
    """Reply with the given texts in order (shared across sessions), then an empty answer."""
    it = iter(replies)
    return lambda _text: next(it, "done")
