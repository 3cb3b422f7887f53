import dataclasses
import json
import time

import pytest

from envace.backends.scripted import ScriptedGenerator
from envace.envs.environment import WorldEnvironment
from envace.rehearsal import (
    GuardRehearsal,
    PromptError,
    RehearsalConfig,
    RehearsalGuard,
    RehearsalPrompts,
    Rehearser,
    rehearse_memory,
    run_with_rehearsal,
)
from envace.rehearsal.private import fit_tokens
from envace.rewards import Context, compute_rewards
from envace.rollout import GuardDecision, RolloutConfig, RolloutEngine
from envace.types import CallStatus, EndReason, Role, Task
from tests.test_rollout import WORLD, agent, counter_task

EVALUATE_MARK = "Evaluate the rehearsal in three short lines"
SUMMARY_MARK = "write notes for yourself"
NOTES = "Plan: call add with n=5, then answer with the value."


def last_header(text: str) -> str:
    return text.rsplit("<|im_start|>", 1)[-1]


class Model:
    """A scripted model playing every part (agent, tools, self-evaluation, summary) that records
    what it was shown. Evaluation i (from 1) reads "EVAL-i: ..." so tests can trace where it went."""

    def __init__(self, act=agent, rehearsed='{"value": 5}', notes=NOTES):
        self.act, self.rehearsed, self.notes = act, rehearsed, notes
        self.seen: list[str] = []
        self.evaluations = 0

    def __call__(self, text: str) -> str:
        self.seen.append(text)
        request = last_header(text.rsplit("<|im_start|>assistant", 1)[0])  # the message being answered
        if request.startswith("user") and EVALUATE_MARK in request:
            self.evaluations += 1
            return f"EVAL-{self.evaluations}: Goal reached: yes. Wrong call: none. Advice: keep the plan."
        if request.startswith("user") and SUMMARY_MARK in request:
            return self.notes
        if last_header(text).startswith("tool"):
            return self.rehearsed
        return self.act(text)

    def generator(self, tokenizer):
        return ScriptedGenerator(tokenizer, self)


class SpyEnv(WorldEnvironment):
    """Records every world it makes, with the state it started from."""

    def __init__(self):
        self.worlds = []

    def make_world(self, task):
        world = super().make_world(task)
        self.worlds.append((world, world.snapshot()))
        return world


def marked_len(tokenizer, text):
    """Tokens a scripted reply costs: the text plus the end marker the generator appends."""
    return len(tokenizer.encode(text + tokenizer.eos_token, add_special_tokens=False))


# ---- private rehearsal ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["parallel", "sequential"])
def test_rehearsal_never_touches_the_real_environment(tokenizer, mode):
    env = SpyEnv()
    task = counter_task()
    rehearser = Rehearser(Model().generator(tokenizer), env, RehearsalConfig(mode=mode, n=3))
    results = rehearser.rehearse_batch([task])
    assert env.worlds == []  # rehearsing creates no world at all
    assert len(results[0].attempts) == 3
    assert all(a.mode == "rehearse" and a.real_env_calls == 0 and a.num_tokens(Role.ENV) == 0 for a in results[0].attempts)

    result = rehearser.run(task)
    [(world, initial)] = env.worlds  # only the committed run made a world, from the initial state
    assert initial == task.initial_state
    assert world.state == {"value": 5}
    assert result.committed.mode == "real" and result.committed.real_env_calls == 1


def test_rehearsal_keeps_a_shared_world_unchanged(tokenizer):
    """An application's environment may hand out one live world: rehearsal must leave it alone."""
    shared = WorldEnvironment().make_world(counter_task())
    env = SpyEnv()
    env.make_world = lambda task: shared
    before = shared.snapshot()
    Rehearser(Model().generator(tokenizer), env, RehearsalConfig(n=4)).rehearse_batch([counter_task()])
    assert shared.snapshot() == before


