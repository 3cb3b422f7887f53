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

from envace.accounting import WorldExecutions, task_data_exports
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


def task_data_chain(parent_model: str | None, tasks_file: str | Path | None) -> dict[str, int]:
    """The recordings of world-free task files behind a run: its parent chain's and its own task
    file's, each once (`accounting.task_data_exports`)."""
    parent = read_manifest(parent_model) or {}
    exports = dict(parent.get("task_data_exports") or {})
    legacy = inherited_executions(parent_model).task_data
    if legacy and not exports:  # a manifest from before recordings were keyed: kept as counted
        exports[f"inherited:{parent_model}"] = legacy
    return exports | task_data_exports(tasks_file)


def chain_executions(parent_model: str | None, tasks_file: str | Path | None, own: WorldExecutions) -> WorldExecutions:
    """Every world execution behind a run's model: its parent chain's, recording its task file,
    and its own (`own`: rollouts, verification, grounding, SFT data)."""
    chain = inherited_executions(parent_model) + own
    chain.task_data = sum(task_data_chain(parent_model, tasks_file).values())
    return chain


def with_executions(manifest: dict[str, Any], parent_model: str | None, tasks_file: str | Path | None, own: WorldExecutions) -> dict[str, Any]:
    """The manifest recording every world execution that made the checkpoint (`chain_executions`),
    and which task-file recordings they include, so that the next run of the chain counts each once."""
    return manifest | {"world_executions": chain_executions(parent_model, tasks_file, own).as_dict(),
                       "task_data_exports": task_data_chain(parent_model, tasks_file)}


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
