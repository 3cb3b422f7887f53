"""The task data layer: the JSONL task format (docs/tasks.md) and the built-in splits.

Every problem in a task file is reported as a `TaskFormatError` naming the file, line, field and
the fix, before any model is loaded. A task may be world-free (`world` absent or null): it then
carries its own `tools`, and usually a recorded `reference` (envace/references.py);
`require_worlds` refuses, before any model loads, the options that would need a world.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
from pathlib import Path
from typing import Any, Iterable, Mapping, NoReturn, Sequence

from envace.config import ConfigError
from envace.envs import HELDOUT_WORLDS, TRAIN_WORLDS, get_world
from envace.references import ReferenceError, call_key, parse_reference
from envace.registry import RegistryError
from envace.types import EpisodeRules, Task

FIELDS = tuple(f.name for f in dataclasses.fields(Task))
REQUIRED = {
    "id": 'add a unique "id"',
    "messages": 'add "messages": [{"role": "user", "content": "..."}]',
}
TYPES: dict[str, tuple[type, ...]] = {
    "id": (str,), "world": (str, type(None)), "messages": (list,), "user_turns": (list,), "initial_state": (dict,),
    "success": (dict,), "reference_calls": (list,), "reference": (list, type(None)), "checklist": (list,),
    "tools": (list, type(None)), "documentation": (str, type(None)), "split": (str,), "difficulty": (int,),
    "hidden_state": (bool,), "rules": (dict,), "metadata": (dict,),
}
# Fields a world-free task cannot use, each with what to do instead. They mean something only to
# an executable world; an empty value (what `dataclasses.asdict` writes) is the same as none.
NEEDS_A_WORLD = {
    "initial_state": "describe the situation in 'messages' or 'documentation' and record the responses in 'reference', or name a \"world\"",
    "success": "grade with a 'checklist' and the judge or reference reward, or name a \"world\"",
}
REFERENCE_FIX = ("write OpenAI-style messages: assistant (with 'tool_calls'), then one tool message per call in order, "
                 "then later user messages (docs/tasks.md)")
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
    """Write tasks as JSONL that `load_tasks` reads back to equal tasks."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for task in tasks:
            f.write(json.dumps(task_to_dict(task), ensure_ascii=False) + "\n")


# The value of every optional field of a Task built from nothing but its required fields.
_DEFAULTS = {k: v for k, v in dataclasses.asdict(Task(id="", world=None, messages=[])).items() if k not in ("id", "world", "messages")}


def task_to_dict(task: Task) -> dict[str, Any]:
    """`dataclasses.asdict(task)` without the fields that hold their default: loading restores
    them, and an empty `success` or `initial_state` written out would read as a mistake (a
    success spec with no checks; a world-free task with a world's state)."""
    return {k: v for k, v in dataclasses.asdict(task).items() if k not in _DEFAULTS or v != _DEFAULTS[k]}


# ---- what needs a world --------------------------------------------------------------------

def require_worlds(tasks: Sequence[Task], needs: Mapping[str, str]) -> None:
    """Refuse, before any model loads, the options in use that need an executable world when a
    task has none. `needs` maps each such option (as the user wrote it) to what to use instead;
    the one rule every command applies, so that they all word it the same way."""
    free = [t.id for t in tasks if t.world is None]
    if not free or not needs:
        return
    more = f" (and {len(free) - 1} more of the {len(tasks)} tasks)" if len(free) > 1 else ""
    reasons = "; ".join(f"{option} needs one: {alternative}" for option, alternative in needs.items())
    raise ConfigError(f"task {free[0]}{more} is world-free (no executable world): {reasons}; or give the task a \"world\"")


# ---- validation ----------------------------------------------------------------------------

def task_from_dict(data: Any, where: str = "<task>") -> Task:
    """Validate one task object and build the `Task`, or raise `TaskFormatError`. A `reference`
    fills in `reference_calls` and `user_turns` where the task leaves them out."""
    _check_keys_and_types(where, data)
    tool_names = _tool_names_of(where, data)
    _check_messages(where, data["messages"])
    _check_messages(where, data.get("user_turns", []), "user_turns", only_user=True)
    if data.get("world") is not None and "success" in data:
        _check_success(where, data["success"])
    _check_calls(where, data.get("reference_calls", []), tool_names)
    data = copy.deepcopy(data)  # a private copy: later edits never alias the caller's dict
    if data.get("reference") is not None:
        _apply_reference(where, data, tool_names)
    if "rules" in data:
        data["rules"] = _rules(where, data["rules"])
    if data.get("world") is None and data.get("rules", EpisodeRules()).user_uses_world:
        _fail(where, "rules.user_uses_world", "the simulated user acts on the task's world, and this task has none",
              'drop "user_uses_world", or name a "world"')
    _check_checklist(where, data.get("checklist", []), _user_turn_count(data))
    if data.get("difficulty", 1) < 1:
        _fail(where, "difficulty", f"{data['difficulty']} is below 1", "use 1 (easy) to 3 (hard)")
    for call in data.get("reference_calls", []):
        call.setdefault("arguments", {})
    data.setdefault("world", None)
    return Task(**data)


