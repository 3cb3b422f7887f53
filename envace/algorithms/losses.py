"""From trajectories + advantages to training rows, and the PPO-clipped loss over them.

The loss sees only rows of (input_ids, loss_mask, advantages, old_logprobs, roles); which
tokens train is decided once, in `build_rows`, from the variant's trained roles and the layout:

- "transcript": one row per trajectory; its REHEARSE tokens are trained in place.
- "isolated": the main row trains ACT; each rehearsed response is its own row
  (`Trajectory.side_rows`), trained there because that is the context it was sampled in.

Shared-prefix training (`pack_shared_prefixes`, `PackedRows`): the K rows of a task group share
their prompt; packed into one sequence [prefix | cont_1 | ... | cont_K] the prefix is forwarded
once, and `sequence_logprobs` still returns every original row's logprobs in the [B, T] layout;
its attention (`prefix_grouped_attention`) computes the prefix's once and each continuation's
over [prefix | itself] only.

Formulas and the variant table: docs/algorithms.md.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Iterator, Literal, Sequence

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
    # The sampler's logprob of token t (given tokens < t), 0 where not sampled. The update compares
    # them with its own (`logprob_mismatch`) and, where the sampler's numerics are not the
    # update's, weights each token's loss by them (truncated importance sampling); the PPO ratio's
    # old policy is the update's own forward (`ppo_loss`).
    sampler_logprobs: list[float]
    # Rows with the same (non-None) value may be forwarded together sharing their common token
    # prefix (`pack_shared_prefixes`); `build_rows` sets it to the task group's index.
    prefix_group: int | None = None


@dataclass
class PackedRows:
    """Rows that share their first `prefix_len` tokens, forwarded as ONE sequence

        [prefix | cont_1 | ... | cont_K]        cont_k = rows[k].input_ids[prefix_len:]

    Each continuation attends to the prefix and causally to itself, never to another
    continuation, and its positions continue from `prefix_len`, so every token sees exactly the
    context it has in its own row. The prefix holds no trained token (loss_mask 0) and every
    continuation holds at least one token."""

    rows: list[Row]
    prefix_len: int

    def __post_init__(self) -> None:
        p = self.prefix_len
        if not self.rows or p < 0:
            raise ValueError("PackedRows needs at least one row and a prefix_len >= 0")
        head = self.rows[0].input_ids[:p]
        for row in self.rows:
            if len(row.input_ids) <= p or row.input_ids[:p] != head:
                raise ValueError(f"every row must start with the {p}-token prefix and continue past it")
            if any(row.loss_mask[:p]):
                raise ValueError("the shared prefix must hold no trained token (loss_mask 0)")

    @property
    def length(self) -> int:
        """Tokens forwarded for the pack: the prefix once plus every continuation."""
        return self.prefix_len + sum(len(r.input_ids) - self.prefix_len for r in self.rows)

    def split(self, max_tokens: int) -> list[Row | PackedRows]:
        """Sub-packs of consecutive continuations, each with the prefix and within `max_tokens`
        where one continuation allows it (a continuation that alone exceeds it gets a sub-pack of
        its own); a sub-pack of one row is that plain row. Whole when it fits already."""
        if self.length <= max_tokens:
            return [self]
        parts: list[list[Row]] = [[]]
        for row in self.rows:
            used = self.prefix_len + sum(len(r.input_ids) - self.prefix_len for r in parts[-1])
            if parts[-1] and used + len(row.input_ids) - self.prefix_len > max_tokens:
                parts.append([])
            parts[-1].append(row)
        return [PackedRows(part, self.prefix_len) if len(part) > 1 else part[0] for part in parts]


Unit = Row | PackedRows  # what a micro-batch holds: a plain row or a packed group


def unit_rows(units: Sequence[Unit]) -> list[Row]:
    """The original rows of `units`, in the order `collate` lays them out ([B, T] row b)."""
    return [r for u in units for r in (u.rows if isinstance(u, PackedRows) else [u])]


def unit_length(unit: Unit) -> int:
    """Tokens one unit forwards (a packed group counts by its packed length)."""
    return unit.length if isinstance(unit, PackedRows) else len(unit.input_ids)


def forwarded_tokens(units: Sequence[Unit]) -> int:
    """Real (non-pad) tokens the forward of `units` processes: sum of row lengths for plain rows,
    prefix once + continuations for packed groups. Compare `forwarded_tokens(rows)` with
    `forwarded_tokens(pack_shared_prefixes(rows))` for the saving."""
    return sum(unit_length(u) for u in units)


def shared_prefix_len(rows: Sequence[Row]) -> int:
    """Longest common prefix of the rows' input_ids, cut before the first trained token of any
    row and so that every row keeps at least one token after it."""
    if not rows:
        return 0
    limit = min(len(r.input_ids) - 1 for r in rows)
    for r in rows:
        limit = min(limit, next((i for i, m in enumerate(r.loss_mask) if m), len(r.loss_mask)))
    first = rows[0].input_ids
    n = 0
    while n < limit and all(r.input_ids[n] == first[n] for r in rows[1:]):
        n += 1
    return n


def pack_shared_prefixes(rows: Sequence[Unit], min_prefix: int = 2) -> list[Unit]:
    """Pack the rows of each `prefix_group` into one `PackedRows` over their `shared_prefix_len`.

    A group of one row, a shared prefix shorter than `min_prefix`, and rows whose prefix_group
    is None (SFT rows, isolated side rows) stay plain rows; units that are already packed pass
    through. A pack takes the place of its group's first row; the order is otherwise kept.
    Packing changes no logprob or gradient (up to float rounding), only what is forwarded."""
    groups: dict[int, list[Row]] = {}
    for u in rows:
        if isinstance(u, Row) and u.prefix_group is not None:
            groups.setdefault(u.prefix_group, []).append(u)
    packs = {key: PackedRows(members, p) for key, members in groups.items()
             if len(members) > 1 and (p := shared_prefix_len(members)) >= min_prefix}
    packed = set(packs)
    out: list[Unit] = []
    for u in rows:
        key = u.prefix_group if isinstance(u, Row) else None
        if key not in packed:
            out.append(u)
        elif key in packs:  # the group's first row: the pack takes its place, the others are in it
            out.append(packs.pop(key))
    return out


@dataclass(frozen=True)
class PackedLayout:
    """Where the pieces of each packed row lie, as python ints (the attention reads it with no
    host sync): row j is [prefix (rows[j][0] tokens) | continuation 1 | ... | continuation K]
    with continuation lengths rows[j][1], then padding up to `width`. A plain row is a pack of
    one continuation and no prefix. `prefix_grouped_attention` reads it. (A dataclass, not a
    tuple: DDP's scatter of the forward's inputs passes it through as it is.)"""

    width: int
    rows: tuple[tuple[int, tuple[int, ...]], ...]  # per packed row: (prefix length, continuation lengths)

    @property
    def tokens(self) -> int:
        """Real (non-pad) tokens of the packed rows."""
        return sum(p + sum(conts) for p, conts in self.rows)

    @property
    def longest_row(self) -> int:
        """The longest original row: the context length a token may see."""
        return max(p + max(conts) for p, conts in self.rows)


@dataclass
class PackedInputs:
    """The forward side of a batch holding packed groups (`collate` of `PackedRows`).

    P packed rows of width L; N (predictor, target) pairs: token t of original row b is
    predicted by the hidden state at flat index `pair_positions[token_pairs[b, t]]` of the
    [P * L] packed hidden states (the position of token t-1; for a continuation's first token,
    the prefix's last position), and pairs for prefix tokens are shared by the rows of a pack."""

    input_ids: torch.Tensor  # [P, L]
    position_ids: torch.Tensor  # [P, L]: prefix 0..p-1, each continuation p, p+1, ...; padding 0
    layout: PackedLayout  # prefix and continuation lengths of each packed row
    pair_positions: torch.Tensor  # [N]: flat index into [P * L] of the predicting hidden state
    pair_targets: torch.Tensor  # [N]: the token it predicts
    token_pairs: torch.Tensor  # [B, T]: the pair giving token (b, t), -1 where none (t = 0, padding)

    def to(self, device: torch.device | str) -> PackedInputs:
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self) if f.name != "layout"})


