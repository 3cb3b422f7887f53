"""Trainer and SFT on a tiny random model over the real tokenizer, with the small Counter world."""

import dataclasses
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from envace.algorithms.losses import build_rows
from envace.algorithms import ADVANTAGES
from envace.config import ConfigError, build
from envace.envs.tasks import save_tasks
from envace.training.sft import SFTConfig, reference_trajectories, run_sft, sft_rows
from envace.training.trainer import TaskStream, TrainConfig, Trainer
from envace.training.variants import VARIANTS
from envace.types import Role, Task

from tests.test_rollout import counter_task

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="DeepSpeed is not installed (the `deepspeed` extra: pip install 'envace[deepspeed]')")

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


@pytest.fixture
def seeds(monkeypatch):
    """The seeds given to every HF sampler the trainer opens, in order."""
    import envace.backends.hf as hf

    given = []

    class Recording(hf.HFGenerator):
        def set_seed(self, seed):
            given.append(seed)
            super().set_seed(seed)

    monkeypatch.setattr(hf, "HFGenerator", Recording)
    return given


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

    mode = VARIANTS.get(variant).rollout_mode
    sim = ScriptedGenerator(tokenizer, lambda _: '{"value": 5}') if mode == "simulator" else None
    engine = RolloutEngine(ScriptedGenerator(tokenizer, agent), WorldEnvironment(), RolloutConfig(mode=mode), simulator=sim)
    groups = engine.run([counter_task()], k=2, progress=False)
    groups[0][0].reward, groups[0][1].reward = 1.0, 0.0
    adv = ADVANTAGES.get("role_grpo")(groups)
    [row, _] = build_rows(groups[0], adv[0].trajectories, VARIANTS.get(variant).trained_roles["policy"], layout)
    trained_roles = {Role(r) for r, m in zip(row.roles, row.loss_mask) if m}
    assert trained_roles == trained
    assert all(m == 0 for r, m in zip(row.roles, row.loss_mask) if r in (Role.PROMPT, Role.ENV, Role.USER))


def test_sft_data_is_real_world_reference_trajectories(tokenizer, task_file):
    from envace.envs.environment import WorldEnvironment
    from envace.envs.tasks import load_tasks

    data, dropped, executions = reference_trajectories(load_tasks(task_file), tokenizer, WorldEnvironment(), 1024)
    assert dropped == 0 and len(data) == 4
    assert executions.sft_data == 8 and executions.total == 8  # 4 reference calls, each run, then replayed to verify
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


def test_sft_with_activation_checkpointing_trains_the_same_model(tmp_path, task_file):
    """The demo's SFT stage recomputes activations to bound its memory: that must change the
    memory only, not the losses or the weights it trains."""
    from safetensors.torch import load_file

    def train(checkpointing: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        out = tmp_path / f"sft-{checkpointing}"
        run_sft(build(SFTConfig, dict(tiny=True, tasks=task_file, epochs=3, rows_per_step=2, lr=3e-3, precision="fp32", activation_checkpointing=checkpointing,
                                      output_dir=str(out), progress=False, tensorboard=False)))
        losses = [json.loads(line)["sft/loss"] for line in open(out / "metrics.jsonl")]
        return losses, load_file(out / "final" / "model.safetensors")

    plain, checkpointed = train(False), train(True)
    assert len(plain[0]) == 6 and plain[0] == pytest.approx(checkpointed[0], rel=1e-5)
    assert plain[1].keys() == checkpointed[1].keys()
    for name, weight in plain[1].items():
        torch.testing.assert_close(checkpointed[1][name], weight, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("reward,degenerate_frac,moves", [
    ("tests.training_rewards:constant", 1.0, False),  # equal rewards: no signal, the update is skipped
    ("tests.training_rewards:rollout_index", 0.0, True),  # rewards 0 and 1 in every group
])
def test_train_step_updates_weights_only_with_a_learning_signal_and_logs(tmp_path, task_file, reward, degenerate_frac, moves):
    # penalty 0: a malformed output of the random model must not give the constant reward a signal
    cfg = build(TrainConfig, dict(SMALL, tasks=task_file, output_dir=str(tmp_path / "run"), steps=1, reward=reward, penalty=0.0))
    trainer = Trainer(cfg)
    before = params(trainer.models.policy)
    metrics = trainer.train_step()
    trainer.logger.close()
    assert metrics["env/rollout_step"] == 0  # rehearse mode never calls the real world
    assert "policy/trained_tokens" in metrics and "time/rollout_share" in metrics
    assert metrics["groups/degenerate_frac"] == degenerate_frac
    assert (not torch.equal(before, params(trainer.models.policy))) == moves
    from envace.training.checkpoint import latest_checkpoint

    assert latest_checkpoint(tmp_path / "run").name.endswith("1")


def test_rows_of_zero_advantage_are_left_out_of_the_update_and_change_no_weight(tmp_path, task_file, monkeypatch):
    """A step whose groups scored alike but one: the update forwards only the signalled group's
    rows (zero_advantage_rows counts the rest) and reaches the weights of the update over all rows."""
    import envace.training.trainer as trainer_mod

    def one_step(name):
        cfg = build(TrainConfig, dict(SMALL, tasks=task_file, output_dir=str(tmp_path / name), steps=1, penalty=0.0,
                                      reward="tests.training_rewards:signal_in_counter_1_only", tasks_per_step=4))
        trainer = Trainer(cfg)
        metrics = trainer.train_step()
        trainer.logger.close()
        return metrics, params(trainer.models.policy)

    dropped, weights = one_step("dropped")
    monkeypatch.setattr(trainer_mod, "rows_with_signal", lambda rows: list(rows))  # the update over every row
    kept, all_rows_weights = one_step("kept")
    assert dropped["groups/degenerate_frac"] == 0.75  # 3 of the 4 task groups scored alike
    assert dropped["policy/zero_advantage_rows"] == 6 and kept["policy/zero_advantage_rows"] == 0  # 3 groups x k=2
    assert dropped["policy/trained_tokens"] == kept["policy/trained_tokens"]  # the same token-mean denominator
    assert dropped["policy/forwarded_tokens"] < kept["policy/forwarded_tokens"]
    # Adam's first step moves a weight by ~lr (1e-3) wherever its gradient is nonzero; leaving rows out
    # changes the micro-batch shapes and so the summation order, and where a gradient is near Adam's eps
    # that order shows (1.1e-6 on 1 of 6.4M weights, measured on an AMD CPU). 1e-5 is 1% of a real step.
    torch.testing.assert_close(weights, all_rows_weights, rtol=0, atol=1e-5)


def test_filter_groups_rolls_out_more_rounds_until_the_step_has_enough_groups_with_a_signal(tmp_path, task_file, seeds):
    """--filter-groups (DAPO's dynamic sampling), 2 tasks per step, at most 3 rounds, a reward with
    a signal in task counter-1's group only: the step rolls out rounds of 2 tasks from the stream
    until 2 counter-1 groups are in or 3 rounds ran, each round from a seed of its own; the update
    takes only the groups with a signal (no zero-advantage row), while every rolled-out group is
    counted."""
    from envace.training.trainer import TaskStream

    cfg = build(TrainConfig, dict(SMALL, tasks=task_file, output_dir=str(tmp_path / "run"), steps=1, penalty=0.0, filter_groups=True,
                                  max_rollout_rounds=3, reward="tests.training_rewards:signal_in_counter_1_only"))
    trainer = Trainer(cfg)
    replica = TaskStream(trainer.tasks, cfg.seed)  # the task order the trainer draws from
    drawn, rounds = [], 0
    while rounds < 3 and drawn.count("counter-1") < 2:
        drawn, rounds = drawn + [t.id for t in replica.take(2)], rounds + 1
    metrics = trainer.train_step()
    trainer.logger.close()
    signal = drawn.count("counter-1")
    assert metrics["filter/rounds"] == rounds == 3 and metrics["filter/groups_rolled_out"] == 2 * rounds  # seed 0: counter-1 once in 6 draws
    assert len(seeds) == len(set(seeds)) == rounds  # one rehearse-mode policy generator, seeded per round
    assert metrics["filter/groups_with_signal"] == signal and metrics["filter/groups_kept"] == min(signal, 2)
    assert trainer.stream.state() == replica.state()  # the next step draws after every task rolled out
    assert metrics["policy/zero_advantage_rows"] == 0 and metrics["groups/degenerate_frac"] == 0.0
    assert metrics["policy/trained_tokens"] > 0 and metrics["policy/skipped_update"] == 0.0


def test_filter_groups_without_any_signal_stops_after_the_last_round_and_skips_the_update(tmp_path, task_file):
    trainer = Trainer(build(TrainConfig, dict(SMALL, tasks=task_file, output_dir=str(tmp_path / "run"), steps=1, penalty=0.0, filter_groups=True,
                                              max_rollout_rounds=2, reward="tests.training_rewards:constant")))
    metrics = trainer.train_step()
    trainer.logger.close()
    assert metrics["filter/rounds"] == 2 and metrics["filter/groups_rolled_out"] == 4 and metrics["filter/groups_kept"] == 0
    assert metrics["policy/skipped_update"] == 1.0
    assert metrics["reward/mean"] == 0.5  # the rollouts of both rounds were scored and logged


def test_resume_reaches_the_same_weights_as_an_uninterrupted_run(tmp_path, task_file):
    full = Trainer(build(TrainConfig, dict(SMALL, tasks=task_file, output_dir=str(tmp_path / "full"))))
    full.fit()
    part = Trainer(build(TrainConfig, dict(SMALL, tasks=task_file, output_dir=str(tmp_path / "part"), steps=1)))
    part.fit()
    # Extended to 2 steps in a copy of the run (benchmarks/grpo_sweep.py's continued rows), which
    # also saves at another interval: neither changes what is trained.
    shutil.copytree(tmp_path / "part", tmp_path / "copy")
    resumed = Trainer(build(TrainConfig, dict(SMALL, tasks=task_file, output_dir=str(tmp_path / "copy"), save_every=2, resume=True)))
    assert resumed.step == 1
    resumed.fit()
    assert torch.allclose(params(full.models.policy), params(resumed.models.policy), atol=1e-6)
    steps = [json.loads(line)["step"] for line in open(tmp_path / "copy" / "metrics.jsonl")]
    assert steps == [1, 2]


def test_a_cosine_run_cannot_be_resumed_with_other_steps(tmp_path):
    """A cosine's learning rate at every step depends on --steps: extending such a run would train
    its remaining steps on another schedule than the one it started, so --resume refuses it."""
    import yaml

    from envace import config as cfgmod
    from envace.training.setup import check_resume

    cfg = build(TrainConfig, dict(tiny=True, output_dir=str(tmp_path), steps=6, schedule="cosine"))
    (tmp_path / "checkpoints" / "step-00000003").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-00000003" / "state.json").write_text("{}")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfgmod.to_dict(cfg)))
    assert check_resume(tmp_path, cfg, resume=True) is not None
    with pytest.raises(ConfigError, match="options differ.*steps"):
        check_resume(tmp_path, dataclasses.replace(cfg, steps=12), resume=True)
    constant = dataclasses.replace(cfg, schedule="constant")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfgmod.to_dict(constant)))
    assert check_resume(tmp_path, dataclasses.replace(constant, steps=12), resume=True) is not None


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
    cfg.rollout.on_malformed = "continue"
    with pytest.raises(ConfigError, match="options differ.*on_malformed"):
        check_resume(tmp_path, cfg, resume=True)


