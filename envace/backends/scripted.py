"""A deterministic `Generator` that replies from a script: for tests and for replaying reference
trajectories through the real rollout engine (so benchmarks' ground truth runs the same code path)."""

from __future__ import annotations

import itertools
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

    def open(self, n: int) -> list[int]:
        ids = [next(self._ids) for _ in range(n)]
        self.sequences.update({i: [] for i in ids})
        return ids

    def close(self, sessions: list[int]) -> None:
        for s in sessions:
            self.sequences.pop(s, None)

    def set_seed(self, seed: int) -> None:
        """A script draws nothing at random."""

    def sync_weights(self, weights: PolicyWeights) -> None:
        """A script has no weights; it records the version, as a real engine would."""
        self.weights_version = weights.version

    def generate(self, sessions: list[int], new_tokens: list[list[int]], params: ParamsArg) -> list[Completion]:
        self.stats.calls += 1
        outs = []
        for s, new, params in zip(sessions, new_tokens, per_session(params, len(sessions))):
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
            seq.extend(ids)
            self.stats.generated_tokens += len(ids)
            outs.append(Completion(ids, [0.0] * len(ids), finish, self.tokenizer.decode(ids)))
        return outs


def sequence_reply(replies: list[str]) -> Reply:
    """Reply with the given texts in order (shared across sessions), then an empty answer."""
    it = iter(replies)
    return lambda _text: next(it, "done")
