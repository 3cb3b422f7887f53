"""benchmarks/grpo_sweep.py's continued rows: a row that resumes another row's finished run for
more steps (the resume itself: tests/test_training.py::test_resume_reaches_the_same_weights_as_an_uninterrupted_run)."""

import pytest

from benchmarks import grpo_sweep
from envace.demo import DemoConfig

SIX, TWELVE, EIGHTEEN = "sft-24-8-tasks-6-steps", "sft-24-8-tasks-12-steps", "sft-24-8-tasks-18-steps"


def test_a_continued_row_needs_the_run_it_continues_first():
    grpo_sweep.check_continued([SIX, TWELVE], DemoConfig(), {})
    grpo_sweep.check_continued([TWELVE], DemoConfig(), {f"train-{SIX}": {}})  # trained by an earlier call
    with pytest.raises(SystemExit, match=f"row {TWELVE} continues row {SIX}'s run: put {SIX} before it"):
        grpo_sweep.check_continued([TWELVE, SIX], DemoConfig(), {})


def test_a_continued_row_may_differ_in_more_steps_only(monkeypatch):
    monkeypatch.setitem(grpo_sweep.ROWS, "other-lr-12-steps", dict(grpo_sweep.ROWS[TWELVE], rl_lr=1e-5))
    monkeypatch.setitem(grpo_sweep.CONTINUES, "other-lr-12-steps", SIX)
    rows = [SIX, "other-lr-12-steps"]
    with pytest.raises(SystemExit, match=f"must differ from {SIX}, which it continues, in more rl_steps only"):
        grpo_sweep.check_continued(rows, DemoConfig(), {})


def test_rows_group_into_the_runs_they_continue():
    assert grpo_sweep.chains(["demo", SIX, "lr-5e-5", TWELVE, EIGHTEEN]) == [["demo"], [SIX, TWELVE, EIGHTEEN], ["lr-5e-5"]]


def test_a_continued_run_starts_as_a_copy_without_the_final_model(tmp_path):
    parent, child = tmp_path / "train-6", tmp_path / "train-12"
    (parent / "checkpoints" / "step-00000006").mkdir(parents=True)
    (parent / "checkpoints" / "step-00000006" / "state.json").write_text("{}")
    (parent / "final").mkdir()
    (parent / "metrics.jsonl").write_text('{"step": 6}\n')
    grpo_sweep.start_as_copy(parent, child)
    assert (child / "checkpoints" / "step-00000006" / "state.json").is_file()
    assert (child / "metrics.jsonl").read_text() == '{"step": 6}\n'
    assert not (child / "final").exists()
    # An interrupted continuation keeps its own progress: nothing is copied over it.
    (child / "metrics.jsonl").write_text('{"step": 6}\n{"step": 7}\n')
    grpo_sweep.start_as_copy(parent, child)
    assert (child / "metrics.jsonl").read_text().count("step") == 2


def test_another_sweeps_trained_stages_are_taken_and_its_evaluations_are_not(tmp_path):
    import json

    theirs = {"seed": 0, "sft-warm": {"result": {"final_model": "a/sft/final"}}, "eval-warm": {"result": {"overall": {}}},
              f"train-{SIX}": {"result": {"run_dir": "a/train"}}, f"eval-{SIX}": {"result": {"overall": {}}}}
    (tmp_path / "results.json").write_text(json.dumps(theirs))
    mine = {"seed": 0, f"train-{TWELVE}": {"result": {"run_dir": "mine"}}}
    grpo_sweep.take_trained(mine, tmp_path)
    assert sorted(mine) == sorted(["seed", "sft-warm", f"train-{SIX}", f"train-{TWELVE}"])
    assert mine[f"train-{TWELVE}"] == {"result": {"run_dir": "mine"}}  # this sweep's own stage is kept
    with pytest.raises(SystemExit, match="was trained with seed 0, this sweep uses seed 1"):
        grpo_sweep.take_trained({"seed": 1}, tmp_path)


