import pytest

from envace.fidelity import exact_match, field_f1, flatten, summarize, trajectory_fidelity
from envace.types import Trajectory


def test_flatten_paths():
    assert flatten({"b": [1, {"c": "x"}], "a": True}) == ["a=true", "b[0]=1", 'b[1].c="x"']


def test_field_f1_hand_computed():
    real = {"id": "A1", "balance": 100, "currency": "USD"}
    rehearsed = {"id": "A1", "balance": 90, "currency": "USD", "extra": 1}
    # leaves: rehearsed 4, real 3, shared 2 -> P=2/4, R=2/3, F1=4/7
    assert field_f1(rehearsed, real) == pytest.approx(4 / 7)
    assert not exact_match(rehearsed, real)
    assert exact_match({"a": 1, "b": 2}, {"b": 2, "a": 1})


def test_trajectory_fidelity_and_summary():
    traj = Trajectory(task_id="t", mode="rehearse", observations=[{"value": 5}, {"value": 9}])
    per_call = trajectory_fidelity(traj, [{"value": 5}, {"value": 10}])
    assert per_call == [{"exact": 1.0, "field_f1": 1.0}, {"exact": 0.0, "field_f1": 0.0}]
    assert summarize(per_call) == {"fidelity/calls": 2, "fidelity/exact": 0.5, "fidelity/field_f1": 0.5}
