"""FinMCP-Bench-style tool F1: hand-computed values, edge cases, the loader and the aggregate."""

from __future__ import annotations

import json

import pytest

from envace.benchmarks import BENCHMARKS, tool_f1, tool_f1_summary
from envace.types import ToolCall, Trajectory


def names(*ns: str) -> list[dict]:
    return [{"name": n, "arguments": {}} for n in ns]


def test_multiset_f1_by_hand():
    r = tool_f1(names("a", "a", "b"), names("a", "b", "b", "c"))
    assert (r["tp"], r["n_pred"], r["n_ref"]) == (2, 4, 3)
    assert r["precision"] == pytest.approx(2 / 4) and r["recall"] == pytest.approx(2 / 3)
    assert r["f1"] == pytest.approx(4 / 7) and r["exact"] is False


@pytest.mark.parametrize(
    "ref, pred, expected",
    [
        ((), (), (1.0, 1.0, 1.0, True)),  # nothing expected, nothing called
        (("a",), (), (0.0, 0.0, 0.0, False)),  # expected calls, none made
        ((), ("a",), (0.0, 0.0, 0.0, False)),  # calls made, none expected
        (("a", "b"), ("b", "a"), (1.0, 1.0, 1.0, False)),  # same multiset, other order
        (("a", "b"), ("a", "b"), (1.0, 1.0, 1.0, True)),
        (("a",), ("b",), (0.0, 0.0, 0.0, False)),
    ],
)
def test_edge_cases(ref, pred, expected):
    r = tool_f1(names(*ref), names(*pred))
    assert (r["precision"], r["recall"], r["f1"], r["exact"]) == pytest.approx(expected)


def test_call_formats_are_all_read_by_name():
    ref = [{"function": {"name": "a", "arguments": "{}"}}, {"name": "b"}]
    pred = [ToolCall("a", {}), ToolCall("b", {"x": 1})]
    assert tool_f1(ref, pred)["f1"] == 1.0


def test_macro_and_micro_by_hand():
    samples = [tool_f1(names("a", "a", "b"), names("a", "b", "b", "c")), tool_f1(names("x"), names("x"))]
    s = tool_f1_summary(samples)
    assert s["macro"]["f1"] == pytest.approx((4 / 7 + 1) / 2)
    assert s["macro"]["precision"] == pytest.approx((0.5 + 1) / 2)
    # pooled: TP = 3, predicted = 5, reference = 4
    assert s["micro"]["precision"] == pytest.approx(3 / 5) and s["micro"]["recall"] == pytest.approx(3 / 4)
    assert s["micro"]["f1"] == pytest.approx(2 * 0.6 * 0.75 / 1.35)
    assert s["exact_match_rate"] == 0.5


def write_data(path):
    tools = [{"name": "get_quote", "description": "q", "parameters": {"type": "object", "properties": {"s": {"type": "string"}}}}]
    explicit = {"id": "s1", "messages": [{"role": "user", "content": "AAPL price?"}], "tools": tools,
                "reference_tool_calls": [{"name": "get_quote", "arguments": {"s": "AAPL"}}], "category": "quotes"}
    embedded = {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "MSFT and AAPL?"},
                             {"role": "assistant", "content": None, "tool_calls": [
                                 {"id": "1", "type": "function", "function": {"name": "get_quote", "arguments": "{\"s\": \"MSFT\"}"}},
                                 {"id": "2", "type": "function", "function": {"name": "get_quote", "arguments": "{\"s\": \"AAPL\"}"}}]}],
                "tools": [{"type": "function", "function": tools[0]}]}
    path.write_text("\n".join(json.dumps(r) for r in (explicit, embedded)))


def test_loader_and_scoring(tmp_path):
    data = tmp_path / "finmcp.jsonl"
    write_data(data)
    bench = BENCHMARKS.get("finmcp")(data_path=data)
    assert bench.offline_status() == {"finmcp": "ok"}
    first, second = bench.load_tasks()
    assert first.id == "s1" and first.metadata["category"] == "quotes" and first.tools[0]["type"] == "function"
    # the reference answer embedded in the messages is split off the prompt
    assert [m["role"] for m in second.messages] == ["system", "user"] and second.id == "finmcp-1"
    assert second.reference_calls == [{"name": "get_quote", "arguments": {"s": "MSFT"}}, {"name": "get_quote", "arguments": {"s": "AAPL"}}]
    assert "error" in bench.make_world(first).call("get_quote", {"s": "AAPL"})

    value, details = bench.score(second, Trajectory(task_id=second.id, mode="real", tool_calls=[ToolCall("get_quote", {})]))
    assert value == pytest.approx(2 / 3) and details["recall"] == 0.5
    results = [{"category": t.metadata["category"], "score": v, "details": d}
               for t, (v, d) in ((first, bench.score(first, Trajectory(task_id="s1", mode="real"))), (second, (value, details)))]
    summary = bench.aggregate(results)
    assert summary["overall"] == pytest.approx((0 + 2 / 3) / 2)
    assert summary["tool_f1"]["all"]["micro"]["recall"] == pytest.approx(1 / 3)
    assert set(summary["categories"]) == {"quotes", "finmcp"}
    assert [t.id for t in bench.load_tasks(categories=["quotes"])] == ["s1"]


def test_registry_and_a_missing_benchmark_package(monkeypatch):
    import sys

    from envace.benchmarks import BenchmarkDependencyError
    from envace.benchmarks import bfcl

    assert BENCHMARKS.names() == ["bfcl", "finmcp", "tau2", "vitabench"]
    monkeypatch.setitem(sys.modules, "bfcl_eval", None)  # as if not installed
    bfcl.bfcl.cache_clear()
    try:
        with pytest.raises(BenchmarkDependencyError, match="pip install --no-deps bfcl-eval==2026.3.23"):
            BENCHMARKS.get("bfcl")().load_tasks(categories=["simple_python"])
    finally:
        bfcl.bfcl.cache_clear()


def test_missing_data_is_explained(monkeypatch):
    monkeypatch.delenv("ENVACE_FINMCP_PATH", raising=False)
    bench = BENCHMARKS.get("finmcp")()
    assert "not redistributable" in bench.offline_status()["finmcp"]
    with pytest.raises(FileNotFoundError, match="ENVACE_FINMCP_PATH"):
        bench.load_tasks()
