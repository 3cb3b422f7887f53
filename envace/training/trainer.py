"""`envace train`: role-level GRPO with world rehearsal, and the baselines behind one flag.

One step, top to bottom:
  1. take the next `tasks_per_step` training tasks (the data position is checkpointed);
  2. roll out K trajectories per task, all batched (mode set by the variant; a share of
     tasks may run against the real world, `real_fraction`);
  3. score each trajectory (reward, default `replay`); measure rehearsal fidelity for free from
     the replay's real observations;
  4. advantages per (task, role) (default `role_grpo`), rows per trained model, one PPO update
     with token-mean over the whole step (micro-batches accumulate into it);
  5. log metrics, write samples, checkpoint atomically.
"""

from __future__ import annotations

import json
import random
import re
import warnings
from dataclasses import dataclass, field as dataclass_field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from tqdm.auto import tqdm

from envace import config as cfgmod
from envace.algorithms import ADVANTAGES, group_metrics
from envace.algorithms.losses import (Row, build_rows, forwarded_tokens, pack_shared_prefixes, ppo_loss, rows_with_signal,
                                     sequence_logprobs)
from envace.config import ConfigError, field
from envace.accounting import WorldExecutions
from envace.manifest import build_manifest, chain_executions, read_manifest, with_executions, write_manifest
from envace.metrics import summarize_records, trajectory_record
from envace.backends.lean import decode_settings
from envace.backends.open import check_models, open_generator
from envace.rewards import Context, compute_rewards, judge_missing, reward_names, runs_world
from envace.rollout import RolloutConfig, RolloutEngine
from envace.training.sharding import UnshardedCopy, checkpointed_optimizer, clip_and_step
from envace.training.sft import nll_step, reference_trajectory, sft_rows
from envace.training.variants import VARIANTS, variants_help
from envace.training.setup import (TrainingOptions, backward_micro_batches, check_resume, check_sharding, load_trainable, make_accelerator,
                                   global_sum, prepare_trainable, seed_everything, shared_run_dir, timed)
from envace.types import Role, Task, Trajectory

def train_rollout() -> RolloutConfig:
    """Training's rollout defaults: shorter than evaluation's, so that a CPU step stays short.
    Sampling at temperature 1 over the full vocabulary whatever RolloutConfig's defaults say;
    another temperature is allowed, a nucleus cut is not (see TrainConfig._validate_sampling)."""
    return RolloutConfig(max_turns=6, max_turn_tokens=128, max_rehearse_tokens=96, max_total_tokens=2048, temperature=1.0, top_p=1.0)


