"""From trajectories + advantages to training rows, and the PPO-clipped loss over them.

The loss sees only rows of (input_ids, loss_mask, advantages, old_logprobs, roles); which
tokens train is decided once, in `build_rows`, from the variant's trained roles and the layout:

- "transcript": one row per trajectory; its REHEARSE tokens are trained in place.
- "isolated": the main row trains ACT; each rehearsed response is its own row
  (`Trajectory.side_rows`), trained there because that is the context it was sampled in.

Formulas and the variant table: docs/algorithms.md.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch
from torch.utils.checkpoint import checkpoint

from envace.algorithms.advantages import TrajectoryAdvantages, role_key
from envace.types import SAMPLED_ROLES, Role, Trajectory

Layout = Literal["transcript", "isolated"]

MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: keeps the ratio finite when a token's logprob collapses


@dataclass
class Row:
    """One training sequence. All lists are aligned with `input_ids`."""

    input_ids: list[int]
    roles: list[int]
    loss_mask: list[float]
    advantages: list[float]
    old_logprobs: list[float]  # sampling logprob of token t (given tokens < t); 0 where not sampled


@dataclass
class Batch:
    """Right-padded rows: every tensor is [B, T]."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    roles: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor

    def to(self, device: torch.device | str) -> Batch:
        return Batch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def _row(seq: Trajectory, advantages: list[float], trained: set[int]) -> Row:
    ids = seq.token_ids
    if len(advantages) != len(ids):
        raise ValueError(f"task {seq.task_id!r}: {len(advantages)} advantages for {len(ids)} tokens")
    roles = seq.roles
    mask = [1.0 if r in trained else 0.0 for r in roles]
    if mask and mask[0]:
        raise ValueError(f"task {seq.task_id!r}: a row cannot start with a trained token (nothing predicts it)")
    return Row(ids, roles, mask, advantages, seq.logprobs)


def _sequences(traj: Trajectory, adv: TrajectoryAdvantages, layout: Layout) -> list[tuple[Trajectory, list[float]]]:
    """The (sequence, token advantages) pairs a trajectory trains on, checked against the layout
    so no rehearsed response is silently dropped or trained twice."""
    if layout == "transcript":
        if traj.side_rows:
            raise ValueError(f"task {traj.task_id!r} has isolated side rows; use layout='isolated'")
        return [(traj, adv.tokens)]
    if layout == "isolated":
        if traj.num_tokens(Role.REHEARSE):
            raise ValueError(
                f"task {traj.task_id!r}: in the isolated layout the main transcript must carry rehearsed "
                "responses as ENV (they were sampled in the side rows); use layout='transcript'"
            )
        if any(side.num_tokens(Role.ACT) for side in traj.side_rows):
            raise ValueError(f"task {traj.task_id!r}: a side row holds ACT tokens; its context must be PROMPT")
        return [(traj, adv.tokens), *zip(traj.side_rows, adv.side_rows)]
    raise ValueError(f"unknown layout {layout!r}; expected 'transcript' or 'isolated'")


def build_rows(
    trajectories: list[Trajectory],
    advantages: list[TrajectoryAdvantages],
    trained_roles: tuple[Role, ...],
    layout: Layout = "transcript",
) -> list[Row]:
    """Training rows for the given roles; rows without a trained token are left out."""
    if len(trajectories) != len(advantages):
        raise ValueError(f"{len(trajectories)} trajectories but {len(advantages)} advantage entries")
    trained = {int(r) for r in trained_roles}
    rows = [
        _row(seq, advs, trained)
        for traj, adv in zip(trajectories, advantages)
        for seq, advs in _sequences(traj, adv, layout)
    ]
    return [r for r in rows if any(r.loss_mask)]


