"""`envace eval --benchmark NAME|all`: checks before any work, summaries with the benchmark's own
aggregate, rehearse mode and test-time rehearsal, and the paper-shaped table; scripted policies
stand in for the model (one slow test runs the real default model)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.stub_openai import stub_openai

from envace.backends.scripted import ScriptedGenerator
from envace.config import ConfigError, build
from envace.evaluation.runner import EvalConfig, plan_benchmarks, run_benchmark_eval, run_eval
from tests.test_bench_engine import reference_policy

pytestmark = pytest.mark.filterwarnings("ignore:.*`ReadOnly` qualifier:UserWarning")
VITA_FIXTURES = Path(__file__).parent / "fixtures" / "vitabench"


def needs(package: str) -> None:
    pytest.importorskip(package, reason=f"{package} is not installed (make install; docs/benchmarks.md)")


def config(tmp_path, **values) -> EvalConfig:
    return build(EvalConfig, {"output_dir": str(tmp_path / "out"), "progress": False, **values})


@pytest.mark.parametrize("values,match", [
    ({"benchmark": "nope"}, "unknown benchmark 'nope'"),
    ({"benchmark": "bfcl", "data_dir": "."}, "--data-dir is read by finmcp, vitabench"),
    ({"categories": ["airline"]}, "--categories goes with --benchmark"),
    ({"benchmark": "finmcp", "data_dir": "/no/such/dir"}, "does not exist"),
    ({"benchmark": "bfcl", "judge": "http://127.0.0.1:9/v1"}, "--judge is read by --reward judge and by the LLM-judged benchmarks \\(vitabench"),
    ({"judge": "http://127.0.0.1:9/v1"}, "here it would be unused"),
])
def test_bad_benchmark_options_fail_at_validation(values, match):
    with pytest.raises(ConfigError, match=match):
        build(EvalConfig, values)


def test_missing_data_and_missing_user_model_fail_before_work(tmp_path, monkeypatch):
    monkeypatch.delenv("ENVACE_FINMCP_PATH", raising=False)
    with pytest.raises(ConfigError, match="finmcp: cannot run offline: needs the FinMCP-Bench data"):
        plan_benchmarks(config(tmp_path, benchmark="finmcp"))
    with pytest.raises(ConfigError, match="vitabench delivery: needs a simulated user .*--user-model"):
        plan_benchmarks(config(tmp_path, benchmark="vitabench", data_dir=str(VITA_FIXTURES)))


def test_a_missing_package_is_named(tmp_path, monkeypatch):
    from envace.benchmarks import bfcl

    monkeypatch.setitem(sys.modules, "bfcl_eval", None)  # as if not installed
    bfcl.bfcl.cache_clear()
    try:
        with pytest.raises(ConfigError, match="pip install --no-deps bfcl-eval==2026.3.23"):
            plan_benchmarks(config(tmp_path, benchmark="bfcl", categories=["simple_python"]))
    finally:
        bfcl.bfcl.cache_clear()


def test_categories_that_cannot_run_say_why(tmp_path):
    needs("bfcl_eval")
    with pytest.raises(ConfigError, match="bfcl web_search_base: cannot run offline: needs a paid web-search API"):
        plan_benchmarks(config(tmp_path, benchmark="bfcl", categories=["web_search_base"]))
    with pytest.raises(ConfigError, match="unknown"):
        plan_benchmarks(config(tmp_path, benchmark="bfcl", categories=["no_such_category"]))


def test_tau2_needs_a_user_model_in_real_mode_only(tmp_path):
    needs("tau2")
    with pytest.raises(ConfigError, match="tau2 airline: needs a simulated user"):
        plan_benchmarks(config(tmp_path, benchmark="tau2", limit=1))
    [solo] = plan_benchmarks(config(tmp_path, benchmark="tau2", categories=["telecom_solo"], limit=1))
    assert solo.split == "base" and len(solo.tasks) == 1 and solo.partial(1)
    # Off real mode the rehearsing model imagines the user, telecom's (who acts on the phone) too.
    [telecom] = plan_benchmarks(config(tmp_path, benchmark="tau2", categories=["telecom"], limit=1, mode="rehearse"))
    assert telecom.tasks[0].rules.user_uses_world


def bfcl_reference(tmp_path, **values):
    """A one-task BFCL multi-turn config and a scripted policy replaying its ground truth; the
    policy plays the tools with a constant answer when asked (rehearse mode)."""
    needs("bfcl_eval")
    cfg = config(tmp_path, benchmark="bfcl", categories=["multi_turn_base"], limit=1, max_total_tokens=100_000, max_turn_tokens=4096, **values)
    [plan] = plan_benchmarks(cfg)
    return cfg, plan.tasks[0]


def test_benchmark_summary_has_categories_aggregate_and_time(tmp_path, tokenizer):
    cfg, task = bfcl_reference(tmp_path)
    summary = run_benchmark_eval(cfg, reference_policy(tokenizer, task.reference_calls))
    assert summary["by_category"]["multi_turn_base"]["n"] == 1 and summary["overall"]["success_rate"] == 1.0
    aggregate = summary["benchmark"]["aggregate"]
    assert aggregate["overall"] == 1.0 and aggregate["groups"] == {"multi_turn": 1.0}
    assert summary["benchmark"]["partial"] and summary["benchmark"]["skipped"]["simple_python"] == "not in --categories"
    assert summary["overall"]["seconds_per_task"] > 0 and summary["end_reasons"] == {"answered": 1}
    out = tmp_path / "out"
    assert "multi_turn_base" in (out / "summary.md").read_text() and "bfcl overall: 1.000" in (out / "summary.md").read_text()
    record = json.loads((out / "records.jsonl").read_text().splitlines()[0])
    assert record["category"] == "multi_turn_base"


def test_memory_prerequisites_run_first_and_are_reported_not_scored(tmp_path, tokenizer):
    from tests.test_bench_engine import memory_policy

    needs("bfcl_eval")
    cfg = config(tmp_path, benchmark="bfcl", categories=["memory_kv"], limit=1, max_total_tokens=200_000, max_turn_tokens=4096, mode="rehearse")
    write = {"name": "core_memory_add", "arguments": {"key": "first_name", "value": "Michael"}}
    summary = run_benchmark_eval(cfg, memory_policy(tokenizer, write))
    assert summary["overall"]["n"] == 1 and summary["benchmark"]["aggregate"]["groups"] == {"agentic": 1.0}
    prereq = summary["prerequisites"]
    # In real mode although the scored question ran in rehearse mode: they write the real memory.
    assert prereq["n"] == 10 and prereq["end_reasons"] == {"answered": 10} and prereq["real_env_calls"] == 1
    out = tmp_path / "out"
    assert len((out / "prerequisites.jsonl").read_text().splitlines()) == 10
    assert "Prerequisites (unscored, real mode, run first): 10 tasks" in (out / "summary.md").read_text()


def test_rehearse_mode_reports_fidelity_against_replayed_calls(tmp_path, tokenizer):
    cfg, task = bfcl_reference(tmp_path, mode="rehearse")
    policy = reference_policy(tokenizer, task.reference_calls)
    reply = policy.reply
    policy.reply = lambda text: '{"result": "ok"}' if text.rsplit("<|im_start|>", 1)[-1].startswith("tool") else reply(text)
    summary = run_benchmark_eval(cfg, policy)
    assert summary["overall"]["fidelity/calls"] == len(task.reference_calls)
    assert 0.0 <= summary["overall"]["fidelity/field_f1"] < 1.0
    assert summary["benchmark"]["aggregate"]["overall"] == 1.0  # BFCL checks the calls, not what was seen


def test_test_time_rehearsal_runs_on_a_benchmark(tmp_path, tokenizer):
    cfg, task = bfcl_reference(tmp_path, rehearsal="parallel", n=1, memory_tokens=32)
    summary = run_benchmark_eval(cfg, reference_policy(tokenizer, task.reference_calls))
    assert summary["rehearsal"]["cost"]["extra_tokens"] > 0 and summary["overall"]["real_env_calls"] > 0
    assert summary["benchmark"]["aggregate"]["overall"] == 1.0


def test_all_writes_one_paper_shaped_table(tmp_path, tokenizer, monkeypatch):
    needs("bfcl_eval")
    needs("tau2")
    monkeypatch.delenv("ENVACE_FINMCP_PATH", raising=False)
    data = tmp_path / "data"
    (data / "finmcp").mkdir(parents=True)
    sample = {"id": "f1", "messages": [{"role": "user", "content": "AAPL price?"}], "tools": [{"name": "get_quote", "parameters": {"type": "object", "properties": {}}}],
              "reference_tool_calls": [{"name": "get_quote", "arguments": {}}]}
    (data / "finmcp" / "samples.jsonl").write_text(json.dumps(sample) + "\n")
    # VitaBench data from the test fixtures, so no default location (../shared) is consulted.
    shutil.copytree(Path(__file__).parent / "fixtures" / "vitabench", data / "vitabench")
    cfg = config(tmp_path, benchmark="all", limit=1, data_dir=str(data), categories=["multi_turn_base", "irrelevance", "airline", "telecom_solo", "delivery", "finmcp"])
    table = run_benchmark_eval(cfg, ScriptedGenerator(tokenizer, lambda _: "I cannot help with that."))
    bfcl, tau2, vita, overall, finmcp = (table["columns"][c] for c in ("BFCL-v4", "tau2-bench", "VitaBench", "overall", "FinMCP F1"))
    # BFCL's weighting: irrelevance (no call: pass) weighs 10, multi-turn (no call: fail) 30.
    assert bfcl["score"] == pytest.approx(10 / 40) and bfcl["n"] == 2 and bfcl["partial"]
    assert "web_search_base" in bfcl["skipped"] and bfcl["skipped"]["live_simple"] == "not in --categories"
    assert tau2["n"] == 1 and tau2["score"] == 0.0 and "needs a simulated user" in tau2["skipped"]["airline"]
    assert vita["score"] is None and "needs a simulated user" in vita["skipped"]["delivery"]
    assert overall["score"] == pytest.approx((10 / 40 + 0.0) / 2) and overall["partial"] and overall["n"] == 3
    assert finmcp["score"] == 0.0 and finmcp["n"] == 1
    out = tmp_path / "out"
    text = (out / "benchmark_table.md").read_text()
    assert "| model | BFCL-v4 | tau2-bench | VitaBench | overall | FinMCP F1 |" in text and "25.0 (n=2, partial)" in text
    assert json.loads((out / "benchmark_table.json").read_text())["columns"]["VitaBench"]["score"] is None
    assert (out / "bfcl" / "summary.json").is_file() and (out / "tau2" / "summary.json").is_file()


def test_a_user_model_url_plays_the_benchmarks_user(tmp_path, tokenizer):
    with stub_openai([{"content": "I would like to order lunch."}, {"content": "###STOP###"}]) as (url, _):
        cfg = config(tmp_path, benchmark="vitabench", data_dir=str(VITA_FIXTURES), categories=["delivery"], limit=1, user_model=url)
        summary = run_benchmark_eval(cfg, ScriptedGenerator(tokenizer, lambda _: "Sorry, I cannot order that."))
    [traj] = [json.loads(line) for line in (tmp_path / "out" / "trajectories.jsonl").read_text().splitlines()]
    assert [m["role"] for m in traj["messages"]] == ["system", "assistant", "user", "assistant"]
    assert traj["messages"][2]["content"] == "I would like to order lunch." and traj["end_reason"] == "answered"
    aggregate = summary["benchmark"]["aggregate"]
    assert aggregate["categories"]["delivery"] == {"accuracy": 0.0, "count": 1} and aggregate["metric"] == "proxy"  # nothing ordered


def test_judge_flag_scores_vitabench_by_its_rubrics(tmp_path, tokenizer, monkeypatch):
    """`--judge MODEL` becomes VitaBench's rubric judge: its greedy reply to the rubric prompt decides."""
    import envace.evaluation.runner as runner
    from tests.test_bench_vitabench import judge_reply

    prompts = []

    def judge_text(prompt: str) -> str:
        prompts.append(prompt)
        return judge_reply({i: True for i in range(20)})  # more verdicts than rubrics: the extra ones are ignored

    judge = ScriptedGenerator(tokenizer, judge_text)
    monkeypatch.setattr(runner, "open_generator", lambda spec, *a, **k: judge)
    with stub_openai([{"content": "Lunch, please."}, {"content": "###STOP###"}]) as (url, _):
        cfg = config(tmp_path, benchmark="vitabench", data_dir=str(VITA_FIXTURES), categories=["delivery"], limit=1, user_model=url, judge="http://judge/v1")
        summary = run_benchmark_eval(cfg, ScriptedGenerator(tokenizer, lambda _: "Sorry, I cannot order that."))
    [traj] = [json.loads(line) for line in (tmp_path / "out" / "trajectories.jsonl").read_text().splitlines()]
    aggregate = summary["benchmark"]["aggregate"]
    assert aggregate["categories"]["delivery"] == {"accuracy": 1.0, "count": 1} and aggregate["metric"] == "rubric"  # the judge said all met
    assert traj["reward_details"]["metric"] == "rubric" and traj["reward_details"]["proxy_score"] == 0.0
    assert "Sorry, I cannot order that." in prompts[-1] and "rubric_0" in prompts[-1]


@pytest.mark.slow
def test_bfcl_multi_turn_on_the_default_model(tmp_path):
    needs("bfcl_eval")
    cfg = config(tmp_path, benchmark="bfcl", categories=["multi_turn_base"], limit=1, temperature=0.0, max_turn_tokens=48, max_total_tokens=3584)
    summary = run_eval(cfg)
    assert summary["by_category"]["multi_turn_base"]["n"] == 1 and summary["benchmark"]["aggregate"] is not None
    assert 0.0 <= summary["overall"]["success_rate"] <= 1.0 and (tmp_path / "out" / "trajectories.jsonl").is_file()
