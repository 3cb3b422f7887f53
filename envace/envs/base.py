"""The executable tool-world contract.

A `ToolWorld` holds JSON-serialisable state, exposes tools as methods decorated with `@tool`
(OpenAI function schemas), validates every call against its schema, and turns any bad call
into the error a real service would return: the rollout never crashes on a tool call. A tool
that raises something other than `ToolError` (a bug) answers `TOOL_EXCEPTION` and is logged.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import random
import re
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import jsonschema

from envace.registry import Registry
from envace.types import Task, ToolCall

WORLDS: Registry[type["ToolWorld"]] = Registry("environment")

logger = logging.getLogger(__name__)

# The error code of a tool that raised an unexpected exception (metrics count them by this code).
TOOL_EXCEPTION = "TOOL_EXCEPTION"


class NoWorldError(ValueError):
    """A world was asked of a world-free task (`Task.world` is None). Commands refuse such
    options before any model loads (`envace.envs.tasks.require_worlds`); this is the guard for
    code that reaches a world anyway."""

    def __init__(self, task_id: str):
        super().__init__(f"world-free task {task_id} has no executable world: roll it out with --mode rehearse (or recorded), "
                         "grade it with a world-free reward (judge, reference), or give the task a \"world\"")
        self.task_id = task_id


class ToolError(Exception):
    """Raised inside a tool to return a service error: {"error": {"code", "message"}}."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def tool(description: str, properties: dict[str, Any] | None = None, required: list[str] | None = None):
    """Mark a world method as a tool and attach its OpenAI function schema."""

    def mark(fn: Callable) -> Callable:
        fn.__tool_schema__ = {
            "type": "function",
            "function": {
                "name": fn.__name__,
                "description": description,
                "parameters": {
                    "type": "object",
                    "properties": properties or {},
                    "required": list(required or []),
                    "additionalProperties": False,
                },
            },
        }
        return fn

    return mark


