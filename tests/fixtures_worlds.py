"""A user-defined world living outside envace, loaded as `tests.fixtures_worlds:Library`."""

from __future__ import annotations

import random

from envace.envs.base import ToolError, ToolWorld, tool
from envace.types import Task

TITLES = ("Dune", "Emma", "Ulysses", "Beloved")


class Library(ToolWorld):
    name = "library"
    description = "A library. Book ids are the titles. borrow fails with UNAVAILABLE if the book is out."

    def default_state(self):
        return {"out": []}

    @tool("Borrow a book.", {"title": {"type": "string"}}, ["title"])
    def borrow(self, title):
        if title in self.state["out"]:
            raise ToolError("UNAVAILABLE", f"{title} is out")
        self.state["out"].append(title)
        return {"borrowed": title}

    @classmethod
    def make_task(cls, rng: random.Random, index: int, difficulty: int) -> Task:
        title, *others = rng.sample(TITLES, len(TITLES))
        out = others[: rng.randint(0, len(others))]
        return Task(id="", world="", messages=[{"role": "user", "content": f"Borrow {title}."}],
                    initial_state={"out": out}, success={"state": [{"path": "out", "equals": [*out, title]}]},
                    reference_calls=[{"name": "borrow", "arguments": {"title": title}}], difficulty=difficulty)
