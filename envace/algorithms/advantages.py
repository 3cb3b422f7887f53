"""Advantage estimators: turn a group of K rollouts of one task into per-output and per-token
advantages.

Every policy output (an ACT span = one assistant turn, a REHEARSE span = one rehearsed tool
response) inherits its trajectory's reward R_i. A malformed/empty output additionally gets
`penalty` added to its own reward (see `output_rewards`). The estimators differ only in the
baseline an output is compared with:

- `role_grpo`: per (task, role), the mean reward over ALL outputs of that role in the group, so a
  rollout with more outputs weighs more in its role's baseline.
- `grpo`: per task, the mean of the K trajectory rewards (plain trajectory-level GRPO).

Outputs are the turns of a trajectory and of its `side_rows` (isolated-simulator REHEARSE rows),
so the same estimator serves the transcript and the isolated layout. Formulas: docs/algorithms.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from envace.registry import Registry
from envace.types import Role, Trajectory

STD_EPS = 1e-6


@dataclass
class TrajectoryAdvantages:
    """Advantages of one trajectory. Untrained tokens (other roles, prompt, env) hold 0."""

    outputs: dict[Role, list[float]]  # one per output of each role: main turns, then side rows, in order
    tokens: list[float]  # aligned with `Trajectory.token_ids`
    side_rows: list[list[float]] = field(default_factory=list)  # aligned with each side row's token_ids


@dataclass
class GroupAdvantages:
    """The K trajectories of one task plus the per-role statistics used to baseline them."""

    trajectories: list[TrajectoryAdvantages]
    baseline: dict[Role, float]  # mu per role
    std: dict[Role, float]  # std of the rewards the baseline was taken over
    num_outputs: dict[Role, int]
    mean_reward: dict[Role, float]  # mean reward of the role's outputs (penalties included)

    @property
    def degenerate(self) -> bool:
        """True when no output of the group has a nonzero advantage (nothing to learn from it)."""
        return all(a == 0.0 for t in self.trajectories for advs in t.outputs.values() for a in advs)


Estimator = Callable[..., list[GroupAdvantages]]
ADVANTAGES: Registry[Estimator] = Registry("advantage estimator")


def role_key(role: Role) -> str:
    """The name a role has in `Trajectory.penalties` and in metric keys ("act", "rehearse")."""
    return role.name.lower()


def output_rewards(traj: Trajectory, role: Role, penalty: float) -> list[float]:
    """Reward of each output of `role` in `traj` (main turns, then side rows).

    Every output gets R_i; an output flagged `Turn.malformed` (it failed to parse, or was empty)
    also gets `penalty`, added as given: pass a negative value (the reference uses -0.1). It
    lowers the offending output's advantage and, through the baseline, slightly raises its
    siblings'.
    """
    if traj.reward is None:
        raise ValueError(f"trajectory of task {traj.task_id!r} (rollout {traj.group}) has no reward; score it first")
    outputs = [turn for seq in [traj, *traj.side_rows] for turn in seq.outputs(role)]
    return [traj.reward + (penalty if turn.malformed else 0.0) for turn in outputs]


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Population mean and std (a single output gets std 0, not NaN)."""
    if min(values) == max(values):
        return values[0], 0.0  # exact, so an equal-reward group gets exactly zero advantage
    mu = sum(values) / len(values)
    return mu, math.sqrt(sum((v - mu) ** 2 for v in values) / len(values))


def _scatter(traj: Trajectory, outputs: dict[Role, list[float]]) -> TrajectoryAdvantages:
    """Spread per-output advantages over the tokens of the turns they belong to."""
    remaining = {role: iter(advs) for role, advs in outputs.items()}

    def tokens(seq: Trajectory) -> list[float]:
        out: list[float] = []
        for turn in seq.turns:
            adv = next(remaining[turn.role]) if turn.role in remaining else 0.0
            out.extend([adv] * len(turn.token_ids))
        return out

    main = tokens(traj)  # before the side rows: the iterators hand out outputs in that order
    return TrajectoryAdvantages(outputs=outputs, tokens=main, side_rows=[tokens(s) for s in traj.side_rows])


def _estimate(
    groups: list[list[Trajectory]],
    roles: tuple[Role, ...],
    normalize_std: bool,
    penalty: float,
    pool: Callable[[list[Trajectory], list[float]], list[float]],
) -> list[GroupAdvantages]:
    """Shared body of the estimators. `pool(group, role_output_rewards)` returns the rewards a
    role's baseline and std are taken over."""
    result = []
    for group in groups:
        if not group:
            raise ValueError("empty rollout group")
        per_traj: list[dict[Role, list[float]]] = [{} for _ in group]
        baseline, std, counts, mean_reward = {}, {}, {}, {}
        for role in roles:
            rewards = [output_rewards(t, role, penalty) for t in group]
            flat = [r for rs in rewards for r in rs]
            counts[role] = len(flat)
            if not flat:  # e.g. REHEARSE in real mode: nothing to baseline or train
                baseline[role], std[role], mean_reward[role] = 0.0, 0.0, 0.0
            else:
                baseline[role], std[role] = _mean_std(pool(group, flat))
                mean_reward[role] = sum(flat) / len(flat)
            scale = std[role] + STD_EPS if normalize_std else 1.0
            for advs, rs in zip(per_traj, rewards):
                advs[role] = [(r - baseline[role]) / scale for r in rs]
        trajs = [_scatter(t, o) for t, o in zip(group, per_traj)]
        result.append(GroupAdvantages(trajs, baseline, std, counts, mean_reward))
    return result


@ADVANTAGES.register("role_grpo")
def role_grpo(
    groups: list[list[Trajectory]],
    roles: tuple[Role, ...] = (Role.ACT, Role.REHEARSE),
    normalize_std: bool = False,
    penalty: float = 0.0,
) -> list[GroupAdvantages]:
    """Role-level GRPO: A = r - mean(r over all outputs of that role in the task group)."""
    return _estimate(groups, roles, normalize_std, penalty, lambda group, flat: flat)


@ADVANTAGES.register("grpo")
def grpo(
    groups: list[list[Trajectory]],
    roles: tuple[Role, ...] = (Role.ACT, Role.REHEARSE),
    normalize_std: bool = False,
    penalty: float = 0.0,
) -> list[GroupAdvantages]:
    """Trajectory-level GRPO: A = r - mean(R_1..R_K), the same baseline for every role."""
    return _estimate(groups, roles, normalize_std, penalty, lambda group, flat: [t.reward for t in group])


def group_metrics(groups: list[GroupAdvantages]) -> dict[str, float]:
    """Logged per step: mean output reward per role (`reward/act`), outputs per group, and the
    fraction of groups that carry no learning signal (`groups/degenerate_frac`)."""
    metrics: dict[str, float] = {"groups/degenerate_frac": sum(g.degenerate for g in groups) / max(len(groups), 1)}
    for role in sorted({r for g in groups for r in g.num_outputs}):
        with_outputs = [g for g in groups if g.num_outputs[role]]
        metrics[f"outputs/{role_key(role)}"] = sum(g.num_outputs[role] for g in groups) / max(len(groups), 1)
        if with_outputs:
            metrics[f"reward/{role_key(role)}"] = sum(g.mean_reward[role] for g in with_outputs) / len(with_outputs)
    return metrics
