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
    ("partial_credit", "partial credit", "{:.3f}"),
    ("tool_f1", "tool F1", "{:.3f}"),
    ("fidelity/exact", "fid. exact", "{:.3f}"),
    ("fidelity/field_f1", "fid. field F1", "{:.3f}"),
    ("calls_per_task", "calls/task", "{:.2f}"),
    ("answered_rate", "answered", "{:.2f}"),
    ("tokens_per_task", "tokens/task", "{:.0f}"),
    ("seconds_per_task", "s/task", "{:.1f}"),
    ("real_env_calls", "real calls", "{:d}"),
    # Executions on a fresh world after the rollout (the replay reward, fidelity's reference).
    ("verification_calls", "verify calls", "{:d}"),
    ("malformed", "malformed", "{:d}"),
    ("tool_exceptions", "tool exceptions", "{:d}"),
]


def _cell(stats: dict[str, Any], key: str, fmt: str | None) -> str:
    value = stats.get(key)
    if value is None:
        return "-"
    if key == "success_ci95":
        return f"[{value[0]:.2f}, {value[1]:.2f}]"
    return fmt.format(int(value) if fmt == "{:d}" else value)


def group_key(summary: dict[str, Any]) -> str:
    """What the rows are: benchmark categories or worlds."""
    return "category" if "by_category" in summary else "world"


def rows(summary: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(name, stats) for name, stats in summary.get(f"by_{group_key(summary)}", {}).items()] + [("overall", summary["overall"])]


def markdown_table(summary: dict[str, Any]) -> str:
    head = f"| {group_key(summary)} | " + " | ".join(c[1] for c in COLUMNS) + " |"
    sep = "|" + "---|" * (len(COLUMNS) + 1)
    body = ["| " + " | ".join([name] + [_cell(stats, k, f) for k, _, f in COLUMNS]) + " |" for name, stats in rows(summary)]
    return "\n".join([head, sep, *body])


def rehearsal_line(summary: dict[str, Any]) -> str:
    """The cost of test-time rehearsal next to what it bought."""
    r = summary.get("rehearsal")
    if not r:
        return ""
    c, n = r["cost"], max(summary["overall"]["n"], 1)
    return (f"Rehearsal: {r['mode']} x{r['n']} by {r['rehearser']}: {c['extra_tokens'] / n:.0f} extra tokens and "
            f"{c['rehearsal_seconds'] / n:.1f} extra seconds per task ({c['execution_tokens'] / n:.0f} tokens, "
            f"{c['execution_seconds'] / n:.1f} s for the committed run).")


def prerequisites_line(summary: dict[str, Any]) -> str:
    """What the scored tasks needed first (unscored, e.g. BFCL's memory-writing conversations)."""
    p = summary.get("prerequisites")
    if not p:
        return ""
    ends = ", ".join(f"{reason} {n}" for reason, n in p["end_reasons"].items())
    return (f"Prerequisites (unscored, real mode, run first): {p['n']} tasks, {p['tokens_per_task']:.0f} tokens and "
            f"{p['seconds_per_task']:.1f} s per task, {p['wall_seconds']:.1f} s in all; ended: {ends}.")


def skipped_text(skipped: dict[str, str], shown: int = 4) -> str:
    """{category: why} as "why: a, b; other why: c" (many categories share a reason; long lists
    are cut to `shown` names and a count)."""
    by_reason: dict[str, list[str]] = {}
    for category, why in skipped.items():
        by_reason.setdefault(why, []).append(category)

    def names(categories: list[str]) -> str:
        more = len(categories) - shown
        return ", ".join(categories[:shown]) + (f" and {more} more" if more > 0 else "")

    return "; ".join(f"{why}: {names(categories)}" for why, categories in by_reason.items())


def benchmark_line(summary: dict[str, Any]) -> str:
    """The benchmark's own overall (its weighting) and what the run left out."""
    b = summary.get("benchmark")
    if not b:
        return ""
    agg = b["aggregate"]
    if agg is None:
        line = f"{b['name']}: not scored by the benchmark reward, so no benchmark aggregate."
    else:
        groups = ", ".join(f"{g} {v:.3f}" for g, v in agg.get("groups", {}).items())
        line = f"{b['name']} overall: {agg['overall']:.3f} ({agg['weighting']})" + (f"; groups: {groups}" if groups else "") + "."
    left_out = [f"--limit {b['limit']} per category"] if b["limit"] is not None else []
    if b["skipped"]:
        left_out.append(f"not run: {skipped_text(b['skipped'])}")
    return line + (f" Partial ({'; '.join(left_out)})." if left_out else "")


def write_summary(summary: dict[str, Any], out: Path) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    title = f"# envace eval: {summary.get('model')} ({summary.get('mode')} mode, {summary.get('source')})"
    notes = [line for line in (benchmark_line(summary), prerequisites_line(summary), rehearsal_line(summary), f"Wall time: {summary.get('wall_seconds', 0):.1f} s") if line]
    if summary.get("trained_on_eval_tasks"):
        notes.insert(0, f"**Flagged: the model was trained on {len(summary['trained_on_eval_tasks'])} of these tasks.**")
    (out / "summary.md").write_text(f"{title}\n\n{markdown_table(summary)}\n\n" + "\n\n".join(notes) + "\n")


def print_summary(summary: dict[str, Any], console: Console | None = None) -> None:
    table = Table(title=f"{summary.get('model')} · {summary.get('mode')} mode · {summary.get('source')}")
    table.add_column(group_key(summary))
    for _, label, _ in COLUMNS:
        table.add_column(label, justify="right")
    for name, stats in rows(summary):
        table.add_row(name, *[_cell(stats, k, f) for k, _, f in COLUMNS])
    # Piped output (CI logs, files) would otherwise wrap at 80 columns.
    console = console or Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
    for line in (benchmark_line(summary), prerequisites_line(summary), rehearsal_line(summary)):
        if line:
            console.print(line, markup=False)


def pooled_success(summary: dict[str, Any], worlds: set[str] | None) -> str:
    """Success over the tasks of some worlds (None = all) of an eval summary, with its 95% CI."""
    from envace.metrics import wilson_interval

    parts = [s for w, s in summary["by_world"].items() if worlds is None or w in worlds]
    n = sum(s["n"] for s in parts)
    wins = sum(s["success_rate"] * s["n"] for s in parts)
    lo, hi = wilson_interval(wins, n)
    return f"{wins / max(n, 1):.2f} [{lo:.2f}, {hi:.2f}] (n={n})"