def collate(rows: list[Row], pad_id: int) -> Batch:
    """Right-pad rows into tensors; padding is PROMPT-role, untrained, attention 0."""
    if not rows:
        raise ValueError("no rows to collate")
    width = max(len(r.input_ids) for r in rows)

    def pad(values: list, fill: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([v + [fill] * (width - len(v)) for v in values], dtype=dtype)

    return Batch(
        input_ids=pad([r.input_ids for r in rows], pad_id, torch.long),
        attention_mask=pad([[1] * len(r.input_ids) for r in rows], 0, torch.long),
        roles=pad([r.roles for r in rows], int(Role.PROMPT), torch.long),
        loss_mask=pad([r.loss_mask for r in rows], 0.0, torch.float32),
        advantages=pad([r.advantages for r in rows], 0.0, torch.float32),
        old_logprobs=pad([r.old_logprobs for r in rows], 0.0, torch.float32),
    )


def _token_logprobs(
    head: torch.nn.Module, softcap: float | None, hidden: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden).float()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logp = torch.log_softmax(logits, dim=-1)
    with torch.no_grad():  # entropy is a metric, not part of the loss
        entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


def sequence_logprobs(model: torch.nn.Module, batch: Batch, chunk_size: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob and entropy of token t under the logits at t-1, both [B, T] (position 0 holds 0).

    The [B, T, vocab] logits are the memory peak of RL on long transcripts, so the LM head runs
    over `chunk_size` positions at a time, and under autograd each chunk is checkpointed: only
    one chunk's logits exist at once, forward or backward. The forward itself goes through
    `model` as given, so a DDP/DeepSpeed wrapper sees it and synchronises the gradients; it
    asks for the last position's logits only and the decoder's output is caught with a hook.
    Works for HF causal LMs and PEFT wrappers of them (`get_decoder()`, `get_output_embeddings()`).
    """
    from accelerate.utils import extract_model_from_parallel

    inner = extract_model_from_parallel(model)
    caught: list[torch.Tensor] = []
    hook = inner.get_decoder().register_forward_hook(lambda _m, _args, out: caught.append(out[0] if isinstance(out, tuple) else out.last_hidden_state))
    try:
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=1, use_cache=False)
    finally:
        hook.remove()
    head = inner.get_output_embeddings()
    softcap = getattr(inner.config, "final_logit_softcapping", None)  # Gemma-style models
    hidden, targets = caught[0][:, :-1], batch.input_ids[:, 1:]
    logps, entropies = [], []
    for start in range(0, hidden.shape[1], chunk_size):
        args = (head, softcap, hidden[:, start : start + chunk_size], targets[:, start : start + chunk_size])
        lp, ent = checkpoint(_token_logprobs, *args, use_reentrant=False) if torch.is_grad_enabled() else _token_logprobs(*args)
        logps.append(lp)
        entropies.append(ent)
    first = torch.zeros(hidden.shape[0], 1, device=hidden.device)
    return torch.cat([first, *logps], dim=1), torch.cat([first, *entropies], dim=1)


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Low-variance KL estimator: for samples x ~ q and log_ratio = log p(x) - log q(x),
    E[exp(lr) - 1 - lr] = KL(q || p), and every term is >= 0."""
    return torch.expm1(log_ratio) - log_ratio


def ppo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate loss (to minimise) and where clipping zeroed the gradient."""
    ratio = torch.exp((logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = clipped < unclipped
    if dual_clip is not None:
        # With A < 0 the PPO loss -ratio*A grows without bound in the ratio; cap it at -c*A.
        cap = -dual_clip * advantages
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        was_clipped = was_clipped | dual
    return loss, was_clipped


def ppo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_eps: float = 0.2,
    dual_clip: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    roles: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean PPO loss over every trained token of the batch, whatever its role.

    `num_tokens` overrides the denominator so that micro-batches accumulated into one step
    together give the token mean over the whole step (pass the step's trained-token count).
    `ref_logprobs` adds kl_coef * k3 per token, an estimate of KL(policy || reference); it is
    also reported when kl_coef is 0. `roles`/`entropy` only feed the metrics (per-role keys like `clip_frac/act`).
    """
    if not logprobs.shape == old_logprobs.shape == advantages.shape == loss_mask.shape:
        raise ValueError("logprobs, old_logprobs, advantages and loss_mask must all be [B, T]")  # no silent broadcast
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if kl_coef and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs from the frozen reference model")
    mask = loss_mask > 0
    denom = num_tokens if num_tokens is not None else mask.sum().clamp(min=1)
    pg, was_clipped = ppo_token_loss(logprobs, old_logprobs, advantages, clip_eps, dual_clip)
    per_token = {"pg_loss": pg}
    if ref_logprobs is not None:
        per_token["ref_kl"] = _k3(ref_logprobs - logprobs)
        pg = pg + kl_coef * per_token["ref_kl"]
    # torch.where, not multiplication: a masked-out token's inf/nan must not reach the sum.
    loss = torch.where(mask, pg, 0.0).sum() / denom
    with torch.no_grad():
        per_token |= {"adv": advantages, "clip_frac": was_clipped.float(), "approx_kl": _k3(logprobs - old_logprobs)}
        if entropy is not None:
            per_token["entropy"] = entropy
        metrics = _masked_means(per_token, mask, roles)
    return loss, {"loss": loss.item(), **metrics}


def _masked_means(values: dict[str, torch.Tensor], mask: torch.Tensor, roles: torch.Tensor | None) -> dict[str, float]:
    """Means over trained tokens, overall (`name`) and per sampled role (`name/act`), plus
    token counts (`tokens`, `tokens/act`) so callers can weight micro-batches. One host sync."""
    scopes = {"": mask}
    if roles is not None:
        scopes |= {f"/{role_key(r)}": mask & (roles == int(r)) for r in SAMPLED_ROLES}
    entries: list[tuple[str, str, torch.Tensor]] = []  # (scope, key, value)
    for suffix, sel in scopes.items():
        count = sel.sum()
        entries.append((suffix, f"tokens{suffix}", count.float()))
        entries += [(suffix, name + suffix, torch.where(sel, v.float(), 0.0).sum() / count.clamp(min=1)) for name, v in values.items()]
    flat = torch.stack([value for _, _, value in entries]).tolist()
    counts = {suffix: v for (suffix, key, _), v in zip(entries, flat) if key.startswith("tokens")}
    # A role with no trained tokens in this batch reports only its zero count, not fake means.
    return {key: v for (suffix, key, _), v in zip(entries, flat) if key.startswith("tokens") or counts[suffix] > 0}