def untimed_metrics(run_dir):
    """Each logged step's metrics without the clock's (which differ between two runs)."""
    lines = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [{k: v for k, v in m.items() if k != "time" and not k.startswith("time/")} for m in lines]


@pytest.mark.slow
def test_killed_run_resumes_from_last_checkpoint(tmp_path, task_file):
    """SIGKILL a training process in step 2, after its step-1 checkpoint; --resume finishes the run
    with the weights and metrics of an uninterrupted run. The reward blocks the run in step 2 and
    says so, so the kill never races the run, on a fast machine or a slow one; it differs within
    each group, so every step updates the weights and a wrongly restored step would show."""
    from safetensors.torch import load_file

    from envace.training.checkpoint import latest_checkpoint
    from tests.training_rewards import BLOCK_RUN_DIR, blocked_marker

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def train_command(out):
        return [sys.executable, "-m", "envace.cli", "train", "--tiny", "--tasks", task_file, "--steps", "3", "--tasks-per-step", "2", "--k", "2",
                "--max-turns", "2", "--max-turn-tokens", "12", "--max-rehearse-tokens", "8", "--max-total-tokens", "400",
                "--reward", "tests.training_rewards:blocking_rollout_index", "--no-progress", "--no-tensorboard", "--output-dir", str(out)]

    env = {k: v for k, v in os.environ.items() if k != BLOCK_RUN_DIR} | {"PYTHONPATH": root}  # tests/ importable
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(train_command(killed), stdout=log, stderr=subprocess.STDOUT, env=env | {BLOCK_RUN_DIR: str(killed)})
    try:
        deadline = time.monotonic() + 300
        while not blocked_marker(killed).exists():  # the run's own signal: once set, it stays blocked
            assert proc.poll() is None, "training died before step 2:\n" + (tmp_path / "killed.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "training did not reach step 2 within 300 s"
            time.sleep(0.1)
        assert latest_checkpoint(killed).name == "step-00000001" and not (killed / "final").exists()
    finally:
        proc.kill()  # SIGKILL: the crash under test (and no blocked process left behind by a failure)
        proc.wait()

    for command in (train_command(killed) + ["--resume"], train_command(whole)):
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
    resumed_weights, whole_weights = (load_file(run / "final" / "model.safetensors") for run in (killed, whole))
    assert resumed_weights.keys() == whole_weights.keys()
    assert all(torch.allclose(resumed_weights[k], whole_weights[k], atol=1e-6) for k in whole_weights)
    assert [m["step"] for m in untimed_metrics(killed)] == [1, 2, 3]  # step 1 from the killed process, 2-3 resumed
    assert untimed_metrics(killed) == untimed_metrics(whole)
    assert [m["policy/skipped_update"] for m in untimed_metrics(whole)] == [0.0] * 3  # the weights moved every step


def distributed(nproc: int, *args: str, timeout: int = 600) -> str:
    """Run tests/ddp_worker.py in `nproc` processes (torch's launcher, gloo on CPU); its stdout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), os.path.join(root, "tests", "ddp_worker.py"), *args]
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1")
    # Its own process group: a collective the processes do not all join hangs them, and on a
    # timeout the workers must go with the launcher rather than outlive the test.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"the {nproc} processes did not finish in {timeout} s (a hung collective?):\n{err[-3000:]}") from None
    assert proc.returncode == 0, err[-3000:]
    return out


@pytest.mark.slow
def test_two_process_sft_reaches_the_weights_of_one_process(tmp_path, task_file):
    """Under DDP, and sharded under FSDP2, each process trains on its share of a step's rows and
    the token mean is over all of them: the weights equal a single-process run's."""
    from safetensors.torch import load_file

    distributed(2, "sft", task_file, str(tmp_path / "two"))
    distributed(2, "sft", task_file, str(tmp_path / "sharded"), "fsdp2")
    distributed(1, "sft", task_file, str(tmp_path / "one"))
    two, sharded, one = (load_file(tmp_path / d / "final" / "model.safetensors") for d in ("two", "sharded", "one"))
    assert max(float((two[k] - one[k]).abs().max()) for k in one) < 1e-4
    assert sharded.keys() == one.keys() and max(float((sharded[k] - one[k]).abs().max()) for k in one) < 1e-4
    steps = [json.loads(line)["step"] for line in open(tmp_path / "two" / "metrics.jsonl")]
    assert steps == [1, 2]  # one logger (the main process), not one per process


@pytest.mark.slow
def test_two_process_grpo_updates_and_keeps_replicas_identical(tmp_path, task_file):
    ranks = rank_lines(distributed(2, "grpo", task_file, str(tmp_path / "grpo")))
    assert set(ranks) == {"0", "1"} and ranks["0"][0] == ranks["1"][0]  # same checksum
    metrics = [json.loads(line) for line in open(tmp_path / "grpo" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["policy/skipped_update"] == 0.0 for m in metrics)
    assert (tmp_path / "grpo" / "final" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["none", "fsdp2", pytest.param("deepspeed-zero3", marks=needs_deepspeed)])
def test_a_process_whose_rows_all_have_advantage_0_still_joins_the_update(tmp_path, task_file, sharding):
    """Process 1's groups all score alike (reward 0 there), so its 4 rows per step are left out of
    the update and it runs padding micro-batches only: it must still join DDP's gradient
    all-reduce, FSDP2's and ZeRO-3's collectives and the metrics reduction, and end on process 0's weights. This failed or
    hung before the padding micro-batch ran the LM head and reached every parameter under
    `trained_only` scoring, and before processes could report different metric keys."""
    ranks = rank_lines(distributed(2, "grpo", task_file, str(tmp_path / "grpo"), sharding, "2", "0", "tests.ddp_worker:varied_on_rank_0"))
    assert set(ranks) == {"0", "1"} and ranks["0"][0] == ranks["1"][0]
    metrics = [json.loads(line) for line in open(tmp_path / "grpo" / "metrics.jsonl")]
    assert [m["policy/zero_advantage_rows"] for m in metrics] == [4.0, 4.0]  # process 1's K = 4 rows, each step
    assert all(m["policy/skipped_update"] == 0.0 for m in metrics)  # process 0's rows did carry a signal


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["none", "fsdp2"])
def test_two_process_grounding_reaches_the_weights_of_one_process(tmp_path, sharding):
    """--rehearse-sft-coef on 2 processes: each grounds on the references of its own share of the
    step's tasks, and the NLL is a token mean over both processes' tool-response tokens. With a
    constant reward no group carries a signal, so the update is the grounding term alone and does
    not depend on what was sampled: 2 steps must land on the weights of one process that grounds
    on all the tasks itself. The tasks' references make 1 to 4 calls, so the processes hold
    different numbers of tool-response tokens and a per-process mean would not."""
    path = tmp_path / "uneven.jsonl"
    tasks = [dataclasses.replace(counter_task(n), reference_calls=[{"name": "add", "arguments": {"n": 1}}] * n) for n in (1, 2, 3, 4)]
    for i, t in enumerate(tasks):
        t.id = f"counter-{i}"
        t.metadata["reference_answer"] = f"The counter is {i + 1}."
    save_tasks(tasks, path)
    args = ("grpo", str(path))
    settings = ("2", "0", "tests.training_rewards:constant", "0.5")
    one = rank_lines(distributed(1, *args, str(tmp_path / "one"), "none", *settings))
    two = rank_lines(distributed(2, *args, str(tmp_path / "two"), sharding, *settings))
    assert two["0"][0] == two["1"][0]
    a, b = final_weights(tmp_path / "two"), final_weights(tmp_path / "one")
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in b) < 1e-5
    metrics = {run: [json.loads(line) for line in open(tmp_path / run / "metrics.jsonl")] for run in ("one", "two")}
    for m_one, m_two in zip(metrics["one"], metrics["two"], strict=True):
        assert m_two["policy/grounding_tokens"] == m_one["policy/grounding_tokens"] > 0
        assert m_two["policy/grounding_nll"] == pytest.approx(m_one["policy/grounding_nll"], rel=1e-5)
        assert m_two["env/grounding_step"] == m_one["env/grounding_step"] > 0
        assert m_two["policy/skipped_update"] == m_one["policy/skipped_update"] == 0.0  # grounding alone moved the weights


