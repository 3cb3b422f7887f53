"""Test-time private rehearsal and the pre-commit rehearsal guard (docs/rehearsal.md)."""

from envace.rehearsal.cost import RehearsalCost, TokenCost
from envace.rehearsal.guard import GUARD_RULES, GuardRehearsal, GuardRule, RehearsalGuard
from envace.rehearsal.private import (
    RehearsalConfig,
    RehearsalResult,
    Rehearser,
    accounting,
    rehearse_memory,
    run_with_rehearsal,
    with_system_note,
)
from envace.rehearsal.prompts import PromptError, RehearsalPrompts, render_attempt

__all__ = [
    "GUARD_RULES", "GuardRehearsal", "GuardRule", "PromptError", "RehearsalConfig", "RehearsalCost", "RehearsalGuard",
    "RehearsalPrompts", "RehearsalResult", "Rehearser", "TokenCost", "accounting", "rehearse_memory", "render_attempt",
    "run_with_rehearsal", "with_system_note",
]
