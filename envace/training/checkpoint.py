"""Atomic, resumable training checkpoints.

Layout: RUN_DIR/checkpoints/step-00000042/
    model-<name>/          `save_pretrained` output (full weights, or only the PEFT adapter)
    optimizer-<name>.pt, scheduler-<name>.pt
    rng.pt                 python / numpy / torch (+ CUDA) global RNG states
    state.json             step, data position, config

A checkpoint is written into a hidden temporary folder and renamed into place with
`os.replace`, so a run killed mid-save leaves the previous checkpoints intact and never a
half-written `step-*` folder. Models/optimizers/schedulers are passed by name (`{"policy": m}`)
because the `no-share` variant trains two models.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from peft import PeftModel, load_peft_weights, set_peft_model_state_dict
from safetensors.torch import load_file

CHECKPOINTS = "checkpoints"
_STEP_DIR = re.compile(r"step-(\d+)")
_TMP_PREFIX = ".tmp-"


@dataclass
class CheckpointState:
    """What `load_checkpoint` hands back besides the restored objects."""

    path: Path
    step: int
    data_state: dict[str, Any]
    config: dict[str, Any]


def _checkpoint_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name)) and (p / "state.json").is_file()]
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    found = _checkpoint_dirs(Path(run_dir))
    return found[-1][1] if found else None


def _rng_state() -> dict[str, Any]:
    # numpy's key array goes through a tensor so rng.pt loads with weights_only=True.
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(path: Path) -> None:
    """Flush file contents before the rename, so a power loss cannot publish empty files."""
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as f:
                os.fsync(f.fileno())


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    models: Mapping[str, torch.nn.Module],
    optimizer_states: Mapping[str, dict[str, Any]] | None = None,
    schedulers: Mapping[str, Any] | None = None,
    data_state: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    keep_last: int = 3,
) -> Path:
    """Write checkpoint `step` atomically and delete all but the newest `keep_last`.

    `optimizer_states` are the optimizers' `state_dict()`s, taken by the caller: for a sharded
    model that is a collective every process runs (`FullOptimizerState`), while only the main
    process calls this. `data_state` (e.g. {"epoch": 1, "index": 128}) and `config` must be
    JSON-serialisable.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(_TMP_PREFIX + "*"):  # left by a run killed mid-save
        shutil.rmtree(stale)
    # Serialise first: a non-JSON value fails here, before minutes of weight writing.
    state = json.dumps({"step": step, "data_state": data_state or {}, "config": config or {}}, indent=2)
    final = root / f"step-{step:08d}"
    tmp = root / f"{_TMP_PREFIX}{final.name}"
    tmp.mkdir()
    for name, model in models.items():
        model.save_pretrained(tmp / f"model-{name}")
    for name, opt_state in (optimizer_states or {}).items():
        torch.save(opt_state, tmp / f"optimizer-{name}.pt")
    for name, sched in (schedulers or {}).items():
        torch.save(sched.state_dict(), tmp / f"scheduler-{name}.pt")
    torch.save(_rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(state)
    _fsync_tree(tmp)
    if final.exists():  # re-saving a step (e.g. right after resuming from it): the new one wins
        shutil.rmtree(final)
    os.replace(tmp, final)
    for _, old in _checkpoint_dirs(Path(run_dir))[:-keep_last]:
        shutil.rmtree(old)
    return final


def _load_model(model: torch.nn.Module, folder: Path) -> None:
    """Restore weights in place, so optimizers built on this model's parameters stay valid."""
    if isinstance(model, PeftModel):
        set_peft_model_state_dict(model, load_peft_weights(str(folder), device="cpu"))
        return
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        state |= load_file(shard)
    result = model.load_state_dict(state, strict=False)
    # save_pretrained drops tied copies (e.g. lm_head tied to the embeddings); those may be
    # missing, anything else missing or unexpected means the wrong model.
    loaded_storage = {p.data_ptr() for n, p in model.named_parameters(remove_duplicate=False) if n in state}
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = [k for k in result.missing_keys if k not in params or params[k].data_ptr() not in loaded_storage]
    if missing or result.unexpected_keys:
        raise ValueError(f"checkpoint {folder} does not match the model: missing {missing}, unexpected {result.unexpected_keys}")


def load_checkpoint(
    path: str | Path,
    models: Mapping[str, torch.nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer] | None = None,
    schedulers: Mapping[str, Any] | None = None,
    restore_rng: bool = True,
) -> CheckpointState:
    """Restore weights, optimizer and scheduler states and the RNGs from a checkpoint folder.

    Build the models, optimizers and schedulers exactly as for a fresh run, then call this:
    the next step then draws the same random numbers and applies the same update as the
    uninterrupted run would have.
    """
    path = Path(path)
    state = json.loads((path / "state.json").read_text())
    for name, model in models.items():
        _load_model(model, path / f"model-{name}")
    for name, opt in (optimizers or {}).items():
        opt.load_state_dict(torch.load(path / f"optimizer-{name}.pt", map_location="cpu", weights_only=True))
    for name, sched in (schedulers or {}).items():
        sched.load_state_dict(torch.load(path / f"scheduler-{name}.pt", weights_only=True))
    if restore_rng:
        _set_rng_state(torch.load(path / "rng.pt", weights_only=True))
    return CheckpointState(path=path, step=state["step"], data_state=state["data_state"], config=state["config"])