def rank_lines(out: str) -> dict[str, list[str]]:
    """ddp_worker's `rank R checksum C held H of T` reports, by rank: [C, H, T]. Found anywhere in
    the output: both processes write to one pipe, so a report may follow the other's unfinished line."""
    return {rank: list(rest) for rank, *rest in re.findall(r"rank (\d+) checksum (\S+) held (\d+) of (\d+)", out)}


def final_weights(run) -> dict:
    from safetensors.torch import load_file

    return load_file(run / "final" / "model.safetensors")


@pytest.mark.slow
def test_fsdp2_grpo_shards_the_model_and_reaches_the_weights_of_ddp_through_a_resume(tmp_path, task_file):
    """--sharding fsdp2 on 2 processes: each holds half the parameters, samples from a gathered
    full copy, and updates as DDP does; its checkpoints (gathered weights, optimizer state in
    one piece) resume. So 1 sharded step, then a resumed 2nd, lands on 2 DDP steps' weights."""
    ddp = rank_lines(distributed(2, "grpo", task_file, str(tmp_path / "ddp"), "none", "2"))
    distributed(2, "grpo", task_file, str(tmp_path / "sharded"), "fsdp2", "1")
    sharded = rank_lines(distributed(2, "grpo", task_file, str(tmp_path / "sharded"), "fsdp2", "2"))  # resumes from step 1
    (_, held, total), (_, ddp_held, _) = sharded["0"], ddp["0"]
    assert int(held) * 2 == int(total) == int(ddp_held)  # even split of the tiny model's parameters
    assert sharded["0"][0] == sharded["1"][0]  # both processes' full copies agree
    a, b = final_weights(tmp_path / "sharded"), final_weights(tmp_path / "ddp")
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in b) < 1e-5
    steps = [json.loads(line) for line in open(tmp_path / "sharded" / "metrics.jsonl")]
    assert [m["step"] for m in steps] == [1, 2] and all(m["policy/skipped_update"] == 0.0 for m in steps)


