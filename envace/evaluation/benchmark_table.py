"""The table `envace eval --benchmark all` writes, shaped like the paper's: one row for the model,
a column per benchmark (BFCL-v4, tau2-bench, VitaBench, their overall) and FinMCP tool F1 where
its data was given. Each cell holds the benchmark's own overall (its `aggregate`, in %), the
number of trajectories behind it, and whether it stands for less than the whole benchmark."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from envace.evaluation.report import skipped_text

COLUMNS = (("bfcl", "BFCL-v4"), ("tau2", "tau2-bench"), ("vitabench", "VitaBench"))
OVERALL = "overall"
EXTRA_COLUMNS = (("finmcp", "FinMCP F1"),)  # shown only when the benchmark ran (its data is user-supplied)


def cell(plan: Any, summary: dict[str, Any] | None, limit: int | None) -> dict[str, Any]:
    """One benchmark's cell: its overall score (None when nothing ran), tasks, partial, why."""
    if summary is None:
        return {"score": None, "n": 0, "partial": True, "skipped": plan.skipped}
    agg = summary["benchmark"]["aggregate"]
    return {
        "score": agg["overall"] if agg else summary["overall"]["mean_reward"],
        "weighting": agg["weighting"] if agg else "mean reward (not the benchmark's scorer)",
        "n": summary["overall"]["n"],
        "partial": plan.partial(limit),
        "skipped": plan.skipped,
        "seconds_per_task": summary["overall"]["seconds_per_task"],
    }


def overall_cell(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """The unweighted mean of the benchmark columns that have a score; partial unless all of them do
    and none is partial."""
    scored = [c for c in cells if c["score"] is not None]
    return {
        "score": sum(c["score"] for c in scored) / len(scored) if scored else None,
        "weighting": "unweighted mean of the benchmark columns with a score",
        "n": sum(c["n"] for c in cells),
        "partial": len(scored) < len(cells) or any(c["partial"] for c in cells),
    }


def benchmark_table(cfg: Any, plans: list[Any], summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    plan = {p.name: p for p in plans}
    columns = {label: cell(plan[name], summaries.get(name), cfg.limit) for name, label in COLUMNS}
    columns[OVERALL] = overall_cell(list(columns.values()))
    columns.update({label: cell(plan[name], summaries[name], cfg.limit) for name, label in EXTRA_COLUMNS if name in summaries})
    return {"model": cfg.model, "mode": cfg.rollout.mode, "rehearsal": cfg.rehearsal, "limit": cfg.limit, "columns": columns}


def _text(c: dict[str, Any]) -> str:
    if c["score"] is None:
        return "–"
    return f"{100 * c['score']:.1f} (n={c['n']}{', partial' if c['partial'] else ''})"


def markdown(table: dict[str, Any]) -> str:
    columns = table["columns"]
    lines = [
        "| model | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
        f"| {table['model']} | " + " | ".join(_text(c) for c in columns.values()) + " |",
        "",
        f"Scores in %, each the benchmark's own overall; n = scored trajectories; mode {table['mode']}"
        + (f", test-time rehearsal {table['rehearsal']}" if table["rehearsal"] != "none" else "")
        + (f", --limit {table['limit']} per category" if table["limit"] is not None else "") + ".",
        "",
    ]
    for label, c in columns.items():
        notes = [c["weighting"]] if "weighting" in c else []
        if c.get("skipped"):
            notes.append(f"not run: {skipped_text(c['skipped'])}")
        if notes:
            lines.append(f"- {label}: " + "; ".join(notes) + ".")
    return "\n".join(lines) + "\n"


def write_table(table: dict[str, Any], out: Path) -> None:
    (out / "benchmark_table.json").write_text(json.dumps(table, indent=2))
    text = markdown(table)
    (out / "benchmark_table.md").write_text(f"# envace benchmarks: {table['model']}\n\n{text}")
    print(text)
