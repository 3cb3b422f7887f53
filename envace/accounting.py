"""Executions in a real, executable world, counted by purpose.

A claim like "trained with no environment" must count every execution, not only the rollouts':
  rollout       a tool call answered by the real world while rolling out (real mode, real-grpo,
                the real share of `--real-fraction`)
  verification  a call re-run on a fresh world after a rollout: reward replays (`replay`) and the
                fidelity reference of rehearsed trajectories
  grounding     a reference call run to ground the rehearser (tasks without a recorded
                reference): the isolated simulator prompt's examples, the reference rows of
                `--rehearse-sft-coef`
  sft_data      executed to make warm-start data (SFT on a world's tasks: the reference replay and
                its verification)
  task_data     executed once to record world-free tasks' references (`envace tasks --no-world`,
                the tau2 train-split converter), read from the task file's `.export.json`; a
                recording used by several runs of a chain is counted once
A checkpoint's manifest carries its chain's counts (SFT -> GRPO), so the final model reports what
made it. A run on world-free tasks from a world-free warm start reports 0 in every column.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from envace.types import Trajectory


@dataclass
class WorldExecutions:
    rollout: int = 0
    verification: int = 0
    grounding: int = 0
    sft_data: int = 0
    task_data: int = 0

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))

    def __add__(self, other: WorldExecutions) -> WorldExecutions:
        return WorldExecutions(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self) | {"total": self.total}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> WorldExecutions:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: int(v) for k, v in (data or {}).items() if k in names})

    @classmethod
    def of(cls, trajectories: Iterable[Trajectory]) -> WorldExecutions:
        """What rolling out and scoring these trajectories executed."""
        out = cls()
        for t in trajectories:
            out.rollout += t.real_env_calls
            out.verification += len(t.real_observations or [])
            out.grounding += t.grounding_calls
        return out


def export_sidecar(tasks_file: str | Path) -> Path:
    """Where an exporter writes how many executions recording a task file took."""
    return Path(f"{tasks_file}.export.json")


def task_data_exports(tasks_file: str | Path | None) -> dict[str, int]:
    """{sha256 of the task file: the executions that recorded its references}, or {} without a
    sidecar (a task file written by hand, or one whose tasks name their world and record
    nothing). Keyed by content, so that a chain training twice on one recording (SFT, then GRPO
    on the same file) counts the executions that made it once."""
    if not tasks_file or not export_sidecar(tasks_file).is_file():
        return {}
    digest = hashlib.sha256(Path(tasks_file).read_bytes()).hexdigest()
    return {digest: int(json.loads(export_sidecar(tasks_file).read_text()).get("world_executions", 0))}
