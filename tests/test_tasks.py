"""The JSONL task format and the built-in splits."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from envace.config import ConfigError, build
from envace.envs import HELDOUT_WORLDS, TRAIN_WORLDS, get_world
from envace.envs.tasks import (SPLITS, TaskFormatError, builtin_tasks, load_tasks, require_worlds, save_tasks, scenario_key,
                               split_of, task_from_dict)
from envace.references import recorded_exchanges

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


def test_excluded_scenarios_are_left_out_and_the_rest_keep_their_ids():
    from envace.envs.tasks import scenario_key

    plain = builtin_tasks("train", 6, worlds=["bank"], difficulty=1)
    left_out = {scenario_key(plain[0]), scenario_key(plain[3])}
    drawn = builtin_tasks("train", 5, worlds=["bank"], difficulty=1, exclude=left_out)
    # the four not excluded of the first six, then the seventh, each under its own id
    assert [t.id for t in drawn] == [f"bank-train-0-{i}" for i in (1, 2, 4, 5, 6)]
    assert as_dicts(drawn[:4]) == as_dicts([plain[i] for i in (1, 2, 4, 5)])
    assert not left_out & {scenario_key(t) for t in drawn}


# ---- JSONL ---------------------------------------------------------------------------------

def test_jsonl_round_trip(tmp_path, splits):
    tasks = splits["test"]
    path = tmp_path / "sub" / "tasks.jsonl"
    save_tasks(tasks, path)
    assert len(path.read_text().splitlines()) == len(tasks)
    assert as_dicts(load_tasks(path)) == as_dicts(tasks)


def doc_lines():
    """The docs' example lines: (the world task's, the world-free task's)."""
    world_line, free_line = re.findall(r"```jsonl\n(.*?)\n```", DOCS.read_text(), re.S)
    return world_line, free_line


def load_line(tmp_path, line):
    path = tmp_path / "example.jsonl"
    path.write_text(line + "\n")
    (task,) = load_tasks(path)
    return task


def test_docs_example_line_loads_and_solves(tmp_path):
    task = load_line(tmp_path, doc_lines()[0])
    world = get_world(task.world)(task.initial_state)
    assert all("error" not in world.call(c["name"], c["arguments"]) for c in task.reference_calls)
    assert world.verify(task, task.metadata["reference_answer"]).success
    assert get_world(task.world)(task.initial_state).verify(task, task.metadata["reference_answer"]).success is False


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
    (json.dumps({**GOOD, "success": {"state": [{"path": "a", "unchanged": False}]}}), ["'success.state[0]'", '"unchanged": true']),
    (json.dumps({**GOOD, "success": {"state": [{"path": "a", "equals": 1, "weight": 0}]}}), ["'success.state[0].weight'", "number > 0"]),
    (json.dumps({**GOOD, "success": {"answer": {"number": 5, "weight": "2"}}}), ["'success.answer.weight'", "number > 0"]),
    (json.dumps({**GOOD, "success": {"answer": {"contains": ["x"], "candidates": "x"}}}), ["'success.answer'", "candidates"]),
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


# ---- world-free tasks ----------------------------------------------------------------------

def schema(name):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}


def assistant_call(call_id, name, arguments):
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


REFERENCE = [
    assistant_call("c1", "add", {"n": 2}), {"role": "tool", "tool_call_id": "c1", "content": '{"value": 2}'},
    {"role": "assistant", "content": "It is 2."},
    {"role": "user", "content": "Now read it back."},
    assistant_call("c2", "read", {}), {"role": "tool", "tool_call_id": "c2", "content": {"value": 2}},
    {"role": "assistant", "content": "Still 2."},
]
FREE = {"id": "f1", "messages": [{"role": "user", "content": "Add 2 to the counter."}], "tools": [schema("add"), schema("read")],
        "documentation": "A counter.", "reference": REFERENCE,
        "checklist": [{"item": "Adds 2", "weight": 1.0}, {"item": "Reads it back", "weight": 1.0, "turn": 1}]}


def test_docs_world_free_line_loads_with_the_bank_worlds_responses(tmp_path):
    task = load_line(tmp_path, doc_lines()[1])
    assert task.world is None and task.success == {} and task.initial_state == {}
    assert [t["function"]["name"] for t in task.tools] == ["list_accounts", "transfer"] and task.documentation.startswith("Bank.")
    assert task.reference_calls == [{"name": "list_accounts", "arguments": {}},
                                    {"name": "transfer", "arguments": {"from_account": "A2", "to_account": "A1", "amount": 100}},
                                    {"name": "transfer", "arguments": {"from_account": "A1", "to_account": "E1", "amount": 50}}]
    assert task.user_turns == [{"role": "user", "content": "Now send 50 to Bob (account E1) from checking and tell me what is left in checking."}]
    assert [c.get("turn", 0) for c in task.checklist] == [0, 1, 1]
    # The recorded responses are what the bank answers from the world example's initial state.
    bank = get_world("bank")(load_line(tmp_path, doc_lines()[0]).initial_state)
    exchanges = recorded_exchanges(task.reference)
    assert [response for _, response in exchanges] == [bank.call(c["name"], c["arguments"]) for c, _ in exchanges]
    assert exchanges[-1][1] == {"amount": 50, "balance": 249, "fee": 1, "id": "T2"}