@dataclass
class TrainConfig(TrainingOptions):
    variant: str = field("envace", help=f"training variant: {variants_help()}", choices=VARIANTS.names)
    init_from: str | None = field(None, help="start from this checkpoint directory (e.g. an `envace sft` run's final/)")
    simulator_model: str | None = field(None, help="frozen simulator for --variant simulator (default: the base --model)")
    tasks: str | None = field(None, help="JSONL training tasks (default: built-in train split)")
    worlds: list[str] = field([], help="built-in training worlds (default: all training worlds)")
    n_per_world: int = field(16, help="built-in training tasks per world")
    difficulty: int | None = field(1, help="built-in task difficulty 1-3 (None = mixed)")
    unseen_tasks: bool = field(True, help="built-in tasks: leave out the scenarios the --init-from checkpoint was trained on (its data "
                                           "manifest), so that GRPO does not rehearse the warm start's own SFT tasks (a task file is used as given)")
    steps: int = field(10, help="training steps")
    tasks_per_step: int = field(4, help="tasks per step")
    k: int = field(4, help="rollouts per task (the GRPO group)")
    filter_groups: bool = field(False, help="DAPO's dynamic sampling: roll out further rounds of --tasks-per-step tasks until the step has "
                                            "--tasks-per-step groups with a learning signal (an output with a nonzero advantage), at most "
                                            "--max-rollout-rounds; the update takes those, and every group rolled out is scored, logged and counted")
    max_rollout_rounds: int = field(3, help="--filter-groups: rounds of --tasks-per-step rollouts per step at most")
    real_fraction: float = field(0.0, help="share of tasks rolled out against the real world in rehearse variants")
    rollout: RolloutConfig = field(default_factory=train_rollout, help="how the step's trajectories roll out",
                                   hidden={"mode": "the variant decides who answers tool calls (--variant)"})
    reward: str = field("replay", help="reward: replay (verifier, 0/1) | partial (verifier, partial credit) | reference | judge | module:function, or a weighted sum of them: judge:0.7,reference:0.3")
    judge: str | None = field(None, help="judge model for a reward with a judge component: a local model spec or an http(s):// OpenAI-compatible URL")
    advantage: str = field("role_grpo", help="advantage estimator: role_grpo | grpo | module:function")
    normalize_std: bool = field(False, help="divide advantages by the group std")
    penalty: float = field(-0.1, help="added to the reward of a malformed/empty output")
    clip_eps: float = field(0.2, help="PPO clip range: the ratio is clipped to [1 - clip_eps, 1 + clip_eps]")
    dual_clip: float | None = field(3.0, help="dual-clip constant (> 1) for negative advantages (None = off)")
    kl_coef: float = field(0.0, help="KL to the frozen initial model (0 = off)")
    rehearse_sft_coef: float = field(0.0, help="grounds the rehearser: adds this weight times the token-mean NLL of the tool responses in "
                                                "the reference trajectories of the step's tasks (recorded, or else executed once per task and "
                                                "counted as grounding) to the update, so that REHEARSE learns what tools return and not only "
                                                "what the task reward pays for (ECHO, PPO-ptx); 0 = off")
    share_prefix: bool = field(True, help="forward each group's shared prompt once in the update (same gradients, fewer tokens)")
    sampler: Literal["hf", "llamacpp", "vllm", "vllm-colocated"] = field("hf", help="rollout engine: hf (samples from the trained module itself), llamacpp "
                                                       "(llama.cpp with the policy's weights pushed after every step; pip install -e '.[llamacpp]'), "
                                                       "vllm (a running `vllm serve` at --vllm-url, weights pushed after every step; docs/scaling.md) "
                                                       "or vllm-colocated (vLLM's engine in the trainer's process, weights pushed after every step; "
                                                       "run the trainer from .venv-vllm, `make install-vllm`)")
    vllm_url: str | None = field(None, help="--sampler vllm: the server's OpenAI base URL (http://HOST:PORT/v1), started as in docs/scaling.md "
                                            "(VLLM_SERVER_DEV_MODE=1, --weight-transfer-config '{\"backend\": \"envace_file\"}')")
    vllm_transfer_dir: str | None = field(None, help="--sampler vllm / vllm-colocated: where pushed weights are written for vLLM to read "
                                                     "(default /dev/shm; a remote server needs a directory on a filesystem both hosts mount)")
    tis_cap: float = field(2.0, help="truncated importance weight cap for samples drawn with other numerics than the update's (bf16, llama.cpp)")
    samples_per_step: int = field(2, help="trajectories written to samples.jsonl per step")

    def validate(self) -> None:
        self.validate_training()
        self.rollout.validate()
        self._validate_data()
        self._validate_variant()
        self._validate_objective()
        self._validate_sampling()

    def _validate_data(self) -> None:
        if self.tasks and not Path(self.tasks).is_file():
            raise ConfigError(f"task file {self.tasks} does not exist")
        if self.init_from and not Path(self.init_from).is_dir():
            raise ConfigError(f"--init-from {self.init_from} is not a directory")
        for name in ("steps", "tasks_per_step", "n_per_world", "max_rollout_rounds"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.k < 2:
            raise ConfigError(f"k must be >= 2 for a group baseline, got {self.k}")
        if self.difficulty not in (None, 1, 2, 3):
            raise ConfigError(f"difficulty must be 1, 2 or 3 (or null for mixed), got {self.difficulty}")
        if self.samples_per_step < 0:
            raise ConfigError(f"samples_per_step must be >= 0, got {self.samples_per_step}")

    def _validate_variant(self) -> None:
        from envace.backends.models import check_model_spec

        variant = VARIANTS.get(self.variant)
        if not 0.0 <= self.real_fraction <= 1.0:
            raise ConfigError(f"real_fraction must be in [0, 1], got {self.real_fraction}")
        if self.real_fraction and not variant.allows_real_fraction:
            raise ConfigError(f"real_fraction applies to rehearse variants, not {self.variant}")
        if variant.requires_layout and self.rollout.rehearse_layout != variant.requires_layout:
            raise ConfigError(f"--variant {self.variant} needs --rehearse-layout {variant.requires_layout} (two models cannot share one transcript's KV cache)")
        if self.simulator_model is not None:
            if not variant.needs_simulator_model:
                users = [name for name in VARIANTS.names() if VARIANTS.get(name).needs_simulator_model]
                raise ConfigError(f"--simulator-model is read by --variant {' | '.join(users)} only; drop it for --variant {self.variant}")
            check_model_spec(self.simulator_model)

    def _validate_objective(self) -> None:
        self._validate_reward()
        if self.advantage not in ADVANTAGES and ":" not in self.advantage:
            raise ConfigError(f"unknown advantage {self.advantage!r}; known: {', '.join(ADVANTAGES.names())} or module:function")
        if not 0 < self.clip_eps < 1:
            raise ConfigError(f"clip_eps must be in (0, 1) (the ratio is clipped to [1 - clip_eps, 1 + clip_eps]), got {self.clip_eps}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ConfigError(f"dual_clip must be > 1 (a negative advantage's loss is capped at dual_clip times it), or null for off; got {self.dual_clip}")
        if self.kl_coef < 0:
            raise ConfigError(f"kl_coef must be >= 0 (0 = off), got {self.kl_coef}")
        self._validate_grounding()
        if self.sampler == "llamacpp":
            from envace.backends.llamacpp import check_engine

            if self.tiny:
                raise ConfigError("--sampler llamacpp serves the model's own GGUF architecture; a --tiny model has none: use --sampler hf")
            try:
                check_engine(self.model)  # the base model's GGUF is the template of the engine's weights
            except (ImportError, ValueError) as err:
                raise ConfigError(f"--sampler llamacpp: {err}") from err
        self._validate_vllm()
        if self.tis_cap < 1:
            raise ConfigError(f"tis_cap must be >= 1 (the importance weight min(exp(old - behaviour), cap) truncates above it), got {self.tis_cap}")

    def _validate_grounding(self) -> None:
        """--rehearse-sft-coef trains the reference transcripts' tool responses into the policy, the
        layout in which the policy itself rehearses: a variant that trains REHEARSE in the policy's
        transcript."""
        if self.rehearse_sft_coef < 0:
            raise ConfigError(f"rehearse_sft_coef must be >= 0 (0 = off), got {self.rehearse_sft_coef}")
        if not self.rehearse_sft_coef:
            return
        if not VARIANTS.get(self.variant).policy_rehearses:
            raise ConfigError(f"--rehearse-sft-coef trains the policy's REHEARSE role, which --variant {self.variant} does not train: "
                              "use --variant envace, or drop --rehearse-sft-coef")
        if self.rollout.rehearse_layout != "transcript":
            raise ConfigError("--rehearse-sft-coef trains tool responses in the agent's transcript, where the policy rehearses with "
                              f"--rehearse-layout transcript; with --rehearse-layout {self.rollout.rehearse_layout} it would train another "
                              "prompt than the one rehearsing: use --rehearse-layout transcript, or drop --rehearse-sft-coef")

    def _validate_vllm(self) -> None:
        """--sampler vllm and --vllm-url go together, and the server must take pushed weights:
        checked here, before any model loads (envace.backends.vllm.VLLMServerGenerator.check_server)."""
        if self.sampler == "vllm-colocated":
            self._validate_vllm_colocated()
            return
        if self.sampler != "vllm":
            if self.vllm_url or self.vllm_transfer_dir:
                flag = "--vllm-url" if self.vllm_url else "--vllm-transfer-dir"
                raise ConfigError(f"{flag} is read by --sampler vllm only; add --sampler vllm or drop {flag}")
            return
        from envace.backends.vllm import INSTALL_HINT, serve_command

        if not self.vllm_url:
            raise ConfigError(f"--sampler vllm needs --vllm-url http://HOST:PORT/v1 of a running server ({INSTALL_HINT}; "
                              f"start it with `{serve_command()}`)")
        self._check_vllm_engine("a served copy")
        self._check_vllm_server()

    def _check_vllm_engine(self, engine: str) -> None:
        """What both vLLM samplers need: --model's own files, one trained model, a transfer directory that exists."""
        if self.tiny:
            raise ConfigError(f"--sampler {self.sampler} pushes the policy into {engine} of --model; a --tiny model has none: use --sampler hf")
        if VARIANTS.get(self.variant).separate_rehearser:
            raise ConfigError(f"--variant {self.variant} trains a separate rehearser, and {engine} of vLLM holds one model's weights: use --sampler hf")
        if self.vllm_transfer_dir and not Path(self.vllm_transfer_dir).is_dir():
            raise ConfigError(f"--vllm-transfer-dir {self.vllm_transfer_dir} is not a directory")

    def _validate_vllm_colocated(self) -> None:
        """--sampler vllm-colocated: vLLM's engine in this process (envace.backends.vllm.VLLMColocatedGenerator),
        so vLLM must be importable here; checked before any model loads, without importing vLLM."""
        import importlib.util
        import sys

        from envace.backends.vllm import COLOCATED_HINT

        if self.vllm_url:
            raise ConfigError("--vllm-url is read by --sampler vllm (a running server); --sampler vllm-colocated starts its own engine "
                              "in the trainer's process: drop --vllm-url, or use --sampler vllm")
        self._check_vllm_engine("the colocated engine")
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(f"--sampler vllm-colocated runs vLLM inside the trainer, but vllm is not importable from {sys.executable}: {COLOCATED_HINT}")

    def _check_vllm_server(self) -> None:
        from envace.backends.openai_http import BackendUnreachableError
        from envace.backends.vllm import INSTALL_HINT, VLLMServerGenerator, WeightSyncError, serve_command
        from envace.backends.models import ModelNotFoundError

        probe = VLLMServerGenerator(self.vllm_url, tokenizer=None, transfer_dir=self.vllm_transfer_dir)
        try:
            probe.check_server(self.rollout.max_total_tokens)
        except BackendUnreachableError as err:
            raise ConfigError(f"--vllm-url {self.vllm_url}: no vLLM server there ({err}). {INSTALL_HINT}, then start the server "
                              f"with `{serve_command(self.model)}` and pass --vllm-url http://127.0.0.1:8000/v1 (docs/scaling.md)") from err
        except (ModelNotFoundError, WeightSyncError) as err:
            raise ConfigError(f"--vllm-url {self.vllm_url}: {err}") from err
        finally:
            probe.shutdown()

    def _validate_reward(self) -> None:
        judge_missing(self.reward, self.judge)
        names = reward_names(self.reward)
        if self.judge and "judge" not in names:
            raise ConfigError(f"--judge is read by the judge reward only; add it to --reward (e.g. --reward judge:0.5,{self.reward}:0.5) or drop --judge")
        check_models(self.judge)

    def _validate_sampling(self) -> None:
        # The PPO ratio compares the updated policy with the distribution that drew the tokens:
        # softmax(logits / T) over the full vocabulary, which the HF sampler records and the
        # update recomputes at the same T. A nucleus cut would change that distribution, greedy
        # decoding would give every rollout of a group the same output (no advantage), and the
        # other engines report T = 1 logprobs only.
        t, top_p = self.rollout.temperature, self.rollout.top_p
        if top_p != 1.0:
            raise ConfigError(f"training samples over the full vocabulary (top_p 1, got top_p={top_p}): the PPO ratio's logprobs "
                              "are those of softmax(logits / temperature) without a nucleus cut; lower --temperature instead")
        if t <= 0:
            raise ConfigError(f"training needs temperature > 0 (got {t}): greedy rollouts of a group are identical, so GRPO has no advantage to learn from")
        if t != 1.0 and self.sampler != "hf":
            raise ConfigError(f"--sampler {self.sampler} reports logprobs at temperature 1 only, so it trains at --temperature 1 (got {t}); "
                              "use --sampler hf for tempered sampling")
        if self.rollout.continuous_batching and self.sampler != "hf":
            raise ConfigError(f"--continuous-batching pauses rows inside the HF sampler's batches; --sampler {self.sampler} batches on its own: "
                              "drop --continuous-batching")
        dtype = self.rollout.sampler_dtype
        if self.sampler == "hf" and dtype in ("f16", "q8_0"):
            raise ConfigError(f"--sampler-dtype {dtype} is llama.cpp's (--sampler llamacpp); --sampler hf samples in auto, f32, bf16, int8 or int4")
        if self.sampler == "llamacpp" and dtype in ("int8", "int4"):
            raise ConfigError(f"--sampler-dtype {dtype} is the HF sampler's (torch's {dtype} kernel); llama.cpp samples in f32, f16, bf16 or q8_0")
        if self.sampler == "hf" and dtype == "int4":
            warnings.warn("--sampler-dtype int4 samples from 4-bit copies of the weights: on trained weights of the default model "
                          "the sampled tokens' logprobs were 0.75-0.81 nats from the update's (bf16: 0.005), more than truncated "
                          "importance weights correct well (docs/performance.md); train with auto, bf16 or int8", stacklevel=2)
        if self.sampler.startswith("vllm") and dtype != "auto":
            raise ConfigError(f"--sampler-dtype is not read by --sampler {self.sampler}: vLLM samples in its own --dtype; drop --sampler-dtype")


def load_train_tasks(cfg: TrainConfig) -> list[Task]:
    from envace.envs import get_world
    from envace.envs.tasks import builtin_tasks, load_tasks, require_worlds

    if cfg.tasks:
        tasks = load_tasks(cfg.tasks)
        require_worlds(tasks, world_needs(cfg))
        return tasks
    for w in cfg.worlds:
        get_world(w)
    # A warm start that imitated a task's reference solves it every time: its K rollouts agree and
    # carry no advantage (the demo's 24-per-world warm start solved 0.64 of its own SFT tasks in the
    # real world, 28 of 32 rows per step with advantage 0, against 0.34 of unseen test tasks).
    seen = (read_manifest(cfg.init_from) or {}).get("scenario_keys", []) if cfg.unseen_tasks and cfg.init_from else []
    return builtin_tasks("train", cfg.n_per_world, worlds=cfg.worlds or None, difficulty=cfg.difficulty, seed=cfg.seed, exclude=seen)


def require_references(tasks: list[Task]) -> None:
    """--rehearse-sft-coef trains on every task's reference trajectory: refuse tasks without one before any model loads."""
    missing = [t.id for t in tasks if not (t.reference or t.reference_calls)]
    if missing:
        raise ConfigError(f"--rehearse-sft-coef trains the tool responses of each task's reference trajectory, and {len(missing)} "
                          f"training task(s) have neither `reference` nor `reference_calls` (first: {missing[0]}): add one "
                          "(docs/tasks.md), or drop --rehearse-sft-coef")


def world_needs(cfg: TrainConfig) -> dict[str, str]:
    """The options in use that need an executable world, each with what world-free tasks can use instead."""
    needs = {}
    if VARIANTS.get(cfg.variant).rollout_mode == "real":
        needs[f"--variant {cfg.variant}"] = "use a rehearse variant such as --variant envace"
    if runs_world(cfg.reward):
        default = " (the default)" if cfg.reward == "replay" else ""
        needs[f"--reward {cfg.reward}{default}"] = "pass --reward judge, reference or module:function"
    if cfg.real_fraction > 0:
        needs[f"--real-fraction {cfg.real_fraction}"] = "use --real-fraction 0"
    return needs


class TaskStream:
    """Deterministic epochs over the training tasks; its position is part of every checkpoint."""

    def __init__(self, tasks: list[Task], seed: int, epoch: int = 0, index: int = 0):
        self.tasks, self.seed, self.epoch, self.index = tasks, seed, epoch, index
        self._order = self._shuffled()

    def _shuffled(self) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[Task]:
        out = []
        while len(out) < n:
            if self.index >= len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffled()
            out.append(self.tasks[self._order[self.index]])
            self.index += 1
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}


@dataclass
class Models:
    """The trained models by name (the variant's `trained_roles`: "policy", and "rehearser" where
    a separate model rehearses), what updates each, and the frozen models."""

    trained: dict[str, Any]
    optimizers: dict[str, torch.optim.Optimizer]
    schedulers: dict[str, Any]
    simulator: Any = None  # frozen, for a variant whose simulator model answers tool calls
    reference: Any = None  # frozen initial policy, for the KL term
    # --sharding fsdp2 or deepspeed-zero3: each trained model's full copy, which rollouts sample from and checkpoints save.
    unsharded: dict[str, UnshardedCopy] = dataclass_field(default_factory=dict)

    @property
    def policy(self) -> Any:
        return self.trained["policy"]

    @property
    def rehearser(self) -> Any:
        return self.trained.get("rehearser")


class Trainer:
    def __init__(self, cfg: TrainConfig):
        from envace.envs.environment import WorldEnvironment

        self.cfg = cfg
        self.variant = VARIANTS.get(cfg.variant)
        self.tasks = load_train_tasks(cfg)  # bad task files fail before any model loads
        if cfg.rehearse_sft_coef:
            require_references(self.tasks)
        self.env = WorldEnvironment()
        self.accelerator = make_accelerator(cfg.precision)
        if cfg.tasks_per_step % self.accelerator.num_processes:
            raise ConfigError(f"tasks_per_step ({cfg.tasks_per_step}) must be a multiple of the number of processes ({self.accelerator.num_processes})")
        check_sharding(self.accelerator, cfg.sharding)
        if cfg.sampler == "vllm-colocated" and self.accelerator.num_processes > 1:
            raise ConfigError("--sampler vllm-colocated runs one vLLM engine in one trainer process; multi-process training with it is not implemented: use --sampler hf or llamacpp")
        self.dir = shared_run_dir(self.accelerator, cfg.output_dir, "train")
        resume_from = check_resume(self.dir, cfg, cfg.resume)
        seed_everything(cfg.seed)
        self.models, self.tokenizer = self._build_models()
        self.judge = open_generator(cfg.judge, cfg.seed, sampler_dtype=cfg.rollout.sampler_dtype) if cfg.judge else None  # frozen, for the judge reward
        self.step = 0
        self.generators: dict[str, Any] = {}  # seed stream -> its generator (Trainer._generator)
        self.stream = TaskStream(self.tasks, cfg.seed)
        # This run's executions in a real world, by purpose (envace/accounting.py); checkpointed.
        self.world_calls = WorldExecutions()
        # --rehearse-sft-coef: task id -> its reference trajectory's row (None: it did not replay), made once per run.
        self.grounding: dict[str, Row | None] = {}
        if resume_from is not None:
            self._resume(resume_from)
        self.manifest = build_manifest(self.tasks, cfg.init_from)
        main = self.accelerator.is_main_process
        if main:
            cfgmod.save(cfg, self.dir / "config.yaml")
            write_manifest(self.manifest, self.dir)
        from envace.training.logging import MetricsLogger

        self.logger = None if not main else MetricsLogger(self.dir, use_tensorboard=cfg.tensorboard, use_wandb=cfg.wandb, wandb_project=cfg.wandb_project, resume_step=self.step if resume_from else None, config=cfgmod.to_dict(cfg))

    # ---- setup ------------------------------------------------------------------------
    def _load(self, spec: str, trainable: bool = True) -> tuple[Any, Any]:
        cfg = self.cfg
        # --tiny replaces the base model only; a checkpoint directory always loads as saved.
        tiny = cfg.tiny and spec == cfg.model
        model, tok = load_trainable(spec, cfg.lora_r if trainable else 0, cfg.lora_alpha, self.accelerator.device, tiny=tiny,
                                    activation_checkpointing=trainable and cfg.activation_checkpointing)
        if not trainable:
            model.requires_grad_(False)
        return model, tok

    def _build_models(self) -> tuple[Models, Any]:
        cfg = self.cfg
        models = Models({}, {}, {})
        for name in self.variant.trained_roles:
            (models.trained[name], models.optimizers[name], models.schedulers[name]), tok, copy = self._trainable(cfg.init_from or cfg.model)
            if copy is not None:
                models.unsharded[name] = copy
        if self.variant.needs_simulator_model:
            models.simulator, _ = self._load(cfg.simulator_model or cfg.model, trainable=False)
        if cfg.kl_coef > 0:
            models.reference, _ = self._load(cfg.init_from or cfg.model, trainable=False)
        return models, tok

    def _trainable(self, spec: str) -> tuple[tuple[Any, Any, Any], Any, UnshardedCopy | None]:
        """((model, optimizer, scheduler), tokenizer, the model's full copy if sharded)."""
        model, tok = self._load(spec)
        model, optimizer, scheduler, copy = prepare_trainable(self.accelerator, model, self.cfg, self.cfg.steps)
        if copy is None:
            # Under bf16, prepare wraps the module's forward in autocast; the rollout samples from that
            # module, and bf16 decode is slower than fp32 on a CPU at batch 8-32 (measured). The update
            # autocasts on its own (backward_micro_batches), so sampling
            # stays fp32 and only the update runs in bf16.
            self.accelerator.unwrap_model(model, keep_fp32_wrapper=False)
        return (model, optimizer, scheduler), tok, copy

    def _full_models(self) -> dict[str, Any]:
        """Each trained model with its whole weights, as checkpoints and rollouts use them: the
        module itself (DDP unwrapped) or, sharded, its full copy (current once `_gather` ran)."""
        return {k: self.models.unsharded[k].module if k in self.models.unsharded else self.accelerator.unwrap_model(m)
                for k, m in self.models.trained.items()}

    def _gather(self) -> None:
        """Sharded: bring every full copy to this step's weights (a collective: every process
        calls it at the same points, before a rollout and before a save)."""
        for name, copy in self.models.unsharded.items():
            if copy.version != self.step:
                copy.refresh(self.models.trained[name], self.step)

    def _optimizer_states(self) -> dict[str, Any]:
        """What checkpoints save and restore per optimizer (`checkpointed_optimizer`)."""
        return {k: checkpointed_optimizer(self.models.trained[k], o) for k, o in self.models.optimizers.items()}

    def _resume(self, path: Path) -> None:
        from envace.training.checkpoint import load_checkpoint

        state = load_checkpoint(path, self._full_models(), self._optimizer_states(), self.models.schedulers)
        for name, copy in self.models.unsharded.items():
            copy.load_into(self.models.trained[name])
            copy.version = state.step
        self.step = state.step
        self.stream = TaskStream(self.tasks, self.cfg.seed, **state.data_state["stream"])
        # Checkpoints from before the purposes were split hold the rollout count only.
        self.world_calls = WorldExecutions.from_dict(state.data_state.get("world_executions") or {"rollout": state.data_state.get("real_env_calls", 0)})

    def _generator(self, model: Any, stream: str, round_index: int = 0) -> Any:
        """The stream's generator, kept across steps: synced to the weights of this step (a
        trained model's; a frozen one never changes) and seeded with this step's seed, so the
        samples depend on (seed, step, process, stream, rollout round) only, resumed or not."""
        from envace.backends.base import PolicyWeights

        name = next((k for k, m in self.models.trained.items() if m is model), None)
        trained = name is not None
        module = self._full_models()[name] if trained else model
        generator = self.generators.get(stream)
        if generator is None:
            generator = self.generators[stream] = self._open_sampler(module) if trained else self._hf_generator(module)
        if trained and generator.weights_version != self.step:
            generator.sync_weights(PolicyWeights(module, version=self.step))
            if self._shared_server:
                # One server samples for every process and the main one pushed into it: no process
                # may sample before that push is done.
                self.accelerator.wait_for_everyone()
        generator.set_seed(sampling_seed(self.cfg.seed, self.step, self.accelerator.process_index, stream, round_index))
        return generator

    def _open_sampler(self, module: Any) -> Any:
        """The rollout engine of a trained model (`--sampler`): every episode of a step is in
        flight at once, so it holds tasks_per_step x K sessions of up to max_total_tokens."""
        cfg = self.cfg
        if cfg.sampler == "hf":
            return self._hf_generator(module)
        if cfg.sampler == "vllm":
            return self._open_vllm()
        if cfg.sampler == "vllm-colocated":
            return self._open_vllm_colocated()
        from envace.backends.llamacpp import LlamaCppGenerator

        dtype = "f32" if cfg.rollout.sampler_dtype == "auto" else cfg.rollout.sampler_dtype  # numerics closest to the update's
        return LlamaCppGenerator(module, self.tokenizer, cfg.model, dtype=dtype, max_sessions=cfg.tasks_per_step * cfg.k,
                                 n_ctx_per_session=cfg.rollout.max_total_tokens + 1, seed=cfg.seed)

    def _hf_generator(self, module: Any) -> Any:
        """A local sampler of `module` in the --sampler-dtype numerics (trained or frozen model)."""
        from envace.backends.hf import HFGenerator

        return HFGenerator(module, self.tokenizer, **decode_settings(self.cfg.rollout.sampler_dtype, module))

    @property
    def _shared_server(self) -> bool:
        """Several training processes sample from one --vllm-url server (DDP or sharded)."""
        return self.cfg.sampler == "vllm" and self.accelerator.num_processes > 1

    def _open_vllm(self) -> Any:
        """The --vllm-url server, checked. Its weights version is unknown (-1: it was started from
        model files, while the trainer may start from --init-from or a resumed checkpoint), so
        `_generator` pushes this step's weights before any rollout; a server whose model does not
        take them fails there. With several processes, the main one pushes (every process holds
        the same weights after a step) and the others only sample."""
        from envace.backends.vllm import VLLMServerGenerator

        generator = VLLMServerGenerator(self.cfg.vllm_url, self.tokenizer, transfer_dir=self.cfg.vllm_transfer_dir,
                                        pushes_weights=self.accelerator.is_main_process)
        generator.check_server(self.cfg.rollout.max_total_tokens)
        return generator

    def _open_vllm_colocated(self) -> Any:
        """vLLM's engine in this process, started from the base model's files: its weights version
        is -1, so `_generator` pushes this step's weights before any rollout. A second policy stream
        (--real-fraction) samples from the first one's engine."""
        from envace.backends.models import resolve_model
        from envace.backends.vllm import VLLMColocatedGenerator

        cfg = self.cfg
        return VLLMColocatedGenerator(resolve_model(cfg.model), self.tokenizer, max_model_len=cfg.rollout.max_total_tokens + 1,
                                      max_num_seqs=cfg.tasks_per_step * cfg.k, transfer_dir=cfg.vllm_transfer_dir, seed=cfg.seed,
                                      share=next(iter(self._colocated()), None))

    def _colocated(self) -> list[Any]:
        """The generators on a colocated vLLM engine (--sampler vllm-colocated), which sleeps through the update."""
        from envace.backends.vllm import VLLMColocatedGenerator

        return [g for g in self.generators.values() if isinstance(g, VLLMColocatedGenerator)]

    # ---- one step ---------------------------------------------------------------------
    def rollout(self, tasks: list[Task], round_index: int = 0) -> list[list[Trajectory]]:
        """K rollouts of each task with this step's weights; `round_index` > 0 for a step's
        further rounds (--filter-groups), which sample from seeds of their own."""
        cfg = self.cfg
        # Validation allows real_fraction > 0 only in variants that rehearse.
        n_real = round(cfg.real_fraction * len(tasks))
        batches = [(tasks[:n_real], "real"), (tasks[n_real:], self.variant.rollout_mode)]
        groups: list[list[Trajectory]] = []
        for model in self.models.trained.values():
            model.eval()
        self._gather()
        for part, mode in batches:
            if not part:
                continue
            policy = self._generator(self.models.policy, f"policy-{mode}", round_index)
            # The model (and its seed stream) that answers tool calls, where it is not the policy.
            side, stream = {"simulator": (self.models.simulator, "simulator"), "rehearse": (self.models.rehearser, "rehearser")}.get(mode, (None, ""))
            simulator = self._generator(side, stream, round_index) if side is not None else None
            engine = RolloutEngine(policy, self.env, replace(cfg.rollout, mode=mode), simulator=simulator)
            with torch.no_grad():
                groups += engine.run(part, k=cfg.k, progress=cfg.progress, desc=f"step {self.step + 1} rollout ({mode}{f', round {round_index + 1}' if round_index else ''})")
        return groups

    def update(self, groups: list[list[Trajectory]], grounding: list[Row] | None = None) -> dict[str, float]:
        """One optimizer step per trained model on the groups' rows (role-level GRPO), plus, for the
        policy, the --rehearse-sft-coef loss on `grounding` (`grounding_rows`)."""
        cfg = self.cfg
        roles = self.variant.trained_roles
        advantages = ADVANTAGES.get(cfg.advantage)(groups, roles=self.variant.all_roles, normalize_std=cfg.normalize_std, penalty=cfg.penalty)
        trajs = [t for g in groups for t in g]
        advs = [a for g in advantages for a in g.trajectories]
        metrics = group_metrics(advantages)
        layout = "isolated" if any(t.side_rows for t in trajs) else "transcript"
        for name, model in self.models.trained.items():
            rows = build_rows(trajs, advs, roles[name], layout, group_sizes=[len(g) for g in groups])
            extra = (grounding or []) if name == "policy" else []
            metrics |= {f"{name}/{k}": v for k, v in self._optimize(name, model, rows, extra).items()}
        return metrics

    @property
    def numerics_differ(self) -> bool:
        """Whether the sampler's logprobs come from other numerics than the update's (a bf16
        update, a bf16 HF sampler, a llama.cpp or vLLM sampler): then they weight each token's loss
        (truncated importance sampling, `tis_cap`). The PPO ratio's old logprobs are the
        update's own either way, never the sampler's."""
        exact = {"dtype": None, "quant": None}
        hf_exact = all(decode_settings(self.cfg.rollout.sampler_dtype, m) == exact for m in self._full_models().values())
        return self.cfg.sampler != "hf" or self.accelerator.mixed_precision != "no" or not hf_exact

    def _optimize(self, name: str, model: Any, rows: list, grounding: list[Row]) -> dict[str, float]:
        cfg = self.cfg
        optimizer, scheduler = self.models.optimizers[name], self.models.schedulers[name]
        optimizer.zero_grad(set_to_none=True)
        total = global_sum(self.accelerator, sum(sum(r.loss_mask) for r in rows))
        grounded = global_sum(self.accelerator, sum(sum(r.loss_mask) for r in grounding))
        # DDP averages gradients over processes: scale the denominator so the result is the
        # token mean over every process's tokens.
        denom = total / self.accelerator.num_processes
        sums: dict[str, float] = {}
        signal = rows_with_signal(rows)
        has_signal = bool(global_sum(self.accelerator, len(signal)))
        if not has_signal and not grounded:
            # No learning signal (e.g. every group had equal rewards): a step would only apply
            # weight decay and move Adam's moments, so the weights stay as they are. The
            # schedule still advances so it stays aligned with the step count.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
                scheduler.step()
            return {"trained_tokens": float(total), "skipped_update": 1.0, "zero_advantage_rows": float(len(rows))}
        # Rows with advantage 0 throughout add exactly 0 to the loss and the gradient, and their
        # tokens stay in `denom`: leaving them out of the forward and the backward
        # changes no weight. A KL term pulls every token towards the reference whatever its
        # advantage, so with one every row is kept. The per-token diagnostics (clip_frac, entropy,
        # approx_kl) are then means over the rows that were forwarded.
        zero_rows = len(rows) if not has_signal else 0 if cfg.kl_coef else len(rows) - len(signal)
        if not cfg.kl_coef or not has_signal:
            rows = signal
        tis_cap = cfg.tis_cap if self.numerics_differ else None
        model.train()

        def loss_fn(batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
            logprobs, entropy = sequence_logprobs(model, batch, temperature=cfg.rollout.temperature, trained_only=True)
            ref = None
            if self.models.reference is not None:
                with torch.no_grad():
                    ref, _ = sequence_logprobs(self.models.reference, batch, temperature=cfg.rollout.temperature, trained_only=True)
            # One optimizer step per rollout batch: the weights this forward runs are the old
            # policy, so its own logprobs, detached, are the ratio's (exactly 1) and no no-grad
            # forward recomputes them. The sampler's are compared with them every step
            # (logprob_mismatch) and weight the loss where its numerics are not the update's.
            return ppo_loss(logprobs, logprobs.detach(), batch.advantages, batch.loss_mask, cfg.clip_eps, cfg.dual_clip, ref, cfg.kl_coef,
                            roles=batch.roles, entropy=entropy, num_tokens=float(denom), behaviour_logprobs=batch.sampler_logprobs, tis_cap=tis_cap)

        # Without a signal the PPO loss is 0 and only the grounding loss trains.
        for m in backward_micro_batches(self.accelerator, model, rows, cfg.micro_batch_tokens, self.tokenizer.pad_token_id, loss_fn, share_prefix=cfg.share_prefix) if has_signal else []:
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + (v if k == "loss" or k.startswith("tokens") else v * m[_token_key(k)])
        sums = {k: v if k == "loss" or k.startswith("tokens") else v / max(sums[_token_key(k)], 1.0) for k, v in sums.items()}
        if grounded:
            # The gradients add up: PPO's token mean over the rollouts plus coef x the token-mean NLL of the references' tool responses.
            nll = nll_step(model, grounding, self.tokenizer.pad_token_id, cfg.micro_batch_tokens, self.accelerator, weight=cfg.rehearse_sft_coef)
            sums |= {"grounding_nll": nll, "grounding_tokens": float(grounded)}
        grad_norm = clip_and_step(model, optimizer, cfg.grad_clip)
        scheduler.step()
        forwarded = forwarded_tokens(pack_shared_prefixes(rows) if cfg.share_prefix else rows)
        return sums | {"grad_norm": float(grad_norm), "lr": scheduler.get_last_lr()[0], "trained_tokens": float(total), "skipped_update": 0.0,
                       "zero_advantage_rows": float(zero_rows),
                       "forwarded_tokens": float(forwarded), "forwarded_tokens_unshared": float(forwarded_tokens(rows))}

    def score(self, tasks: list[Task], groups: list[list[Trajectory]]) -> dict[str, float]:
        """Rewards for the groups, then the step's rollout metrics (`rollout_metrics`)."""
        self.reward(tasks, groups)
        return self.rollout_metrics(tasks, groups)

    def reward(self, tasks: list[Task], groups: list[list[Trajectory]]) -> None:
        compute_rewards(self.cfg.reward, groups, tasks, Context(env=self.env, judge=self.judge))

    def rollout_metrics(self, tasks: list[Task], groups: list[list[Trajectory]], other: WorldExecutions | None = None) -> dict[str, float]:
        """Success, reward, fidelity and world executions of scored groups (and `other`
        executions of this process's step); adds them to the run's count, so call it once per group."""
        records = [trajectory_record(t, tr) for t, g in zip(tasks, groups) for tr in g]
        summary = summarize_records(records)
        local = (WorldExecutions.of(tr for g in groups for tr in g) + (other or WorldExecutions())).as_dict()
        step_calls = WorldExecutions.from_dict({k: global_sum(self.accelerator, v) for k, v in local.items()})
        self.world_calls += step_calls
        keys = ("success_rate", "partial_credit", "mean_reward", "tokens_per_task", "calls_per_task", "answered_rate", "turn_limit_rate",
                "malformed", "tool_exceptions", "fidelity/exact", "fidelity/field_f1", "fidelity/calls")
        out = {k if k != "mean_reward" else "reward/mean": summary[k] for k in keys if k in summary} | reward_component_means(groups)
        # Step and run totals per purpose (env/<purpose>_step, env/<purpose>_total); global already.
        return out | {f"env/{k}_{span}": v for span, calls in (("step", step_calls), ("total", self.world_calls)) for k, v in calls.as_dict().items()}

    def _global_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """One value per metric over all processes (`merge_process_metrics`)."""
        if self.accelerator.num_processes == 1:
            return metrics
        from accelerate.utils import gather_object

        return merge_process_metrics(gather_object([metrics]))

    def collect(self) -> tuple[list[Task], list[list[Trajectory]], list[bool], float, int]:
        """This step's rollouts, rewarded: one round of --tasks-per-step tasks, or with
        --filter-groups further rounds until tasks_per_step groups over all processes carry a
        learning signal (at most max_rollout_rounds). Returns every task and group rolled out,
        whether each group has a signal (with --filter-groups; else empty), the rollouts'
        seconds and the rounds run."""
        cfg = self.cfg
        tasks: list[Task] = []
        groups: list[list[Trajectory]] = []
        signal: list[bool] = []
        seconds = 0.0
        for rounds in range(1, cfg.max_rollout_rounds + 1):
            # Every process draws the same tasks and rolls out its own share of them.
            part = self.stream.take(cfg.tasks_per_step)[self.accelerator.process_index :: self.accelerator.num_processes]
            new, t = timed(lambda: self.rollout(part, round_index=rounds - 1))
            self.reward(part, new)
            tasks, groups, seconds = tasks + part, groups + new, seconds + t
            if not cfg.filter_groups:
                break
            signal += map(self.has_signal, new)
            if global_sum(self.accelerator, sum(signal)) >= cfg.tasks_per_step:
                break
        return tasks, groups, signal, seconds, rounds

    def has_signal(self, group: list[Trajectory]) -> bool:
        """Whether a rewarded group gives some trained output a nonzero advantage (DAPO's
        non-zero-variance groups; a malformed output's penalty counts)."""
        cfg = self.cfg
        return not ADVANTAGES.get(cfg.advantage)([group], roles=self.variant.all_roles, normalize_std=cfg.normalize_std, penalty=cfg.penalty)[0].degenerate

    def kept_groups(self, groups: list[list[Trajectory]], signal: list[bool]) -> list[list[Trajectory]]:
        """The groups the update takes: all of them, or with --filter-groups those with a signal
        (`signal`, one flag per group), the first tasks_per_step over the processes in process order."""
        if not self.cfg.filter_groups:
            return groups
        kept = [g for g, has in zip(groups, signal) if has]
        before = 0
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            before = sum(gather_object([len(kept)])[: self.accelerator.process_index])
        return kept[: max(0, self.cfg.tasks_per_step - before)]

    def grounding_rows(self, tasks: list[Task]) -> tuple[list[Row], WorldExecutions]:
        """--rehearse-sft-coef: each task's reference trajectory as a row whose tool responses (ENV
        tokens, the REHEARSE targets, as in `envace sft`) are trained, and the world executions
        making them took. Made once per task in a run (cached); a task without a recorded reference
        executes its reference calls in its world, counted as grounding; a reference that does not
        replay (or verify) gives no row."""
        executions = WorldExecutions()
        for task in tasks:
            if task.id not in self.grounding:
                traj, good = reference_trajectory(task, self.tokenizer, self.env, self.cfg.rollout.max_total_tokens)
                executions.grounding += WorldExecutions.of([traj]).total
                self.grounding[task.id] = sft_rows([traj], (Role.ENV,))[0] if good else None
        rows = [self.grounding[t.id] for t in tasks]
        return [r for r in rows if r is not None], executions

    def train_step(self) -> dict[str, float]:
        before = {stream: generator.stats.counters() for stream, generator in self.generators.items()}
        tasks, groups, signal, t_rollout, rounds = self.collect()
        kept = self.kept_groups(groups, signal)
        grounding, grounding_calls = [], WorldExecutions()
        if self.cfg.rehearse_sft_coef:
            task_of = {t.id: t for t in tasks}
            grounding, grounding_calls = self.grounding_rows([task_of[g[0].task_id] for g in kept])
        metrics = self.rollout_metrics(tasks, groups, grounding_calls) | self._sampler_metrics(before)
        if self.cfg.filter_groups:
            counts = {"groups_rolled_out": len(groups), "groups_with_signal": sum(signal), "groups_kept": len(kept)}
            metrics |= {"filter/rounds": float(rounds)} | {f"filter/{k}": global_sum(self.accelerator, v) for k, v in counts.items()}
        for generator in self._colocated():
            # The update gets the device (vLLM's sleep mode; a no-op on CPU); the engine wakes
            # itself at the next weight sync or generation.
            generator.sleep()
        update, t_update = timed(lambda: self.update(kept, grounding))
        self.step += 1
        metrics |= update | {"time/rollout_s": t_rollout, "time/update_s": t_update, "time/rollout_share": t_rollout / max(t_rollout + t_update, 1e-9)}
        metrics = sampler_rates(self._global_metrics(metrics))
        if self.logger is not None:
            self.logger.log(self.step, metrics)
            self.logger.write_samples(self.step, [g[0] for g in groups[: self.cfg.samples_per_step]], self.tokenizer)
        if self.step % self.cfg.save_every == 0 or self.step == self.cfg.steps:
            self.save()
        return metrics

    def _sampler_metrics(self, before: dict[str, dict[str, float]]) -> dict[str, float]:
        """What each generator did this step, as `sampler/<stream>/<count>`: tokens, calls, the
        engine's own counts (weight syncs; vLLM's prefix-cache tokens); what the clock measured
        (seconds, sync seconds) goes under `time/sampler/<stream>/`, with the step's other
        timings, since it differs between runs. The rates follow from these (`sampler_rates`)."""
        out = {}
        for stream, generator in self.generators.items():
            then = before.get(stream, {})
            step = {k: v - then.get(k, 0.0) for k, v in generator.stats.counters().items()}
            out |= {f"{'time/' if _clocked(k) else ''}sampler/{stream}/{k}": v for k, v in step.items()}
        return out

    def save(self) -> None:
        from envace.training.checkpoint import save_checkpoint

        self._gather()
        # Every process gathers (sharded optimizer states are collectives); the main one writes.
        optimizer_states = {k: o.state_dict() for k, o in self._optimizer_states().items()}
        if self.accelerator.is_main_process:
            save_checkpoint(self.dir, self.step, self._full_models(), optimizer_states, self.models.schedulers,
                            data_state={"stream": self.stream.state(), "world_executions": self.world_calls.as_dict()},
                            config=cfgmod.to_dict(self.cfg), keep_last=self.cfg.keep_last)
        self.accelerator.wait_for_everyone()

    def export(self) -> Path:
        """The final policy as a loadable model directory (`final/`), merged if LoRA."""
        out = self.dir / "final"
        model = self._full_models()["policy"]
        if hasattr(model, "merge_and_unload"):
            import copy

            model = copy.deepcopy(model).merge_and_unload()
        model.save_pretrained(out)
        self.tokenizer.save_pretrained(out)
        write_manifest(with_executions(self.manifest, self.cfg.init_from, self.cfg.tasks, self.world_calls), out)
        return out

    def chain_executions(self) -> WorldExecutions:
        """Every world execution behind the final model: the warm start's chain (its manifest),
        recording the task file (its export sidecar), and this run's."""
        return chain_executions(self.cfg.init_from, self.cfg.tasks, self.world_calls)

    def fit(self) -> dict[str, Any]:
        main = self.accelerator.is_main_process
        bar = tqdm(total=self.cfg.steps, initial=self.step, desc="train", disable=not (self.cfg.progress and main))
        last: dict[str, float] = {}
        while self.step < self.cfg.steps:
            last = self.train_step()
            bar.update(1)
            bar.set_postfix({k: round(last[k], 3) for k in ("success_rate", "reward/mean") if k in last})
        bar.close()
        self._gather()  # sharded: the export below writes the full copy, on the main process only
        result = {"run_dir": str(self.dir), "final_model": str(self.dir / "final"), "plots": [], "last_metrics": last,
                  "world_executions": self.world_calls.as_dict(), "chain_world_executions": self.chain_executions().as_dict()}
        if main:
            from envace.training.plots import plot_metrics

            self.export()
            self.logger.close()
            result["plots"] = [str(p) for p in plot_metrics(self.dir / "metrics.jsonl", self.dir / "plots")]
        self.accelerator.wait_for_everyone()
        return result


# One sampling stream per generator of a step (the policy per rollout mode, a separate rehearser,
# a frozen simulator), so that no two generators of one step share a seed.
SEED_STREAMS = ("policy-real", "policy-rehearse", "policy-simulator", "rehearser", "simulator")


def sampling_seed(seed: int, step: int, process: int, stream: str, round_index: int = 0) -> int:
    """The sampling seed of one generator at one step. It depends on (seed, step, process, stream,
    rollout round) only, so a resumed run samples what the uninterrupted run would; SeedSequence
    hashes them to 64 bits, so seeds stay distinct for any number of processes and steps (a linear
    formula collides once its strides overlap). A step's further rounds (--filter-groups) get seeds
    of their own, so a task drawn again in one does not repeat its rollouts; the first round's
    seeds are those of a run without further rounds."""
    entropy = [seed, step, process, SEED_STREAMS.index(stream)] + ([round_index] if round_index else [])
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0])


def reward_component_means(groups: list[list[Trajectory]]) -> dict[str, float]:
    """`reward/<name>`: the step's mean of each component of a weighted reward (none otherwise)."""
    trajs = [t for g in groups for t in g]
    names = sorted({name for t in trajs for name in t.reward_components})
    return {f"reward/{name}": sum(t.reward_components[name] for t in trajs) / len(trajs) for name in names}


def sampler_rates(metrics: dict[str, float]) -> dict[str, float]:
    """`metrics` with each sampler stream's rates for the step, from its counts over all processes
    (so a rate is the whole step's, not a mean of the processes' rates): generated tokens per
    second of the processes' mean rollout clock, the prefix-cache hit rate, and the rows per
    batched decode forward (few rows per forward is what slows a CPU rollout)."""
    out = dict(metrics)
    for key in metrics:
        parts = key.split("/")
        if parts[0] != "sampler" or parts[-1] != "generated_tokens":
            continue
        stream = "/".join(parts[1:-1])
        seconds = metrics.get(f"time/sampler/{stream}/seconds", 0.0)
        queries, hits = metrics.get(f"sampler/{stream}/prefix_cache_queries", 0.0), metrics.get(f"sampler/{stream}/prefix_cache_hits", 0.0)
        if seconds > 0:
            out[f"time/sampler/{stream}/generated_tokens_per_s"] = metrics[key] / seconds
        if queries:
            out[f"sampler/{stream}/prefix_cache_hit_rate"] = hits / queries
        if steps := metrics.get(f"sampler/{stream}/decode_steps", 0.0):
            out[f"sampler/{stream}/rows_per_decode_step"] = metrics.get(f"sampler/{stream}/decode_tokens", 0.0) / steps
    return out


def _clocked(count: str) -> bool:
    return count == "seconds" or count.endswith(("_seconds", "_per_s"))


def is_count(metric: str) -> bool:
    """Metrics that count this process's things (tokens trained, malformed outputs, its sampler's
    tokens, calls and pushes), summed over processes; `trained_tokens` and `env/*` are global
    already, and the rest (clock values among them) are means."""
    parts = metric.split("/")
    return (metric in ("malformed", "tool_exceptions", "fidelity/calls") or parts[0] == "sampler"
            or (len(parts) > 1 and parts[1] in ("tokens", "forwarded_tokens", "forwarded_tokens_unshared", "zero_advantage_rows")))


def merge_process_metrics(reported: list[dict[str, float]]) -> dict[str, float]:
    """One value per metric from each process's own: counts (`is_count`) summed, the rest
    averaged over the processes that report them. Processes may report different keys: one whose
    update had only padding (its rows all of advantage 0), no tokens of a role, or no tool calls
    has no mean of them, and is not counted as a 0 in it."""
    keys = sorted(set().union(*reported))
    merged = {}
    for k in keys:
        values = [float(m[k]) for m in reported if k in m]
        merged[k] = sum(values) if is_count(k) else sum(values) / len(values)
    return merged


def _token_key(metric: str) -> str:
    """The token count a per-token mean is weighted by: `tokens/act` for `clip_frac/act`."""
    role = metric.rsplit("/", 1)[1] if "/" in metric else ""
    return f"tokens/{role}" if role in ("act", "rehearse") else "tokens"


def run_train(cfg: TrainConfig) -> dict[str, Any]:
    result = Trainer(cfg).fit()
    print(json.dumps({k: result[k] for k in ("run_dir", "final_model", "world_executions", "chain_world_executions")}, indent=2))
    return result
