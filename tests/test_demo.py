import json
from pathlib import Path

import pytest

from envace.backends.models import machine_line
from envace.config import ConfigError, build
from envace.demo import DemoConfig, in_fresh_process, run_demo


def test_demo_config_validation():
    with pytest.raises(ConfigError, match="rl_k"):
        build(DemoConfig, {"rl_k": 1})
    with pytest.raises(ConfigError, match="rl_reward"):
        build(DemoConfig, {"rl_reward": "judge"})
    with pytest.raises(ConfigError, match="rl_temperature"):
        build(DemoConfig, {"rl_temperature": 0.0})  # a greedy group has no advantages
    with pytest.raises(ConfigError, match="pass --rl-rehearse-sft-coef 0 with --rl-grounding"):
        build(DemoConfig, {"rl_grounding": True})
    with pytest.raises(ConfigError, match="rl_rehearse_sft_coef must be >= 0"):
        build(DemoConfig, {"rl_rehearse_sft_coef": -1.0})
    with pytest.raises(ConfigError, match="rl_real_fraction"):
        build(DemoConfig, {"rl_real_fraction": 1.5})
    with pytest.raises(ConfigError, match="eval_sampler_dtype must be auto, f32 or bf16, got 'q8_0'"):
        build(DemoConfig, {"eval_sampler_dtype": "q8_0"})  # llama.cpp's, not the evaluation's


def test_demo_config_refuses_variant_settings_the_variant_does_not_read():
    with pytest.raises(ConfigError, match="unknown rl_variant 'grpo'; known: act-only, envace, no-share, real-grpo, simulator"):
        build(DemoConfig, {"rl_variant": "grpo"})
    # grounding trains the policy's REHEARSE role: on by default, so a baseline must turn it off by name
    with pytest.raises(ConfigError, match="pass --rl-rehearse-sft-coef 0 with --rl-variant act-only"):
        build(DemoConfig, {"rl_variant": "act-only"})
    with pytest.raises(ConfigError, match="--rl-variant no-share does not train the policy's REHEARSE role"):
        build(DemoConfig, {"rl_variant": "no-share"})
    with pytest.raises(ConfigError, match="rl_real_fraction .* --rl-variant real-grpo does not rehearse"):
        build(DemoConfig, {"rl_variant": "real-grpo", "rl_rehearse_sft_coef": 0.0, "rl_real_fraction": 0.5})
    with pytest.raises(ConfigError, match="rl_grounding .* --rl-variant simulator does not rehearse"):
        build(DemoConfig, {"rl_variant": "simulator", "rl_rehearse_sft_coef": 0.0, "rl_grounding": True})
    with pytest.raises(ConfigError, match="rl_simulator_model is read by --rl-variant simulator only; drop it for --rl-variant envace"):
        build(DemoConfig, {"rl_simulator_model": "default"})
    # a world-free GRPO stage refuses, by the demo's flags, each setting that would run a world
    with pytest.raises(ConfigError, match="--rl-world-free trains with no world, and --rl-reward partial needs one: use --rl-reward reference"):
        build(DemoConfig, {"rl_world_free": True})
    with pytest.raises(ConfigError, match="and --rl-variant real-grpo needs one: .*does not roll out in the world "
                                          r"\(act-only, envace, no-share, simulator\)"):
        build(DemoConfig, {"rl_world_free": True, "rl_reward": "reference", "rl_variant": "real-grpo", "rl_rehearse_sft_coef": 0.0})
    with pytest.raises(ConfigError, match="and --rl-real-fraction needs one"):
        build(DemoConfig, {"rl_world_free": True, "rl_reward": "reference", "rl_real_fraction": 0.5})