def test_parallel_attempts_are_one_batch_from_the_same_context(tokenizer):
    model = Model()
    policy = model.generator(tokenizer)
    result = Rehearser(policy, WorldEnvironment(), RehearsalConfig(mode="parallel", n=3)).run(counter_task())
    assert [a.group for a in result.attempts] == [0, 1, 2]
    assert len({tuple(a.turns[0].token_ids) for a in result.attempts}) == 1  # same prompt
    # batched: 3 attempts x 3 outputs in 3 rounds, 3 evaluations in 1 call, 1 summary, 2 committed ACT turns
    assert policy.stats.calls == 3 + 1 + 1 + 2
    assert result.evaluations == [f"EVAL-{i}: Goal reached: yes. Wrong call: none. Advice: keep the plan." for i in (1, 2, 3)]


def test_sequential_attempts_see_earlier_attempts_and_evaluations(tokenizer):
    model = Model()
    result = Rehearser(model.generator(tokenizer), WorldEnvironment(), RehearsalConfig(mode="sequential", n=3)).run(counter_task())
    first_prompts = [tokenizer.decode(a.turns[0].token_ids) for a in result.attempts]
    assert "Private rehearsal so far" not in first_prompts[0]
    assert "EVAL-1" in first_prompts[1] and "EVAL-2" not in first_prompts[1]
    assert "EVAL-1" in first_prompts[2] and "EVAL-2" in first_prompts[2]
    assert 'tool (imagined): {"value": 5}' in first_prompts[1]  # attempt 1's transcript, too
    # Each evaluation was asked about its own attempt right after it, before the next attempt.
    eval_prompts = [s for s in model.seen if EVALUATE_MARK in s]
    assert len(eval_prompts) == 3 and 'agent: <tool_call>{"name": "add"' in eval_prompts[0]


def test_memory_respects_its_token_bound_and_reaches_the_committed_run(tokenizer):
    model = Model(notes="note " * 400)
    policy = model.generator(tokenizer)
    result = Rehearser(policy, WorldEnvironment(), RehearsalConfig(n=2, memory_tokens=16)).run(counter_task())
    assert 0 < len(tokenizer.encode(result.memory, add_special_tokens=False)) <= 16
    assert result.cost.summary.generated == 16  # generation was capped at the bound
    committed_prompt = result.committed.turns[0].text
    assert "# Private rehearsal notes" in committed_prompt and result.memory in committed_prompt
    assert result.committed.final_answer == "The counter is 5."


def test_fit_tokens_cuts_to_the_bound(tokenizer):
    text = "rehearsal notes about the counter " * 50
    fitted = fit_tokens(text, tokenizer, 10)
    assert len(tokenizer.encode(fitted, add_special_tokens=False)) <= 10 and text.startswith(fitted)
    assert fit_tokens("short", tokenizer, 10) == "short"


def test_accounting_adds_up(tokenizer):
    """Hand count: every reply's tokens, and every token fed, against the generators' own counters."""
    acting, rehearsing = Model(), Model()
    policy, rehearser_gen = acting.generator(tokenizer), rehearsing.generator(tokenizer)
    n = 2
    result = Rehearser(policy, WorldEnvironment(), RehearsalConfig(n=n), rehearser=rehearser_gen).run(counter_task())
    cost = result.cost

    per_attempt = marked_len(tokenizer, '<tool_call>{"name": "add", "arguments": {"n": 5}}</tool_call>') + marked_len(tokenizer, '{"value": 5}') + marked_len(tokenizer, "The counter is 5.")
    assert cost.attempts.generated == n * per_attempt
    assert cost.evaluations.generated == sum(marked_len(tokenizer, e) for e in result.evaluations)
    assert cost.summary.generated == marked_len(tokenizer, NOTES)
    assert cost.attempts.prompt == sum(len(a.token_ids) for a in result.attempts) - n * per_attempt
    # The rehearsing model did all the extra work, the acting model only the committed run.
    assert rehearser_gen.stats.generated_tokens == cost.extra.generated
    assert rehearser_gen.stats.prefill_tokens == cost.extra.prompt
    assert policy.stats.generated_tokens == cost.execution.generated
    assert policy.stats.prefill_tokens == cost.execution.prompt
    assert all(EVALUATE_MARK not in s and SUMMARY_MARK not in s for s in acting.seen)

    d = cost.as_dict()
    phases = d["phases"]
    assert d["extra_tokens"] == sum(phases[p]["generated"] + phases[p]["prompt"] for p in ("attempts", "evaluations", "summary", "guard"))
    assert d["extra_tokens"] == d["extra_generated_tokens"] + d["extra_prompt_tokens"]
    assert d["execution_tokens"] == len(result.committed.token_ids)
    assert d["rehearsal_seconds"] == pytest.approx(sum(phases[p]["seconds"] for p in ("attempts", "evaluations", "summary", "guard")), abs=2e-3)


