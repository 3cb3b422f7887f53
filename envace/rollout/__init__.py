"""Batched multi-turn rollouts, written once against the token-in/token-out `Generator`
(engine.py), with one tool responder per mode (responders.py), one user channel per source
(users.py) and one writer of the transcript's rules (episode.py)."""

from envace.rollout.config import Mode, RolloutConfig
from envace.rollout.engine import Environment, RolloutEngine
from envace.rollout.responders import CallGuard, GuardDecision, ToolResponder
from envace.rollout.users import UserSimulator

__all__ = ["CallGuard", "Environment", "GuardDecision", "Mode", "RolloutConfig", "RolloutEngine", "ToolResponder", "UserSimulator"]