def test_reference_fills_in_reference_calls_and_user_turns():
    task = task_from_dict(FREE, "inline")
    assert task.world is None
    assert task.reference_calls == [{"name": "add", "arguments": {"n": 2}}, {"name": "read", "arguments": {}}]
    assert task.user_turns == [{"role": "user", "content": "Now read it back."}]
    # Given ones that agree are kept as they are.
    same = task_from_dict({**FREE, "reference_calls": [{"name": "add", "arguments": {"n": 2}}, {"name": "read"}],
                           "user_turns": [{"role": "user", "content": "Now read it back."}]}, "inline")
    assert same.reference_calls == task.reference_calls and same.user_turns == task.user_turns


def test_world_free_tasks_round_trip(tmp_path):
    tasks = [task_from_dict(FREE, "inline"), task_from_dict({"id": "f2", "world": None, "messages": FREE["messages"], "tools": []}, "inline"),
             task_from_dict({k: v for k, v in GOOD.items() if k != "success"}, "inline")]  # a world task graded by the judge only
    path = tmp_path / "free.jsonl"
    save_tasks(tasks, path)
    assert as_dicts(load_tasks(path)) == as_dicts(tasks)
    first = json.loads(path.read_text().splitlines()[0])
    assert first["world"] is None and "success" not in first and "initial_state" not in first  # defaults are left out


def test_world_tasks_take_a_reference_and_documentation():
    reference = [assistant_call("c1", "list_accounts", {}), {"role": "tool", "content": '{"accounts": []}'}, {"role": "assistant", "content": "None."}]
    task = task_from_dict({**GOOD, "reference": reference, "documentation": "Be brief."}, "inline")
    assert task.world == "bank" and task.reference_calls == [{"name": "list_accounts", "arguments": {}}] and task.documentation == "Be brief."


def free_line(**changes):
    return json.dumps({k: v for k, v in {**FREE, **changes}.items() if v is not None})


@pytest.mark.parametrize("line, fragments", [
    (free_line(tools=None), ["'tools'", "missing: a task without a world", 'name a "world"']),
    (free_line(tools=[{"name": 3}]), ["'tools[0]'", "not a function schema"]),
    (free_line(success={"answer": {"number": 2}}), ["'success'", "needs an executable world", "'checklist'", "judge or reference reward"]),
    (free_line(initial_state={"value": 0}), ["'initial_state'", "needs an executable world", "'reference'"]),
    (free_line(rules={"simulated_user": True, "user_uses_world": True}), ["'rules.user_uses_world'", "has none"]),
    (free_line(world=7), ["'world'", "expected string or null"]),
    (free_line(documentation=["rules"]), ["'documentation'", "expected string or null"]),
    (free_line(reference=[{"role": "tool", "content": "{}"}]), ["'reference'", "without a pending call", "after the assistant message"]),
    (free_line(reference=[assistant_call("c1", "add", {})]), ["'reference'", "no recorded tool response", '"role": "tool"']),
    (free_line(reference=[{"role": "system", "content": "x"}]), ["'reference'", "role must be assistant, tool or user", "OpenAI-style"]),
    (free_line(reference=[{"role": "assistant", "content": {"text": "x"}}]), ["'reference[0].content'", "expected string"]),
    (free_line(reference=[assistant_call("c1", "steal", {}), {"role": "tool", "content": "{}"}]), ["'reference'", "unknown tool 'steal'", "add, read"]),
    (free_line(reference_calls=[{"name": "add", "arguments": {"n": 3}}, {"name": "read"}]),
     ["'reference_calls'", "differ from the calls of 'reference' at call 0", "drop 'reference_calls'"]),
    (free_line(reference_calls=[{"name": "add", "arguments": {"n": 2}}]), ["'reference_calls'", "at call 1 (1 given, 2 in 'reference')"]),
    (free_line(user_turns=[{"role": "user", "content": "Something else."}]), ["'user_turns'", "differ from the later user messages"]),
    (free_line(checklist=[{"item": "x", "turn": -1}]), ["'checklist[0].turn'", "integer >= 0"]),
    (free_line(checklist=[{"item": "x", "turn": True}]), ["'checklist[0].turn'", "integer >= 0"]),
    (free_line(checklist=[{"item": "x", "turn": 2}]), ["'checklist[0].turn'", "2 names a user turn the task does not have (it has 2: 0..1)"]),
    (free_line(checklist=[{"item": "x", "round": 1}]), ["'checklist[0]'", "bad item"]),
])
def test_malformed_world_free_lines_name_file_line_field_and_fix(tmp_path, line, fragments):
    test_malformed_lines_name_file_line_field_and_fix(tmp_path, line, fragments)


