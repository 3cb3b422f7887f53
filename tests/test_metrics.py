import pytest

from envace.metrics import bootstrap_mean_ci, paired_comparison, summarize_records, trajectory_record, wilson_interval
from envace.types import CallStatus, EndReason, Role, Task, ToolCall, Trajectory, Turn

EXECUTED, REHEARSED, REVISED = CallStatus.EXECUTED, CallStatus.REHEARSED, CallStatus.REVISED
RAISED = {"error": {"code": "TOOL_EXCEPTION", "message": "transfer raised ZeroDivisionError: division by zero"}}
SERVICE_ERROR = {"error": {"code": "NOT_FOUND", "message": "no account E9"}}


def scored_traj(reward, calls, mode="real", obs=None, status=EXECUTED, real=None):
    """5 tokens (3 prompt, 2 ACT); every call has `status`."""
    return Trajectory(task_id="t", mode=mode, turns=[Turn(Role.PROMPT, [1, 2, 3]), Turn(Role.ACT, [4, 5], [0.0, 0.0])],
                      tool_calls=[ToolCall(c, {}, status=status) for c in calls], observations=obs or [], reward=reward,
                      end_reason=EndReason.ANSWERED, real_observations=real)


TASK = Task(id="t", world="bank", messages=[])


def test_wilson_interval_hand_computed():
    # p=0.5, n=4, z=1.96: centre 0.5, half = 1.96*sqrt(0.0625+0.0600)/1.9604 = 0.3498
    low, high = wilson_interval(2, 4)
    assert low == pytest.approx(0.1500, abs=1e-3) and high == pytest.approx(0.8500, abs=1e-3)
    assert wilson_interval(0, 0) == (0.0, 0.0)


def test_records_and_summary_hand_computed():
    task = Task(id="t", world="bank", messages=[], reference_calls=[{"name": "a"}, {"name": "b"}])
    good = trajectory_record(task, scored_traj(1.0, ["a", "b"]))
    half = trajectory_record(task, scored_traj(0.0, ["a"]))
    assert (good["tool_f1"], half["tool_precision"], half["tool_recall"]) == (1.0, 1.0, 0.5)
    s = summarize_records([good, half], wall_seconds=10.0)
    assert s["success_rate"] == 0.5 and s["seconds_per_task"] == 5.0
    assert s["tool_f1"] == pytest.approx((1.0 + 2 / 3) / 2)
    assert s["tokens_per_task"] == 5
    # how the episodes ended: 3 calls over 2 tasks; a third that hit the turn limit after 4 calls
    assert (s["calls_per_task"], s["answered_rate"], s["turn_limit_rate"]) == (1.5, 1.0, 0.0)
    looped = scored_traj(0.0, ["a", "a", "a", "a"])
    looped.end_reason = EndReason.MAX_TURNS
    s = summarize_records([good, half, trajectory_record(task, looped)])
    assert s["calls_per_task"] == pytest.approx(7 / 3) and s["answered_rate"] == pytest.approx(2 / 3) and s["turn_limit_rate"] == pytest.approx(1 / 3)


def test_fidelity_comes_from_the_typed_real_observations():
    # Rehearsed {x: 1} against the real {x: 2}; the reward's details hold nothing about it.
    traj = scored_traj(1.0, ["a"], mode="rehearse", obs=[{"x": 1}], status=REHEARSED, real=[{"x": 2}])
    s = summarize_records([trajectory_record(TASK, traj)])
    assert s["fidelity/exact"] == 0.0 and s["fidelity/calls"] == 1
    traj.real_observations = None  # not replayed: no fidelity, rather than a made-up one
    assert "fidelity/calls" not in summarize_records([trajectory_record(TASK, traj)])