@dataclass
class Batch:
    """Right-padded rows: every tensor is [B, T], one row per original `Row` (packed or not).
    `packed` is set when the batch holds packed groups: the model then forwards it instead of
    `input_ids`, and `sequence_logprobs` maps the result back to [B, T]."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    roles: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    sampler_logprobs: torch.Tensor
    packed: PackedInputs | None = None

    def to(self, device: torch.device | str) -> Batch:
        return Batch(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device) for f in fields(self)})

    @property
    def forwarded_tokens(self) -> int:
        """Real (non-pad) tokens the forward processes."""
        return self.packed.layout.tokens if self.packed is not None else int(self.attention_mask.sum())


def _row(seq: Trajectory, advantages: list[float], trained: set[int], prefix_group: int | None = None) -> Row:
    ids = seq.token_ids
    if len(advantages) != len(ids):
        raise ValueError(f"task {seq.task_id!r}: {len(advantages)} advantages for {len(ids)} tokens")
    roles = seq.roles
    mask = [1.0 if r in trained else 0.0 for r in roles]
    if mask and mask[0]:
        raise ValueError(f"task {seq.task_id!r}: a row cannot start with a trained token (nothing predicts it)")
    return Row(ids, roles, mask, advantages, seq.logprobs, prefix_group=prefix_group)


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
    group_sizes: list[int] | None = None,
) -> list[Row]:
    """Training rows for the given roles; rows without a trained token are left out.

    Each main row's `prefix_group` is the index of its task group, for `pack_shared_prefixes`:
    the groups are `group_sizes` consecutive trajectories each (the trainer's
    `[len(g) for g in groups]`), or, when None, each run of consecutive trajectories with the
    same `task_id`. Side rows (isolated layout) get None and stay unpacked."""
    if len(trajectories) != len(advantages):
        raise ValueError(f"{len(trajectories)} trajectories but {len(advantages)} advantage entries")
    if group_sizes is None:
        group_of = [0] * len(trajectories)
        for i in range(1, len(trajectories)):
            group_of[i] = group_of[i - 1] + (trajectories[i].task_id != trajectories[i - 1].task_id)
    else:
        if sum(group_sizes) != len(trajectories) or any(n < 0 for n in group_sizes):
            raise ValueError(f"group_sizes {group_sizes} do not split {len(trajectories)} trajectories into groups")
        group_of = [g for g, n in enumerate(group_sizes) for _ in range(n)]
    trained = {int(r) for r in trained_roles}
    rows = [
        _row(seq, advs, trained, group if seq is traj else None)
        for traj, adv, group in zip(trajectories, advantages, group_of)
        for seq, advs in _sequences(traj, adv, layout)
    ]
    return [r for r in rows if any(r.loss_mask)]


def rows_with_signal(rows: Sequence[Row]) -> list[Row]:
    """The rows whose PPO loss can move the weights: some trained token has a non-zero advantage.
    The clipped surrogate is ratio * A, so a row with A = 0 on every trained token adds exactly 0
    to the loss and to its gradient (it still counts in a token mean's denominator). GRPO makes
    many: a group whose rollouts all scored alike has A = 0 throughout (DAPO's "zero-variance"
    groups, which it drops from the batch for the same reason)."""
    return [r for r in rows if any(m and a for a, m in zip(r.advantages, r.loss_mask))]


def collate(rows: Sequence[Unit], pad_id: int) -> Batch:
    """Right-pad rows into [B, T] tensors; padding is PROMPT-role, untrained, attention 0.

    `rows` may hold `PackedRows` (see `pack_shared_prefixes`): their rows take their places in
    [B, T] (`unit_rows`), and the batch gets `packed` inputs for the forward, in which a plain
    row is a pack of one continuation and no prefix."""
    if not rows:
        raise ValueError("no rows to collate")
    flat = unit_rows(rows)
    width = max(len(r.input_ids) for r in flat)

    def pad(values: list, fill: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([v + [fill] * (width - len(v)) for v in values], dtype=dtype)

    return Batch(
        input_ids=pad([r.input_ids for r in flat], pad_id, torch.long),
        attention_mask=pad([[1] * len(r.input_ids) for r in flat], 0, torch.long),
        roles=pad([r.roles for r in flat], int(Role.PROMPT), torch.long),
        loss_mask=pad([r.loss_mask for r in flat], 0.0, torch.float32),
        advantages=pad([r.advantages for r in flat], 0.0, torch.float32),
        sampler_logprobs=pad([r.sampler_logprobs for r in flat], 0.0, torch.float32),
        packed=_packed_inputs(rows, pad_id, width) if any(isinstance(u, PackedRows) for u in rows) else None,
    )


def _packed_inputs(units: Sequence[Unit], pad_id: int, width: int) -> PackedInputs:
    packs = [u if isinstance(u, PackedRows) else PackedRows([u], 0) for u in units]
    length = max(p.length for p in packs)
    ids, positions, token_pairs = [], [], []
    pair_positions: list[int] = []
    pair_targets: list[int] = []
    for j, pack in enumerate(packs):
        p, base, head = pack.prefix_len, j * length, pack.rows[0].input_ids
        seq, pos = head[:p], list(range(p))
        shared = []  # the pair of prefix token t (t = 1..p-1), shared by the pack's rows
        for t in range(1, p):
            shared.append(len(pair_positions))
            pair_positions.append(base + t - 1)
            pair_targets.append(head[t])
        for row in pack.rows:
            n, offset = len(row.input_ids), len(seq)
            seq, pos = seq + row.input_ids[p:], pos + list(range(p, n))
            pairs = [-1] * width
            for t in range(1, n):
                if t < p:
                    pairs[t] = shared[t - 1]
                    continue
                pairs[t] = len(pair_positions)
                pair_positions.append(base + (p - 1 if t == p else offset + t - 1 - p))
                pair_targets.append(row.input_ids[t])
            token_pairs.append(pairs)
        fill = length - len(seq)
        ids.append(seq + [pad_id] * fill)
        positions.append(pos + [0] * fill)
    layout = PackedLayout(length, tuple((pk.prefix_len, tuple(len(r.input_ids) - pk.prefix_len for r in pk.rows)) for pk in packs))
    as_long = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    return PackedInputs(as_long(ids), as_long(positions), layout, as_long(pair_positions), as_long(pair_targets), as_long(token_pairs))


PREFIX_GROUPED_ATTENTION = "envace_prefix_grouped"  # its name in transformers' AttentionInterface


def prefix_grouped_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_layout: PackedLayout | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over packed rows (Prefix Grouper), as a transformers attention function: query,
    key and value are [P, heads, L, head_dim] and the output is [P, L, heads, head_dim].

    Per packed row (`packed_layout`, passed through the model call as a keyword argument), one
    `scaled_dot_product_attention` for the prefix, causal over the prefix, and one per
    continuation over [prefix keys | its own keys] with the [n, p + n] mask "key j <= p + i", so
    each continuation sees the prefix and causally itself, and only those scores are computed
    (not the (packed length)^2 of a dense mask). Every continuation's gradient reaches the
    prefix's keys and values. Padding positions output 0. The layout replaces the mask: the model
    gets none (transformers builds none for an attention name it has no mask function for)."""
    if packed_layout is None:
        raise ValueError(f"the {PREFIX_GROUPED_ATTENTION!r} attention needs packed_layout= in the model call (sequence_logprobs passes it)")
    if attention_mask is not None:
        raise ValueError(f"the {PREFIX_GROUPED_ATTENTION!r} attention takes its layout from packed_layout, not from an attention mask")
    if kwargs.get("softcap") is not None:
        raise ValueError("shared-prefix packing does not support attention logit softcapping; forward without packing (share_prefix=False)")
    window = kwargs.get("sliding_window")
    if window is not None and packed_layout.longest_row > window:
        raise ValueError(f"shared-prefix packing does not support a sliding window ({window}) shorter than a row "
                         f"({packed_layout.longest_row} tokens); forward without packing (share_prefix=False)")
    rows, width = packed_layout.rows, packed_layout.width
    if query.shape[0] != len(rows) or query.shape[2] != width or key.shape[2] != width:
        raise ValueError(f"packed_layout is for {len(rows)} rows of {width} tokens, the attention got query {tuple(query.shape)}, key {tuple(key.shape)}")
    if query.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        # Under CPU bf16 autocast SDPA would take bf16 inputs, and its bf16 backward is no faster
        # than its fp32 one at the update's shapes, slower for short continuations over a prefix
        # (`benchmarks/attention_shapes.py --dtype bf16`): in fp32 the demo step's profiled update
        # spent 1.00-1.14 s in attention against 1.23-1.40 (update_profile.py, docs/performance.md).
        with torch.autocast("cpu", enabled=False):
            return _prefix_grouped_sdpa(module, query.float(), key.float(), value.float(), dropout, scaling, packed_layout)
    return _prefix_grouped_sdpa(module, query, key, value, dropout, scaling, packed_layout)


def _prefix_grouped_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         dropout: float, scaling: float | None, packed_layout: PackedLayout) -> tuple[torch.Tensor, None]:
    rows, width = packed_layout.rows, packed_layout.width
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:  # GQA: repeat the key/value heads once per layer (masked sdpa on CPU is no faster with enable_gqa)
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    outputs = []
    for j, (p, conts) in enumerate(rows):
        q, k, v = query[j : j + 1], key[j : j + 1], value[j : j + 1]
        pieces = [sdpa(q[:, :, :p], k[:, :, :p], v[:, :, :p], dropout_p=dropout, scale=scaling, is_causal=True)] if p else []
        start = p
        for n in conts:
            end = start + n
            if p:
                mask = torch.ones(n, p + n, dtype=torch.bool, device=query.device).tril(p)  # query i sees prefix and own keys <= i
                keys, values = torch.cat([k[:, :, :p], k[:, :, start:end]], dim=2), torch.cat([v[:, :, :p], v[:, :, start:end]], dim=2)
                pieces.append(sdpa(q[:, :, start:end], keys, values, attn_mask=mask, dropout_p=dropout, scale=scaling))
            else:  # a plain row: causal over itself
                pieces.append(sdpa(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], dropout_p=dropout, scale=scaling, is_causal=True))
            start = end
        if start < width:
            pieces.append(pieces[-1].new_zeros(1, q.shape[1], width - start, value.shape[-1]))
        outputs.append(torch.cat(pieces, dim=2))
    return torch.cat(outputs).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """`model` (an HF model or a PEFT wrapper of one) with `name` as its attention implementation
    for the duration (`set_attn_implementation`), then its own again."""
    previous = model.config._attn_implementation
    if previous == name:
        yield
        return
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:  # transformers only warns for models that do not dispatch through AttentionInterface
        raise ValueError(f"{type(model).__name__} does not take its attention from transformers' AttentionInterface, which shared-prefix "
                         "packing needs; forward without packing (share_prefix=False)")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@contextlib.contextmanager
