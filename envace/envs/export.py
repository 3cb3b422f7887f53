"""`envace tasks`: write built-in tasks to a JSONL task file (a starting point for your own)."""

from __future__ import annotations

from dataclasses import dataclass

from envace.config import ConfigError, field


@dataclass
class ExportConfig:
    output: str = field("tasks.jsonl", help="JSONL file to write")
    split: str = field("train", help="train | val | test | heldout")
    n_per_world: int = field(8, help="tasks per world")
    worlds: list[str] = field([], help="world names (default: all of the split)")
    difficulty: int | None = field(None, help="1-3 (default: mixed)")
    seed: int = field(0, help="generator seed")

    def validate(self) -> None:
        if self.n_per_world < 1:
            raise ConfigError(f"n_per_world must be >= 1, got {self.n_per_world}")


def export_tasks(cfg: ExportConfig) -> None:
    from envace.envs.tasks import builtin_tasks, save_tasks

    tasks = builtin_tasks(cfg.split, cfg.n_per_world, worlds=cfg.worlds or None, difficulty=cfg.difficulty, seed=cfg.seed)
    save_tasks(tasks, cfg.output)
    print(f"wrote {len(tasks)} tasks to {cfg.output}")
