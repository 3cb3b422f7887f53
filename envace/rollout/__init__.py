"""Batched multi-turn rollouts, written once against the token-in/token-out `Generator`."""

from envace.rollout.config import Mode, RolloutConfig, rollout_config_from
from envace.rollout.engine import CallGuard, Environment, GuardDecision, RolloutEngine, UserSimulator

__all__ = ["CallGuard", "Environment", "GuardDecision", "Mode", "RolloutConfig", "RolloutEngine", "UserSimulator", "rollout_config_from"]