def test_batch_over_tasks_and_run_with_rehearsal(tokenizer):
    tasks = [counter_task(), counter_task(5)]
    tasks[1].id = "t1"
    policy = Model().generator(tokenizer)
    env = WorldEnvironment()
    started = time.perf_counter()
    groups, acc = run_with_rehearsal(policy, env, tasks, RehearsalConfig(n=2), progress=False)
    wall = time.perf_counter() - started
    assert [[t.task_id for t in g] for g in groups] == [["t0"], ["t1"]]
    compute_rewards("replay", groups, tasks, Context(env=env))
    assert [g[0].reward for g in groups] == [1.0, 1.0]
    assert acc["mode"] == "parallel" and acc["n"] == 2 and acc["tasks"] == 2
    assert acc["extra_tokens"] == sum(t["extra_tokens"] for t in acc["per_task"])
    assert acc["execution_tokens"] == sum(len(g[0].token_ids) for g in groups)
    assert acc["rehearsal_seconds"] + acc["execution_seconds"] <= wall + 0.01
    assert acc["per_task"][0]["memory"] == NOTES and len(acc["per_task"][1]["evaluations"]) == 2


class PeakSessions(ScriptedGenerator):
    """Records the most sessions open at once and the largest `generate` call: what holds KV cache."""

    def __init__(self, tokenizer, reply):
        super().__init__(tokenizer, reply)
        self.peak_open = self.peak_call = 0

    def open(self, n):
        ids = super().open(n)
        self.peak_open = max(self.peak_open, len(self.sequences))
        return ids

    def generate(self, sessions, new_tokens, params):
        self.peak_call = max(self.peak_call, len(sessions))
        return super().generate(sessions, new_tokens, params)


@pytest.mark.parametrize("mode", ["parallel", "sequential"])
def test_max_active_bounds_attempts_evaluations_and_summaries(tokenizer, mode):
    """5 tasks x N = 3 is 15 attempts and 15 evaluations; with max_active 4 no more than 4 sessions
    are ever open, and every attempt is still evaluated and every task summarised."""
    tasks = [dataclasses.replace(counter_task(), id=f"t{i}") for i in range(5)]
    model = Model()
    rehearser = PeakSessions(tokenizer, model)
    config = RehearsalConfig(mode=mode, n=3, execution=RolloutConfig(max_active=4))
    results = Rehearser(rehearser, WorldEnvironment(), config).rehearse_batch(tasks)
    assert rehearser.peak_open == 4 and rehearser.peak_call == 4
    assert [len(r.attempts) for r in results] == [3] * 5 and [len(r.evaluations) for r in results] == [3] * 5
    assert model.evaluations == 15 and all(r.memory == NOTES for r in results)
    assert rehearser.sequences == {}  # every session closed

    unbounded = PeakSessions(tokenizer, Model())
    Rehearser(unbounded, WorldEnvironment(), RehearsalConfig(mode=mode, n=3)).rehearse_batch(tasks)
    assert unbounded.peak_open == (15 if mode == "parallel" else 5)  # without it: all at once


def test_rehearsal_eval_rejects_a_bad_limit_before_any_model_loads(monkeypatch):
    from benchmarks import rehearsal_eval

    monkeypatch.setattr("envace.backends.make_generator", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit, match="max_active must be >= 1, or 0 for all at once, got -1"):
        rehearsal_eval.main(["--max-active", "-1"])