def test_demo_grpo_stage_takes_grounding_real_fraction_and_group_filtering_into_its_train_config(tmp_path):
    from envace.demo import train_config

    plain = train_config(build(DemoConfig, {}), tmp_path)
    assert (plain.rollout.rehearse_layout, plain.rollout.grounding, plain.real_fraction) == ("transcript", False, 0.0)
    assert plain.filter_groups and not train_config(build(DemoConfig, {"rl_filter_groups": False}), tmp_path).filter_groups
    assert not plain.rollout.continuous_batching and train_config(build(DemoConfig, {"rl_continuous_batching": True}), tmp_path).rollout.continuous_batching
    assert plain.rehearse_sft_coef == 0.5 and train_config(build(DemoConfig, {"rl_rehearse_sft_coef": 0.0}), tmp_path).rehearse_sft_coef == 0.0
    grounded = train_config(build(DemoConfig, {"rl_grounding": True, "rl_rehearse_sft_coef": 0.0, "rl_real_fraction": 0.5}), tmp_path)
    # grounding exists only in the isolated simulator prompt: the flag must bring that layout with it
    assert (grounded.rollout.rehearse_layout, grounded.rollout.grounding, grounded.real_fraction) == ("isolated", True, 0.5)
    assert plain.variant == "envace"
    for variant, layout in (("act-only", "transcript"), ("real-grpo", "transcript"), ("simulator", "transcript"), ("no-share", "isolated")):
        baseline = train_config(build(DemoConfig, {"rl_variant": variant, "rl_rehearse_sft_coef": 0.0}), tmp_path)
        # no-share's second model cannot share the agent's transcript cache: the variant brings its layout
        assert (baseline.variant, baseline.rollout.rehearse_layout, baseline.rehearse_sft_coef) == (variant, layout, 0.0)
    # the frozen simulator is the warm start by default (the base model before it exists), or the model named
    simulator = {"rl_variant": "simulator", "rl_rehearse_sft_coef": 0.0}
    warm = tmp_path / "warm"
    warm.mkdir()
    (warm / "config.json").write_text("{}")  # a checkpoint directory, as far as the spec check looks
    assert train_config(build(DemoConfig, simulator), tmp_path).simulator_model is None
    assert train_config(build(DemoConfig, simulator), tmp_path, init_from=str(warm)).simulator_model == str(warm)
    assert train_config(build(DemoConfig, simulator | {"rl_simulator_model": "default"}), tmp_path, init_from=str(warm)).simulator_model == "default"
    assert train_config(build(DemoConfig, {}), tmp_path, init_from=str(warm)).simulator_model is None  # envace has no simulator


def test_a_world_free_grpo_stage_trains_on_its_tasks_world_free_form_and_counts_recording_them(tmp_path):
    from envace.demo import grpo_stage_config, train_config
    from envace.envs.tasks import builtin_tasks
    from envace.manifest import build_manifest, scenario_keys, write_manifest

    cfg = build(DemoConfig, {"rl_world_free": True, "rl_reward": "reference"})
    warm = tmp_path / "warm"
    world_tasks = builtin_tasks("train", 16, difficulty=1, seed=0)
    write_manifest(build_manifest(world_tasks[:3], None), warm)  # the warm start trained on three of them
    (warm / "config.json").write_text("{}")
    train = grpo_stage_config(cfg, tmp_path / "train", init_from=str(warm))
    assert (train.tasks, train.reward, train.variant, train.rehearse_sft_coef) == (str(tmp_path / "train" / "tasks.world-free.jsonl"), "reference", "envace", 0.5)
    written = [json.loads(line) for line in Path(train.tasks).read_text().splitlines()]
    # the tasks the built-in draw would train on: 16 per world, the warm start's own scenarios left out (others drawn in their place)
    drawn = builtin_tasks("train", 16, difficulty=1, seed=0, exclude=scenario_keys(world_tasks[:3]))
    assert [t["id"] for t in written] == [t.id for t in drawn] and not {t.id for t in world_tasks[:3]} & {t["id"] for t in written}
    assert all(t.get("world") is None and t["reference"] for t in written)  # no world to run; a recorded reference to ground and reward with
    # one execution per reference call, recorded once: what the stage cost in world access
    sidecar = json.loads(Path(train.tasks + ".export.json").read_text())
    assert sidecar["world_executions"] == sum(len(t.reference_calls) for t in drawn) > 0
    assert train_config(cfg, tmp_path / "train", init_from=str(warm)).tasks is None  # the pure config draws built-in tasks


def test_default_demo_evaluates_at_least_40_tasks_across_all_worlds():
    from envace.envs import HELDOUT_WORLDS, TRAIN_WORLDS

    assert DemoConfig().eval_per_world * len(TRAIN_WORLDS + HELDOUT_WORLDS) >= 40