@pytest.mark.slow
def test_fsdp2_lora_grpo_reaches_the_weights_of_ddp_lora(tmp_path, task_file):
    """LoRA under FSDP2 (frozen base and trained adapters in one sharded unit): the exported,
    merged model equals DDP's; the checkpoints hold the adapter only, as unsharded LoRA runs do."""
    distributed(2, "grpo", task_file, str(tmp_path / "ddp"), "none", "2", "4")
    distributed(2, "grpo", task_file, str(tmp_path / "sharded"), "fsdp2", "2", "4")
    a, b = final_weights(tmp_path / "sharded"), final_weights(tmp_path / "ddp")
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in b) < 1e-5
    saved = tmp_path / "sharded" / "checkpoints" / "step-00000002" / "model-policy"
    assert (saved / "adapter_model.safetensors").is_file() and not (saved / "model.safetensors").exists()


def test_fsdp2_in_one_process_is_refused_before_any_model_loads(tmp_path, task_file, monkeypatch):
    import envace.training.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "load_trainable", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(ConfigError, match="--sharding fsdp2 splits the model over the processes.*torchrun"):
        Trainer(build(TrainConfig, dict(SMALL, tasks=task_file, output_dir=str(tmp_path / "run"), sharding="fsdp2")))


@pytest.mark.parametrize("variant,extra", [("real-grpo", {}), ("simulator", {}), ("no-share", {"rehearse_layout": "isolated"}), ("act-only", {})])
def test_every_variant_runs_a_step(tmp_path, task_file, variant, extra):
    trainer = Trainer(build(TrainConfig, dict(SMALL, tasks=task_file, output_dir=str(tmp_path / variant), steps=1, variant=variant, **extra)))
    metrics = trainer.train_step()
    trainer.logger.close()
    assert trainer.variant.rollout_mode == {"real-grpo": "real", "simulator": "simulator"}.get(variant, "rehearse")
    if variant != "real-grpo":
        assert metrics["env/rollout_step"] == 0  # only real rollouts touch the world
    assert set(trainer.models.trained) == ({"policy", "rehearser"} if variant == "no-share" else {"policy"})
    assert (trainer.models.simulator is not None) == (variant == "simulator")


def test_real_fraction_rolls_out_that_share_of_the_step_tasks_in_real_mode(tmp_path, task_file):
    """envace with real_fraction 0.5 over 4 tasks: 2 tasks' groups real, 2 rehearsed without a real call."""
    trainer = Trainer(build(TrainConfig, dict(SMALL, tasks=task_file, output_dir=str(tmp_path / "run"), steps=1, tasks_per_step=4, real_fraction=0.5)))
    groups = []
    rollout = trainer.rollout

    def recording_rollout(tasks, round_index=0):
        groups.extend(rollout(tasks, round_index))
        return groups

    trainer.rollout = recording_rollout
    trainer.train_step()
    trainer.logger.close()
    assert len({g[0].task_id for g in groups}) == 4
    assert [[t.mode for t in g] for g in groups] == [["real"] * 2] * 2 + [["rehearse"] * 2] * 2
    assert all(t.real_env_calls == 0 for g in groups[2:] for t in g)


@pytest.mark.parametrize("continuous_batching", [False, True])
def test_each_step_reports_what_its_sampler_generated(tmp_path, task_file, continuous_batching):
    """sampler/<stream>/generated_tokens is the step's own count: every ACT and REHEARSE token of
    the step's rollouts (the envace variant samples both roles from one policy stream), not the
    generator's running total; with continuous batching too (a paused row's tokens count once)."""
    from envace.types import EndReason, Role

    trainer = Trainer(build(TrainConfig, dict(SMALL, tasks=task_file, output_dir=str(tmp_path / "run"), steps=2, continuous_batching=continuous_batching)))
    rollout, groups = trainer.rollout, []
    trainer.rollout = lambda tasks, round_index=0: groups.append(rollout(tasks, round_index)) or groups[-1]
    steps = [trainer.train_step() for _ in range(2)]
    trainer.logger.close()
    for metrics, step_groups in zip(steps, groups):
        sampled = sum(len(turn.token_ids) for g in step_groups for t in g for turn in t.turns if turn.role in (Role.ACT, Role.REHEARSE))
        assert metrics["sampler/policy-rehearse/generated_tokens"] == sampled > 0
        assert metrics["time/sampler/policy-rehearse/generated_tokens_per_s"] > 0  # clock values are time/ metrics
        assert not any(k.startswith("sampler/") and k.endswith(("seconds", "_per_s")) for k in metrics)
        # how the step's episodes ended: the same rollouts' calls and end reasons
        trajs = [t for g in step_groups for t in g]
        assert metrics["calls_per_task"] == pytest.approx(sum(len(t.tool_calls) for t in trajs) / len(trajs))
        assert metrics["answered_rate"] == pytest.approx(sum(t.end_reason == EndReason.ANSWERED for t in trajs) / len(trajs))


def test_counted_metrics_are_summed_over_processes_the_rest_averaged():
    from envace.training.trainer import is_count

    keys = ("policy/tokens/act", "policy/tokens", "malformed", "fidelity/calls", "sampler/policy-rehearse/generated_tokens", "sampler/policy-rehearse/syncs",
            "policy/trained_tokens", "env/rollout_step", "reward/act", "tokens_per_task", "calls_per_task", "answered_rate", "time/sampler/policy-rehearse/seconds")
    assert [is_count(k) for k in keys] == [True] * 6 + [False] * 7


def test_process_metrics_merge_when_the_processes_report_different_keys():
    """Process 0 trained act tokens only, process 1 had only a padding micro-batch (its rows all
    of advantage 0): counts are summed (tokens 6 + 0, zero-advantage rows 0 + 4), a mean comes
    from the processes that report it (pg_loss 0.5 from process 0 alone, not (0.5 + 0) / 2), and
    a mean both report is averaged (grad_norm (1 + 3) / 2)."""
    from envace.training.trainer import merge_process_metrics

    busy = {"policy/tokens": 6.0, "policy/tokens/act": 6.0, "policy/pg_loss": 0.5, "policy/zero_advantage_rows": 0.0, "policy/grad_norm": 1.0}
    padding = {"policy/tokens": 0.0, "policy/tokens/act": 0.0, "policy/zero_advantage_rows": 4.0, "policy/grad_norm": 3.0}
    assert merge_process_metrics([busy, padding]) == {"policy/tokens": 6.0, "policy/tokens/act": 6.0, "policy/pg_loss": 0.5,
                                                      "policy/zero_advantage_rows": 4.0, "policy/grad_norm": 2.0}


