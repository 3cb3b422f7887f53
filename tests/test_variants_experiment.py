"""benchmarks/variants_experiment.py: its rows are the demo's GRPO stage with each variant in
place, and its table and curves read a results.json as benchmarks/grpo_sweep.py writes it."""

import dataclasses
from pathlib import Path

from benchmarks import variants_experiment
from envace.demo import DemoConfig, train_config
from envace.training.variants import VARIANTS


def test_every_variant_is_a_row_of_the_demos_grpo_stage_with_only_that_changed(tmp_path):
    rows = variants_experiment.experiment_rows(steps=6)
    configs = {name: train_config(dataclasses.replace(DemoConfig(), **change), tmp_path) for name, change in rows.items()}
    assert {cfg.variant for cfg in configs.values()} == set(VARIANTS.names())  # every registered variant has a row
    demo = train_config(dataclasses.replace(DemoConfig(), rl_steps=6), tmp_path)
    assert configs["envace"] == demo  # the demo's own recipe, at the experiment's step count
    assert configs["envace"].rehearse_sft_coef == 0.5 and configs["envace-ungrounded"].rehearse_sft_coef == 0.0
    for name, cfg in configs.items():
        assert cfg.steps == 6 and (cfg.lr, cfg.k, cfg.tasks_per_step, cfg.seed) == (demo.lr, demo.k, demo.tasks_per_step, demo.seed)
        if name not in ("envace", "envace-ungrounded", "world-free"):
            assert (cfg.variant, cfg.rehearse_sft_coef) == (name.removesuffix("-base"), 0.0)
    # world-free: envace, grounded, rewarded without a world (its task file: tests/test_demo.py)
    assert configs["world-free"] == train_config(dataclasses.replace(DemoConfig(), rl_steps=6, rl_reward="reference"), tmp_path)
    # the simulator rows differ in the frozen model that answers: the warm start (once it exists), or the base model
    warm = tmp_path / "warm"
    warm.mkdir()
    (warm / "config.json").write_text("{}")
    simulators = {name: train_config(dataclasses.replace(DemoConfig(), **rows[name]), tmp_path, init_from=str(warm)).simulator_model
                  for name in ("simulator", "simulator-base")}
    assert simulators == {"simulator": str(warm), "simulator-base": "default"}


def overall(success: float, partial: float, ends: dict | None = None, calls: int = 0) -> dict:
    by_world = {"shop": {"n": 2, "success_rate": success}, "travel": {"n": 2, "success_rate": 0.0}}
    return {"result": {"overall": {"n": 4, "success_rate": success / 2, "partial_credit": partial, "real_env_calls": calls},
                       "by_world": by_world, "end_reasons": ends or {}}}


def test_the_summary_counts_each_rows_world_executions_by_purpose_how_its_episodes_ended_and_compares_it_with_the_warm_start():
    paired = {"mean_diff": 0.25, "ci95": [0.0, 0.5], "better": 1, "worse": 0}
    results = {"eval-base": overall(0.0, 0.0), "eval-warm": overall(0.5, 0.25, {"answered": 1, "max_turns": 3}, calls=14),
               "eval-act-only": overall(1.0, 0.5, {"answered": 2, "max_turns": 1, "malformed_act": 1}, calls=9),
               "sft": {"result": {"world_executions": {"total": 76}}},
               "compare-act-only": {"success": paired, "partial_credit": paired},
               "train-act-only": {"seconds": 600.0, "result": {"world_executions": {"rollout": 0, "verification": 31, "grounding": 0, "total": 31}}}}
    lines = variants_experiment.summary_table(results, ["act-only", "real-grpo"]).splitlines()
    assert len(lines) == 5  # header, rule, base, warm start, act-only (real-grpo has not finished)
    assert lines[2].startswith("| base (untrained) | 0.00 [") and lines[2].endswith("| 0.000 | - |  |  |  |  |")  # no end reasons recorded
    assert lines[3].startswith("| warm start (SFT) | 0.50 [") and "| 76 (its SFT data) |" in lines[3]  # shop 1 of 2; the SFT data's executions
    assert "| 0.250 | 1 / 3 / 0 (3.50) |" in lines[3]  # 1 answered, 3 at the turn limit; 14 calls over 4 tasks
    # a warm start given with --warm has no SFT stage here: its data's executions come from a trained row's manifest chain
    del results["sft"]
    results["train-act-only"]["result"]["chain_world_executions"] = {"sft_data": 182}
    assert "| 182 (its SFT data) |" in variants_experiment.summary_table(results, ["act-only"]).splitlines()[3]
    assert lines[4] == ("| act-only | 1.00 [0.34, 1.00] (n=2) | 0.00 [0.00, 0.66] (n=2) | 0.500 | 2 / 1 / 1 (2.25) | +0.250 [+0.000, +0.500] (1/0) "
                        "| +0.250 [+0.000, +0.500] (1/0) | 0 / 31 / 0 / 0 | 10.0 |")
    # a world-free row's executions: recording its tasks' references, up front
    results |= {"compare-world-free": results["compare-act-only"], "eval-world-free": overall(1.0, 0.5),
                "train-world-free": {"seconds": 60.0, "result": {"world_executions": {"rollout": 0, "verification": 0, "grounding": 0},
                                                                 "chain_world_executions": {"sft_data": 182, "task_data": 138}}}}
    assert variants_experiment.summary_table(results, ["world-free"]).splitlines()[4].endswith("| 0 / 0 / 0 / 138 | 1.0 |")


