"""Advantage estimators (role-level GRPO) and the PPO-clipped loss over role-tagged rows."""

from envace.algorithms.advantages import ADVANTAGES, GroupAdvantages, TrajectoryAdvantages, group_metrics
from envace.algorithms.losses import Batch, Row, build_rows, collate, ppo_loss, ppo_token_loss, sequence_logprobs

__all__ = [
    "ADVANTAGES",
    "Batch",
    "GroupAdvantages",
    "Row",
    "TrajectoryAdvantages",
    "build_rows",
    "collate",
    "group_metrics",
    "ppo_loss",
    "ppo_token_loss",
    "sequence_logprobs",
]
