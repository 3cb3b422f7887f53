"""Per-step metrics to RUN_DIR/metrics.jsonl (the source of truth, read back by `plots`), plus
TensorBoard and optionally Weights & Biases; readable sample trajectories to samples.jsonl.

On resume from step S, entries logged after S by the interrupted run are dropped from both
JSONL files and TensorBoard (`purge_step`), so the curves show each step exactly once.
"""

from __future__ import annotations

import json
import os
import time
from numbers import Real
from pathlib import Path
from typing import Any

from envace.types import Role, Trajectory

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
WANDB_ID_FILE = "wandb_id.txt"


def _truncate_after(path: Path, step: int) -> None:
    """Keep the lines with "step" <= step; rewritten atomically. A torn last line is dropped."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # the interrupted run died mid-write
            continue
        if entry.get("step", 0) <= step:
            kept.append(line + "\n")
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


class MetricsLogger:
    def __init__(
        self,
        run_dir: str | Path,
        use_tensorboard: bool = True,
        use_wandb: bool = False,
        wandb_project: str | None = None,
        resume_step: int | None = None,
        config: dict[str, Any] | None = None,
    ):
        """`resume_step`: the step of the checkpoint this run resumes from (None for a new run)."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            for name in (METRICS_FILE, SAMPLES_FILE):
                _truncate_after(self.run_dir / name, resume_step)
        self._metrics = open(self.run_dir / METRICS_FILE, "a")
        self._samples = open(self.run_dir / SAMPLES_FILE, "a")
        self._tb = None
        if use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # slow import; only when used

            purge = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge)
        self._wandb = _init_wandb(self.run_dir, wandb_project, config) if use_wandb else None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """One JSON line {"step", "time", **metrics}, flushed so a crash loses nothing logged."""
        self._metrics.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        self._metrics.flush()
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, Real)}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def write_samples(self, step: int, trajectories: list[Trajectory], tokenizer: Any) -> None:
        """Append each trajectory as one JSON line with its turns decoded and role-tagged."""
        for traj in trajectories:
            entry = {
                "step": step,
                "task_id": traj.task_id,
                "rollout": traj.group,
                "mode": traj.mode,
                "reward": traj.reward,
                "end_reason": traj.end_reason.value if traj.end_reason else None,
                "penalties": traj.penalties,
                "turns": _turns(traj, tokenizer),
                "side_rows": [_turns(side, tokenizer) for side in traj.side_rows],
            }
            self._samples.write(json.dumps(entry) + "\n")
        self._samples.flush()

    def close(self) -> None:
        self._metrics.close()
        self._samples.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _turns(traj: Trajectory, tokenizer: Any) -> list[dict[str, str]]:
    # Decoded from the token ids (what was trained), not Turn.text (what a parser saw).
    return [{"role": Role(t.role).name.lower(), "text": tokenizer.decode(t.token_ids)} for t in traj.turns]


def _init_wandb(run_dir: Path, project: str | None, config: dict[str, Any] | None) -> Any:
    try:
        import wandb
    except ImportError:
        raise RuntimeError("use_wandb=True needs the wandb package: pip install 'envace[wandb]'") from None
    # The run id lives in the run dir, so a resumed run continues the same wandb run.
    id_file = run_dir / WANDB_ID_FILE
    if not id_file.exists():
        id_file.write_text(wandb.util.generate_id())
    return wandb.init(project=project, dir=str(run_dir), id=id_file.read_text().strip(), resume="allow", config=config)
