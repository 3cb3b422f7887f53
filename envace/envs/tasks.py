"""The task data layer: the JSONL task format (docs/tasks.md) and the built-in splits.

Every problem in a task file is reported as a `TaskFormatError` naming the file, line, field and
the fix, before any model is loaded.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
from pathlib import Path
from typing import Any, Iterable, NoReturn

from envace.config import ConfigError
from envace.envs import HELDOUT_WORLDS, TRAIN_WORLDS, get_world
from envace.registry import RegistryError
from envace.types import EpisodeRules, Task

FIELDS = tuple(f.name for f in dataclasses.fields(Task))
REQUIRED = {
    "id": 'add a unique "id"',
    "world": 'add "world": a built-in world name or "module.path:ClassName"',
    "messages": 'add "messages": [{"role": "user", "content": "..."}]',
}
TYPES: dict[str, tuple[type, ...]] = {
    "id": (str,), "world": (str,), "messages": (list,), "user_turns": (list,), "initial_state": (dict,),
    "success": (dict,), "reference_calls": (list,), "checklist": (list,), "tools": (list, type(None)),
    "split": (str,), "difficulty": (int,), "hidden_state": (bool,), "rules": (dict,), "metadata": (dict,),
}
JSON_TYPES = {str: "string", list: "array", dict: "object", int: "integer", bool: "boolean", type(None): "null"}
ROLES = ("system", "user", "assistant", "tool")
SPLITS = {"train": TRAIN_WORLDS, "val": TRAIN_WORLDS, "test": TRAIN_WORLDS + HELDOUT_WORLDS, "heldout": HELDOUT_WORLDS}
# Share of the scenario-hash space owned by each split: a scenario belongs to exactly one split.
SPLIT_SHARES = (("train", 55), ("val", 15), ("test", 15), ("heldout", 15))


class TaskFormatError(ValueError):
    """A malformed task; the message says where (file:line), which field, and how to fix it."""


def _fail(where: str, field: str, problem: str, fix: str) -> NoReturn:
    raise TaskFormatError(f"{where}: field '{field}': {problem}; fix: {fix}")


def _show(value: Any) -> str:
    return json.dumps(value, default=repr)[:80]


# ---- reading and writing -------------------------------------------------------------------

def load_tasks(path: str | Path) -> list[Task]:
    """Read a JSONL task file: one task object per line; blank lines are skipped; `id` defaults to <stem>-<line>."""
    path = Path(path)
    if not path.is_file():
        raise TaskFormatError(f"{path}: task file not found; fix: give the path of a .jsonl file (docs/tasks.md)")
    tasks: list[Task] = []
    first_line: dict[str, int] = {}
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskFormatError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno}); "
                                  "fix: put each task on one line as one complete JSON object") from None
        if isinstance(data, dict):
            data.setdefault("id", f"{path.stem}-{lineno}")
        task = task_from_dict(data, where)
        if task.id in first_line:
            _fail(where, "id", f"{task.id!r} is already used on line {first_line[task.id]}", "give every task its own id")
        first_line[task.id] = lineno
        tasks.append(task)
    if not tasks:
        raise TaskFormatError(f"{path}: no tasks in the file; fix: write one JSON task object per line (docs/tasks.md)")
    return tasks


def save_tasks(tasks: Iterable[Task], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for task in tasks:
            f.write(json.dumps(dataclasses.asdict(task), ensure_ascii=False) + "\n")


# ---- validation ----------------------------------------------------------------------------

def task_from_dict(data: Any, where: str = "<task>") -> Task:
    """Validate one task object and build the `Task`, or raise `TaskFormatError`."""
    if not isinstance(data, dict):
        raise TaskFormatError(f"{where}: a task must be a JSON object, got {type(data).__name__}; "
                              'fix: write {"id": ..., "world": ..., "messages": [...]}')
    for key in sorted(data):
        if key not in FIELDS:
            close = difflib.get_close_matches(key, FIELDS, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            _fail(where, key, "unknown key", f"{hint}known keys: {', '.join(FIELDS)}")
    for key, fix in REQUIRED.items():
        if key not in data:
            _fail(where, key, "missing", fix)
    for key, kinds in TYPES.items():
        value = data.get(key)
        if key in data and (not isinstance(value, kinds) or (kinds == (int,) and isinstance(value, bool))):
            expected = " or ".join(JSON_TYPES[k] for k in kinds)
            _fail(where, key, f"expected {expected}, got {_show(value)}", f"make '{key}' a JSON {expected}")
    try:
        world = get_world(data["world"])
    except RegistryError as exc:
        _fail(where, "world", str(exc), "use a built-in world or 'module.path:ClassName' of an importable ToolWorld")
    _check_messages(where, data["messages"])
    _check_messages(where, data.get("user_turns", []), "user_turns", only_user=True)
    if "success" in data:
        _check_success(where, data["success"])
    tools = data.get("tools")
    names = [t.get("function", t).get("name") for t in tools if isinstance(t, dict)] if tools else world.tool_names()
    _check_calls(where, data.get("reference_calls", []), names)
    _check_checklist(where, data.get("checklist", []))
    if data.get("difficulty", 1) < 1:
        _fail(where, "difficulty", f"{data['difficulty']} is below 1", "use 1 (easy) to 3 (hard)")
    data = copy.deepcopy(data)  # a private copy: later edits never alias the caller's dict
    for call in data.get("reference_calls", []):
        call.setdefault("arguments", {})
    if "rules" in data:
        data["rules"] = _rules(where, data["rules"])
    return Task(**data)


def _rules(where: str, rules: dict[str, Any]) -> EpisodeRules:
    try:
        return EpisodeRules.from_dict(rules)
    except (ValueError, TypeError, KeyError) as exc:
        _fail(where, "rules", str(exc), 'write e.g. {"max_steps_per_turn": 20, "stop_tools": ["done"]} (docs/benchmarks.md)')


def _check_messages(where: str, messages: list[Any], field: str = "messages", only_user: bool = False) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            _fail(where, f"{field}[{i}]", f"not a message: {_show(m)}",
                  f'write {{"role": one of {", ".join(ROLES)}, "content": "text"}}')
        if only_user and m["role"] != "user":
            _fail(where, f"{field}[{i}].role", f"{m['role']!r} is not 'user'", "list only later user messages here")
    if field == "messages" and not any(m["role"] == "user" for m in messages):
        _fail(where, field, "no user message", 'add {"role": "user", "content": "<the request>"} (a system message is optional)')


def _check_success(where: str, spec: dict[str, Any]) -> None:
    for key in spec:
        if key not in ("state", "answer"):
            _fail(where, f"success.{key}", "unknown key", "use 'state' (a list of checks) and/or 'answer'")
    state = spec.get("state", [])
    if not isinstance(state, list):
        _fail(where, "success.state", "not a list", 'write [{"path": "a.b", "equals": value}, ...]')
    for i, cond in enumerate(state):
        ok = isinstance(cond, dict) and isinstance(cond.get("path"), str) and set(cond) in ({"path", "equals"}, {"path", "absent"})
        if not ok or cond.get("absent", True) is not True:
            _fail(where, f"success.state[{i}]", f"bad check {_show(cond)}",
                  'write {"path": "accounts.A1.balance", "equals": 90} or {"path": "files./tmp/x", "absent": true}')
    answer = spec.get("answer")
    if answer is not None and not _valid_answer(answer):
        _fail(where, "success.answer", f"bad answer check {_show(answer)}",
              'write {"contains": ["text", ...]} or {"number": 42, "tol": 0.01}')
    if not state and not answer:
        _fail(where, "success", "has no checks", "add 'state' assertions and/or an 'answer' check, or drop 'success' to grade with the judge only")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _valid_answer(answer: Any) -> bool:
    if not isinstance(answer, dict) or set(answer) - {"contains", "number", "tol"}:
        return False
    if "contains" in answer:
        words = answer["contains"]
        return isinstance(words, list) and bool(words) and all(isinstance(w, str) for w in words)
    return _is_number(answer.get("number")) and _is_number(answer.get("tol", 0))


def _check_calls(where: str, calls: list[Any], tool_names: list[str]) -> None:
    for i, call in enumerate(calls):
        field = f"reference_calls[{i}]"
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            _fail(where, f"{field}.name", "missing", 'write {"name": "<tool>", "arguments": {...}}')
        if set(call) - {"name", "arguments"} or not isinstance(call.get("arguments", {}), dict):
            _fail(where, field, f"bad call {_show(call)}", 'write {"name": "<tool>", "arguments": {...}} and nothing else')
        if call["name"] not in tool_names:
            _fail(where, f"{field}.name", f"unknown tool {call['name']!r}", f"use one of: {', '.join(tool_names)}")


def _check_checklist(where: str, checklist: list[Any]) -> None:
    for i, entry in enumerate(checklist):
        ok = isinstance(entry, dict) and isinstance(entry.get("item"), str) and set(entry) <= {"item", "weight"}
        weight = entry.get("weight", 1.0) if ok else None
        if not ok or not _is_number(weight) or weight <= 0:
            _fail(where, f"checklist[{i}]", f"bad item {_show(entry)}", 'write {"item": "what to check", "weight": 1.0} with weight > 0')


# ---- built-in splits -----------------------------------------------------------------------

def scenario_key(task: Task) -> str:
    """Identity of a scenario (world, initial state, solution), independent of its id, split and wording."""
    blob = json.dumps([task.world, task.initial_state, task.reference_calls], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def split_of(task: Task) -> str:
    bucket = int(scenario_key(task)[:8], 16) % 100
    for split, share in SPLIT_SHARES:
        if bucket < share:
            return split
        bucket -= share
    raise AssertionError("SPLIT_SHARES must add up to 100")


def builtin_tasks(split: str, n_per_world: int, worlds: Iterable[str] | None = None,
                  difficulty: int | None = None, seed: int = 0) -> list[Task]:
    """n_per_world distinct generated tasks per world. A scenario's hash decides its one split, so
    train, val, test and heldout never share a task. difficulty None mixes levels 1-3.
    Bad options raise `ConfigError` (a ValueError), reported by the CLI as one line."""
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    if difficulty not in (None, 1, 2, 3):
        raise ConfigError(f"difficulty must be 1, 2, 3 or None (mixed), got {difficulty!r}")
    return [task for name in (worlds or SPLITS[split]) for task in _draw(name, split, n_per_world, difficulty, seed)]


def _draw(name: str, split: str, n: int, difficulty: int | None, seed: int) -> list[Task]:
    cls = get_world(name)
    levels = [difficulty] if difficulty else [1, 2, 3]
    size = 8 * n // len(levels) + 8  # a split owns >= 15% of scenarios
    while True:
        # generate_tasks is prefix-stable, so a larger pool only appends; the picks stay the same.
        pools = [cls.generate_tasks(size, split, seed, level) for level in levels]
        picked, seen = [], set()
        for task in (t for group in zip(*pools) for t in group):
            task.world = name
            key = scenario_key(task)
            if key not in seen and split_of(task) == split:
                picked.append(task)
            seen.add(key)
        if len(picked) >= n or size > 64 * n + 64:
            break
        size *= 2
    if len(picked) < n:
        raise ConfigError(f"world {name!r} yields only {len(picked)} distinct {split} tasks, asked for {n}")
    for i, task in enumerate(picked[:n]):
        task.id = f"{name}-{split}-{seed}-{i}"
    return picked[:n]
