"""benchmarks/eval_noise.py: its settings and what counts as a task that moved."""

import pytest

from benchmarks import eval_noise


def test_settings_parse_as_dtype_and_rollouts_in_flight():
    assert eval_noise.parse_settings("bf16:64,f32:16") == [("bf16", 64), ("f32", 16)]
    for bad in ("q8_0:64", "bf16", "bf16:0", "f32:x"):
        with pytest.raises(SystemExit, match="is not DTYPE:WIDTH"):
            eval_noise.parse_settings(bad)


def test_flips_are_the_tasks_whose_score_moved():
    reference = {"a": 1.0, "b": 0.0, "c": 0.5}
    assert eval_noise.flips(reference, {"a": 1.0, "b": 1.0, "c": 0.25}) == ["b", "c"]
    assert eval_noise.flips(reference, dict(reference)) == []
    with pytest.raises(ValueError, match="different tasks"):
        eval_noise.flips(reference, {"a": 1.0})
