"""The default `Environment`: each task names its world (a registered name or `module:Class`),
or none (a world-free task: its own documentation and tools, and no world to execute calls in)."""

from __future__ import annotations

from typing import Any

from envace.envs.base import WORLDS, NoWorldError, ToolWorld
from envace.types import Task


class WorldEnvironment:
    """Builds a fresh world from the task's initial state (an empty one: the world's default).
    The agent's documentation is the task's `documentation` when it has one, else the world's
    `description`; its tools are the task's `tools` when it has them, else the world's."""

    def world_class(self, task: Task) -> type[ToolWorld]:
        if task.world is None:
            raise NoWorldError(task.id)
        return WORLDS.get(task.world)

    def make_world(self, task: Task) -> ToolWorld:
        return self.world_class(task)(task.initial_state)

    def describe(self, task: Task) -> tuple[str, list[dict[str, Any]]]:
        if task.world is None:  # a world-free task describes itself
            return task.documentation or "", task.tools if task.tools is not None else []
        cls = self.world_class(task)
        documentation = task.documentation if task.documentation is not None else cls.description
        return documentation, task.tools if task.tools is not None else cls.tool_schemas()
