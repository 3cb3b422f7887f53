"""Executable tool worlds. Importing this package registers the built-in worlds in `WORLDS`."""

from __future__ import annotations

from envace.envs import bank, calendar, files, shop, travel  # noqa: F401  (registration side effect)
from envace.envs.base import WORLDS, ToolError, ToolWorld, tool
from envace.registry import RegistryError

TRAIN_WORLDS = ("shop", "bank", "files", "calendar")
HELDOUT_WORLDS = ("travel",)  # never trained on: measures transfer to an unseen world


def get_world(name: str) -> type[ToolWorld]:
    """A registered world by name, or a user world given as 'module.path:ClassName'."""
    cls = WORLDS.get(name)
    if not (isinstance(cls, type) and issubclass(cls, ToolWorld)):
        raise RegistryError(f"environment {name!r} is {cls!r}, not a ToolWorld subclass")
    return cls


__all__ = ["WORLDS", "ToolWorld", "ToolError", "tool", "get_world", "TRAIN_WORLDS", "HELDOUT_WORLDS"]
