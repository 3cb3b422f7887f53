"""The default `Environment`: each task names its world (a registered name or `module:Class`)."""

from __future__ import annotations

from typing import Any

from envace.envs.base import WORLDS, ToolWorld
from envace.types import Task


class WorldEnvironment:
    """Builds a fresh world from the task's initial state (an empty one: the world's default);
    documentation comes from the world class."""

    def world_class(self, task: Task) -> type[ToolWorld]:
        return WORLDS.get(task.world)

    def make_world(self, task: Task) -> ToolWorld:
        return self.world_class(task)(task.initial_state)

    def describe(self, task: Task) -> tuple[str, list[dict[str, Any]]]:
        cls = self.world_class(task)
        return cls.description, task.tools if task.tools is not None else cls.tool_schemas()