def test_executions_after_the_rollout_are_counted_apart_from_the_rollouts():
    # Rehearse mode: nothing ran while rolling out, 2 calls replayed on a fresh world to verify.
    rehearsed = scored_traj(1.0, ["a", "b"], mode="rehearse", obs=[{}, {}], status=REHEARSED, real=[{}, {}])
    # Real mode: 1 call ran while rolling out, replayed once more by the replay reward.
    real = scored_traj(1.0, ["a"], obs=[{}], real=[{}])
    real.real_env_calls = 1
    s = summarize_records([trajectory_record(TASK, rehearsed), trajectory_record(TASK, real)])
    assert (s["real_env_calls"], s["verification_calls"]) == (1, 3)


def test_tool_exceptions_hand_computed():
    # Real mode: the first executed call raised, the second got a service error (not an exception),
    # the revised one never ran; the replay raised again on the first.
    real = Trajectory(task_id="t", mode="real", observations=[RAISED, SERVICE_ERROR, {"error": {"code": "NOT_EXECUTED"}}],
                      tool_calls=[ToolCall("transfer", {}, status=EXECUTED), ToolCall("get_balance", {}, status=EXECUTED),
                                  ToolCall("transfer", {}, status=REVISED)],
                      real_observations=[RAISED, SERVICE_ERROR])
    # Rehearse mode: the policy wrote a TOOL_EXCEPTION (no tool raised); the replay's tool did raise.
    rehearsed = Trajectory(task_id="t", mode="rehearse", observations=[RAISED], tool_calls=[ToolCall("transfer", {}, status=REHEARSED)],
                           real_observations=[RAISED])
    records = [trajectory_record(TASK, real), trajectory_record(TASK, rehearsed)]
    assert [r["tool_exceptions"] for r in records] == [2, 1]
    assert summarize_records(records)["tool_exceptions"] == 3


def test_success_is_the_verifiers_verdict_when_there_is_one():
    # A partial-credit reward of 0.75 is not a success; a judge's 1.0 with no verdict is.
    verified = scored_traj(0.75, [])
    verified.success, verified.partial_credit = False, 0.75
    judged = scored_traj(1.0, [])
    records = [trajectory_record(TASK, verified), trajectory_record(TASK, judged)]
    assert [r["success"] for r in records] == [0.0, 1.0]
    s = summarize_records(records)
    assert s["success_rate"] == 0.5 and s["partial_credit"] == 0.75  # the mean over the verified record only


def test_bootstrap_ci_hand_computed():
    # Resamples of [0, 0, 1] have k ones with P(k) = 8/27, 12/27, 6/27, 1/27 (means 0, 1/3, 2/3, 1):
    # the 2.5th percentile is 0 and the 97.5th is 1 (the mass up to 2/3 is 26/27 = 0.963 < 0.975).
    assert bootstrap_mean_ci([0, 0, 1]) == (0.0, 1.0)
    # [0, 1] x 20: the mean's sd is 0.5 / sqrt(40) = 0.079, so the 95% interval is 0.5 -/+ ~0.155.
    low, high = bootstrap_mean_ci([0, 1] * 20)
    assert low == pytest.approx(0.5 - 1.96 * 0.5 / 40 ** 0.5, abs=0.03) and high == pytest.approx(0.5 + 1.96 * 0.5 / 40 ** 0.5, abs=0.03)
    assert bootstrap_mean_ci([0.25] * 5) == (0.25, 0.25)


def test_paired_comparison_hand_made():
    before = {"a": 0.0, "b": 1.0, "c": 0.0, "d": 0.5, "only-before": 1.0}
    after = {"a": 1.0, "b": 1.0, "c": 0.0, "d": 0.0, "only-after": 0.0}
    out = paired_comparison(before, after)
    # differences on a, b, c, d: +1, 0, 0, -0.5 -> mean 0.125
    assert (out["n"], out["mean_diff"], out["better"], out["worse"], out["same"]) == (4, 0.125, 1, 1, 2)
    assert out["ci95"][0] < 0 < out["ci95"][1]
    always = paired_comparison({t: 0.0 for t in "abcdef"}, {t: 1.0 for t in "abcdef"})
    assert always["ci95"] == [1.0, 1.0]
    with pytest.raises(ValueError, match="share no task"):
        paired_comparison({"a": 1.0}, {"b": 1.0})