def test_a_finished_run_is_reused_only_for_a_row_with_its_training_settings(tmp_path):
    import dataclasses

    from envace.config import save
    from envace.demo import train_config

    warm = tmp_path / "warm"
    warm.mkdir()
    (warm / "config.json").write_text("{}")  # a model directory, as far as validation looks

    def row_config(out, **change):
        return train_config(dataclasses.replace(DemoConfig(), rl_rehearse_sft_coef=0.0, **change), out / "train-row", init_from=str(warm))

    finished = row_config(tmp_path, rl_steps=3, rl_variant="simulator", rl_simulator_model="default")
    finished.simulator_model = None  # written before the simulator was named: TrainConfig's default, the base model
    save(finished, tmp_path / "train-row" / "config.yaml")
    results = {"train-row": {"result": {"run_dir": str(tmp_path / "train-row")}}}
    # where it was written and how it checkpointed do not change the weights: reused
    elsewhere = row_config(tmp_path / "other", rl_steps=3, rl_variant="simulator", rl_simulator_model="default")
    elsewhere.save_every = 1
    grpo_sweep.check_reused(results, "row", elsewhere)
    with pytest.raises(SystemExit, match=r"trained with steps=3; the row now asks for steps=6: use another --out"):
        grpo_sweep.check_reused(results, "row", row_config(tmp_path, rl_steps=6, rl_variant="simulator", rl_simulator_model="default"))
    with pytest.raises(SystemExit, match=r"trained with simulator_model='default'; the row now asks for simulator_model='.*warm'"):
        grpo_sweep.check_reused(results, "row", row_config(tmp_path, rl_steps=3, rl_variant="simulator"))
    (tmp_path / "train-row" / "config.yaml").unlink()
    with pytest.raises(SystemExit, match="has no .*config.yaml: it cannot be checked"):
        grpo_sweep.check_reused(results, "row", elsewhere)


def test_the_table_shows_rehearsal_fidelity_per_step_and_on_the_test_tasks_where_measured():
    paired = {"mean_diff": 0.025, "ci95": [0.0, 0.075], "better": 1, "worse": 0}
    overall = {"success_rate": 0.1, "partial_credit": 0.2}
    results = {"warm-of-current-demo": "warm", "compare-current-demo": {"success": paired, "partial_credit": paired},
               "eval-warm": {"result": {"overall": overall}}, "eval-current-demo": {"result": {"overall": overall}},
               "train-current-demo": {"seconds": 300.0},
               # a step before fidelity was logged (an older results.json) reads "-"
               "curve-current-demo": [{"reward/mean": 0.1, "malformed": 2, "fidelity/exact": 0.5}, {"reward/mean": 0.2, "malformed": 0}]}
    row = grpo_sweep.table(results, ["current-demo"]).splitlines()[2]
    assert "| 0.50, - | - | 300 |" in row  # no rehearse-mode evaluation: no test-task fidelity
    results["eval-rehearse-warm"] = {"result": {"overall": overall | {"fidelity/exact": 0.25, "fidelity/field_f1": 0.5}}}
    row = grpo_sweep.table(results, ["current-demo"]).splitlines()[2]
    assert "| 0.50, - | 0.25 / 0.50 -> - | 300 |" in row  # the row itself not evaluated in rehearse mode
    results["eval-rehearse-current-demo"] = {"result": {"overall": overall | {"fidelity/exact": 0.375, "fidelity/field_f1": 0.625}}}
    row = grpo_sweep.table(results, ["current-demo"]).splitlines()[2]
    assert "| 0.50, - | 0.25 / 0.50 -> 0.38 / 0.62 | 300 |" in row
    results["compare-rehearse-current-demo"] = {"exact": paired, "field_f1": {"n": 30, "mean_diff": 0.068, "ci95": [0.01, 0.13], "better": 12, "worse": 5}}
    row = grpo_sweep.table(results, ["current-demo"]).splitlines()[2]
    assert "| 0.25 / 0.50 -> 0.38 / 0.62; field F1 paired over 30 tasks +0.068 [+0.010, +0.130] (12/5) | 300 |" in row


