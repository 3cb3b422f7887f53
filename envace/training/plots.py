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