def test_mode_none_is_the_plain_committed_run(tokenizer):
    policy = Model().generator(tokenizer)
    result = Rehearser(policy, WorldEnvironment(), RehearsalConfig(mode="none")).run(counter_task())
    assert result.attempts == [] and result.memory == "" and result.cost.extra.tokens == 0
    assert result.committed.final_answer == "The counter is 5."
    assert "Private rehearsal" not in result.committed.turns[0].text


def test_rehearse_memory_for_own_agent_loops(tokenizer):
    env = SpyEnv()
    section = rehearse_memory(Model().generator(tokenizer), env, counter_task(), RehearsalConfig(n=2))
    assert section.startswith("# Private rehearsal notes") and NOTES in section
    assert env.worlds == []


def test_prompts_are_overridable_and_checked(tokenizer, tmp_path):
    path = tmp_path / "prompts.yaml"
    path.write_text("evaluate: |\n  CUSTOM CHECK of {attempt}\n  " + EVALUATE_MARK + "\nmemory: 'NOTES FOR ME: {memory}'\n")
    prompts = RehearsalPrompts.from_yaml(path)
    model = Model()
    result = Rehearser(model.generator(tokenizer), WorldEnvironment(), RehearsalConfig(n=1, prompts=prompts)).run(counter_task())
    assert any(s.count("CUSTOM CHECK of agent:") == 1 for s in model.seen)
    assert f"NOTES FOR ME: {NOTES}" in result.committed.turns[0].text
    with pytest.raises(PromptError, match="unknown placeholder"):
        RehearsalPrompts(memory="{memory} {oops}")
    with pytest.raises(PromptError, match="must use the placeholder"):
        RehearsalPrompts(revise="no attempts here")
    with pytest.raises(PromptError, match="unknown rehearsal prompt"):
        RehearsalPrompts.from_dict({"evaluation": "{attempt}"})


def test_config_is_validated(tokenizer):
    with pytest.raises(ValueError, match="n must be >= 1"):
        Rehearser(Model().generator(tokenizer), WorldEnvironment(), RehearsalConfig(n=0))


# ---- pre-commit guard -------------------------------------------------------------------------


def reset_task():
    return Task(
        id="reset",
        world=WORLD,
        messages=[{"role": "user", "content": "Reset the counter and tell me the value."}],
        initial_state={"value": 7},
        success={"state": [{"path": "value", "equals": 0}]},
    )


def resetter(text: str) -> str:
    """Agent: reset the counter once; after any tool response, report it."""
    if "<|im_start|>tool" in text.split("<|im_start|>user", 1)[-1]:
        return "Result: " + text.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0]
    return '<tool_call>{"name": "reset_counter", "arguments": {}}</tool_call>'


def guarded_run(tokenizer, rehearsed, rule="goal", horizon=1, act=resetter):
    model = Model(act=act, rehearsed=rehearsed)
    env = SpyEnv()
    guard = RehearsalGuard(model.generator(tokenizer), env, rule=rule, horizon=horizon)
    engine = RolloutEngine(ScriptedGenerator(tokenizer, act), env, RolloutConfig(mode="real"), guard=guard)
    [[traj]] = engine.run([reset_task()], progress=False)
    [(world, _)] = env.worlds  # the guard's rehearsal made no world
    return traj, world, model


def test_guard_blocks_a_call_whose_rehearsal_fails(tokenizer):
    traj, world, _ = guarded_run(tokenizer, '{"error": {"code": "LOCKED", "message": "the counter is locked"}}')
    assert world.state == {"value": 7} and traj.real_env_calls == 0
    [event] = traj.events
    assert event["action"] == "revise" and event["rule"] == "goal"
    assert event["rehearsed_observation"] == {"error": {"code": "LOCKED", "message": "the counter is locked"}}
    assert "LOCKED" in event["rehearsal"] and "LOCKED: the counter is locked" in event["reason"]
    assert traj.observations[0] == {"error": {"code": "NOT_EXECUTED", "message": event["reason"]}}
    assert traj.end_reason == EndReason.ANSWERED and "NOT_EXECUTED" in traj.final_answer
    # The blocked reset never ran, so replaying what was executed leaves the counter at 7: no success.
    assert [c.status for c in traj.tool_calls] == [CallStatus.REVISED] and traj.committed_calls == []
    compute_rewards("replay", [[traj]], [reset_task()], Context(env=WorldEnvironment()))
    assert traj.reward == 0.0


