"""Benchmark adapters: `BENCHMARKS.get(name)()` gives a `Benchmark` (see base.py).

Registered: bfcl (BFCL-v4), tau2 (tau2-bench), finmcp (FinMCP-Bench tool F1), vitabench (VitaBench
public part). Importing this package is cheap: each adapter imports its benchmark's own package
only when first used, and names the pip command if it is missing.
"""

from __future__ import annotations

from envace.benchmarks import bfcl, finmcp, tau2, vitabench  # noqa: F401  (registration side effect)
from envace.benchmarks.base import BENCHMARKS, Benchmark, BenchmarkDependencyError, benchmark_reward, openai_chat
from envace.benchmarks.finmcp import tool_f1, tool_f1_summary

__all__ = ["BENCHMARKS", "Benchmark", "BenchmarkDependencyError", "benchmark_reward", "openai_chat", "tool_f1", "tool_f1_summary"]