def error(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


class ToolWorld:
    """Base class for executable worlds. Subclasses define `@tool` methods and `generate_tasks`."""

    name: ClassVar[str] = ""
    # Documentation the agent sees (system prompt): states the rules that make responses predictable.
    description: ClassVar[str] = ""
    # Tools whose effect cannot be undone (checked by the pre-commit rehearsal guard).
    irreversible_tools: ClassVar[frozenset[str]] = frozenset()
    # False for worlds that answer calls without running them: replaying calls there verifies nothing.
    executable: ClassVar[bool] = True

    def __init__(self, state: dict[str, Any] | None = None):
        self.state: dict[str, Any] = {}
        # Calls whose tool raised an unexpected exception (answered TOOL_EXCEPTION) in this world's life.
        self.tool_exceptions = 0
        self.reset(state)

    # ---- state -------------------------------------------------------------------------
    def reset(self, state: dict[str, Any] | None = None) -> None:
        """Start from `state`; None or an empty mapping means `default_state()`. Tasks that give no
        `initial_state` hold `{}` (the Task default), and they mean the world's default, not nothing."""
        self.state = copy.deepcopy(state) if state else self.default_state()

    def default_state(self) -> dict[str, Any]:
        return {}

    def snapshot(self) -> dict[str, Any]:
        return copy.deepcopy(self.state)

    # ---- tools -------------------------------------------------------------------------
    @classmethod
    def _schemas(cls) -> dict[str, dict[str, Any]]:
        """name -> schema, collected once per class."""
        if "_schema_map" not in cls.__dict__:
            found = (getattr(getattr(cls, a, None), "__tool_schema__", None) for a in sorted(dir(cls)))
            cls._schema_map = {s["function"]["name"]: s for s in found if s is not None}
        return cls._schema_map

    @classmethod
    def _validator(cls, name: str) -> jsonschema.protocols.Validator:
        """One compiled validator per tool: validating is on the hot path of rollouts and replays."""
        if "_validators" not in cls.__dict__:
            cls._validators = {}
        if name not in cls._validators:
            cls._validators[name] = jsonschema.Draft202012Validator(cls._schemas()[name]["function"]["parameters"])
        return cls._validators[name]

    @classmethod
    def tool_schemas(cls) -> list[dict[str, Any]]:
        return copy.deepcopy(list(cls._schemas().values()))

    @classmethod
    def tool_names(cls) -> list[str]:
        return list(cls._schemas())

    def call(self, name: str, arguments: Any) -> dict[str, Any]:
        """Execute one call. Always returns a JSON object; errors are observations, not exceptions."""
        if name not in self._schemas():
            return error("TOOL_NOT_FOUND", f"unknown tool {name!r}; available: {', '.join(self.tool_names())}")
        if not isinstance(arguments, dict):
            return error("INVALID_ARGUMENTS", f"arguments must be a JSON object, got {type(arguments).__name__}")
        problem = next(iter(self._validator(name).iter_errors(arguments)), None)
        if problem is not None:
            where = ".".join(str(p) for p in problem.absolute_path) or "arguments"
            return error("INVALID_ARGUMENTS", f"{where}: {problem.message}")
        try:
            result = getattr(self, name)(**arguments)
            # Round-trip through JSON so observations are exactly what a service would send (a
            # result JSON cannot encode is a tool bug too, so it is inside the guard).
            return json.loads(json.dumps(result if isinstance(result, dict) else {"result": result}))
        except ToolError as exc:
            return error(exc.code, exc.message)
        except Exception as exc:  # a bug in the tool must not end the rollout or the replay reward
            return self.tool_exception(name, exc)

    def tool_exception(self, name: str, exc: Exception) -> dict[str, Any]:
        """The observation for a tool `name` that raised `exc` unexpectedly: a TOOL_EXCEPTION error.
        Logs the traceback once and counts it in `tool_exceptions`. Worlds that override `call`
        use it for whatever their own execution did not expect."""
        self.tool_exceptions += 1
        logger.warning("tool %r of world %s raised %s", name, type(self).__name__, type(exc).__name__, exc_info=exc)
        return error(TOOL_EXCEPTION, f"{name} raised {type(exc).__name__}: {exc}")

    def execute(self, call: ToolCall) -> dict[str, Any]:
        return self.call(call.name, call.arguments)

    # ---- tasks -------------------------------------------------------------------------
    @classmethod
    def generate_tasks(cls, n: int, split: str, seed: int = 0, difficulty: int = 1) -> list[Task]:
        """Seeded task generator. Subclasses implement `make_task(rng, index, difficulty)`."""
        rng = random.Random(f"{cls.name}:{split}:{seed}")
        tasks = []
        for i in range(n):
            task = cls.make_task(rng, i, difficulty)
            task.split = split
            task.id = f"{cls.name}-{split}-{seed}-{i}"
            task.world = cls.name
            tasks.append(task)
        return tasks

    @classmethod
    def make_task(cls, rng: random.Random, index: int, difficulty: int) -> Task:
        raise NotImplementedError(f"{cls.__name__} does not generate tasks")

    # ---- verification ------------------------------------------------------------------
    def verify(self, task: Task, final_answer: str | None) -> Verdict:
        """Check the task's success spec against this world's current state and the answer; the
        state the task started from tells which checks guard against side effects."""
        # Read only, so the task's own dict serves (no copy on the reward's per-rollout path).
        return check_success(task.success, self.state, final_answer, task.initial_state or self.default_state())


def get_path(state: Any, path: str) -> Any:
    """Read 'a.b.0.c' from nested dicts/lists; raises KeyError if absent."""
    node = state
    for part in path.split(".") if path else []:
        if isinstance(node, list):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise KeyError(path)
    return node


MAX_ANSWER_NUMBERS = 4


@dataclass
class Check:
    """One check of a success spec. A guard asserts what the task's initial state already held
    (a record the task must not touch, a table left `unchanged`): doing nothing passes it, so it
    earns no partial credit, and failing it is a side effect the task did not ask for."""

    name: str
    ok: bool
    got: Any
    weight: float = 1.0
    guard: bool = False


@dataclass
class Verdict:
    """The verifier's result. `success` (every check passes) is the headline metric;
    `partial` is the partial-credit reward: the weighted fraction of the goal checks passed, 0
    when any guard fails (a side effect must not be paid for by the checks it did not break),
    1 for a spec whose checks are all guards and pass."""

    checks: list[Check]

    @property
    def success(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def partial(self) -> float:
        if not all(c.ok for c in self.checks if c.guard):
            return 0.0
        goals = [c for c in self.checks if not c.guard]
        total = sum(c.weight for c in goals)
        return sum(c.weight for c in goals if c.ok) / total if goals else 1.0

    def details(self) -> dict[str, Any]:
        """For reading (`Trajectory.reward_details`)."""
        return {"checks": [dataclasses.asdict(c) for c in self.checks], "passed": sum(c.ok for c in self.checks),
                "total": len(self.checks), "partial": self.partial}


_ID = re.compile(r"([A-Za-z]+)\d+")


def _answer_numbers(text: str) -> list[float]:
    return [float(m.replace(",", "").rstrip(".")) for m in re.findall(r"-?\d[\d,]*\.?\d*", text)]


def _contains_word(text: str, needle: str) -> bool:
    """Case-insensitive match that does not cut words or numbers: "3" is not found in "30"."""
    return re.search(rf"(?<![\w.]){re.escape(needle.lower())}(?![\w]|\.\d)", text.lower()) is not None


def _named_candidates(text: str, needles: list[str], candidates: list[str]) -> set[str]:
    """The distinct candidates the answer names: the spec's own `candidates`, and every id of the
    shape of an id-like needle (`F123` -> every `F<digits>` in the answer)."""
    named = {c.lower() for c in candidates if _contains_word(text, c)}
    for prefix in {m[1] for n in needles if (m := _ID.fullmatch(n))}:
        named |= {w.lower() for w in re.findall(rf"(?<![\w.]){re.escape(prefix)}\d+(?!\w)", text, flags=re.IGNORECASE)}
    return named


def _answer_ok(spec: dict[str, Any], text: str) -> bool:
    if "contains" in spec:
        needles = [str(s) for s in spec["contains"]]
        # Naming every candidate must not pass (reward hacking): the answer may name no more
        # candidates (ids of a needle's shape, or the spec's `candidates`) than it must.
        named = _named_candidates(text, needles, [str(c) for c in spec.get("candidates", [])])
        return all(_contains_word(text, n) for n in needles) and len(named) <= len({n.lower() for n in needles})
    if "number" in spec:
        tol = spec.get("tol", 1e-6)
        numbers = _answer_numbers(text)
        # An answer that lists many numbers must not pass by enumeration (reward hacking).
        return len(set(numbers)) <= MAX_ANSWER_NUMBERS and any(abs(x - spec["number"]) <= tol for x in numbers)
    raise ValueError(f"answer spec needs 'contains' or 'number', got {spec}")


def _read(state: Any, path: str) -> tuple[bool, Any]:
    try:
        return True, get_path(state, path)
    except (KeyError, IndexError, ValueError):
        return False, None


def _state_check(cond: dict[str, Any], state: dict[str, Any], initial: dict[str, Any] | None) -> Check:
    path = cond["path"]
    present, value = _read(state, path)
    was_present, was = _read(initial, path) if initial is not None else (None, None)
    if cond.get("unchanged"):
        if initial is None:
            raise ValueError(f"state check {path}: 'unchanged' needs the task's initial state")
        ok, guard = (present, value) == (was_present, was), True
    elif cond.get("absent"):
        ok, guard = not present, was_present is False
    else:
        ok, guard = present and value == cond.get("equals"), bool(was_present) and was == cond.get("equals")
    return Check(f"state {path}", ok, value, float(cond.get("weight", 1.0)), guard)


def check_success(spec: dict[str, Any], state: dict[str, Any], final_answer: str | None,
                  initial: dict[str, Any] | None = None) -> Verdict:
    """Deterministic verifier over a success spec (documented in docs/tasks.md).

    spec = {"state": [{"path": "...", "equals": v} | {"path": "...", "absent": true} | {"path": "...", "unchanged": true}],
            "answer": {"contains": [str, ...], "candidates"?: [str, ...]} | {"number": x, "tol": t}}
    Each check may carry a "weight" (default 1) for partial credit. `contains` matches whole
    words/numbers case-insensitively and fails when the answer names more candidates than it
    must; `number` passes when a number in the answer is within `tol` and the answer holds at
    most MAX_ANSWER_NUMBERS distinct numbers. With `initial` (the state the task started from),
    checks that assert what it already held are guards (`Check.guard`).
    """
    checks = [_state_check(cond, state, initial) for cond in spec.get("state", [])]
    answer_spec = spec.get("answer")
    if answer_spec:
        text = final_answer or ""
        checks.append(Check("answer", _answer_ok(answer_spec, text), text[:200], float(answer_spec.get("weight", 1.0))))
    if not checks:
        raise ValueError("success spec has no checks: give 'state' assertions and/or an 'answer'")
    return Verdict(checks)