def test_guard_allows_a_call_whose_rehearsal_succeeds(tokenizer):
    traj, world, _ = guarded_run(tokenizer, '{"value": 0}')
    assert world.state == {"value": 0} and traj.real_env_calls == 1
    [event] = traj.events
    assert event["action"] == "execute" and event["rehearsed_observation"] == {"value": 0}
    assert event["rehearsal_end"] == "answered" and 'Result: {"value": 0}' in event["rehearsal"]
    assert event["cost"]["generated"] > 0 and event["cost"]["prompt"] > len(traj.turns[0].token_ids)
    assert traj.observations == [{"value": 0}]  # the agent sees the real response, not the rehearsal


def test_goal_needs_an_answer_but_no_error_does_not(tokenizer):
    def stubborn(text):  # never answers: keeps resetting
        return '<tool_call>{"name": "reset_counter", "arguments": {}}</tool_call>'

    traj, _, _ = guarded_run(tokenizer, '{"value": 0}', rule="goal", act=stubborn)
    assert traj.events[0]["action"] == "revise" and "did not reach an answer within 1 turns" in traj.events[0]["reason"]
    traj, world, _ = guarded_run(tokenizer, '{"value": 0}', rule="no_error", horizon=0)
    assert traj.events[0]["action"] == "execute" and world.state == {"value": 0}


def test_broken_rehearsal_fails_goal_but_is_no_evidence_for_no_error(tokenizer):
    traj, _, _ = guarded_run(tokenizer, "it will probably work")
    assert traj.events[0]["action"] == "revise" and traj.events[0]["rehearsal_end"] == "malformed_rehearsal"
    traj, world, _ = guarded_run(tokenizer, "it will probably work", rule="no_error")
    assert traj.events[0]["action"] == "execute" and traj.events[0]["rehearsed_observation"] is None
    assert world.state == {"value": 0}


def stop_rule(rehearsal: GuardRehearsal) -> GuardDecision:
    return GuardDecision("stop", f"ask the user before {rehearsal.call.name}")


def test_user_rule_by_module_path_can_stop(tokenizer):
    traj, world, _ = guarded_run(tokenizer, '{"value": 0}', rule="tests.test_rehearsal:stop_rule")
    assert traj.end_reason == EndReason.STOPPED and world.state == {"value": 7}
    assert [c.status for c in traj.tool_calls] == [CallStatus.STOPPED]
    compute_rewards("replay", [[traj]], [reset_task()], Context(env=WorldEnvironment()))
    assert traj.reward == 0.0
    assert traj.events[0]["rule"] == "tests.test_rehearsal:stop_rule" and traj.events[0]["reason"] == "ask the user before reset_counter"


def test_guard_rehearses_from_the_current_trajectory(tokenizer):
    """Two calls in one ACT turn: the rehearsal starts after the first call's real response and
    answers the guarded call first; the live trajectory is left as it was."""

    def add_then_reset(text):
        if "<|im_start|>tool" in text.split("<|im_start|>user", 1)[-1]:
            return "ok"
        return '<tool_call>{"name": "add", "arguments": {"n": 2}}</tool_call>\n<tool_call>{"name": "reset_counter", "arguments": {}}</tool_call>'

    traj, world, model = guarded_run(tokenizer, '{"value": 0}', act=add_then_reset)
    rehearse_prompt = next(s for s in model.seen if last_header(s).startswith("tool"))
    assert rehearse_prompt.endswith('{"value": 9}<|im_end|>\n<|im_start|>tool\n')  # add's real response, then the guarded call
    assert traj.observations == [{"value": 9}, {"value": 0}] and world.state == {"value": 0}
    assert [t.role for t in traj.turns if t.role != Role.PROMPT] == [Role.ACT, Role.ENV, Role.ENV, Role.ACT]