def _check_keys_and_types(where: str, data: Any) -> None:
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


def _tool_names_of(where: str, data: dict[str, Any]) -> list[str]:
    """The tools the task's calls may name: its own `tools`, else its world's. A world-free task
    has nothing else to take them from, nor anything that could use a world's fields."""
    tools = data.get("tools")
    if data.get("world") is None:
        if tools is None:
            _fail(where, "tools", "missing: a task without a world must list the tools the agent can call",
                  'add "tools": [{"type": "function", "function": {"name": ..., "parameters": {...}}}], or name a "world"')
        for key, fix in NEEDS_A_WORLD.items():
            if data.get(key):
                _fail(where, key, "needs an executable world, and this task has none (no 'world')", fix)
        return _schema_names(where, tools)
    try:
        world = get_world(data["world"])
    except RegistryError as exc:
        _fail(where, "world", str(exc), "use a built-in world or 'module.path:ClassName' of an importable ToolWorld")
    return _schema_names(where, tools) if tools is not None else world.tool_names()


def _schema_names(where: str, tools: list[Any]) -> list[str]:
    names = []
    for i, schema in enumerate(tools):
        fn = schema.get("function", schema) if isinstance(schema, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            _fail(where, f"tools[{i}]", f"not a function schema: {_show(schema)}",
                  'write {"type": "function", "function": {"name": "<tool>", "description": ..., "parameters": {...}}}')
        names.append(fn["name"])
    return names


def _apply_reference(where: str, data: dict[str, Any], tool_names: list[str]) -> None:
    """Check `reference` and fill in (or check against it) `reference_calls` and `user_turns`."""
    turns, later_users = _parse_reference(where, data["reference"])
    calls = [{"name": c["name"], "arguments": c["arguments"]} for turn in turns for c in turn.calls]
    for i, call in enumerate(calls):
        if call["name"] not in tool_names:
            _fail(where, "reference", f"call {i} names unknown tool {call['name']!r}", f"use one of: {', '.join(tool_names)}")
    # Absent reference_calls are derived from the reference by `Task` itself.
    if "reference_calls" in data:
        _check_same_calls(where, data["reference_calls"], calls)
    users = [{"role": "user", "content": text} for text in later_users]
    if "user_turns" not in data:
        data["user_turns"] = users
    elif users and [m["content"] for m in data["user_turns"]] != later_users:
        _fail(where, "user_turns", "differ from the later user messages of 'reference'",
              "drop 'user_turns' (they are read from 'reference') or make them the same messages in the same order")


def _parse_reference(where: str, reference: list[Any]) -> tuple[list[Any], list[str]]:
    # The parser reads content loosely ("or ''"); the file format says what it must be.
    for i, m in enumerate(reference):
        if isinstance(m, dict) and m.get("role") in ("assistant", "user") and not isinstance(m.get("content", ""), (str, type(None))):
            _fail(where, f"reference[{i}].content", f"expected string, got {_show(m['content'])}", "write the message's text as a string")
    try:
        return parse_reference(reference)
    except ReferenceError as exc:
        problem, _, fix = str(exc).partition("; fix: ")
        _fail(where, "reference", problem, fix or REFERENCE_FIX)


def _check_same_calls(where: str, given: list[dict[str, Any]], derived: list[dict[str, Any]]) -> None:
    keys = [call_key(c["name"], c.get("arguments", {})) for c in given]
    expected = [call_key(c["name"], c["arguments"]) for c in derived]
    if keys != expected:
        at = next((i for i, (a, b) in enumerate(zip(keys, expected)) if a != b), min(len(keys), len(expected)))
        _fail(where, "reference_calls", f"differ from the calls of 'reference' at call {at} ({len(keys)} given, {len(expected)} in 'reference')",
              "drop 'reference_calls' (they are read from 'reference') or list the same calls in the same order")


def _user_turn_count(data: dict[str, Any]) -> int | None:
    """User turns of the task (the opening request is turn 0), or None when a simulated user
    decides how many there are."""
    rules = data.get("rules", EpisodeRules())
    return None if rules.simulated_user else 1 + len(data.get("user_turns", []))


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
        kinds = set(cond) - {"weight"} if isinstance(cond, dict) else set()
        ok = isinstance(cond.get("path") if isinstance(cond, dict) else None, str) and kinds in ({"path", "equals"}, {"path", "absent"}, {"path", "unchanged"})
        if not ok or cond.get("absent", True) is not True or cond.get("unchanged", True) is not True:
            _fail(where, f"success.state[{i}]", f"bad check {_show(cond)}",
                  'write {"path": "accounts.A1.balance", "equals": 90}, {"path": "files./tmp/x", "absent": true} '
                  'or {"path": "transfers", "unchanged": true}, each with an optional "weight"')
        _check_weight(where, f"success.state[{i}].weight", cond)
    answer = spec.get("answer")
    if answer is not None and not _valid_answer(answer):
        _fail(where, "success.answer", f"bad answer check {_show(answer)}",
              'write {"contains": ["text", ...], "candidates": ["text", ...]} or {"number": 42, "tol": 0.01}, each with an optional "weight"')
    if answer is not None:
        _check_weight(where, "success.answer.weight", answer)
    if not state and not answer:
        _fail(where, "success", "has no checks", "add 'state' assertions and/or an 'answer' check, or drop 'success' to grade with the judge only")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_weight(where: str, field: str, check: dict[str, Any]) -> None:
    weight = check.get("weight", 1.0)
    if not _is_number(weight) or not weight > 0:
        _fail(where, field, f"{_show(weight)} is not a number > 0", 'write e.g. "weight": 2 (partial credit weighs each check by it; default 1)')


def _is_strings(words: Any) -> bool:
    return isinstance(words, list) and bool(words) and all(isinstance(w, str) for w in words)


def _valid_answer(answer: Any) -> bool:
    if not isinstance(answer, dict):
        return False
    if "contains" in answer:
        return not set(answer) - {"contains", "candidates", "weight"} and _is_strings(answer["contains"]) and _is_strings(answer.get("candidates", [""]))
    return not set(answer) - {"number", "tol", "weight"} and _is_number(answer.get("number")) and _is_number(answer.get("tol", 0))


def _check_calls(where: str, calls: list[Any], tool_names: list[str]) -> None:
    for i, call in enumerate(calls):
        field = f"reference_calls[{i}]"
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            _fail(where, f"{field}.name", "missing", 'write {"name": "<tool>", "arguments": {...}}')
        if set(call) - {"name", "arguments"} or not isinstance(call.get("arguments", {}), dict):
            _fail(where, field, f"bad call {_show(call)}", 'write {"name": "<tool>", "arguments": {...}} and nothing else')
        if call["name"] not in tool_names:
            _fail(where, f"{field}.name", f"unknown tool {call['name']!r}", f"use one of: {', '.join(tool_names)}")


def _check_checklist(where: str, checklist: list[Any], user_turns: int | None) -> None:
    for i, entry in enumerate(checklist):
        ok = isinstance(entry, dict) and isinstance(entry.get("item"), str) and set(entry) <= {"item", "weight", "turn"}
        weight = entry.get("weight", 1.0) if ok else None
        if not ok or not _is_number(weight) or weight <= 0:
            _fail(where, f"checklist[{i}]", f"bad item {_show(entry)}", 'write {"item": "what to check", "weight": 1.0} with weight > 0')
        turn = entry.get("turn", 0)
        if not isinstance(turn, int) or isinstance(turn, bool) or turn < 0:
            _fail(where, f"checklist[{i}].turn", f"expected an integer >= 0, got {_show(turn)}",
                  "name the user turn the item belongs to: 0 = the opening request, k = the k-th later user message")
        if user_turns is not None and turn >= user_turns:
            _fail(where, f"checklist[{i}].turn", f"{turn} names a user turn the task does not have (it has {user_turns}: 0..{user_turns - 1})",
                  "use a turn that exists, or add the user message to 'user_turns' / 'reference'")


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
                  difficulty: int | None = None, seed: int = 0, exclude: Iterable[str] = ()) -> list[Task]:
    """n_per_world distinct generated tasks per world. A scenario's hash decides its one split, so
    train, val, test and heldout never share a task. difficulty None mixes levels 1-3. `exclude`:
    scenario keys to leave out (a checkpoint's training tasks); the others keep the ids they have
    without it, so one id names one scenario however the tasks were drawn.
    Bad options raise `ConfigError` (a ValueError), reported by the CLI as one line."""
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    if difficulty not in (None, 1, 2, 3):
        raise ConfigError(f"difficulty must be 1, 2, 3 or None (mixed), got {difficulty!r}")
    excluded = frozenset(exclude)
    return [task for name in (worlds or SPLITS[split]) for task in _draw(name, split, n_per_world, difficulty, seed, excluded)]


def _draw(name: str, split: str, n: int, difficulty: int | None, seed: int, excluded: frozenset[str]) -> list[Task]:
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
        kept = [t for t in picked if scenario_key(t) not in excluded]
        if len(kept) >= n or size > 64 * (n + len(picked) - len(kept)) + 64:
            break
        size *= 2
    if len(kept) < n:
        besides = f" besides the {len(picked) - len(kept)} excluded" if len(kept) < len(picked) else ""
        raise ConfigError(f"world {name!r} yields only {len(kept)} distinct {split} tasks{besides}, asked for {n}")
    for i, task in enumerate(picked):
        task.id = f"{name}-{split}-{seed}-{i}"
    return kept[:n]