def test_sampler_rates_come_from_the_counts_of_all_processes():
    """Two processes: 100 and 200 tokens in 1 s and 3 s (clock mean 2 s), 100 prompt tokens looked
    up with 0 hits and 300 with 100. The step's rates are 300 / 2 = 150 tokens/s and 100 / 400 =
    0.25, not the mean of the processes' rates (0.167). 90 tokens fed back in 30 batched decode
    forwards: 3 rows per decode step."""
    from envace.training.trainer import sampler_rates

    summed = {"sampler/policy-rehearse/generated_tokens": 300.0, "time/sampler/policy-rehearse/seconds": 2.0,
              "sampler/policy-rehearse/prefix_cache_queries": 400.0, "sampler/policy-rehearse/prefix_cache_hits": 100.0,
              "sampler/policy-rehearse/decode_tokens": 90.0, "sampler/policy-rehearse/decode_steps": 30.0,
              "sampler/simulator/generated_tokens": 0.0, "time/sampler/simulator/seconds": 0.0}
    rates = sampler_rates(summed)
    assert rates["time/sampler/policy-rehearse/generated_tokens_per_s"] == 150.0
    assert rates["sampler/policy-rehearse/prefix_cache_hit_rate"] == 0.25
    assert rates["sampler/policy-rehearse/rows_per_decode_step"] == 3.0
    assert "sampler/simulator/rows_per_decode_step" not in rates
    assert "time/sampler/simulator/generated_tokens_per_s" not in rates and "sampler/simulator/prefix_cache_hit_rate" not in rates


def test_on_malformed_reaches_the_rollout_config(task_file):
    cfg = build(TrainConfig, dict(SMALL, tasks=task_file, on_malformed="continue"))
    assert cfg.rollout.on_malformed == "continue"


# ---- validation before any model loads, sampling, seeds (issue #10 C, D, E) -----------------

@pytest.mark.parametrize("values,option", [
    ({"dual_clip": 0.5}, "dual_clip"), ({"dual_clip": 1.0}, "dual_clip"),
    ({"clip_eps": 0.0}, "clip_eps"), ({"clip_eps": 1.0}, "clip_eps"),
    ({"kl_coef": -0.1}, "kl_coef"),
    ({"lr": 0.0}, "lr"), ({"micro_batch_tokens": 0}, "micro_batch_tokens"), ({"grad_clip": 0.0}, "grad_clip"),
    ({"lora_r": -1}, "lora_r"), ({"lora_alpha": 0}, "lora_alpha"), ({"warmup_steps": -1}, "warmup_steps"),
    ({"weight_decay": -0.1}, "weight_decay"), ({"seed": -1}, "seed"), ({"save_every": 0}, "save_every"), ({"keep_last": 0}, "keep_last"),
    ({"steps": 0}, "steps"), ({"tasks_per_step": 0}, "tasks_per_step"), ({"n_per_world": 0}, "n_per_world"), ({"max_rollout_rounds": 0}, "max_rollout_rounds"),
    ({"difficulty": 4}, "difficulty"), ({"samples_per_step": -1}, "samples_per_step"),
    ({"max_turns": 0}, "max_turns"), ({"max_turn_tokens": 0}, "max_turn_tokens"), ({"max_rehearse_tokens": 0}, "max_rehearse_tokens"),
    ({"max_total_tokens": 0}, "max_total_tokens"), ({"max_active": -1}, "max_active"),
    ({"advantage": "nope"}, "advantage"), ({"init_from": "/no/such/dir"}, "--init-from"),
    ({"simulator_model": "default"}, "--simulator-model"),  # read by --variant simulator only
    ({"rehearse_sft_coef": -0.1}, "rehearse_sft_coef"),
    ({"rehearse_sft_coef": 0.1, "variant": "act-only"}, "--variant envace"),  # trains no REHEARSE token
    ({"rehearse_sft_coef": 0.1, "variant": "no-share", "rehearse_layout": "isolated"}, "--variant envace"),  # the policy does not rehearse
    ({"rehearse_sft_coef": 0.1, "rehearse_layout": "isolated"}, "--rehearse-layout transcript"),
    ({"continuous_batching": True, "sampler": "llamacpp"}, "--continuous-batching"),  # pauses rows inside the HF sampler only
    ({"sampler": "llamacpp", "sampler_dtype": "int4"}, "--sampler-dtype int4 is the HF sampler's"),  # torch's kernel
    ({"sampler_dtype": "q8_0"}, "--sampler-dtype q8_0 is llama.cpp's"),
])
def test_train_config_rejects_each_bad_option_by_name(values, option):
    with pytest.raises(ConfigError, match=re.escape(option)):
        build(TrainConfig, values)


def test_training_with_an_int4_sampler_warns_about_its_mismatch():
    with pytest.warns(UserWarning, match="int4 samples from 4-bit copies.*train with auto, bf16 or int8"):
        build(TrainConfig, {"sampler_dtype": "int4"})


def test_a_missing_simulator_model_fails_before_training():
    from envace.backends.models import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="/no/such/model"):
        build(TrainConfig, {"variant": "simulator", "simulator_model": "/no/such/model"})