def test_resume_needs_a_rehearsal_mode(tokenizer):
    engine = RolloutEngine(ScriptedGenerator(tokenizer, agent), WorldEnvironment(), RolloutConfig(mode="real"))
    [[traj]] = engine.run([counter_task()], progress=False)
    with pytest.raises(ValueError, match="resume needs mode"):
        engine.resume(counter_task(), traj)
    rehearse = RolloutEngine(ScriptedGenerator(tokenizer, agent), WorldEnvironment(), RolloutConfig(mode="rehearse"))
    with pytest.raises(ValueError, match="finished"):
        rehearse.resume(counter_task(), traj)


def test_guard_cost_is_accounted_in_the_committed_run(tokenizer):
    model = Model(act=resetter, rehearsed='{"value": 0}')
    guard_gen = model.generator(tokenizer)
    env = WorldEnvironment()
    guard = RehearsalGuard(guard_gen, env, rule="goal", horizon=1)
    result = Rehearser(Model(act=resetter, rehearsed='{"value": 0}').generator(tokenizer), env, RehearsalConfig(n=1), guard=guard).run(reset_task())
    assert result.committed.events[0]["action"] == "execute"
    assert result.cost.guard.generated == guard_gen.stats.generated_tokens > 0
    assert result.cost.guard.prompt == guard_gen.stats.prefill_tokens
    assert result.cost.extra.tokens == sum(c.tokens for c in (result.cost.attempts, result.cost.evaluations, result.cost.summary, result.cost.guard))


# ---- end to end on the real default model ------------------------------------------------------


@pytest.mark.slow
def test_parallel_rehearsal_and_guard_on_the_default_model(one_thread):
    """Parallel rehearsal (N=2) and the guard with SmolLM2-135M, small limits (< 3 min on 2 CPUs)."""
    from envace.backends.hf import HFGenerator
    from envace.backends.models import load_model

    model, tok = load_model("default", device="cpu")
    hf = HFGenerator(model, tok, seed=0)
    env = SpyEnv()
    small = RolloutConfig(max_turns=2, max_turn_tokens=32, max_rehearse_tokens=24, max_total_tokens=1024, temperature=0.0)
    config = RehearsalConfig(mode="parallel", n=2, execution=small, attempt=dataclasses.replace(small, temperature=0.8), evaluation_tokens=24, memory_tokens=24)
    task = counter_task(3)
    result = Rehearser(hf, env, config, guard=RehearsalGuard(hf, env, rule="no_error", horizon=1, config=small)).run(task)
    assert len(result.attempts) == 2 and len(result.evaluations) == 2
    assert all(a.real_env_calls == 0 and a.end_reason is not None for a in result.attempts)
    assert len(tok.encode(result.memory, add_special_tokens=False)) <= 24
    assert result.committed.end_reason is not None and result.committed.mode == "real"
    assert [initial for _, initial in env.worlds] == [task.initial_state]
    assert result.cost.attempts.generated > 0 and result.cost.summary.generated <= 24
    assert json.dumps(result.cost.as_dict())  # serialisable next to the result

    # The guard with the real model rehearsing a scripted agent's irreversible call (same tokenizer).
    guard = RehearsalGuard(hf, env, rule="goal", horizon=1, config=small)
    engine = RolloutEngine(ScriptedGenerator(tok, resetter), env, RolloutConfig(mode="real"), guard=guard)
    [[traj]] = engine.run([reset_task()], progress=False)
    [event] = traj.events
    assert event["action"] in ("execute", "revise") and event["rule"] == "goal" and event["rehearsal"]
    assert env.worlds[-1][0].state == ({"value": 0} if event["action"] == "execute" else {"value": 7})