@pytest.mark.slow
def test_demo_pipeline_end_to_end_on_a_tiny_model(tmp_path):
    """The whole demo (SFT, rehearsal GRPO, evaluations, report) on a tiny random model."""
    cfg = build(DemoConfig, dict(tiny=True, output_dir=str(tmp_path), eval_per_world=1, sft_per_world=2, sft_epochs=1,
                                 rl_steps=1, rl_tasks_per_step=1, rl_k=2, max_turn_tokens=16, eval_rehearse=True, progress=False))
    summary = run_demo(cfg)
    assert list(summary["stages"]) == ["SFT", "SFT + rehearsal GRPO", "SFT + rehearsal GRPO, rehearse mode"]
    report = (tmp_path / "report.md").read_text()
    assert "| SFT + rehearsal GRPO |" in report and "held-out world (travel)" in report
    paired = summary["paired"]["partial_credit"]
    assert paired["n"] == 5 and paired["better"] + paired["worse"] + paired["same"] == 5  # one task per world, both runs
    assert "| partial credit |" in report and (tmp_path / "training_story.png").stat().st_size > 0
    calls = summary["train"]["world_executions"]
    # rehearsal rollouts; verification depends on the calls made. The rehearser is grounded on the references of the
    # tasks whose groups the update took (a call each, and the replay that verifies it), none if the filter kept none.
    [step] = [json.loads(line) for line in (Path(summary["train"]["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert calls["rollout"] == 0 and (calls["grounding"] >= 2) == (step["filter/groups_kept"] > 0)
    assert summary["train"]["chain_world_executions"]["sft_data"] > 0  # and so is the warm start's data
    assert (tmp_path / "report.html").read_text().count("<table>") >= 2
    assert summary["stages"]["SFT + rehearsal GRPO, rehearse mode"]["overall"]["real_env_calls"] == 0
    assert set(summary["peak_rss_gib"]) == set(summary["timings_s"]) and all(v > 0 for v in summary["peak_rss_gib"].values())
    assert "| stage | seconds | peak RSS GiB |" in report
    assert f"min on {machine_line(summary['machine'])}." in report  # the wall time names the machine it was measured on


@pytest.mark.slow
def test_demo_pipeline_with_a_baseline_variant_names_it_and_counts_its_world_runs(tmp_path):
    """--rl-variant real-grpo (the GRPO baseline against the real worlds): the report names the
    variant and its mode rather than calling it rehearsal, and reports the world executions its run counted."""
    cfg = build(DemoConfig, dict(tiny=True, output_dir=str(tmp_path), eval_per_world=1, sft_per_world=2, sft_epochs=1, rl_variant="real-grpo",
                                 rl_rehearse_sft_coef=0.0, rl_filter_groups=False, rl_steps=1, rl_tasks_per_step=1, rl_k=2, max_turn_tokens=16,
                                 progress=False))
    summary = run_demo(cfg)
    assert list(summary["stages"]) == ["SFT", "SFT + GRPO (real-grpo)"]
    report = (tmp_path / "report.md").read_text()
    assert ", variant real-grpo) against the real worlds." in report and "rehearsal GRPO" not in report
    assert "## What the GRPO steps changed: SFT + GRPO (real-grpo) minus SFT, task by task" in report
    calls = summary["train"]["world_executions"]
    assert calls["grounding"] == 0
    # the rollouts' executions as the run counted them (the tiny model's calls are mostly malformed: often 0)
    run = [json.loads(line) for line in (Path(summary["train"]["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert calls["rollout"] == run[-1]["env/rollout_total"]


@pytest.mark.slow
def test_a_world_free_demo_runs_no_world_in_its_grpo_stage_and_reports_what_recording_its_tasks_cost(tmp_path):
    cfg = build(DemoConfig, dict(tiny=True, output_dir=str(tmp_path), eval_per_world=1, sft_per_world=2, sft_epochs=1, rl_world_free=True,
                                 rl_reward="reference", rl_steps=1, rl_tasks_per_step=1, rl_k=2, max_turn_tokens=16, progress=False))
    summary = run_demo(cfg)
    calls, chain = summary["train"]["world_executions"], summary["train"]["chain_world_executions"]
    assert (calls["rollout"], calls["verification"], calls["grounding"]) == (0, 0, 0)
    recorded = json.loads((tmp_path / "train" / "tasks.world-free.jsonl.export.json").read_text())["world_executions"]
    assert chain["task_data"] == recorded > 0 and chain["sft_data"] > 0
    report = (tmp_path / "report.md").read_text()
    assert f", {recorded} recorded the world-free training tasks' references." in report
    assert "**0** to verify, 0 for grounding" in report  # no replay to explain


def test_each_demo_stage_runs_in_a_fresh_process_and_reports_its_peak_memory():
    """A stage's memory is the system's again when it ends: the stage ran in another process,
    whose own peak RSS comes back with the result (and an error comes back as itself)."""
    import os

    pid, peak = in_fresh_process(os.getpid)
    assert pid != os.getpid() and 0 < peak < 64
    with pytest.raises(ZeroDivisionError):
        in_fresh_process(divmod, 1, 0)


def test_rehearsal_fidelity_is_compared_per_task_over_the_tasks_both_models_rehearsed(tmp_path):
    from envace.demo import compare_fidelity, per_task_fidelity

    def write(name: str, fidelity: dict[str, list[tuple[float, float]]]) -> Path:
        (tmp_path / name).mkdir()
        records = [{"task_id": t, "fidelity": [{"exact": e, "field_f1": f} for e, f in calls]} for t, calls in fidelity.items()]
        (tmp_path / name / "records.jsonl").write_text("\n".join(map(json.dumps, records)) + "\n")
        return tmp_path / name

    # task c rehearsed no call before (malformed, or answered at once): it has no fidelity to pair
    before = write("before", {"a": [(0.0, 0.5), (1.0, 1.0)], "b": [(0.0, 0.2)], "c": []})
    after = write("after", {"a": [(1.0, 1.0)], "b": [(0.0, 0.4), (0.0, 0.6)], "c": [(1.0, 1.0)]})
    assert per_task_fidelity(before, "field_f1") == {"a": 0.75, "b": 0.2}
    paired = compare_fidelity(before, after)
    # exact: a 0.5 -> 1.0, b 0 -> 0; field F1: a 0.75 -> 1.0, b 0.2 -> 0.5
    assert paired["exact"]["n"] == 2 and paired["exact"]["mean_diff"] == pytest.approx(0.25) and (paired["exact"]["better"], paired["exact"]["same"]) == (1, 1)
    assert paired["field_f1"]["mean_diff"] == pytest.approx((0.25 + 0.3) / 2) and paired["field_f1"]["better"] == 2


def test_pooled_comparison_keeps_each_pairs_tasks_apart(tmp_path):
    """Two seeds' evaluations may reuse a task id; pooled, each pair's task is its own sample."""
    from envace.demo import compare_pooled

    def write(name: str, success: float) -> Path:
        (tmp_path / name).mkdir()
        (tmp_path / name / "records.jsonl").write_text(json.dumps({"task_id": "t", "success": success, "partial_credit": success / 2}) + "\n")
        return tmp_path / name

    pooled = compare_pooled([(write("b0", 0.0), write("a0", 1.0)), (write("b1", 1.0), write("a1", 1.0))])
    assert (pooled["success"]["n"], pooled["success"]["mean_diff"], pooled["success"]["better"], pooled["success"]["same"]) == (2, 0.5, 1, 1)
    assert pooled["partial_credit"]["mean_diff"] == 0.25


@pytest.mark.parametrize("bf16", [True, False])
def test_both_training_stages_recompute_activations_exactly_where_they_train_under_bf16(tmp_path, monkeypatch, bf16):
    """Under bf16 autocast the saved activations are the demo's peak memory (docs/performance.md,
    "Memory"); in fp32 the stages fit without recomputing them and run faster."""
    import envace.training.setup as setup
    from envace.demo import sft_config, train_config

    monkeypatch.setattr(setup, "native_bf16", lambda: bf16)
    assert train_config(build(DemoConfig, {}), tmp_path).activation_checkpointing is bf16
    # the SFT stage trains in fp32 by default (its bf16 warm start broke the call format), so recomputes nothing
    sft = sft_config(build(DemoConfig, {}), tmp_path)
    assert (sft.precision, sft.activation_checkpointing) == ("fp32", False)
    sft = sft_config(build(DemoConfig, {"sft_precision": "auto"}), tmp_path)
    assert (sft.precision, sft.activation_checkpointing) == ("auto", bf16)