def _prefix_grouped(model: torch.nn.Module) -> Iterator[None]:
    """The packed forward's attention: `prefix_grouped_attention` for the duration, in the forward
    and in the backward's recomputation of layers under activation checkpointing (each such
    layer's checkpoint function runs its layer under it too, then is restored)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PREFIX_GROUPED_ATTENTION, prefix_grouped_attention)

    def grouped(fn: Callable) -> Callable:
        def run(*args, **kwargs):
            with _attention_implementation(model, PREFIX_GROUPED_ATTENTION):
                return fn(*args, **kwargs)
        return run

    def checkpointing(checkpoint_fn: Callable) -> Callable:  # the checkpoint stores grouped(fn) to recompute
        return lambda fn, *args, **kwargs: checkpoint_fn(grouped(fn), *args, **kwargs)

    # transformers sets `_gradient_checkpointing_func` on every module it checkpoints with (activation_checkpointing_enable)
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) and "_gradient_checkpointing_func" in vars(m)]
    originals = [m._gradient_checkpointing_func for m in layers]
    for layer, checkpoint_fn in zip(layers, originals):
        layer._gradient_checkpointing_func = checkpointing(checkpoint_fn)
    try:
        with _attention_implementation(model, PREFIX_GROUPED_ATTENTION):
            yield
    finally:
        for layer, checkpoint_fn in zip(layers, originals):
            layer._gradient_checkpointing_func = checkpoint_fn


class _SelectedLogprob(torch.autograd.Function):
    """(log softmax(logits)[target], entropy of softmax(logits)) per row, in as few passes over the
    [N, vocab] logits as they need: one log-softmax, one softmax (kept for the backward) and one dot
    product for the entropy, which is a metric (not differentiated). The backward writes
    g * (onehot(target) - softmax) in place of the kept softmax, where autograd's log_softmax +
    gather would allocate and zero-fill another [N, vocab] tensor and read it twice."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.log_softmax(logits, dim=-1)
        probs = logp.exp()
        entropy = -torch.bmm(probs.unsqueeze(1), logp.unsqueeze(2)).view(-1)  # one read of each, no [N, vocab] product
        ctx.save_for_backward(probs, targets)
        ctx.mark_non_differentiable(entropy)
        return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: torch.Tensor) -> tuple[torch.Tensor, None]:
        probs, targets = ctx.saved_tensors
        out = probs.mul_(-grad.unsqueeze(-1))  # the kept softmax is not needed again: reuse its memory
        return out.scatter_add_(-1, targets.unsqueeze(-1), grad.unsqueeze(-1)), None