def test_the_fidelity_plot_is_drawn_only_for_rows_that_logged_fidelity(tmp_path):
    old = {"curve-demo": [{"step": 1, "reward/mean": 0.1, "malformed": 0}]}  # a row from before fidelity was logged
    assert grpo_sweep.fidelity_plot(old, ["demo"], tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()
    curves = old | {"curve-rehearse-sft-0.5": [{"step": s, "fidelity/exact": f, "policy/grounding_nll": n} for s, f, n in ((1, 0.3, 0.9), (2, 0.4, 0.7))]}
    path = grpo_sweep.fidelity_plot(curves, ["demo", "rehearse-sft-0.5"], tmp_path / "fidelity.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_pooled_table_compares_each_row_with_its_warm_start_and_the_first_row_over_every_sweep(tmp_path):
    import json

    def sweep(name: str, scores: dict[str, list[float]]) -> object:
        out = tmp_path / name
        for stage, successes in scores.items():
            (out / stage).mkdir(parents=True)
            (out / stage / "records.jsonl").write_text("".join(json.dumps({"task_id": f"t{i}", "success": s, "partial_credit": s}) + "\n"
                                                               for i, s in enumerate(successes)))
        (out / "results.json").write_text(json.dumps({"warm-of-a": "warm", "warm-of-b": "warm", "compare-a": {}, "compare-b": {}}))
        return out

    one = sweep("seed0", {"eval-warm": [0, 0], "eval-a": [1, 0], "eval-b": [1, 1]})
    two = sweep("seed1", {"eval-warm": [1, 0], "eval-a": [0, 0], "eval-b": [1, 0]})
    lines = grpo_sweep.pooled_table([one, two], ["a", "b"]).splitlines()
    # a vs warm: +1, 0, -1, 0; b vs warm: +1, +1, 0, 0; b vs a: 0, +1, +1, 0 (4 tasks each)
    assert lines[4].startswith("| a | its warm start | +0.000 [") and "(1/1, 4 tasks)" in lines[4]
    assert lines[5].startswith("| b | its warm start | +0.500 [") and "(2/0, 4 tasks)" in lines[5]
    assert lines[6].startswith("| b | a | +0.500 [") and "(2/0, 4 tasks)" in lines[6]
    with pytest.raises(SystemExit, match=r"--pool .*seed0: no finished rows \['c'\] there"):
        grpo_sweep.pooled_table([one, two], ["a", "c"])
    with pytest.raises(SystemExit, match=r"--pool .*nowhere: no finished rows \['a'\]"):
        grpo_sweep.pooled_table([tmp_path / "nowhere"], ["a"])


@pytest.mark.slow
def test_a_sweep_trains_evaluates_and_compares_its_rows_and_a_rerun_keeps_every_finished_stage(tmp_path, monkeypatch):
    """grpo_sweep.run end to end on a tiny model: two rows from one warm start, each trained,
    evaluated and compared task by task with it; a second call runs no stage again."""
    stages = []

    def in_this_process(fn, *args):  # counts the stages (the sweep spawns a process per stage)
        stages.append(fn.__name__)
        return fn(*args), 0.0

    monkeypatch.setattr(grpo_sweep, "in_fresh_process", in_this_process)
    tiny = dict(tiny=True, sft_per_world=2, sft_epochs=1, rl_steps=1, rl_tasks_per_step=1, rl_k=2, max_turn_tokens=16)
    defs = {"tiny-a": tiny, "tiny-b": dict(tiny, rl_lr=1e-5)}
    settings = {"seed": 0, "eval_per_world": 1, "eval_sampler_dtype": "f32"}
    results = grpo_sweep.run(tmp_path, list(defs), settings, defs=defs)
    assert stages == ["run_sft", "evaluate_model", "run_train", "evaluate_model", "run_train", "evaluate_model"]
    for row in defs:
        assert results[f"warm-of-{row}"] == results["warm-of-tiny-a"]  # one warm start for both
        assert results[f"compare-{row}"]["success"]["n"] == 5  # one test task per world, the held-out one's included
        assert [step["step"] for step in results[f"curve-{row}"]] == [1]
    table = (tmp_path / "results.md").read_text()
    assert all(f"| {row} |" in table for row in defs)

    stages.clear()
    assert grpo_sweep.run(tmp_path, list(defs), settings, defs=defs)["compare-tiny-b"] == results["compare-tiny-b"]
    assert stages == []
    with pytest.raises(SystemExit, match="holds a sweep with seed 0: pass that --seed or another --out"):
        grpo_sweep.run(tmp_path, list(defs), settings | {"seed": 1}, defs=defs)
