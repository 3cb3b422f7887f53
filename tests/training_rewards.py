"""User rewards for the training tests, named as `tests.training_rewards:<function>` (how a user
names their own `module:function` reward)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from envace.training.checkpoint import latest_checkpoint

# Set to a run's output directory to make `blocking_rollout_index` stop that run in its step 2.
BLOCK_RUN_DIR = "ENVACE_TEST_BLOCK_RUN_DIR"


def constant(task, traj, ctx):
    """The same reward for every rollout: no group carries a learning signal."""
    return 0.5, {}


def rollout_index(task, traj, ctx):
    """0 for a group's first rollout, 1 for the second: every group of k=2 carries a signal."""
    return float(traj.group), {}


def signal_in_counter_1_only(task, traj, ctx):
    """`rollout_index` for task counter-1, a constant elsewhere: one group of the step carries a
    signal, the others have advantage 0 throughout."""
    return (float(traj.group) if task.id == "counter-1" else 0.5), {}


def blocked_marker(run_dir: str | Path) -> Path:
    """The file `blocking_rollout_index` writes when it stops the run in `run_dir` (beside the run, not in it)."""
    return Path(f"{run_dir}.blocked")


def blocking_rollout_index(task, traj, ctx):
    """`rollout_index`, so that every step moves the weights. With $ENVACE_TEST_BLOCK_RUN_DIR set,
    the first reward after that run's first checkpoint (step 2's first) creates `blocked_marker`
    and never returns: the run stops at a point it signals, however fast or slow the machine is."""
    run_dir = os.environ.get(BLOCK_RUN_DIR)
    if run_dir and latest_checkpoint(run_dir) is not None:
        blocked_marker(run_dir).touch()
        while True:  # until the test kills the process
            time.sleep(3600)
    return rollout_index(task, traj, ctx)
