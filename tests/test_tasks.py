"""The JSONL task format and the built-in splits."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from envace.envs import HELDOUT_WORLDS, TRAIN_WORLDS, get_world
from envace.envs.tasks import (SPLITS, TaskFormatError, builtin_tasks, load_tasks, save_tasks, scenario_key,
                               split_of, task_from_dict)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "tasks.md"
GOOD = {"id": "t1", "world": "bank", "messages": [{"role": "user", "content": "What is my balance?"}],
        "success": {"answer": {"number": 5}}}


def as_dicts(tasks):
    return [dataclasses.asdict(t) for t in tasks]


# ---- built-in splits -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def splits():
    return {split: builtin_tasks(split, 6, seed=0) for split in SPLITS}


def test_splits_never_share_a_scenario(splits):
    keys = {split: {scenario_key(t) for t in tasks} for split, tasks in splits.items()}
    for split, tasks in splits.items():
        assert len(keys[split]) == len(tasks)  # distinct within a split too
        assert all(t.split == split_of(t) == split for t in tasks)  # the scenario hash owns the split
        for other in SPLITS:
            if other != split:
                assert not keys[split] & keys[other], (split, other)
    ids = [t.id for tasks in splits.values() for t in tasks]
    assert len(ids) == len(set(ids))


def test_split_worlds(splits):
    def worlds(split):
        return sorted({t.world for t in splits[split]})

    assert worlds("train") == worlds("val") == sorted(TRAIN_WORLDS)
    assert worlds("test") == sorted(TRAIN_WORLDS + HELDOUT_WORLDS)
    assert worlds("heldout") == sorted(HELDOUT_WORLDS) == ["travel"]
    assert len(splits["test"]) == 6 * 5
    assert {t.difficulty for t in splits["test"]} == {1, 2, 3}  # None = mixed


def test_builtin_tasks_are_deterministic_and_seeded(splits):
    assert as_dicts(builtin_tasks("train", 6, seed=0)) == as_dicts(splits["train"])
    assert as_dicts(builtin_tasks("train", 6, seed=1)) != as_dicts(splits["train"])


def test_builtin_tasks_options():
    tasks = builtin_tasks("val", 3, worlds=["files"], difficulty=3)
    assert [t.world for t in tasks] == ["files"] * 3 and {t.difficulty for t in tasks} == {3}
    with pytest.raises(ValueError, match="unknown split"):
        builtin_tasks("dev", 2)
    with pytest.raises(ValueError, match="difficulty"):
        builtin_tasks("train", 2, difficulty=4)


# ---- JSONL ---------------------------------------------------------------------------------

def test_jsonl_round_trip(tmp_path, splits):
    tasks = splits["test"]
    path = tmp_path / "sub" / "tasks.jsonl"
    save_tasks(tasks, path)
    assert len(path.read_text().splitlines()) == len(tasks)
    assert as_dicts(load_tasks(path)) == as_dicts(tasks)


def test_docs_example_line_loads_and_solves(tmp_path):
    (line,) = re.findall(r"```jsonl\n(.*?)\n```", DOCS.read_text(), re.S)
    path = tmp_path / "example.jsonl"
    path.write_text(line + "\n")
    (task,) = load_tasks(path)
    world = get_world(task.world)(task.initial_state)
    assert all("error" not in world.call(c["name"], c["arguments"]) for c in task.reference_calls)
    assert world.verify(task, task.metadata["reference_answer"])[0] == 1.0
    assert get_world(task.world)(task.initial_state).verify(task, task.metadata["reference_answer"])[0] == 0.0


def test_defaults_and_blank_lines(tmp_path):
    path = tmp_path / "mine.jsonl"
    body = {k: v for k, v in GOOD.items() if k != "id"}
    path.write_text("\n" + json.dumps(body) + "\n\n" + json.dumps({**body, "world": "tests.fixtures_worlds:Library"}) + "\n")
    first, second = load_tasks(path)
    assert (first.id, second.id) == ("mine-2", "mine-4")
    assert first.split == "train" and first.difficulty == 1 and first.tools is None


@pytest.mark.parametrize("line, fragments", [
    ("{not json", ["invalid JSON"]),
    ("[1, 2]", ["must be a JSON object"]),
    (json.dumps({**GOOD, "world": "atlantis"}), ["'world'", "unknown environment 'atlantis'", "module.path:ClassName"]),
    (json.dumps({k: v for k, v in GOOD.items() if k != "messages"}), ["'messages'", "missing", '"role": "user"']),
    (json.dumps({**GOOD, "messages": [{"role": "system", "content": "hi"}]}), ["'messages'", "no user message"]),
    (json.dumps({**GOOD, "messages": [{"role": "user"}]}), ["'messages[0]'", "not a message"]),
    (json.dumps({**GOOD, "success": {}}), ["'success'", "no checks"]),
    (json.dumps({**GOOD, "success": {"state": [{"path": "a", "equal": 1}]}}), ["'success.state[0]'", '"equals"']),
    (json.dumps({**GOOD, "success": {"answer": {"number": "5"}}}), ["'success.answer'", "contains"]),
    (json.dumps({**GOOD, "reference_calls": [{"arguments": {}}]}), ["'reference_calls[0].name'", "missing"]),
    (json.dumps({**GOOD, "reference_calls": [{"name": "steal", "arguments": {}}]}), ["unknown tool 'steal'", "transfer"]),
    (json.dumps({**GOOD, "checklist": [{"item": "x", "weight": 0}]}), ["'checklist[0]'", "weight > 0"]),
    (json.dumps({**GOOD, "difficulty": "hard"}), ["'difficulty'", "expected integer"]),
    (json.dumps({**GOOD, "hidden": True}), ["'hidden'", "unknown key", "did you mean 'hidden_state'"]),
])
def test_malformed_lines_name_file_line_field_and_fix(tmp_path, line, fragments):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + line + "\n")
    with pytest.raises(TaskFormatError) as info:
        load_tasks(path)
    message = str(info.value)
    assert f"{path}:2:" in message and "fix:" in message
    for fragment in fragments:
        assert fragment in message


def test_duplicate_ids_and_missing_or_empty_files(tmp_path):
    path = tmp_path / "dup.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(TaskFormatError, match=r"dup.jsonl:2: field 'id': 't1' is already used on line 1"):
        load_tasks(path)
    with pytest.raises(TaskFormatError, match="not found"):
        load_tasks(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TaskFormatError, match="no tasks"):
        load_tasks(tmp_path / "empty.jsonl")


def test_task_from_dict_copies_its_input():
    data = json.loads(json.dumps(GOOD))
    task = task_from_dict(data, "inline")
    data["messages"][0]["content"] = "changed"
    assert task.messages[0]["content"] == "What is my balance?"
    with pytest.raises(TaskFormatError, match="^inline: field 'id': missing"):
        task_from_dict({k: v for k, v in GOOD.items() if k != "id"}, "inline")
