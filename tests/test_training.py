"""Trainer and SFT on a tiny random model over the real tokenizer, with the small Counter world."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from envace.algorithms.losses import TRAINED_ROLES, build_rows
from envace.algorithms import ADVANTAGES
from envace.config import ConfigError, build
from envace.envs.tasks import save_tasks
from envace.training.sft import SFTConfig, reference_trajectories, run_sft, sft_rows
from envace.training.trainer import TaskStream, TrainConfig, Trainer
from envace.types import Role, Task

from tests.test_rollout import counter_task

SMALL = dict(tiny=True, steps=2, tasks_per_step=2, k=2, max_turns=2, max_turn_tokens=12, max_rehearse_tokens=8,
             max_total_tokens=400, progress=False, tensorboard=False, lr=1e-3)


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tasks") / "counter.jsonl"
    tasks = [counter_task(n) for n in (1, 2, 3, 4)]
    for i, t in enumerate(tasks):
        t.id = f"counter-{i}"
        t.metadata["reference_answer"] = f"The counter is {i + 1}."
    save_tasks(tasks, path)
    return str(path)


def params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_task_stream_is_deterministic_and_resumable():
    tasks = [Task(id=str(i), world="w", messages=[]) for i in range(5)]
    a = TaskStream(tasks, seed=3)
    first = [t.id for t in a.take(7)]
    b = TaskStream(tasks, seed=3)
    b.take(4)
    c = TaskStream(tasks, seed=3, **b.state())
    assert [t.id for t in c.take(3)] == first[4:]
    assert sorted(first[:5]) == [str(i) for i in range(5)]  # an epoch visits every task once


@pytest.mark.parametrize(
    "values,match",
    [
        ({"k": 1}, "k must be >= 2"),
        ({"variant": "no-share"}, "no-share needs --rehearse-layout isolated"),
        ({"real_fraction": 1.5}, "real_fraction"),
        ({"variant": "real-grpo", "real_fraction": 0.5}, "real_fraction applies"),
        ({"reward": "nope"}, "unknown reward"),
        ({"model": "/no/such/model"}, "model"),
        ({"tasks": "/no/such.jsonl"}, "does not exist"),
        ({"resume": True}, "--resume needs --output-dir"),
    ],
)
def test_train_config_validation(values, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        build(TrainConfig, values)


@pytest.mark.parametrize(
    "variant,layout,trained",
    [
        ("envace", "transcript", {Role.ACT, Role.REHEARSE}),
        ("act-only", "transcript", {Role.ACT}),
        ("real-grpo", "transcript", {Role.ACT}),
        ("simulator", "transcript", {Role.ACT}),
    ],
)
def test_variant_masks_choose_trained_tokens(tokenizer, variant, layout, trained):
    from envace.backends.scripted import ScriptedGenerator
    from envace.envs.environment import WorldEnvironment
    from envace.rollout import RolloutConfig, RolloutEngine
    from tests.test_rollout import agent

    mode = {"real-grpo": "real", "simulator": "simulator"}.get(variant, "rehearse")
    sim = ScriptedGenerator(tokenizer, lambda _: '{"value": 5}') if mode == "simulator" else None
    engine = RolloutEngine(ScriptedGenerator(tokenizer, agent), WorldEnvironment(), RolloutConfig(mode=mode), simulator=sim)
    groups = engine.run([counter_task()], k=2, progress=False)
    groups[0][0].reward, groups[0][1].reward = 1.0, 0.0
    adv = ADVANTAGES.get("role_grpo")(groups)
    [row, _] = build_rows(groups[0], adv[0].trajectories, TRAINED_ROLES[variant]["policy"], layout)
    trained_roles = {Role(r) for r, m in zip(row.roles, row.loss_mask) if m}
    assert trained_roles == trained
    assert all(m == 0 for r, m in zip(row.roles, row.loss_mask) if r in (Role.PROMPT, Role.ENV, Role.USER))


def test_sft_data_is_real_world_reference_trajectories(tokenizer, task_file):
    from envace.envs.environment import WorldEnvironment
    from envace.envs.tasks import load_tasks

    data, dropped = reference_trajectories(load_tasks(task_file), tokenizer, WorldEnvironment(), 1024)
    assert dropped == 0 and len(data) == 4
    assert all(t.reward == 1.0 and t.real_env_calls == 1 for t in data)
    row = sft_rows(data[:1], (Role.ACT, Role.ENV))[0]
    trained_text = tokenizer.decode([i for i, m in zip(row.input_ids, row.loss_mask) if m])
    assert '"name": "add"' in trained_text and '{"value": 1}' in trained_text and "The counter is 1." in trained_text


def test_sft_reduces_loss(tmp_path, task_file):
    cfg = build(SFTConfig, dict(tiny=True, tasks=task_file, epochs=3, rows_per_step=4, lr=3e-3, output_dir=str(tmp_path / "sft"), progress=False, tensorboard=False))
    result = run_sft(cfg)
    losses = [json.loads(line)["sft/loss"] for line in open(tmp_path / "sft" / "metrics.jsonl")]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert (tmp_path / "sft" / "final" / "config.json").is_file() and result["examples"] == 4


def test_train_step_updates_weights_and_logs(tmp_path, task_file):
    cfg = build(TrainConfig, dict(SMALL, tasks=task_file, output_dir=str(tmp_path / "run"), steps=1))
    trainer = Trainer(cfg)
    before = params(trainer.models.policy)
    metrics = trainer.train_step()
    trainer.logger.close()
    assert metrics["env/real_calls_step"] == 0  # rehearse mode never calls the real world
    assert "policy/trained_tokens" in metrics and "time/rollout_share" in metrics
    moved = not torch.equal(before, params(trainer.models.policy))
    assert moved == (metrics["groups/degenerate_frac"] < 1.0)
    from envace.training.checkpoint import latest_checkpoint

    assert latest_checkpoint(tmp_path / "run").name.endswith("1")


def test_resume_reaches_the_same_weights_as_an_uninterrupted_run(tmp_path, task_file):
    full = Trainer(build(TrainConfig, dict(SMALL, tasks=task_file, output_dir=str(tmp_path / "full"))))
    full.fit()
    part = Trainer(build(TrainConfig, dict(SMALL, tasks=task_file, output_dir=str(tmp_path / "part"), steps=1)))
    part.fit()
    resumed = Trainer(build(TrainConfig, dict(SMALL, tasks=task_file, output_dir=str(tmp_path / "part"), resume=True)))
    assert resumed.step == 1
    resumed.fit()
    assert torch.allclose(params(full.models.policy), params(resumed.models.policy), atol=1e-6)
    steps = [json.loads(line)["step"] for line in open(tmp_path / "part" / "metrics.jsonl")]
    assert steps == [1, 2]


def test_existing_run_needs_resume_flag(tmp_path, task_file):
    Trainer(build(TrainConfig, dict(SMALL, tasks=task_file, output_dir=str(tmp_path / "r"), steps=1))).fit()
    with pytest.raises(ConfigError, match="--resume"):
        Trainer(build(TrainConfig, dict(SMALL, tasks=task_file, output_dir=str(tmp_path / "r"), steps=1)))
    with pytest.raises(ConfigError, match="options differ.*lr"):
        Trainer(build(TrainConfig, dict(SMALL, tasks=task_file, output_dir=str(tmp_path / "r"), lr=0.5, resume=True)))


def test_resume_accepts_a_run_saved_before_an_option_existed(tmp_path):
    """A run saved by an older envace lacks newer options: they count as their defaults."""
    import yaml

    from envace import config as cfgmod
    from envace.training.setup import check_resume

    cfg = build(TrainConfig, dict(tiny=True, output_dir=str(tmp_path)))
    (tmp_path / "checkpoints" / "step-00000001").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-00000001" / "state.json").write_text("{}")
    saved = cfgmod.to_dict(cfg)
    del saved["on_malformed"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    assert check_resume(tmp_path, cfg, resume=True) is not None
    cfg.on_malformed = "continue"
    with pytest.raises(ConfigError, match="options differ.*on_malformed"):
        check_resume(tmp_path, cfg, resume=True)


@pytest.mark.slow
def test_killed_run_resumes_from_last_checkpoint(tmp_path, task_file):
    """SIGKILL a training process after its first checkpoint; --resume finishes the run."""
    out = tmp_path / "killed"
    args = [sys.executable, "-m", "envace.cli", "train", "--tiny", "--tasks", task_file, "--steps", "3", "--tasks-per-step", "2", "--k", "2",
            "--max-turns", "2", "--max-turn-tokens", "12", "--max-rehearse-tokens", "8", "--max-total-tokens", "400",
            "--no-progress", "--no-tensorboard", "--output-dir", str(out)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    from envace.training.checkpoint import latest_checkpoint

    while latest_checkpoint(out) is None:
        assert time.time() < deadline and proc.poll() is None, "training died before its first checkpoint"
        time.sleep(0.5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "final").exists()
    done = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "final" / "config.json").is_file()
    steps = [json.loads(line)["step"] for line in open(out / "metrics.jsonl")]
    assert steps == sorted(set(steps)) and steps[-1] == 3


def distributed(nproc: int, *args: str, timeout: int = 600) -> str:
    """Run tests/ddp_worker.py in `nproc` processes (torch's launcher, gloo on CPU); its stdout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), os.path.join(root, "tests", "ddp_worker.py"), *args]
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_two_process_sft_reaches_the_weights_of_one_process(tmp_path, task_file):
    """Under DDP each process trains on its share of a step's rows and the token mean is over
    all of them: the weights equal a single-process run's."""
    from safetensors.torch import load_file

    distributed(2, "sft", task_file, str(tmp_path / "two"))
    distributed(1, "sft", task_file, str(tmp_path / "one"))
    two, one = (load_file(tmp_path / d / "final" / "model.safetensors") for d in ("two", "one"))
    assert max(float((two[k] - one[k]).abs().max()) for k in one) < 1e-4
    steps = [json.loads(line)["step"] for line in open(tmp_path / "two" / "metrics.jsonl")]
    assert steps == [1, 2]  # one logger (the main process), not one per process


@pytest.mark.slow
def test_two_process_grpo_updates_and_keeps_replicas_identical(tmp_path, task_file):
    out = distributed(2, "grpo", task_file, str(tmp_path / "grpo"))
    checksums = dict(line.split()[1::2] for line in out.splitlines() if line.startswith("rank "))
    assert set(checksums) == {"0", "1"} and checksums["0"] == checksums["1"]
    metrics = [json.loads(line) for line in open(tmp_path / "grpo" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["policy/skipped_update"] == 0.0 for m in metrics)
    assert (tmp_path / "grpo" / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize("variant,extra", [("real-grpo", {}), ("simulator", {}), ("no-share", {"rehearse_layout": "isolated"}), ("act-only", {}), ("envace", {"real_fraction": 0.5})])
def test_every_variant_runs_a_step(tmp_path, task_file, variant, extra):
    trainer = Trainer(build(TrainConfig, dict(SMALL, tasks=task_file, output_dir=str(tmp_path / variant), steps=1, variant=variant, **extra)))
    metrics = trainer.train_step()
    trainer.logger.close()
    real_calls = metrics["env/real_calls_step"]
    assert trainer.cfg.rollout_mode == {"real-grpo": "real", "simulator": "simulator"}.get(variant, "rehearse")
    if variant not in ("real-grpo", "envace"):
        assert real_calls == 0  # only real rollouts (real-grpo, or envace's real_fraction) touch the world
    assert set(trainer.models.trained()) == ({"policy", "rehearser"} if variant == "no-share" else {"policy"})
    assert (trainer.models.simulator is not None) == (variant == "simulator")


def test_counted_metrics_are_summed_over_processes_the_rest_averaged():
    from envace.training.trainer import is_count

    keys = ("policy/tokens/act", "policy/tokens", "malformed", "fidelity/calls", "policy/trained_tokens", "env/real_calls_step", "reward/act", "tokens_per_task")
    assert [is_count(k) for k in keys] == [True, True, True, True, False, False, False, False]


def test_on_malformed_reaches_the_rollout_config(task_file):
    cfg = build(TrainConfig, dict(SMALL, tasks=task_file, on_malformed="continue"))
    assert cfg.rollout_config("rehearse").on_malformed == "continue" and cfg.rollout_config("real").on_malformed == "continue"