def _token_logprobs(
    head: torch.nn.Module, softcap: float | None, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden).float()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    if temperature != 1.0:
        logits = logits / temperature
    return _SelectedLogprob.apply(logits, targets)


def sequence_logprobs(model: torch.nn.Module, batch: Batch, chunk_size: int = 512,
                      temperature: float = 1.0, trained_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob and entropy of token t under softmax(logits at t-1 / temperature), both [B, T]
    (position 0 holds 0). `temperature` is the rollout's sampling temperature, so that the PPO
    ratio compares the distribution that drew the tokens (as the samplers report it).
    `trained_only`: score only the tokens a loss reads (loss_mask > 0), 0 elsewhere: the LM head
    and its vocabulary-wide softmax are a large share of an update over long transcripts whose
    prompts and tool documentation are not trained.

    The [B, T, vocab] logits are the memory peak of RL on long transcripts, so the LM head runs
    over `chunk_size` positions at a time, and under autograd each chunk is checkpointed: only
    one chunk's logits exist at once, forward or backward. The forward goes through `model` as
    given, and the scoring runs inside it: for the call the LM head is replaced by `_ScoringHead`,
    which hands the decoder's hidden states to the real head chunk by chunk and returns the
    scores as the model's "logits" ([B, T, 2]). So a wrapper sees the head's every use within its
    forward and its output: DDP synchronises its gradients, and FSDP2 (which reshards the root's
    parameters, the head's among them, after the forward) and ZeRO-3 have them gathered then.
    Works for HF causal LMs and PEFT wrappers of them (`get_output_embeddings()`).

    A batch with `packed` inputs (packed groups) is forwarded in ONE model call over the packed
    rows, with explicit position ids and the model's attention switched to
    `prefix_grouped_attention` for the call (and for its layers' recomputation in the backward
    under activation checkpointing), which reads the rows' layout from the `packed_layout`
    keyword argument that transformers passes down to the attention; the LM head then runs once
    per (predicting position, target) pair, so a shared prefix's tokens are scored once, and the
    result is laid out per original row ([B, T], 0 at padding).
    """
    from accelerate.utils import extract_model_from_parallel

    inner = extract_model_from_parallel(model)
    softcap = getattr(inner.config, "final_logit_softcapping", None)  # Gemma-style models
    packed = batch.packed
    scored = batch.loss_mask > 0 if trained_only else None
    if scored is not None and not scored.any():
        # Nothing to score (a process's padding micro-batch, `lockstep_micro_batches`): score
        # every token anyway. The LM head must run: ZeRO-3 all-gathers its weights when it is
        # called, the other processes' heads wait for that, and a loss must reach every
        # parameter (with a zero gradient: the mask is 0) for DDP's all-reduce to complete.
        scored = None
    if packed is None:
        targets = batch.input_ids[:, 1:]
        scored = torch.ones_like(targets, dtype=torch.bool) if scored is None else scored[:, 1:]
        score = lambda head, hidden: _row_logprobs(head, softcap, hidden[:, :-1], targets, scored, chunk_size, temperature)  # noqa: E731
        with _scoring_head(inner, score):
            out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=0, use_cache=False)
    else:
        score = lambda head, hidden: _packed_logprobs(head, softcap, hidden, packed, scored, chunk_size, temperature)  # noqa: E731
        with _prefix_grouped(inner), _scoring_head(inner, score):
            out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, packed_layout=packed.layout, logits_to_keep=0, use_cache=False)
    return out.logits[..., 0], out.logits[..., 1]


class _ScoringHead(torch.nn.Module):
    """The LM head's stand-in for one `sequence_logprobs` forward: `score(head, hidden)` ->
    (logprobs, entropies), returned stacked as [..., 2] where the model returns its logits. The
    real head is held unregistered, so the module tree a wrapper manages is unchanged."""

    def __init__(self, head: torch.nn.Module, score: Callable[[torch.nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]):
        super().__init__()
        object.__setattr__(self, "_head", head)
        self._score = score

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._score(self._head, hidden), dim=-1)


@contextlib.contextmanager
def _scoring_head(model: torch.nn.Module, score: Callable) -> Iterator[None]:
    """`model` with its LM head replaced by a `_ScoringHead` for the duration. A softcapping
    model (Gemma) would softcap the head's output in its forward: the scores apply the softcap to
    the real logits themselves, so the model's is off meanwhile."""
    head = model.get_output_embeddings()
    name = next(n for n, m in model.named_modules() if m is head)
    parent = model.get_submodule(name.rpartition(".")[0])
    attr = name.rpartition(".")[2]
    softcap = getattr(model.config, "final_logit_softcapping", None)
    setattr(parent, attr, _ScoringHead(head, score))
    if softcap is not None:
        model.config.final_logit_softcapping = None
    try:
        yield
    finally:
        setattr(parent, attr, head)
        if softcap is not None:
            model.config.final_logit_softcapping = softcap


def _score(head: torch.nn.Module, softcap: float | None, predictors: torch.Tensor, targets: torch.Tensor,
           step: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropies) [N] of N (hidden state, target) pairs, `step` pairs at a time
    (checkpointed under autograd: one step's logits exist at once, forward or backward)."""
    logps, entropies = [predictors.new_zeros(0, dtype=torch.float32)], [predictors.new_zeros(0, dtype=torch.float32)]
    for start in range(0, predictors.shape[0], step):
        args = (head, softcap, predictors[start : start + step], targets[start : start + step], temperature)
        lp, ent = checkpoint(_token_logprobs, *args, use_reentrant=False) if torch.is_grad_enabled() else _token_logprobs(*args)
        logps.append(lp)
        entropies.append(ent)
    return torch.cat(logps), torch.cat(entropies)


def _row_logprobs(head: torch.nn.Module, softcap: float | None, hidden: torch.Tensor, targets: torch.Tensor, scored: torch.Tensor,
                  chunk_size: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Score each row's `scored` tokens from the hidden state before them, chunk_size positions per
    row at a time; [B, T] with 0 at position 0, which nothing predicts, and where not scored."""
    lp, ent = _score(head, softcap, hidden[scored], targets[scored], chunk_size * hidden.shape[0], temperature)
    first = torch.zeros(hidden.shape[0], 1, device=hidden.device)
    zeros = torch.zeros(targets.shape, device=hidden.device)
    return torch.cat([first, zeros.masked_scatter(scored, lp)], dim=1), torch.cat([first, zeros.masked_scatter(scored, ent)], dim=1)


def _packed_logprobs(head: torch.nn.Module, softcap: float | None, hidden: torch.Tensor, packed: PackedInputs, scored: torch.Tensor | None,
                     chunk_size: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Score the (predicting position, target) pairs that give a `scored` token of the original
    rows (every pair when None), chunk_size positions per packed row at a time, and gather the
    pairs into the original rows' [B, T] (0 where none or not scored)."""
    if packed.pair_positions.numel() == 0:  # one-token rows only: nothing is predicted
        zeros = torch.zeros(packed.token_pairs.shape, device=hidden.device)
        return zeros, zeros.clone()
    valid = packed.token_pairs >= 0
    if scored is not None:
        valid = valid & scored
    index = packed.token_pairs.clamp(min=0)
    needed = index[valid].unique() if scored is not None else torch.arange(packed.pair_positions.numel(), device=index.device)
    predictors = hidden.reshape(-1, hidden.shape[-1]).index_select(0, packed.pair_positions[needed])
    lp, ent = _score(head, softcap, predictors, packed.pair_targets[needed], chunk_size * hidden.shape[0], temperature)
    pairs = torch.zeros(packed.pair_positions.numel(), device=hidden.device)
    lp, ent = pairs.index_put((needed,), lp), pairs.index_put((needed,), ent)
    return torch.where(valid, lp[index], 0.0), torch.where(valid, ent[index], 0.0)


def budget_micro_batches(units: Sequence[Unit], max_tokens: int) -> Iterator[list[Unit]]:
    """Group units (longest first) so that units x padded length stays within `max_tokens`.

    A packed group counts as one row of its packed length; one longer than `max_tokens` is first
    split into sub-packs of its continuations, each with the prefix (`PackedRows.split`); a
    single unit longer than the budget is a micro-batch of its own. Plain rows are grouped as
    they always were. (`envace.training.setup.micro_batches` is this.)"""
    split = [part for u in units for part in (u.split(max_tokens) if isinstance(u, PackedRows) else [u])]
    ordered = sorted(split, key=unit_length, reverse=True)
    batch: list[Unit] = []
    for unit in ordered:
        width = unit_length(batch[0]) if batch else unit_length(unit)
        if batch and (len(batch) + 1) * width > max_tokens:
            yield batch
            batch = []
        batch.append(unit)
    if batch:
        yield batch


def lockstep_micro_batches(units: Sequence[Unit], max_tokens: int, pad_id: int,
                           lockstep: Callable[[int], int] | None = None) -> list[list[Unit]]:
    """`budget_micro_batches`, never empty (a process with no rows gets one padding micro-batch,
    so it still joins the gradient all-reduce), and with `lockstep` as many as `lockstep(n)`
    (the largest count over the processes, for a sharded model whose every forward is a
    collective). A padding micro-batch is one two-token row that trains nothing: zero loss mask,
    zero advantage."""
    chunks = list(budget_micro_batches(units, max_tokens))
    count = max(1, lockstep(len(chunks)) if lockstep else len(chunks))
    padding = [Row([pad_id, pad_id], [0, 0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0])]
    return chunks + [padding] * (count - len(chunks))


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
    behaviour_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean PPO loss over every trained token of the batch, whatever its role.

    `num_tokens` overrides the denominator so that micro-batches accumulated into one step
    together give the token mean over the whole step (pass the step's trained-token count).
    `ref_logprobs` adds kl_coef * k3 per token, an estimate of KL(policy || reference); it is
    also reported when kl_coef is 0. `roles`/`entropy` only feed the metrics (per-role keys like `clip_frac/act`).

    `old_logprobs` are the policy the ratio compares with. An update that takes one optimizer
    step per rollout batch (envace's trainer) passes its own forward's, detached: the weights it
    starts from are the old policy, so the ratio is exactly 1 (verl's on-policy path,
    `old_log_prob = log_prob.detach()`), and no separate forward recomputes them.

    Truncated importance sampling (TIS, as verl's `tis_imp_ratio_cap`): `behaviour_logprobs` are
    the sampler's; given them, `logprob_mismatch` = mean |old - behaviour| is reported, and with
    `tis_cap` (a sampler with other numerics than the update's drew the tokens) each token's
    policy-gradient loss is multiplied by the detached w = min(exp(old - behaviour), tis_cap)
    (the KL term is not), reporting `tis_weight` (mean w) and `tis_truncated_frac`. Without
    behaviour logprobs no correction applies, whatever `tis_cap` says.
    """
    if not logprobs.shape == old_logprobs.shape == advantages.shape == loss_mask.shape:
        raise ValueError("logprobs, old_logprobs, advantages and loss_mask must all be [B, T]")  # no silent broadcast
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if kl_coef and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs from the frozen reference model")
    if tis_cap is not None and not tis_cap > 0:
        raise ValueError(f"tis_cap must be > 0 (or None for off), got {tis_cap}")
    if behaviour_logprobs is not None and behaviour_logprobs.shape != logprobs.shape:
        raise ValueError("behaviour_logprobs must be [B, T] like logprobs")
    mask = loss_mask > 0
    denom = num_tokens if num_tokens is not None else mask.sum().clamp(min=1)
    pg, was_clipped = ppo_token_loss(logprobs, old_logprobs, advantages, clip_eps, dual_clip)
    tis: dict[str, torch.Tensor] = {}
    if behaviour_logprobs is not None:
        with torch.no_grad():
            log_w = (old_logprobs - behaviour_logprobs).float()
            tis["logprob_mismatch"] = log_w.abs()
            if tis_cap is not None:
                weight = torch.exp(log_w.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)).clamp(max=tis_cap)
                tis |= {"tis_weight": weight, "tis_truncated_frac": (log_w > math.log(tis_cap)).float()}
        if tis_cap is not None:
            pg = pg * tis["tis_weight"]
    per_token = {"pg_loss": pg}
    if ref_logprobs is not None:
        per_token["ref_kl"] = _k3(ref_logprobs - logprobs)
        pg = pg + kl_coef * per_token["ref_kl"]
    # torch.where, not multiplication: a masked-out token's inf/nan must not reach the sum.
    loss = torch.where(mask, pg, 0.0).sum() / denom
    with torch.no_grad():
        per_token |= {"adv": advantages, "clip_frac": was_clipped.float(), "approx_kl": _k3(logprobs - old_logprobs)} | tis
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
