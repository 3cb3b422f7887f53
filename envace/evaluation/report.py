"""Summaries as a console table, JSON and Markdown."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

COLUMNS = [
    ("n", "tasks", "{:d}"),
    ("success_rate", "success", "{:.3f}"),
    ("success_ci95", "95% CI", None),
    ("tool_f1", "tool F1", "{:.3f}"),
    ("fidelity/exact", "fid. exact", "{:.3f}"),
    ("fidelity/field_f1", "fid. field F1", "{:.3f}"),
    ("tokens_per_task", "tokens/task", "{:.0f}"),
    ("seconds_per_task", "s/task", "{:.1f}"),
    ("real_env_calls", "real calls", "{:d}"),
    ("malformed", "malformed", "{:d}"),
]


def _cell(stats: dict[str, Any], key: str, fmt: str | None) -> str:
    value = stats.get(key)
    if value is None:
        return "-"
    if key == "success_ci95":
        return f"[{value[0]:.2f}, {value[1]:.2f}]"
    return fmt.format(int(value) if fmt == "{:d}" else value)


def rows(summary: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(name, stats) for name, stats in summary.get("by_world", {}).items()] + [("overall", summary["overall"])]


def markdown_table(summary: dict[str, Any]) -> str:
    head = "| world | " + " | ".join(c[1] for c in COLUMNS) + " |"
    sep = "|" + "---|" * (len(COLUMNS) + 1)
    body = ["| " + " | ".join([name] + [_cell(stats, k, f) for k, _, f in COLUMNS]) + " |" for name, stats in rows(summary)]
    return "\n".join([head, sep, *body])


def write_summary(summary: dict[str, Any], out: Path) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    title = f"# envace eval: {summary.get('model')} ({summary.get('mode')} mode, {summary.get('source')})"
    (out / "summary.md").write_text(f"{title}\n\n{markdown_table(summary)}\n\nWall time: {summary.get('wall_seconds', 0):.1f} s\n")


def print_summary(summary: dict[str, Any], console: Console | None = None) -> None:
    table = Table(title=f"{summary.get('model')} · {summary.get('mode')} mode · {summary.get('source')}")
    table.add_column("world")
    for _, label, _ in COLUMNS:
        table.add_column(label, justify="right")
    for name, stats in rows(summary):
        table.add_row(name, *[_cell(stats, k, f) for k, _, f in COLUMNS])
    # Piped output (CI logs, files) would otherwise wrap at 80 columns.
    (console or Console(width=None if sys.stdout.isatty() else 160)).print(table)
