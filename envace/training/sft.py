"""`envace sft`: warm start on reference trajectories.

The task's reference is replayed through the rollout engine (a scripted policy emits the
expert's messages), so the data has exactly the token layout the policy sees later. The tool
responses come from the task's recorded `reference` (mode "recorded": no world runs) or, for a
world task without one, from executing the reference calls in its world (real mode, then the
replay reward keeps only the trajectories that verify). ACT tokens learn the calls and the
answer; the tool responses (forced ENV tokens) train the REHEARSE role: the model learns to
predict what the world returns. Both sources give the same tokens for the same responses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm.auto import tqdm

from envace import config as cfgmod
from envace.accounting import WorldExecutions
from envace.algorithms.losses import Row, sequence_logprobs
from envace.backends.scripted import ScriptedGenerator, sequence_reply
from envace.config import ConfigError, field
from envace.manifest import build_manifest, with_executions, write_manifest
from envace.references import expert_replies
from envace.rewards import Context, compute_rewards
from envace.rollout import RolloutConfig, RolloutEngine
from envace.training.setup import (TrainingOptions, backward_micro_batches, check_resume, check_sharding, load_trainable, make_accelerator,
                                   global_sum, prepare_trainable, seed_everything, shared_run_dir)
from envace.training.sharding import checkpointed_optimizer, clip_and_step
from envace.transcript import compact_json
from envace.types import CallStatus, EndReason, Role, Task, Trajectory

TRAIN_ROLES = {"act": (Role.ACT,), "act+env": (Role.ACT, Role.ENV)}


@dataclass
class SFTConfig(TrainingOptions):
    lr: float = field(5e-5, help="AdamW learning rate")
    tasks: str | None = field(None, help="JSONL tasks with reference_calls (default: built-in train split)")
    worlds: list[str] = field([], help="built-in worlds (default: all training worlds)")
    n_per_world: int = field(32, help="built-in tasks per world")
    difficulty: int | None = field(None, help="built-in difficulty 1-3 (None = mixed)")
    epochs: int = field(2, help="passes over the data")
    rows_per_step: int = field(8, help="trajectories per optimizer step")
    train_roles: Literal["act", "act+env"] = field("act+env", help="act+env also trains REHEARSE on the real tool responses")
    max_total_tokens: int = field(2048, help="drop reference trajectories longer than this")

    def validate(self) -> None:
        self.validate_training()
        if self.tasks and not Path(self.tasks).is_file():
            raise ConfigError(f"task file {self.tasks} does not exist")
        for name in ("epochs", "rows_per_step", "n_per_world", "max_total_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.difficulty not in (None, 1, 2, 3):
            raise ConfigError(f"difficulty must be 1, 2 or 3 (or null for mixed), got {self.difficulty}")


def reference_replies(task: Task) -> list[str]:
    """What an expert writes on each ACT turn: the recorded reference's messages, else one
    reference call per turn, then the answer."""
    if task.reference:
        return expert_replies(task.reference)
    if not task.reference_calls:
        raise ValueError(f"task {task.id} has no reference or reference_calls; SFT needs one")
    calls = [f"<tool_call>{compact_json({'name': c['name'], 'arguments': c.get('arguments', {})})}</tool_call>" for c in task.reference_calls]
    return calls + [str(task.metadata.get("reference_answer", "Done."))]


def reference_trajectory(task: Task, tokenizer: Any, env: Any, max_total_tokens: int) -> tuple[Trajectory, bool]:
    """(the task's reference replayed through the engine, whether it is good training data): a
    recorded reference must replay to its answer with every call answered from the record; an
    executed one must verify (replay reward 1.0)."""
    replies = reference_replies(task)
    mode = "recorded" if task.reference else "real"
    config = RolloutConfig(mode=mode, max_turns=len(replies), max_turn_tokens=max_total_tokens, max_total_tokens=max_total_tokens)
    [[traj]] = RolloutEngine(ScriptedGenerator(tokenizer, sequence_reply(replies)), env, config).run([task], progress=False)
    if mode == "recorded":
        return traj, traj.end_reason == EndReason.ANSWERED and all(c.status == CallStatus.REFERENCE for c in traj.tool_calls)
    compute_rewards("replay", [[traj]], [task], Context(env=env))
    return traj, traj.reward == 1.0


def reference_trajectories(tasks: list[Task], tokenizer: Any, env: Any, max_total_tokens: int) -> tuple[list[Trajectory], int, WorldExecutions]:
    """Every task's reference trajectory that is good training data, the number dropped, and the
    world executions it took (all of them: dropped trajectories' and verification replays too)."""
    kept, dropped, executions = [], 0, WorldExecutions()
    for task in tasks:
        traj, good = reference_trajectory(task, tokenizer, env, max_total_tokens)
        used = WorldExecutions.of([traj])
        executions.sft_data += used.total
        if good:
            kept.append(traj)
        else:
            dropped += 1
    return kept, dropped, executions


def sft_rows(trajectories: list[Trajectory], roles: tuple[Role, ...]) -> list[Row]:
    trained = {int(r) for r in roles}
    rows = []
    for t in trajectories:
        ids, tags = t.token_ids, t.roles
        zeros = [0.0] * len(ids)
        rows.append(Row(ids, tags, [1.0 if r in trained else 0.0 for r in tags], zeros, zeros))
    return rows


def nll_step(model: Any, rows: list[Row], pad_id: int, max_tokens: int, accelerator: Any, weight: float = 1.0) -> float:
    """Accumulate the gradient of `weight` times the token-mean negative log-likelihood over
    `rows` (this process's share of the step's rows) into the model's; returns the token-mean
    NLL over every process's rows (unweighted)."""
    local = float(sum(sum(r.loss_mask) for r in rows))
    # DDP averages gradients over processes: normalise by the mean token count per process.
    total = global_sum(accelerator, local)

    def loss_fn(batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        logprobs, _ = sequence_logprobs(model, batch, trained_only=True)
        nll = -(logprobs * batch.loss_mask).sum() / (total / accelerator.num_processes)
        return weight * nll, {"loss": nll.item() / accelerator.num_processes}

    loss_sum = sum(m["loss"] for m in backward_micro_batches(accelerator, model, rows, max_tokens, pad_id, loss_fn))
    return global_sum(accelerator, loss_sum)


def run_sft(cfg: SFTConfig) -> dict[str, Any]:
    from envace.envs.environment import WorldEnvironment
    from envace.envs.tasks import builtin_tasks, load_tasks
    from envace.training.checkpoint import load_checkpoint, save_checkpoint
    from envace.training.logging import MetricsLogger
    from envace.training.plots import plot_metrics

    tasks = load_tasks(cfg.tasks) if cfg.tasks else builtin_tasks("train", cfg.n_per_world, worlds=cfg.worlds or None, difficulty=cfg.difficulty, seed=cfg.seed)
    accelerator = make_accelerator(cfg.precision)
    check_sharding(accelerator, cfg.sharding)
    main = accelerator.is_main_process
    out = shared_run_dir(accelerator, cfg.output_dir, "sft")
    resume_from = check_resume(out, cfg, cfg.resume)
    seed_everything(cfg.seed)
    model, tokenizer = load_trainable(cfg.model, cfg.lora_r, cfg.lora_alpha, accelerator.device, tiny=cfg.tiny,
                                      activation_checkpointing=cfg.activation_checkpointing)
    data, dropped, executions = reference_trajectories(tasks, tokenizer, WorldEnvironment(), cfg.max_total_tokens)
    if not data:
        raise ConfigError("no reference trajectory verified: the tasks' reference_calls do not solve them")
    rows = sft_rows(data, TRAIN_ROLES[cfg.train_roles])
    steps_per_epoch = -(-len(rows) // cfg.rows_per_step)
    total_steps = steps_per_epoch * cfg.epochs
    model, optimizer, scheduler, copy = prepare_trainable(accelerator, model, cfg, total_steps)
    # The whole weights, as checkpoints save them: the model (DDP unwrapped) or, sharded, its full copy.
    full = copy.module if copy is not None else accelerator.unwrap_model(model)
    step = 0
    if resume_from is not None:
        step = load_checkpoint(resume_from, {"policy": full}, {"policy": checkpointed_optimizer(model, optimizer)}, {"policy": scheduler}).step
        if copy is not None:
            copy.load_into(model)
    manifest = with_executions(build_manifest(tasks, None, sft_dropped=dropped), None, cfg.tasks, executions)
    logger = None
    if main:
        cfgmod.save(cfg, out / "config.yaml")
        write_manifest(manifest, out)
        logger = MetricsLogger(out, use_tensorboard=cfg.tensorboard, use_wandb=cfg.wandb, wandb_project=cfg.wandb_project, resume_step=step if resume_from else None, config=cfgmod.to_dict(cfg))
    bar = tqdm(total=total_steps, initial=step, desc="sft", disable=not (cfg.progress and main))
    model.train()
    while step < total_steps:
        epoch, index = divmod(step, steps_per_epoch)
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)).tolist()
        chunk = [rows[i] for i in order[index * cfg.rows_per_step : (index + 1) * cfg.rows_per_step]]
        optimizer.zero_grad(set_to_none=True)
        # Every process draws the same rows and trains on its own share of them.
        share = chunk[accelerator.process_index :: accelerator.num_processes]
        loss = nll_step(model, share, tokenizer.pad_token_id, cfg.micro_batch_tokens, accelerator)
        grad_norm = clip_and_step(model, optimizer, cfg.grad_clip)
        scheduler.step()
        step += 1
        if logger is not None:
            logger.log(step, {"sft/loss": loss, "sft/grad_norm": float(grad_norm), "lr": scheduler.get_last_lr()[0], "epoch": epoch})
        bar.update(1)
        bar.set_postfix(loss=round(loss, 4))
        if step % cfg.save_every == 0 or step == total_steps:
            # Every process gathers (sharded weights and optimizer state); the main one writes.
            if copy is not None:
                copy.refresh(model, step)
            optimizer_state = checkpointed_optimizer(model, optimizer).state_dict()
            if main:
                save_checkpoint(out, step, {"policy": full}, {"policy": optimizer_state}, {"policy": scheduler}, data_state={"epoch": epoch}, config=cfgmod.to_dict(cfg), keep_last=cfg.keep_last)
            accelerator.wait_for_everyone()
    bar.close()
    final = out / "final"
    # Every world execution that made the data, as the RL variants count theirs (0 when every
    # task carries a recorded reference, apart from what recording the task file took).
    result = {"run_dir": str(out), "final_model": str(final), "examples": len(rows), "dropped": dropped, "steps": total_steps,
              "world_executions": manifest["world_executions"]}
    if main:
        logger.close()
        # The last step saved a checkpoint, so a sharded run's full copy holds the final weights.
        export = full.merge_and_unload() if hasattr(full, "merge_and_unload") else full
        export.save_pretrained(final)
        tokenizer.save_pretrained(final)
        write_manifest(manifest, final)
        plot_metrics(out / "metrics.jsonl", out / "plots")
        print(json.dumps(result, indent=2))
    accelerator.wait_for_everyone()
    return result
