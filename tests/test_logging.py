"""metrics.jsonl / samples.jsonl, resume truncation, TensorBoard events, PNG plots."""

import importlib.util
import json

import pytest

from envace.training.logging import MetricsLogger
from envace.training.plots import plot_metrics
from envace.types import EndReason, Role, Trajectory, Turn


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_jsonl_and_tensorboard(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        for step in (1, 2, 3):
            logger.log(step, {"loss": 1.0 / step, "reward/act": 0.1 * step, "note": "text is kept in JSON only"})
        # flushed per line: readable while the run is still going
        assert [e["step"] for e in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    entries = read_jsonl(tmp_path / "metrics.jsonl")
    assert entries[1]["loss"] == 0.5 and entries[2]["reward/act"] == pytest.approx(0.3) and "time" in entries[0]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_resume_truncates_entries_after_the_checkpoint(tmp_path):
    with MetricsLogger(tmp_path, use_tensorboard=False) as logger:
        for step in range(1, 6):
            logger.log(step, {"loss": float(step)})
            logger.write_samples(step, [], tokenizer=None)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # the interrupted run died mid-line
    with MetricsLogger(tmp_path, use_tensorboard=False, resume_step=3) as logger:
        assert [e["step"] for e in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
        logger.log(4, {"loss": 40.0})
    entries = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(e["step"], e["loss"]) for e in entries] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


class CharTokenizer:
    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def test_samples_are_role_tagged_text(tmp_path):
    side = Trajectory("t1", "rehearse", [Turn(Role.PROMPT, [0]), Turn(Role.REHEARSE, [4])])
    traj = Trajectory(
        "t1", "rehearse",
        [Turn(Role.PROMPT, [0, 1]), Turn(Role.ACT, [2], [-0.1]), Turn(Role.ENV, [4]), Turn(Role.ACT, [3], [-0.2])],
        reward=1.0, end_reason=EndReason.ANSWERED, group=2, side_rows=[side],
    )
    with MetricsLogger(tmp_path, use_tensorboard=False) as logger:
        logger.write_samples(7, [traj], CharTokenizer())
    (sample,) = read_jsonl(tmp_path / "samples.jsonl")
    assert sample["step"] == 7 and sample["rollout"] == 2 and sample["reward"] == 1.0 and sample["end_reason"] == "answered"
    assert sample["turns"] == [
        {"role": "prompt", "text": "ab"}, {"role": "act", "text": "c"}, {"role": "env", "text": "e"}, {"role": "act", "text": "d"},
    ]
    assert sample["side_rows"] == [[{"role": "prompt", "text": "a"}, {"role": "rehearse", "text": "e"}]]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_missing_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="pip install"):
        MetricsLogger(tmp_path, use_tensorboard=False, use_wandb=True)


def test_plots_are_png_files(tmp_path):
    with MetricsLogger(tmp_path, use_tensorboard=False) as logger:
        for step in range(1, 4):
            logger.log(step, {"reward/mean": 0.1 * step, "reward/act": 0.2, "reward/rehearse": 0.3, "success_rate": 0.5,
                              "fidelity/exact": 0.4, "clip_frac": 0.1, "clip_frac/act": 0.2, "note": "skipped",
                              "policy/loss": 0.5, "policy/adv": 0.0, "policy/adv/act": 0.1, "policy/adv/rehearse": -0.1})
    paths = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "plots")
    # "policy" holds deeper keys, so it is a namespace: one figure per policy/<family>
    assert sorted(p.name for p in paths) == [
        "clip_frac.png", "fidelity.png", "policy_adv.png", "policy_loss.png", "reward.png", "success_rate.png",
    ]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