def test_checklist_turns_of_a_simulated_user_are_not_bounded():
    task = task_from_dict({**FREE, "checklist": [{"item": "x", "turn": 5}], "rules": {"simulated_user": True}}, "inline")
    assert task.checklist[0]["turn"] == 5


# ---- options that need a world -------------------------------------------------------------

def free_file(tmp_path, world_first=False):
    path = tmp_path / "free.jsonl"
    lines = [json.dumps(GOOD)] if world_first else []
    path.write_text("\n".join(lines + [json.dumps(FREE)]) + "\n")
    return str(path)


def test_require_worlds_names_the_first_world_free_task_each_option_and_its_alternative():
    world_task, free = task_from_dict(GOOD, "a"), task_from_dict(FREE, "b")
    require_worlds([world_task], {"--mode real": "use --mode rehearse"})  # every task has a world
    require_worlds([world_task, free], {})  # nothing needs one
    with pytest.raises(ConfigError) as info:
        require_worlds([world_task, free, dataclasses.replace(free, id="f9")], {"--mode real": "use --mode rehearse", "--guard goal": "drop --guard"})
    assert str(info.value) == ('task f1 (and 1 more of the 3 tasks) is world-free (no executable world): --mode real needs one: use --mode rehearse; '
                               '--guard goal needs one: drop --guard; or give the task a "world"')


@pytest.mark.parametrize("values, fragments", [
    ({}, ["task f1 is world-free", "--mode real (the default) needs one: use --mode rehearse", "--reward replay (the default) needs one: use --reward judge"]),
    ({"mode": "rehearse"}, ["--reward replay (the default) needs one"]),
    ({"reward": "reference"}, ["--mode real (the default) needs one"]),
    ({"reward": "reference", "rehearsal": "parallel"}, ["--rehearsal parallel (it commits in the real world) needs one: drop --rehearsal"]),
    ({"reward": "reference", "guard": "goal"}, ["--guard goal needs one: drop --guard"]),
    ({"mode": "rehearse", "reward": "replay"}, ["--reward replay needs one"]),
])
def test_eval_refuses_world_options_on_world_free_tasks_before_any_model_loads(tmp_path, monkeypatch, values, fragments):
    from envace.evaluation import runner

    def no_model(*args, **kwargs):
        raise AssertionError("a model was opened before the task check")

    monkeypatch.setattr(runner, "open_generator", no_model)
    cfg = build(runner.EvalConfig, {"tasks": free_file(tmp_path, world_first=True), "output_dir": str(tmp_path / "out"), **values})
    with pytest.raises(ConfigError) as info:
        runner.run_eval(cfg)
    for fragment in fragments:
        assert fragment in str(info.value)
    assert "(and" not in str(info.value)  # one world-free task among two


def test_eval_of_world_free_tasks_in_rehearse_mode_with_a_world_free_reward_loads(tmp_path):
    from envace.evaluation.runner import EvalConfig, load_eval_tasks

    (_, task) = load_eval_tasks(build(EvalConfig, {"tasks": free_file(tmp_path, world_first=True), "mode": "rehearse", "reward": "reference"}))
    assert task.world is None


@pytest.mark.parametrize("values, fragments", [
    ({}, ["--reward replay (the default) needs one: pass --reward judge, reference or module:function"]),
    ({"reward": "reference", "variant": "real-grpo"}, ["--variant real-grpo needs one: use a rehearse variant"]),
    ({"reward": "reference", "real_fraction": 0.5}, ["--real-fraction 0.5 needs one: use --real-fraction 0"]),
    ({"reward": "reference:0.5,replay:0.5"}, ["--reward reference:0.5,replay:0.5 needs one: pass --reward judge"]),
])
def test_train_refuses_world_options_on_world_free_tasks_before_any_model_loads(tmp_path, monkeypatch, values, fragments):
    from envace.training import trainer

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the task check")

    monkeypatch.setattr(trainer, "load_trainable", no_model)
    cfg = build(trainer.TrainConfig, {"tasks": free_file(tmp_path), "output_dir": str(tmp_path / "out"), **values})
    with pytest.raises(ConfigError) as info:
        trainer.Trainer(cfg)
    assert "task f1 is world-free (no executable world)" in str(info.value)
    for fragment in fragments:
        assert fragment in str(info.value)
    assert trainer.load_train_tasks(build(trainer.TrainConfig, {"tasks": free_file(tmp_path), "reward": "reference"}))[0].world is None
