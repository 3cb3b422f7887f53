"""`envace tasks`: write built-in tasks to a JSONL task file (a starting point for your own).

With `--no-world` the tasks are written world-free (docs/tasks.md): each carries its world's tools
and description, and a reference trajectory whose tool responses were recorded by executing the
task's reference calls once, here, on a fresh world. Those executions are what world-free training
on the file really cost in world access, so they are printed and written to a sidecar
(`<output>.export.json`) that training reports (envace/accounting.py).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envace.accounting import export_sidecar
from envace.config import ConfigError, field
from envace.types import Task


@dataclass
class ExportConfig:
    output: str = field("tasks.jsonl", help="JSONL file to write")
    split: str = field("train", help="train | val | test | heldout")
    n_per_world: int = field(8, help="tasks per world")
    worlds: list[str] = field([], help="world names (default: all of the split)")
    difficulty: int | None = field(None, help="1-3 (default: mixed)")
    seed: int = field(0, help="generator seed")
    world: bool = field(True, help="--no-world: write world-free tasks, their reference responses recorded once at export time")

    def validate(self) -> None:
        if self.n_per_world < 1:
            raise ConfigError(f"n_per_world must be >= 1, got {self.n_per_world}")


def export_tasks(cfg: ExportConfig) -> dict[str, Any]:
    """Write the tasks; returns {"tasks", "world_executions", "source"} (the sidecar's content
    with --no-world; world tasks execute nothing here)."""
    from envace.envs.tasks import builtin_tasks

    tasks = builtin_tasks(cfg.split, cfg.n_per_world, worlds=cfg.worlds or None, difficulty=cfg.difficulty, seed=cfg.seed)
    source = f"builtin:{cfg.split} seed={cfg.seed} difficulty={cfg.difficulty or 'mixed'} worlds={','.join(sorted({t.world for t in tasks}))}"
    return write_task_file(tasks, cfg.output, world=cfg.world, source=source)


def write_task_file(tasks: list[Task], output: str | Path, world: bool, source: str) -> dict[str, Any]:
    """Write world tasks to `output` as they are, or (world=False) in their world-free form with
    the executions that recorded their references in the sidecar; returns the provenance
    ({"tasks", "world_executions", "source"})."""
    from envace.envs.tasks import save_tasks

    executions = 0
    if not world:
        tasks, executions = world_free_tasks(tasks)
    save_tasks(tasks, output)
    provenance = {"tasks": len(tasks), "world_executions": executions, "source": source}
    sidecar = export_sidecar(output)
    if world:
        sidecar.unlink(missing_ok=True)  # an earlier --no-world export's count no longer describes the file
        print(f"wrote {len(tasks)} tasks to {output}")
        return provenance
    sidecar.write_text(json.dumps(provenance, indent=2) + "\n", encoding="utf-8")
    print(f"exported {len(tasks)} tasks; {executions} tool executions at export time (wrote {output} and {sidecar})")
    return provenance


def world_free_tasks(tasks: list[Task]) -> tuple[list[Task], int]:
    """(the world-free form of each task, tool executions made to record their references)."""
    converted = [world_free_task(task) for task in tasks]
    return [task for task, _ in converted], sum(n for _, n in converted)


def world_free_task(task: Task) -> tuple[Task, int]:
    """(the world-free form of a world task, tool executions made). It keeps the task's id, its
    messages, checklist and reference calls; `metadata.exported_from` names the world it came
    from and `metadata.source_scenario` its scenario hash, to map it back (its `initial_state`
    and `success` are dropped: only a world can use them)."""
    from envace.envs.environment import WorldEnvironment
    from envace.envs.tasks import scenario_key

    env = WorldEnvironment()
    documentation, tools = env.describe(task)
    reference = recorded_reference(task, env.make_world(task))
    metadata = {**task.metadata, "exported_from": task.world, "source_scenario": scenario_key(task)}
    world_free = dataclasses.replace(task, world=None, initial_state={}, success={}, tools=tools, documentation=documentation,
                                     reference=reference, metadata=metadata)
    return world_free, sum(m["role"] == "tool" for m in reference)  # one execution per recorded response


def recorded_reference(task: Task, world: Any) -> list[dict[str, Any]]:
    """The task's reference trajectory as OpenAI-style messages, each reference call executed on
    `world` in order: one assistant message per call, each answered by the tool message holding the
    world's response, then the answer. The same turns as SFT's expert (`reference_replies`)."""
    reference: list[dict[str, Any]] = []
    for i, call in enumerate(task.reference_calls):
        call_id = f"call_{i}"
        arguments = call.get("arguments", {})
        response = world.call(call["name"], arguments)
        reference.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}]})
        reference.append({"role": "tool", "tool_call_id": call_id, "content": json.dumps(response, ensure_ascii=False)})
    reference.append({"role": "assistant", "content": str(task.metadata.get("reference_answer", "Done."))})
    return reference
