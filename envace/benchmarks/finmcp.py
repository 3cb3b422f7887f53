"""FinMCP-Bench-style tool F1, and a loader for the benchmark's data (user-supplied: the data is
published on a model hub and not redistributable).

The metric compares tool NAMES only, as multisets:
  TP = size of the multiset intersection of reference and predicted names
  P = TP / #predicted, R = TP / #reference, F1 = 2PR / (P + R)
  A zero denominator gives 1 when both lists are empty and 0 otherwise: nothing expected and
  nothing called is perfect; calling nothing when calls were expected, or calling something
  when nothing was expected, is 0. F1 is 0 when P + R = 0.
  exact = the ordered name sequences are equal.
Over a set of samples: macro = mean of per-sample P/R/F1; micro = P/R/F1 of the pooled counts;
exact_match_rate = share of samples with exact = True.

Data (JSON list or JSONL, one sample per line):
  {"id": "...",                      optional; defaults to <file stem>-<index>
   "messages": [...],                 OpenAI chat messages (system optional, user, ...)
   "tools": [...],                    OpenAI tool schemas ({"type": "function", "function": {...}}) or bare function dicts
   "reference_tool_calls": [...],     optional; else "tool_calls"; else the tool_calls of the assistant
                                      messages after the last user message (those messages are then
                                      removed from the prompt)
   "category": "..."}                 optional; defaults to "finmcp"
  A call is {"name", "arguments"} or OpenAI's {"function": {"name", "arguments"}}; arguments may be a
  JSON string.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

from envace.benchmarks.base import BENCHMARKS, Benchmark, UnexecutableWorld, category_accuracy
from envace.envs.base import ToolWorld
from envace.rewards import prf
from envace.types import Task, ToolCall, Trajectory

DATA_ENV = "ENVACE_FINMCP_PATH"


def call_name(call: ToolCall | dict[str, Any]) -> str:
    if isinstance(call, ToolCall):
        return call.name
    return call["function"]["name"] if "function" in call else call["name"]


def _prf(tp: int, n_pred: int, n_ref: int) -> dict[str, float]:
    precision, recall, f1 = prf(tp, n_pred, n_ref)
    return {"precision": precision, "recall": recall, "f1": f1}


def tool_f1(reference_calls: Iterable[ToolCall | dict[str, Any]], predicted_calls: Iterable[ToolCall | dict[str, Any]]) -> dict[str, Any]:
    """Per-sample name-multiset precision/recall/F1, the counts behind them, and exact ordered match."""
    ref = [call_name(c) for c in reference_calls]
    pred = [call_name(c) for c in predicted_calls]
    tp = sum((Counter(ref) & Counter(pred)).values())
    return {"tp": tp, "n_pred": len(pred), "n_ref": len(ref), **_prf(tp, len(pred), len(ref)), "exact": ref == pred}


def tool_f1_summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Macro and micro P/R/F1 and the exact-match rate over per-sample `tool_f1` results."""
    n = len(samples)
    if not n:
        return {"count": 0}
    macro = {k: sum(s[k] for s in samples) / n for k in ("precision", "recall", "f1")}
    tp, n_pred, n_ref = (sum(s[k] for s in samples) for k in ("tp", "n_pred", "n_ref"))
    return {"count": n, "macro": macro, "micro": _prf(tp, n_pred, n_ref), "exact_match_rate": sum(s["exact"] for s in samples) / n}


# ---- data --------------------------------------------------------------------------------

def _normalize_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    return {"name": fn["name"], "arguments": json.loads(args) if isinstance(args, str) else dict(args)}


def _normalize_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return tool if tool.get("type") == "function" else {"type": "function", "function": tool}


def _split_reference(record: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(prompt messages, reference calls) of one sample, per the precedence in the module doc."""
    messages = list(record["messages"])
    calls = record.get("reference_tool_calls", record.get("tool_calls"))
    if calls is not None:
        return messages, calls
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    answer = messages[last_user + 1 :]
    calls = [c for m in answer if m["role"] == "assistant" for c in m.get("tool_calls") or []]
    return (messages[: last_user + 1], calls) if calls else (messages, [])


def read_records(path: Path) -> list[dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    data = json.loads(text)
    return data if isinstance(data, list) else [data]


def record_to_task(record: dict[str, Any], default_id: str) -> Task:
    messages, calls = _split_reference(record)
    return Task(
        id=str(record.get("id", default_id)),
        world=FinMCP.name,
        messages=messages,
        tools=[_normalize_tool(t) for t in record.get("tools", [])],
        reference_calls=[_normalize_call(c) for c in calls],
        split="test",
        metadata={"benchmark": FinMCP.name, "category": record.get("category", FinMCP.name)},
    )


@BENCHMARKS.register("finmcp")
class FinMCP(Benchmark):
    """Tool-name F1 against the reference calls; tools are not executed (they are live MCP
    services), so every call is answered with a NOT_EXECUTABLE error."""

    name = "finmcp"

    def __init__(self, data_path: str | Path | None = None):
        path = data_path or os.environ.get(DATA_ENV)
        self.data_path = Path(path) if path else None

    def load_tasks(self, split: str = "test", limit: int | None = None, categories: list[str] | None = None) -> list[Task]:
        if self.data_path is None:
            raise FileNotFoundError(f"FinMCP-Bench data is not redistributable: download it and pass data_path (envace eval: --data-dir) or set {DATA_ENV} (docs/benchmarks.md)")
        files = sorted(self.data_path.glob("*.json*")) if self.data_path.is_dir() else [self.data_path]
        tasks = [record_to_task(r, f"{f.stem}-{i}") for f in files for i, r in enumerate(read_records(f))]
        tasks = [t for t in tasks if categories is None or t.metadata["category"] in categories]
        return tasks[:limit]

    def make_world(self, task: Task) -> ToolWorld:
        return UnexecutableWorld("FinMCP tools are live services; calls are scored by name, not executed")

    def score(self, task: Task, trajectory: Trajectory) -> tuple[float, dict[str, Any]]:
        result = tool_f1(task.reference_calls, trajectory.tool_calls)
        return result["f1"], result

    def offline_status(self) -> dict[str, str]:
        if self.data_path is None or not self.data_path.exists():
            return {self.name: f"needs the FinMCP-Bench data (not redistributable): pass data_path (envace eval: --data-dir) or set {DATA_ENV}"}
        return {self.name: "ok"}

    def aggregate(self, results: list[dict[str, Any]]) -> dict[str, Any]:
        """Tool F1 summaries overall and per category; needs each result's score "details"."""
        by_category: dict[str, list[dict[str, Any]]] = {}
        for r in results:
            by_category.setdefault(r["category"], []).append(r["details"])
        summary = tool_f1_summary([r["details"] for r in results])
        return {
            "categories": category_accuracy(results),
            "tool_f1": {"all": summary, **{c: tool_f1_summary(s) for c, s in by_category.items()}},
            "overall": summary["macro"]["f1"] if results else 0.0,
            "weighting": "overall = macro tool F1 (mean over samples); micro = F1 of pooled counts",
        }
