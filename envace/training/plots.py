"""PNG curves from a run's metrics.jsonl: one figure per metric family.

A family is the part of a key before the first "/", so `reward/mean`, `reward/act` and
`reward/rehearse` share a figure, as do `clip_frac` and `clip_frac/act`. A first part that
holds deeper keys is a namespace (the trainer prefixes loss metrics with the model name:
`policy/clip_frac/act`), and there the family is the first two parts. Whatever keys are
present get plotted; the documented ones are listed in docs/algorithms.md ("Logged metrics").
Uses matplotlib's Agg canvas directly, so importing this never changes a pyplot backend.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from numbers import Real
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

NOT_PLOTTED = {"step", "time"}


def _series(metrics_jsonl: Path) -> dict[str, tuple[list[int], list[float]]]:
    series: dict[str, tuple[list[int], list[float]]] = defaultdict(lambda: ([], []))
    for line in metrics_jsonl.read_text().splitlines():
        entry = json.loads(line)
        for key, value in entry.items():
            if key not in NOT_PLOTTED and isinstance(value, Real):
                series[key][0].append(entry["step"])
                series[key][1].append(float(value))
    return series


def plot_metrics(metrics_jsonl: str | Path, out_dir: str | Path) -> list[Path]:
    """Write `<family>.png` into out_dir for every metric family found; return the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    series = _series(Path(metrics_jsonl))
    namespaces = {key.split("/")[0] for key in series if key.count("/") >= 2}
    families: dict[str, list[str]] = defaultdict(list)
    for key in sorted(series):
        parts = key.split("/")
        families["/".join(parts[:2] if parts[0] in namespaces else parts[:1])].append(key)
    paths = []
    for family, keys in families.items():
        fig = Figure(figsize=(7, 4), layout="tight")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for key in keys:
            steps, values = series[key]
            ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=key)
        ax.set_xlabel("step")
        ax.set_title(family)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        path = out_dir / (re.sub(r"[^A-Za-z0-9_.-]", "_", family) + ".png")
        fig.savefig(path, dpi=100)
        paths.append(path)
    return paths


# The story of a rehearsal run, one panel each: what each role was paid, whether tasks got
# solved, and whether REHEARSE's imagined responses matched the real world's.
STORY = (("reward per role", ("reward/act", "reward/rehearse")), ("success and partial credit", ("success_rate", "partial_credit")),
         ("rehearsal fidelity", ("fidelity/exact", "fidelity/field_f1")))


def story_plot(metrics_jsonl: str | Path, out_path: str | Path) -> Path:
    """One PNG with three panels per training step: reward per role, success and partial
    credit, rehearsal fidelity; a panel whose metrics the run did not log says so."""
    series = _series(Path(metrics_jsonl))
    fig = Figure(figsize=(13, 3.8), layout="tight")
    FigureCanvasAgg(fig)
    for i, (title, keys) in enumerate(STORY, 1):
        ax = fig.add_subplot(1, len(STORY), i)
        logged = [k for k in keys if k in series]
        for key in logged:
            ax.plot(*series[key], marker=".", label=key)
        if not logged:
            ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center", transform=ax.transAxes)
        ax.set(title=title, xlabel="step", ylim=(-0.15, 1.05))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.grid(alpha=0.3)
        if logged:
            ax.legend(fontsize="small")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100)
    return out_path