@pytest.mark.parametrize("values,match", [
    ({"reward": "judge"}, "has a judge component: give --judge MODEL"),
    ({"reward": "judge:0.5,replay:0.5"}, "has a judge component: give --judge MODEL"),
    ({"judge": "http://127.0.0.1:9/v1"}, "--judge is read by the judge reward only"),
    ({"reward": "replay:0"}, "weight of replay must be a finite number > 0"),
    ({"reward": "judge:1,nope:1", "judge": "http://127.0.0.1:9/v1"}, "unknown reward 'nope'"),
])
def test_the_judge_reward_needs_judge_and_judge_needs_the_judge_reward(values, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        build(TrainConfig, values)


@pytest.mark.parametrize("values,match", [
    ({"top_p": 0.9}, "full vocabulary (top_p 1, got top_p=0.9)"),
    ({"rollout": {"temperature": 0.0}}, "needs temperature > 0 (got 0.0)"),
    ({"temperature": 0.7, "sampler": "llamacpp"}, "--sampler llamacpp reports logprobs at temperature 1 only"),
])
def test_training_samples_only_where_the_ppo_ratio_is_exact(values, match):
    """The ratio's logprobs are those of softmax(logits / T) over the full vocabulary: a nucleus
    cut, greedy decoding, or an engine that reports T = 1 logprobs at another T is refused."""
    with pytest.raises(ConfigError, match=re.escape(match)):
        build(TrainConfig, values)


def test_a_tempered_step_scores_the_tokens_at_the_sampling_temperature(tmp_path, task_file):
    """At T = 0.5 the fp32 sampler records log softmax(logits / 0.5) and the fp32 update scores
    the same: its logprobs equal the sampler's (logprob_mismatch ~0). An update that read the
    logits at T = 1 would differ by order one on every token."""
    metrics = Trainer(build(TrainConfig, dict(SIGNAL, tasks=task_file, precision="fp32", sampler_dtype="f32", temperature=0.5,
                                              output_dir=str(tmp_path / "t05")))).train_step()
    assert metrics["policy/skipped_update"] == 0
    assert metrics["policy/logprob_mismatch"] == pytest.approx(0.0, abs=1e-5) and metrics["policy/clip_frac"] == 0.0


def test_variant_choices_come_from_the_registry():
    with pytest.raises(ConfigError, match="variant='bogus' is not one of") as err:
        build(TrainConfig, {"variant": "bogus"})
    assert all(name in str(err.value) for name in VARIANTS.names())
    assert set(VARIANTS.names()) == {"envace", "real-grpo", "simulator", "no-share", "act-only"}


@pytest.mark.parametrize("values,option", [
    ({"epochs": 0}, "epochs"), ({"rows_per_step": 0}, "rows_per_step"), ({"n_per_world": 0}, "n_per_world"),
    ({"max_total_tokens": 0}, "max_total_tokens"), ({"difficulty": 0}, "difficulty"), ({"lr": -1.0}, "lr"),
])
def test_sft_config_rejects_each_bad_option_by_name(values, option):
    with pytest.raises(ConfigError, match=re.escape(option)):
        build(SFTConfig, values)


@pytest.mark.parametrize("values,option", [
    ({"max_turns": 0}, "max_turns"), ({"top_p": 0.0}, "top_p"), ({"temperature": -1.0}, "temperature"), ({"max_active": -1}, "max_active"),
    ({"n": 0}, "n must"), ({"memory_tokens": 0}, "memory_tokens"), ({"guard_horizon": -1}, "guard_horizon"),
    ({"simulator": "default"}, "--simulator is read by --mode simulator"), ({"rehearser": "default"}, "--rehearser is read by --rehearsal"),
])
def test_eval_config_rejects_each_bad_option_by_name(values, option):
    from envace.evaluation.runner import EvalConfig

    with pytest.raises(ConfigError, match=re.escape(option)):
        build(EvalConfig, values)


def test_sampling_seeds_are_distinct_for_every_generator_process_step_and_rollout_round():
    from envace.training.trainer import SEED_STREAMS, sampling_seed

    seeds = [sampling_seed(0, step, process, stream, r) for step in range(100) for process in range(64) for stream in SEED_STREAMS for r in range(3)]
    assert len(set(seeds)) == len(seeds) == 100 * 64 * len(SEED_STREAMS) * 3
    assert sampling_seed(0, 5, 1, "policy-rehearse") == sampling_seed(0, 5, 1, "policy-rehearse", 0)  # round 0: the seeds of before


def test_a_resumed_run_samples_with_the_seeds_of_the_uninterrupted_run(tmp_path, task_file, seeds):
    """envace with real_fraction rolls out a real and a rehearse batch per step: each generator
    gets its own seed, and a resumed run's step 2 gets the seeds the uninterrupted run's had."""
    run = dict(SMALL, tasks=task_file, real_fraction=0.5)
    Trainer(build(TrainConfig, dict(run, output_dir=str(tmp_path / "full")))).fit()
    full, seeds[:] = list(seeds), []
    Trainer(build(TrainConfig, dict(run, output_dir=str(tmp_path / "part"), steps=1))).fit()
    Trainer(build(TrainConfig, dict(run, output_dir=str(tmp_path / "part"), resume=True))).fit()
    assert len(full) == 4 and len(set(full)) == 4  # 2 steps x (real, rehearse) policy generators
    assert seeds == full


def test_each_steps_rollout_samples_from_the_weights_after_the_previous_updates(tmp_path, task_file, monkeypatch):
    """The trainer keeps one generator per stream and syncs it before each rollout: step N's
    samples come from the weights after N-1 optimizer steps, and from the module being trained."""
    import envace.backends.hf as hf

    seen = []

    class Recording(hf.HFGenerator):
        def generate(self, sessions, new_tokens, params):
            seen.append((trainer.step, self.weights_version, self.model is trainer.accelerator.unwrap_model(trainer.models.policy)))
            return super().generate(sessions, new_tokens, params)

    monkeypatch.setattr(hf, "HFGenerator", Recording)
    trainer = Trainer(build(TrainConfig, dict(SMALL, tasks=task_file, steps=3, output_dir=str(tmp_path / "run"))))
    trainer.fit()
    assert sorted(set(seen)) == [(0, 0, True), (1, 1, True), (2, 2, True)]


SIGNAL = dict(SMALL, steps=1, reward="tests.training_rewards:rollout_index")  # rewards 0 and 1 in every group


def test_sharing_the_prompt_in_the_update_forwards_fewer_tokens_and_trains_the_same_weights(tmp_path, task_file):
    runs = {}
    for share in (True, False):
        trainer = Trainer(build(TrainConfig, dict(SIGNAL, tasks=task_file, precision="fp32", share_prefix=share, output_dir=str(tmp_path / str(share)))))
        runs[share] = trainer.train_step()
    shared, plain = runs[True], runs[False]
    assert shared["policy/forwarded_tokens_unshared"] == plain["policy/forwarded_tokens"] == plain["policy/forwarded_tokens_unshared"]
    assert shared["policy/forwarded_tokens"] < 0.7 * plain["policy/forwarded_tokens"]  # K=2 rollouts share each prompt
    assert shared["policy/loss"] == pytest.approx(plain["policy/loss"], abs=1e-6)
    # Adam's first step is ~lr * sign(grad), so float noise in near-zero gradients shows in the
    # weights; the gradient itself is what packing must not change (tests/test_algorithms.py
    # compares it parameter by parameter).
    assert shared["policy/grad_norm"] == pytest.approx(plain["policy/grad_norm"], rel=1e-5)
    assert shared["policy/skipped_update"] == 0 and shared["policy/grad_norm"] > 0  # the step did move the weights


def test_a_bf16_update_weights_the_samplers_logprobs_by_truncated_importance(tmp_path, task_file):
    """The fp32 sampler's logprobs are not the bf16 update's: the ratio's old logprobs are the
    update's own (the ratio is exactly 1: approx_kl 0), the sampler's only weight the loss, and
    their mismatch is reported. In fp32 the two agree (mismatch ~0) and nothing is weighted."""
    trainer = Trainer(build(TrainConfig, dict(SIGNAL, tasks=task_file, precision="bf16", output_dir=str(tmp_path / "bf16"))))
    module = trainer.accelerator.unwrap_model(trainer.models.policy)
    assert "_original_forward" not in module.__dict__  # accelerate's autocast wrapper is off: the rollout samples in fp32
    bf16 = trainer.train_step()
    fp32 = Trainer(build(TrainConfig, dict(SIGNAL, tasks=task_file, precision="fp32", sampler_dtype="f32", output_dir=str(tmp_path / "fp32")))).train_step()
    assert bf16["policy/logprob_mismatch"] > 0 and bf16["policy/tis_weight"] > 0
    assert bf16["policy/approx_kl"] == pytest.approx(0.0, abs=1e-9)
    assert fp32["policy/logprob_mismatch"] == pytest.approx(0.0, abs=1e-5) and "policy/tis_weight" not in fp32


def test_a_bf16_sampler_under_an_fp32_update_is_treated_as_another_policy(tmp_path, task_file):
    """The lean bf16 sampler's logprobs are the bf16 model's: with an fp32 update the ratio's old
    logprobs are the update's own (ratio exactly 1) and the sampler's only weight the loss,
    mismatch reported."""
    trainer = Trainer(build(TrainConfig, dict(SIGNAL, tasks=task_file, precision="fp32", sampler_dtype="bf16", output_dir=str(tmp_path / "run"))))
    assert trainer.numerics_differ
    metrics = trainer.train_step()
    assert trainer.generators["policy-rehearse"].dtype == torch.bfloat16 and trainer.generators["policy-rehearse"].lean is not None
    assert metrics["policy/logprob_mismatch"] > 0 and metrics["policy/tis_weight"] > 0
    assert metrics["policy/approx_kl"] == pytest.approx(0.0, abs=1e-9)


# ---- the judge reward and weighted rewards in training (issue #12) ---------------------------

def test_a_missing_local_judge_model_fails_before_training():
    from envace.backends.models import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="/no/such/judge"):
        build(TrainConfig, {"reward": "judge", "judge": "/no/such/judge"})


