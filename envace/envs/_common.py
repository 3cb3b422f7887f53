"""Machinery shared by the built-in worlds: canonical responses, id helpers, and the reference
`Script` that solves a generated task against a live world and freezes it into a `Task`.

Generated success specs are read from the state the reference solution actually produced, so a
task's spec, its reference calls and the world's dynamics cannot drift apart.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any, Callable, ClassVar

from envace.envs.base import ToolError, ToolWorld
from envace.types import Task


def canonical(obj: Any) -> Any:
    """Sort dict keys recursively: every response has exactly one textual form to imitate."""
    if isinstance(obj, dict):
        return {k: canonical(obj[k]) for k in sorted(obj)}
    if isinstance(obj, list):
        return [canonical(v) for v in obj]
    return obj


def money(x: float) -> int | float:
    """Round to cents; whole amounts stay ints so 12 prints as 12, not 12.0."""
    x = round(float(x), 2)
    return int(x) if x.is_integer() else x


def _id_key(key: str) -> tuple[str, int]:
    m = re.fullmatch(r"(\D*)(\d+)", key)
    return (m[1], int(m[2])) if m else (key, -1)


def ordered(table: dict[str, Any]) -> list[tuple[str, Any]]:
    """Items of an id-keyed table in documented order: E2 before E10."""
    return sorted(table.items(), key=lambda kv: _id_key(kv[0]))


def next_id(table: dict[str, Any], prefix: str) -> str:
    """Records are never removed (cancelled ones keep their id), so ids are <prefix><count + 1>."""
    return f"{prefix}{len(table) + 1}"


def lookup(table: dict[str, Any], key: str, what: str) -> Any:
    if key not in table:
        raise ToolError("NOT_FOUND", f"no {what} {key!r}")
    return table[key]


def arg(kind: str, description: str = "", **extra: Any) -> dict[str, Any]:
    """A JSON-schema property for a tool argument."""
    return {"type": kind, **({"description": description} if description else {}), **extra}


class World(ToolWorld):
    """Base of the built-in worlds: canonical responses and the shared task recipe.

    A world lists task `families`: functions `(rng, difficulty) -> Task` whose user message is
    only the request. `make_task` picks one, makes every 4th task hidden-state, and prepends the
    world's `facts` (its initial state in words) to the request of the others.
    """

    families: ClassVar[tuple[Callable[[random.Random, int], Task], ...]] = ()

    def call(self, name: str, arguments: Any) -> dict[str, Any]:
        return canonical(super().call(name, arguments))

    @classmethod
    def facts(cls, state: dict[str, Any]) -> str:
        raise NotImplementedError

    @classmethod
    def make_task(cls, rng: random.Random, index: int, difficulty: int) -> Task:
        family = rng.choice(cls.families)
        task = family(rng, difficulty)
        task.difficulty = difficulty
        task.hidden_state = index % 4 == 3
        if not task.hidden_state:
            request = task.messages[0]["content"]
            task.messages[0]["content"] = f"{cls.facts(task.initial_state)}\n{request}"
        task.metadata["family"] = family.__name__
        return task


class Script:
    """Runs a reference solution on a live world, recording each call; `task` freezes the result."""

    def __init__(self, world_cls: type[ToolWorld], state: dict[str, Any]):
        self.world = world_cls(state)
        self.initial = self.world.snapshot()
        self.calls: list[dict[str, Any]] = []

    def __call__(self, name: str, **arguments: Any) -> dict[str, Any]:
        # The method itself, not `call`: jsonschema re-checks the schema on every `call` (~10 ms), and
        # the replay tests run every reference call through `call`, schema validation included.
        try:
            result = getattr(self.world, name)(**arguments)
        except ToolError as exc:  # a generator bug, never a task property
            raise RuntimeError(f"reference call {name}({arguments}) failed: {exc.code}: {exc.message}") from None
        self.calls.append({"name": name, "arguments": arguments})
        return canonical(json.loads(json.dumps(result)))

    def task(self, request: str, *, check: tuple[str, ...] = (), answer: Any = None, candidates: tuple[str, ...] = (),
             checklist: tuple[tuple[str, float], ...] = ()) -> Task:
        """`check` names top-level tables whose every record must end as the reference left it;
        every other table the reference left alone must stay `unchanged` (a transfer, a booking
        or an edit the task did not ask for fails it). `candidates`: the values a `contains`
        answer could name (it may name only the right ones)."""
        states = [c for table in check for c in _state_checks(self.initial, self.world.state, table)]
        states += [{"path": table, "unchanged": True} for table in sorted(self.initial)
                   if table not in check and self.world.state.get(table) == self.initial[table]]
        success: dict[str, Any] = {"state": states} if states else {}
        metadata: dict[str, Any] = {}
        items = list(checklist)
        if answer is not None:  # a number, a string, or a list of strings that must all appear
            words = answer if isinstance(answer, list) else [answer]
            success["answer"] = ({"number": answer, "tol": 0.01} if isinstance(answer, (int, float))
                                 else {"contains": words, **({"candidates": list(candidates)} if candidates else {})})
            metadata["reference_answer"] = " and ".join(map(str, words))
            items.append((f"The final answer states {metadata['reference_answer']}", 1.0))
        return Task(
            id="", world=self.world.name, messages=[{"role": "user", "content": request}],
            initial_state=self.initial, success=success, reference_calls=self.calls,
            checklist=[{"item": item, "weight": weight} for item, weight in items], metadata=metadata,
        )


def _state_checks(before: dict[str, Any], after: dict[str, Any], table: str) -> list[dict[str, Any]]:
    """One check per record (so a verifier reports which record is wrong); whole value otherwise."""
    new = after.get(table)
    keys = sorted(set(before.get(table) or {}) | set(new), key=_id_key) if isinstance(new, dict) else []
    if not keys:
        return [{"path": table, "equals": new}]
    return [{"path": f"{table}.{k}", "equals": new[k]} if k in new else {"path": f"{table}.{k}", "absent": True}
            for k in keys]
