import pytest

from envace.fidelity import exact_match, field_f1, flatten, summarize, trajectory_fidelity
from envace.types import CallStatus, ToolCall, Trajectory


def test_flatten_paths():
    assert flatten({"b": [1, {"c": "x"}], "a": True}) == ["a=true", "b[0]=1", 'b[1].c="x"']


def test_field_f1_hand_computed():
    real = {"id": "A1", "balance": 100, "currency": "USD"}
    rehearsed = {"id": "A1", "balance": 90, "currency": "USD", "extra": 1}
    # leaves: rehearsed 4, real 3, shared 2 -> P=2/4, R=2/3, F1=4/7
    assert field_f1(rehearsed, real) == pytest.approx(4 / 7)
    assert not exact_match(rehearsed, real)
    assert exact_match({"a": 1, "b": 2}, {"b": 2, "a": 1})


def rehearsed_with_a_revised_call():
    """add (rehearsed), reset_counter (revised by the guard: ACT saw its reason), get (rehearsed),
    add (unanswered: the episode ended first)."""
    calls = [ToolCall("add", {"n": 5}, status=CallStatus.REHEARSED), ToolCall("reset_counter", {}, status=CallStatus.REVISED),
             ToolCall("get", {}, status=CallStatus.REHEARSED), ToolCall("add", {"n": 1}, status=CallStatus.UNANSWERED)]
    observations = [{"value": 5}, {"error": {"code": "NOT_EXECUTED", "message": "irreversible"}}, {"value": 9}]
    return Trajectory(task_id="t", mode="rehearse", tool_calls=calls, observations=observations)


def test_trajectory_fidelity_aligns_by_committed_call_and_summarizes():
    traj = rehearsed_with_a_revised_call()
    traj.real_observations = [{"value": 5}, {"value": 10}]  # the real world's answers to add and get
    per_call = trajectory_fidelity(traj)
    # add: {value: 5} vs {value: 5}; get: {value: 9} vs {value: 10} (the guard's reason is never compared)
    assert per_call == [{"exact": 1.0, "field_f1": 1.0}, {"exact": 0.0, "field_f1": 0.0}]
    assert summarize(per_call) == {"fidelity/calls": 2, "fidelity/exact": 0.5, "fidelity/field_f1": 0.5}


def test_trajectory_fidelity_without_a_reference_or_with_a_misaligned_one():
    traj = rehearsed_with_a_revised_call()
    assert trajectory_fidelity(traj) == []  # never replayed: nothing to compare
    traj.real_observations = [{"value": 5}, {"error": {"code": "NOT_EXECUTED"}}, {"value": 10}]  # one per call, not per committed call
    with pytest.raises(ValueError, match="3 real observations for 2 committed calls"):
        trajectory_fidelity(traj)