def test_a_weighted_judge_reward_trains_and_logs_each_component(tmp_path, tokenizer, monkeypatch):
    """--judge opens one judge for the run; each step sends all its judge prompts in one generate
    call; the weighted value trains and each component is logged as reward/<name>."""
    from tests.test_rewards import honest, recording_judge

    judge = recording_judge(tokenizer, honest("1: PASS\n2: FAIL"))  # weight 3 of 4: 0.75 for every rollout
    opened = []
    monkeypatch.setattr("envace.training.trainer.open_generator", lambda spec, seed, **kw: opened.append(spec) or judge)
    path = tmp_path / "judged.jsonl"
    checklist = [{"item": "adds the number", "weight": 3.0}, {"item": "reports the value", "weight": 1.0}]
    tasks = [counter_task(n, checklist=checklist) for n in (1, 2)]
    for t in tasks:
        t.id = f"judged-{t.reference_calls[0]['arguments']['n']}"
    save_tasks(tasks, path)
    reward = "judge:3,tests.training_rewards:rollout_index:1"  # rollout_index: 0 and 1 in each group of k=2
    trainer = Trainer(build(TrainConfig, dict(SMALL, tasks=str(path), output_dir=str(tmp_path / "run"), steps=1, reward=reward, judge="http://judge/v1")))
    metrics = trainer.train_step()
    trainer.logger.close()
    assert opened == ["http://judge/v1"] and judge.stats.calls == 1 and len(judge.prompts) == 4  # 2 tasks x k=2, one call
    assert metrics["reward/judge"] == 0.75 and metrics["reward/tests.training_rewards:rollout_index"] == 0.5
    assert metrics["reward/mean"] == pytest.approx(((3 * 0.75 + 0) / 4 + (3 * 0.75 + 1) / 4) / 2)  # 0.6875


def test_sft_rows_from_recorded_references_equal_rows_from_executing_the_world(tokenizer, task_file):
    """World-free SFT: the exported tasks' recorded responses become the same REHEARSE targets,
    token for token, as executing the world gives, with no world made."""
    from envace.envs.environment import WorldEnvironment
    from envace.envs.export import world_free_tasks
    from envace.envs.tasks import load_tasks

    class NoWorlds(WorldEnvironment):
        def make_world(self, task):
            raise AssertionError("a world was made")

    world_tasks = load_tasks(task_file)
    free, recorded_with = world_free_tasks(world_tasks)
    executed, _, world_cost = reference_trajectories(world_tasks, tokenizer, WorldEnvironment(), 1024)
    recorded, dropped, free_cost = reference_trajectories(free, tokenizer, NoWorlds(), 1024)
    assert dropped == 0 and free_cost.total == 0 and world_cost.sft_data == 8 and recorded_with == 4
    roles = (Role.ACT, Role.ENV)
    for a, b in zip(sft_rows(executed, roles), sft_rows(recorded, roles)):
        assert a.input_ids == b.input_ids and a.roles == b.roles and a.loss_mask == b.loss_mask
    # The REHEARSE targets are exactly the recorded responses' tokens.
    row, traj = sft_rows(recorded[:1], roles)[0], recorded[0]
    env_turn = next(t for t in traj.turns if t.role == Role.ENV)
    start = sum(len(t.token_ids) for t in traj.turns[: traj.turns.index(env_turn)])
    response = tokenizer.encode('{"value": 1}', add_special_tokens=False)
    assert row.input_ids[start:start + len(response)] == response and all(row.loss_mask[start:start + len(response)])


def scripted_group(tokenizer, task, mode, k=2):
    """K rollouts of `task` by the scripted agent of tests/test_rollout (one add call, then the answer)."""
    from envace.backends.scripted import ScriptedGenerator
    from envace.envs.environment import WorldEnvironment
    from envace.rollout import RolloutConfig, RolloutEngine
    from tests.test_rollout import agent

    return RolloutEngine(ScriptedGenerator(tokenizer, agent), WorldEnvironment(), RolloutConfig(mode=mode)).run([task], k=k, progress=False)


def test_world_executions_count_reward_replays_for_world_tasks_and_nothing_for_world_free_ones(tmp_path, task_file, tokenizer):
    from tests.test_rollout import recorded_counter_task

    trainer = Trainer(build(TrainConfig, dict(SMALL, tasks=task_file, output_dir=str(tmp_path / "world"), steps=1)))
    world = counter_task(5)
    metrics = trainer.score([world], scripted_group(tokenizer, world, "rehearse"))
    # Two rehearsed rollouts, one committed add each: the replay reward ran each once more.
    assert (metrics["env/rollout_step"], metrics["env/verification_step"], metrics["env/verification_total"]) == (0, 2, 2)
    metrics = trainer.score([world], scripted_group(tokenizer, world, "real"))
    # Real rollouts: the world answered each add, and the replay reward still re-ran it to score.
    assert (metrics["env/rollout_step"], metrics["env/verification_step"], metrics["env/verification_total"]) == (2, 2, 4)
    trainer.logger.close()

    free_file = tmp_path / "free.jsonl"
    save_tasks([recorded_counter_task()], free_file)
    trainer = Trainer(build(TrainConfig, dict(SMALL, tasks=str(free_file), reward="reference", output_dir=str(tmp_path / "free"), steps=1)))
    free = recorded_counter_task()
    metrics = trainer.score([free], scripted_group(tokenizer, free, "rehearse"))
    trainer.logger.close()
    assert all(metrics[f"env/{p}_total"] == 0 for p in ("rollout", "verification", "grounding", "sft_data", "task_data"))
    assert metrics["reward/mean"] == 1.0  # the reference reward scored the rehearsed call with no world


