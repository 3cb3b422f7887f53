"""The checkpoint chain's world-execution counts (envace/manifest.py, envace/accounting.py)."""

import json

from envace.accounting import WorldExecutions, export_sidecar
from envace.manifest import build_manifest, chain_executions, with_executions, write_manifest
from envace.types import Task

TASKS = [Task(id="a", world=None, messages=[])]


def recorded_file(path, executions: int, content: str = '{"id": "a"}\n') -> str:
    """A task file with the export sidecar that recording it would leave."""
    path.write_text(content)
    export_sidecar(path).write_text(json.dumps({"tasks": 1, "world_executions": executions}))
    return str(path)


def test_a_recording_used_by_sft_and_then_grpo_is_counted_once(tmp_path):
    """SFT on a file whose recording took 7 executions, then GRPO on the same file (3 replays of
    its own): 7 task-data executions, not 14; a second, different file adds its own 4."""
    free = recorded_file(tmp_path / "free.jsonl", 7)
    sft = tmp_path / "sft"
    write_manifest(with_executions(build_manifest(TASKS, None), None, free, WorldExecutions()), sft)
    assert json.loads((sft / "data_manifest.json").read_text())["world_executions"]["task_data"] == 7

    grpo = chain_executions(str(sft), free, WorldExecutions(verification=3))
    assert (grpo.task_data, grpo.verification, grpo.total) == (7, 3, 10)
    other = recorded_file(tmp_path / "other.jsonl", 4, content='{"id": "b"}\n')
    assert chain_executions(str(sft), other, WorldExecutions()).task_data == 11


def test_a_parent_manifest_without_keyed_recordings_keeps_its_count(tmp_path):
    """A checkpoint written before recordings were keyed says only "task_data: 5": those 5 stay,
    beside the run's own file's 7 (they cannot be matched, so they are not merged away)."""
    old = tmp_path / "old"
    write_manifest(build_manifest(TASKS, None) | {"world_executions": WorldExecutions(task_data=5).as_dict()}, old)
    assert chain_executions(str(old), recorded_file(tmp_path / "free.jsonl", 7), WorldExecutions()).task_data == 12
    assert chain_executions(str(old), None, WorldExecutions()).task_data == 5