def test_the_curves_put_each_rows_reward_against_steps_and_against_real_world_executions(tmp_path):
    results = {"curve-envace": [{"step": 1, "reward/mean": 0.1, "env/total_total": 12}, {"step": 2, "reward/mean": 0.2, "env/total_total": 30}]}
    path = variants_experiment.curves_plot(results, ["envace", "real-grpo"], tmp_path / "curves.png")
    assert path is not None and Path(path).read_bytes()[:4] == b"\x89PNG"
    assert variants_experiment.curves_plot({}, ["envace"], tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


def finished_run(out: Path, steps: int, warm: list[float], row: list[float], versus_warm: dict) -> Path:
    """A finished run of the row "envace" at `steps` steps: its warm start's and the row's greedy
    test records (success per task of t0..t3, partial credit the same), and the results.json
    entries `steps_from` reads."""
    import json

    for name, scores in (("eval-warm", warm), ("eval-envace", row)):
        (out / name).mkdir(parents=True)
        records = [{"task_id": f"t{i}", "total_tokens": 10, "num_calls": 1, "end_reason": "answered", "success": s, "partial_credit": s}
                   for i, s in enumerate(scores)]
        (out / name / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    results = {"eval-warm": {"result": {"overall": {"success_rate": sum(warm) / 4, "partial_credit": sum(warm) / 4}}},
               "eval-envace": {"result": {"overall": {"success_rate": sum(row) / 4, "partial_credit": sum(row) / 4}}},
               "compare-envace": {"success": versus_warm, "partial_credit": versus_warm}, "curve-envace": [{"step": s} for s in range(1, steps + 1)]}
    (out / "results.json").write_text(json.dumps(results))
    return out


def test_runs_that_differ_only_in_steps_are_one_learning_curve_and_other_warm_starts_are_refused(tmp_path):
    import pytest

    warm = [0.0, 0.0, 1.0, 0.0]
    paired = {"mean_diff": 0.25, "ci95": [0.0, 0.5], "better": 1, "worse": 0}
    twelve = finished_run(tmp_path / "twelve", 12, warm, [1.0, 1.0, 0.0, 0.0], paired)
    six = finished_run(tmp_path / "six", 6, warm, [1.0, 0.0, 1.0, 0.0], paired)
    text = variants_experiment.steps_from([twelve, six], ["envace"], tmp_path / "steps.png")  # any order: sorted by steps
    lines = text.splitlines()[2:]
    assert lines[0] == "| envace | 0 (warm start) | 0.250 / 0.250 | | |"
    assert lines[1].startswith("| envace | 6 | 0.500 / 0.500 | +0.250 [+0.000, +0.500] (1/0) / +0.250") and lines[1].endswith("|  |")
    # 12 against 6, task by task: t1 gained, t2 lost, t0 and t3 the same: mean 0
    assert lines[2].startswith("| envace | 12 | 0.500 / 0.500 |") and "| +0.000 [" in lines[2] and "(1/1) / +0.000" in lines[2]
    assert (tmp_path / "steps.png").read_bytes()[:4] == b"\x89PNG"
    other = finished_run(tmp_path / "other", 6, [1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0], paired)
    with pytest.raises(SystemExit, match="different warm starts"):
        variants_experiment.steps_from([twelve, other], ["envace"], tmp_path / "refused.png")