def test_grpo_from_a_warm_start_draws_built_in_tasks_it_was_not_trained_on(tmp_path):
    from envace.envs.tasks import builtin_tasks, scenario_key
    from envace.manifest import MANIFEST, build_manifest
    from envace.training.trainer import load_train_tasks

    warm = tmp_path / "warm"
    warm.mkdir()
    sft_tasks = builtin_tasks("train", 3, worlds=["bank"], difficulty=1)  # what an `envace sft --n-per-world 3` saw
    (warm / MANIFEST).write_text(json.dumps(build_manifest(sft_tasks, None)))
    cfg = build(TrainConfig, {"worlds": ["bank"], "n_per_world": 4, "init_from": str(warm), "output_dir": str(tmp_path / "run")})
    assert [t.id for t in load_train_tasks(cfg)] == [f"bank-train-0-{i}" for i in (3, 4, 5, 6)]
    # without a warm start, or with the option off, the first four
    for overrides in ({"init_from": None}, {"unseen_tasks": False}):
        tasks = load_train_tasks(dataclasses.replace(cfg, **overrides))
        assert [t.id for t in tasks] == [f"bank-train-0-{i}" for i in range(4)]
        assert {scenario_key(t) for t in sft_tasks} <= {scenario_key(t) for t in tasks}


# ---- --rehearse-sft-coef: grounding the rehearser on the references' tool responses --------------

def captured_gradients(monkeypatch):
    """The policy's gradient at each optimizer step, as clip_and_step receives it."""
    import envace.training.trainer as trainer_mod

    grads, step = [], trainer_mod.clip_and_step

    def recording(model, optimizer, max_norm):
        grads.append(torch.cat([p.grad.detach().flatten().clone() if p.grad is not None else torch.zeros(p.numel()) for p in model.parameters()]))
        return step(model, optimizer, max_norm)

    monkeypatch.setattr(trainer_mod, "clip_and_step", recording)
    return grads


def response_nll_gradient(model, row):
    """The gradient of the token-mean NLL of `row`'s ENV tokens, computed from the logits directly
    (not through envace's loss code): the loss --rehearse-sft-coef adds."""
    model.zero_grad(set_to_none=True)
    ids = torch.tensor([row.input_ids])
    logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    env = torch.tensor([r == Role.ENV for r in row.roles[1:]])
    nll = -logprobs[env].mean()
    nll.backward()
    grad = torch.cat([p.grad.detach().flatten().clone() if p.grad is not None else torch.zeros(p.numel()) for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return nll.item(), grad


def test_rehearse_sft_coef_trains_the_references_tool_responses_even_without_a_group_signal(tmp_path, task_file, monkeypatch):
    """Equal rewards (no PPO signal): the update is not skipped, and its gradient is exactly
    coef x the gradient of the token-mean NLL of the reference's tool-response tokens, computed
    here from the initial weights' logits; one task per step so the row is known."""
    import copy

    grads = captured_gradients(monkeypatch)
    cfg = build(TrainConfig, dict(SMALL, tasks=task_file, output_dir=str(tmp_path / "run"), steps=1, tasks_per_step=1, penalty=0.0,
                                  reward="tests.training_rewards:constant", rehearse_sft_coef=0.5, precision="fp32"))
    trainer = Trainer(cfg)
    initial = copy.deepcopy(trainer.models.policy)
    metrics = trainer.train_step()
    trainer.logger.close()
    [task_id] = trainer.grounding
    row = trainer.grounding[task_id]
    assert {Role(r) for r, m in zip(row.roles, row.loss_mask) if m} == {Role.ENV}  # only the tool responses are trained
    assert metrics["groups/degenerate_frac"] == 1.0 and metrics["policy/skipped_update"] == 0.0
    nll, grad = response_nll_gradient(initial, row)
    assert metrics["policy/grounding_tokens"] == sum(r == Role.ENV for r in row.roles[1:])
    assert metrics["policy/grounding_nll"] == pytest.approx(nll, rel=1e-5)
    torch.testing.assert_close(grads[0], 0.5 * grad, rtol=1e-4, atol=1e-7)


def test_rehearse_sft_coef_adds_its_gradient_to_the_ppo_gradient(tmp_path, task_file, monkeypatch):
    """With a signal in every group the same rollouts (same seeds) give gradient(coef) =
    gradient(no coef) + coef x the NLL gradient of the step's reference rows."""
    import copy

    grads = captured_gradients(monkeypatch)
    runs = {}
    for coef in (0.0, 2.0):
        trainer = Trainer(build(TrainConfig, dict(SMALL, tasks=task_file, output_dir=str(tmp_path / f"run{coef}"), steps=1, tasks_per_step=1,
                                                  reward="tests.training_rewards:rollout_index", rehearse_sft_coef=coef,
                                                  precision="fp32")))
        initial = copy.deepcopy(trainer.models.policy)
        runs[coef] = trainer.train_step()
        trainer.logger.close()
    assert runs[0.0]["policy/trained_tokens"] == runs[2.0]["policy/trained_tokens"] > 0  # the same rollouts
    assert "policy/grounding_nll" not in runs[0.0]
    _, grad = response_nll_gradient(initial, next(iter(trainer.grounding.values())))
    torch.testing.assert_close(grads[1], grads[0] + 2.0 * grad, rtol=1e-4, atol=1e-6)


def test_rehearse_sft_coef_counts_the_references_it_executes_once_per_task_and_nothing_for_recorded_ones(tmp_path, task_file):
    """A world task's reference is executed (its add call, then the replay that verifies it: 2
    executions) once per run, counted as grounding; a recorded reference runs no world."""
    from tests.test_rollout import NoWorlds, recorded_counter_task

    trainer = Trainer(build(TrainConfig, dict(SMALL, tasks=task_file, output_dir=str(tmp_path / "world"), steps=1, rehearse_sft_coef=0.1)))
    tasks = trainer.tasks[:2]
    rows, executions = trainer.grounding_rows(tasks)
    again, executions_again = trainer.grounding_rows(tasks)
    trainer.logger.close()
    assert len(rows) == 2 and [r.input_ids for r in again] == [r.input_ids for r in rows]
    assert executions.as_dict() == {"rollout": 0, "verification": 0, "grounding": 4, "sft_data": 0, "task_data": 0, "total": 4}
    assert executions_again.total == 0  # made once per run

    free_file = tmp_path / "free.jsonl"
    save_tasks([recorded_counter_task()], free_file)
    trainer = Trainer(build(TrainConfig, dict(SMALL, tasks=str(free_file), reward="reference", output_dir=str(tmp_path / "free"), steps=1,
                                              rehearse_sft_coef=0.1)))
    trainer.env = NoWorlds()
    rows, executions = trainer.grounding_rows(trainer.tasks)
    metrics = trainer.train_step()
    trainer.logger.close()
    assert len(rows) == 1 and executions.total == 0
    assert metrics["env/total_total"] == 0 and metrics["policy/grounding_tokens"] > 0


def test_rehearse_sft_coef_refuses_tasks_without_a_reference_before_any_model_loads(tmp_path, monkeypatch):
    import envace.training.trainer as trainer_mod

    path = tmp_path / "bare.jsonl"
    bare = counter_task()
    bare.reference_calls = []
    save_tasks([bare], path)
    monkeypatch.setattr(trainer_mod, "load_trainable", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(ConfigError, match="neither `reference` nor `reference_calls` \\(first: t0\\)"):
        Trainer(build(TrainConfig, dict(SMALL, tasks=str(path), output_dir=str(tmp_path / "run"), rehearse_sft_coef=0.1)))
