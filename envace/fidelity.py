"""Rehearsal fidelity: how well rehearsed tool responses match what the real world returns for
the same calls. Tells a user whether the policy's internal world model can be trusted."""

from __future__ import annotations

import json
from typing import Any

from envace.rewards import multiset_f1
from envace.types import Trajectory


def flatten(obj: Any, prefix: str = "") -> list[str]:
    """JSON -> 'path=value' leaves; lists keep their indices so order matters."""
    if isinstance(obj, dict):
        if not obj:
            return [f"{prefix}={{}}"]
        return [leaf for k in sorted(obj) for leaf in flatten(obj[k], f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(obj, list):
        if not obj:
            return [f"{prefix}=[]"]
        return [leaf for i, v in enumerate(obj) for leaf in flatten(v, f"{prefix}[{i}]")]
    return [f"{prefix}={json.dumps(obj, sort_keys=True)}"]


def field_f1(rehearsed: dict[str, Any], real: dict[str, Any]) -> float:
    return multiset_f1(flatten(rehearsed), flatten(real))[2]


def exact_match(rehearsed: dict[str, Any], real: dict[str, Any]) -> bool:
    return json.dumps(rehearsed, sort_keys=True) == json.dumps(real, sort_keys=True)


def trajectory_fidelity(traj: Trajectory) -> list[dict[str, float]]:
    """Per-call fidelity of a rehearse- or simulator-mode trajectory: each committed call's
    rehearsed observation against the real world's response to it (`traj.real_observations`,
    one per committed call; None: nothing to compare). Calls that were not committed (revised,
    unanswered, malformed) had no rehearsed answer the agent acted on, so they are not compared."""
    real = traj.real_observations
    if real is None:
        return []
    rehearsed = [obs for _, obs in traj.committed_exchanges()]
    if len(rehearsed) != len(real):
        raise ValueError(f"trajectory {traj.task_id}: {len(real)} real observations for {len(rehearsed)} committed calls")
    return [{"exact": float(exact_match(r, t)), "field_f1": field_f1(r, t)} for r, t in zip(rehearsed, real)]


def summarize(per_call: list[dict[str, float]]) -> dict[str, float]:
    if not per_call:
        return {"fidelity/calls": 0}
    n = len(per_call)
    return {
        "fidelity/calls": n,
        "fidelity/exact": sum(c["exact"] for c in per_call) / n,
        "fidelity/field_f1": sum(c["field_f1"] for c in per_call) / n,
    }
