"""Summary statistics of scored trajectories: success with a confidence interval, tool-call F1,
rehearsal fidelity, cost per task. Evaluation and training both aggregate with these, so this
module depends on neither."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from envace.envs.base import TOOL_EXCEPTION
from envace.fidelity import summarize, trajectory_fidelity
from envace.rewards import multiset_f1
from envace.types import CallStatus, EndReason, Role, Task, Trajectory


def wilson_interval(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval for a binomial proportion (sensible at small n and p near 0/1)."""
    if n == 0:
        return 0.0, 0.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap_mean_ci(values: list[float], resamples: int = 10_000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (resampled with replacement, a
    fixed seed so that a report is reproducible). [0, 0, 1] -> (0, 1): its exact bootstrap puts
    26/27 of the mass on means <= 2/3, less than 0.975."""
    import numpy as np

    if not values:
        return 0.0, 0.0
    data = np.asarray(values, dtype=np.float64)
    means = np.random.default_rng(seed).choice(data, size=(resamples, len(data)), replace=True).mean(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail], method="inverted_cdf")
    return float(low), float(high)


def paired_comparison(before: dict[str, float], after: dict[str, float], **bootstrap: Any) -> dict[str, Any]:
    """after - before on the tasks both scored (task id -> score): the mean per-task difference
    with its bootstrap CI, and how many tasks got better, worse or stayed."""
    common = sorted(set(before) & set(after))
    if not common:
        raise ValueError("paired comparison: the two runs share no task id; evaluate both on the same tasks")
    diffs = [after[t] - before[t] for t in common]
    return {"n": len(common), "mean_diff": sum(diffs) / len(diffs), "ci95": list(bootstrap_mean_ci(diffs, **bootstrap)),
            "better": sum(d > 0 for d in diffs), "worse": sum(d < 0 for d in diffs), "same": sum(d == 0 for d in diffs)}


def tool_call_prf(task: Task, traj: Trajectory) -> dict[str, float] | None:
    """Name-level precision/recall/F1 of the calls against the task's reference calls."""
    if not task.reference_calls:
        return None
    p, r, f1 = multiset_f1([c.name for c in traj.tool_calls], [c["name"] for c in task.reference_calls])
    return {"precision": p, "recall": r, "f1": f1}


def is_tool_exception(observation: dict[str, Any]) -> bool:
    error = observation.get("error")
    return isinstance(error, dict) and error.get("code") == TOOL_EXCEPTION


def tool_exceptions(traj: Trajectory) -> int:
    """Executions whose tool raised (answered TOOL_EXCEPTION): while rolling out, and when the
    calls were replayed after it. Rehearsed or simulated responses are written by a model, not
    by a tool, so they never count."""
    executed = [o for c, o in traj.committed_exchanges() if c.status == CallStatus.EXECUTED]
    return sum(map(is_tool_exception, executed + (traj.real_observations or [])))


def trajectory_record(task: Task, traj: Trajectory, success_threshold: float = 1.0) -> dict[str, Any]:
    """One flat record per trajectory: what summaries aggregate and what the JSONL stores.

    `real_env_calls` are the executions while rolling out; `verification_calls` those after it,
    on a fresh world (the replay reward's, or the replay that gives fidelity its reference)."""
    record: dict[str, Any] = {
        "task_id": task.id,
        "world": task.world,
        "split": task.split,
        "hidden_state": task.hidden_state,
        "difficulty": task.difficulty,
        "reward": traj.reward,
        # The verifier's verdict when the reward ran it; otherwise the reward reaching the threshold.
        "success": float(traj.success if traj.success is not None else (traj.reward or 0.0) >= success_threshold),
        "partial_credit": traj.partial_credit,
        "end_reason": traj.end_reason.value if traj.end_reason else None,
        "num_calls": len(traj.tool_calls),
        "real_env_calls": traj.real_env_calls,
        "verification_calls": len(traj.real_observations or []),
        "tool_exceptions": tool_exceptions(traj),
        "act_tokens": traj.num_tokens(Role.ACT),
        "rehearse_tokens": traj.num_tokens(Role.REHEARSE),
        "total_tokens": traj.num_tokens(),
        "seconds": traj.seconds,
        "penalties": dict(traj.penalties),
    }
    prf = tool_call_prf(task, traj)
    if prf:
        record.update({f"tool_{k}": v for k, v in prf.items()})
    if traj.mode != "real" and traj.real_observations is not None:
        record["fidelity"] = trajectory_fidelity(traj)
    return record


def partial_credit_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean partial credit over the records the verifier scored, with a 95% bootstrap CI."""
    credits = [r["partial_credit"] for r in records if r.get("partial_credit") is not None]
    if not credits:
        return {}
    return {"partial_credit": sum(credits) / len(credits), "partial_credit_ci95": list(bootstrap_mean_ci(credits))}


def summarize_records(records: list[dict[str, Any]], wall_seconds: float | None = None) -> dict[str, Any]:
    """Aggregate records. Rollouts run batched, so per-task cost is the batch's wall time / n
    when given (a trajectory's own `seconds` spans the whole batch it ran in)."""
    n = len(records)
    if n == 0:
        return {"n": 0}
    successes = sum(r["success"] for r in records)
    low, high = wilson_interval(successes, n)
    out: dict[str, Any] = {
        "n": n,
        "success_rate": successes / n,
        "success_ci95": [low, high],
        "mean_reward": sum(r["reward"] or 0.0 for r in records) / n,
        **partial_credit_summary(records),
        "tokens_per_task": sum(r["total_tokens"] for r in records) / n,
        "seconds_per_task": (wall_seconds if wall_seconds is not None else sum(r["seconds"] for r in records)) / n,
        "real_env_calls": sum(r["real_env_calls"] for r in records),
        "verification_calls": sum(r["verification_calls"] for r in records),
        "tool_exceptions": sum(r["tool_exceptions"] for r in records),
        "malformed": sum(sum(r["penalties"].values()) for r in records),
        # How episodes ended: a policy that learned to stop looping, or to stop too early, can score
        # like one that learned the task; its calls and end reasons tell them apart.
        "calls_per_task": sum(r["num_calls"] for r in records) / n,
        "answered_rate": sum(r["end_reason"] == EndReason.ANSWERED.value for r in records) / n,
        "turn_limit_rate": sum(r["end_reason"] == EndReason.MAX_TURNS.value for r in records) / n,
    }
    with_ref = [r for r in records if "tool_f1" in r]
    if with_ref:
        for k in ("precision", "recall", "f1"):
            out[f"tool_{k}"] = sum(r[f"tool_{k}"] for r in with_ref) / len(with_ref)
    calls = [c for r in records for c in r.get("fidelity", [])]
    if any("fidelity" in r for r in records):
        out.update(summarize(calls))
    return out


def summarize_by(records: list[dict[str, Any]], key: str, wall_seconds: float | None = None) -> dict[str, dict[str, Any]]:
    """Per-bucket summaries; the wall time is shared out by each bucket's share of tokens."""
    buckets: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        buckets[str(r[key])].append(r)
    total_tokens = sum(r["total_tokens"] for r in records) or 1
    return {k: summarize_records(v, None if wall_seconds is None else wall_seconds * sum(r["total_tokens"] for r in v) / total_tokens)
            for k, v in sorted(buckets.items())}
