"""Data manifests: which tasks a checkpoint was trained on, so evaluation can refuse leakage.
Training writes them and evaluation reads them, so this module depends on neither.

Every training run writes `data_manifest.json` into its run directory and into its exported
model directory. A run that starts from another checkpoint (`--init-from`) inherits that
checkpoint's manifest, so SFT -> GRPO chains carry every task they saw.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from envace.accounting import WorldExecutions
from envace.types import Task

MANIFEST = "data_manifest.json"


def scenario_keys(tasks: list[Task]) -> list[str]:
    """The tasks' scenarios; a world-free task exported from a world task (`envace tasks
    --no-world`) counts as its source scenario, so evaluating on that world task is leakage too."""
    from envace.envs.tasks import scenario_key

    return sorted({t.metadata.get("source_scenario") or scenario_key(t) for t in tasks})


def read_manifest(model_dir: str | Path | None) -> dict[str, Any] | None:
    path = Path(model_dir) / MANIFEST if model_dir else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


def build_manifest(tasks: list[Task], parent_model: str | None, **extra: Any) -> dict[str, Any]:
    parent = read_manifest(parent_model) or {"task_ids": [], "scenario_keys": []}
    return {
        "task_ids": sorted(set(parent["task_ids"]) | {t.id for t in tasks}),
        "scenario_keys": sorted(set(parent["scenario_keys"]) | set(scenario_keys(tasks))),
        **extra,
    }


def inherited_executions(parent_model: str | None) -> WorldExecutions:
    """The world executions of the checkpoint chain that `parent_model` ends (0 without a manifest)."""
    return WorldExecutions.from_dict((read_manifest(parent_model) or {}).get("world_executions"))


def with_executions(manifest: dict[str, Any], chain: WorldExecutions) -> dict[str, Any]:
    """The manifest recording `chain`: every world execution that made the checkpoint."""
    return manifest | {"world_executions": chain.as_dict()}


def write_manifest(manifest: dict[str, Any], *dirs: Path) -> None:
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        (d / MANIFEST).write_text(json.dumps(manifest))


def overlap(model_dir: str | Path, tasks: list[Task]) -> list[str]:
    """Ids of evaluation tasks that the model at `model_dir` was trained on (by id or scenario)."""
    manifest = read_manifest(model_dir)
    if manifest is None:
        return []
    ids, keys = set(manifest["task_ids"]), set(manifest["scenario_keys"])
    from envace.envs.tasks import scenario_key

    return [t.id for t in tasks if t.id in ids or scenario_key(t) in keys]
