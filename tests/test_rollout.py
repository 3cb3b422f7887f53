import json

import pytest

from envace.backends.scripted import ScriptedGenerator
from envace.envs.environment import WorldEnvironment
from envace.rewards import Context, compute_rewards
from envace.rollout import RolloutConfig, RolloutEngine
from envace.types import EndReason, Role, Task

WORLD = "tests.worlds:Counter"


def counter_task(target=5, **kw):
    return Task(
        id="t0",
        world=WORLD,
        messages=[{"role": "user", "content": f"Add {target} to the counter and tell me the value."}],
        initial_state={"value": 0},
        success={"state": [{"path": "value", "equals": target}], "answer": {"number": target}},
        reference_calls=[{"name": "add", "arguments": {"n": target}}],
        **kw,
    )


def agent(session_text: str) -> str:
    """Scripted policy: call add(5) once, then answer with the last observed value.
    When asked to play the tool (rehearse mode), it predicts {"value": 5}."""
    last_header = session_text.rsplit("<|im_start|>", 1)[-1]
    if last_header.startswith("tool"):
        return '{"value": 5}'
    if '"value"' in session_text.split("<|im_start|>user", 1)[-1]:
        value = json.loads(session_text.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0])["value"]
        return f"The counter is {value}."
    return '<tool_call>{"name": "add", "arguments": {"n": 5}}</tool_call>'


def engine(tokenizer, mode="real", reply=agent, **cfg):
    policy = ScriptedGenerator(tokenizer, reply)
    return RolloutEngine(policy, WorldEnvironment(), RolloutConfig(mode=mode, **cfg)), policy


def test_real_mode_forces_env_tokens_and_succeeds(tokenizer):
    eng, _ = engine(tokenizer, "real")
    [[traj]] = eng.run([counter_task()], progress=False)
    assert traj.end_reason == EndReason.ANSWERED
    assert [c.to_dict() for c in traj.tool_calls] == [{"name": "add", "arguments": {"n": 5}}]
    assert traj.observations == [{"value": 5}]
    assert traj.final_answer == "The counter is 5."
    assert traj.real_env_calls == 1
    assert [t.role for t in traj.turns if t.role != Role.PROMPT] == [Role.ACT, Role.ENV, Role.ACT]
    assert traj.num_tokens(Role.REHEARSE) == 0
    assert len(traj.roles) == len(traj.token_ids) == len(traj.logprobs)


def test_rehearse_mode_policy_writes_tool_turn_and_never_calls_world(tokenizer):
    eng, _ = engine(tokenizer, "rehearse")
    [[traj]] = eng.run([counter_task()], progress=False)
    assert [t.role for t in traj.turns if t.role != Role.PROMPT] == [Role.ACT, Role.REHEARSE, Role.ACT]
    assert traj.real_env_calls == 0
    assert traj.observations == [{"value": 5}]
    compute_rewards("replay", [[traj]], [counter_task()], Context(env=WorldEnvironment()))
    assert traj.reward == 1.0
    assert traj.reward_details["real_observations"] == [{"value": 5}]


def test_same_token_layout_in_real_and_rehearse_mode(tokenizer):
    """The policy acts on the same tokens whether the world or the policy answered."""
    [[real]] = engine(tokenizer, "real")[0].run([counter_task()], progress=False)
    [[reh]] = engine(tokenizer, "rehearse")[0].run([counter_task()], progress=False)
    assert real.token_ids == reh.token_ids
    assert [r for r in real.roles if r not in (Role.ENV, Role.REHEARSE)] == [r for r in reh.roles if r not in (Role.ENV, Role.REHEARSE)]


def test_transcript_tokens_decode_to_the_chat_template_rendering(tokenizer):
    eng, _ = engine(tokenizer, "real")
    [[traj]] = eng.run([counter_task()], progress=False)
    rendered = tokenizer.apply_chat_template(
        traj.messages[:2]
        + [{"role": "assistant", "content": traj.messages[2]["content"]},
           {"role": "tool", "content": json.dumps(traj.observations[0], separators=(", ", ": "))},
           {"role": "assistant", "content": traj.final_answer}],
        tokenize=False,
    )
    assert tokenizer.decode(traj.token_ids) == rendered.rstrip("\n")


def test_prefix_is_never_re_encoded(tokenizer):
    eng, policy = engine(tokenizer, "rehearse")
    [[traj]] = eng.run([counter_task()], progress=False)
    generated = traj.num_tokens(Role.ACT) + traj.num_tokens(Role.REHEARSE)
    # Every token not generated was fed exactly once; none was fed twice.
    assert policy.stats.prefill_tokens == len(traj.token_ids) - generated


def test_malformed_act_is_observation_penalty_and_end(tokenizer):
    eng, _ = engine(tokenizer, "real", reply=lambda _: '<tool_call>{"name": "add", "arguments": {n: 5}}</tool_call>')
    [[traj]] = eng.run([counter_task()], progress=False)
    assert traj.end_reason == EndReason.MALFORMED_ACT
    assert traj.penalties == {"act": 1}
    assert traj.observations[-1]["error"]["code"] == "MALFORMED_TOOL_CALL"


def test_malformed_rehearsal_is_observation_penalty_and_end(tokenizer):
    def reply(text):
        return "value is five" if text.rsplit("<|im_start|>", 1)[-1].startswith("tool") else agent(text)

    eng, _ = engine(tokenizer, "rehearse", reply=reply)
    [[traj]] = eng.run([counter_task()], progress=False)
    assert traj.end_reason == EndReason.MALFORMED_REHEARSAL
    assert traj.penalties == {"rehearse": 1}
    assert traj.turns[-1].role == Role.REHEARSE


def test_bad_tool_call_is_an_observation_not_a_crash(tokenizer):
    calls = iter(['<tool_call>{"name": "add", "arguments": {"n": "five"}}</tool_call>', "sorry"])
    eng, _ = engine(tokenizer, "real", reply=lambda _: next(calls))
    [[traj]] = eng.run([counter_task()], progress=False)
    assert traj.observations[0]["error"]["code"] == "INVALID_ARGUMENTS"
    assert traj.end_reason == EndReason.ANSWERED


@pytest.mark.parametrize("limit,reason", [("max_turns", EndReason.MAX_TURNS), ("max_turn_tokens", EndReason.MAX_TURN_TOKENS), ("max_total_tokens", EndReason.MAX_TOTAL_TOKENS)])
def test_limits_end_with_recorded_reason(tokenizer, limit, reason):
    loop = '<tool_call>{"name": "get", "arguments": {}}</tool_call>'
    values = {"max_turns": 3, "max_turn_tokens": 4, "max_total_tokens": 400}
    eng, _ = engine(tokenizer, "real", reply=lambda _: loop, **{limit: values[limit]})
    [[traj]] = eng.run([counter_task()], progress=False)
    assert traj.end_reason == reason
    if limit == "max_turns":
        assert traj.num_tokens(Role.ACT) and len(traj.outputs(Role.ACT)) == 3
    if limit == "max_total_tokens":
        assert len(traj.token_ids) <= 400


def test_simulator_mode_uses_separate_prompt_and_frozen_model(tokenizer):
    seen = []

    def simulator(text):
        seen.append(text)
        return '{"value": 7}'

    sim = ScriptedGenerator(tokenizer, simulator)
    eng = RolloutEngine(ScriptedGenerator(tokenizer, agent), WorldEnvironment(), RolloutConfig(mode="simulator"), simulator=sim)
    [[traj]] = eng.run([counter_task()], progress=False)
    assert traj.observations == [{"value": 7}]
    assert traj.real_env_calls == 0
    assert "precise tool simulator" in seen[0] and '"name": "add"' in seen[0]
    assert [t.role for t in traj.turns if t.role != Role.PROMPT] == [Role.ACT, Role.ENV, Role.ACT]


def test_isolated_rehearsal_makes_side_rows(tokenizer):
    def reply(text):
        return '{"value": 5}' if "precise tool simulator" in text else agent(text)

    eng, _ = engine(tokenizer, "rehearse", reply=reply, rehearse_layout="isolated")
    [[traj]] = eng.run([counter_task()], progress=False)
    assert len(traj.side_rows) == 1
    assert [t.role for t in traj.side_rows[0].turns] == [Role.PROMPT, Role.REHEARSE]
    assert traj.num_tokens(Role.REHEARSE) == 0  # the main row holds only forced tool tokens


def test_user_turns_are_replayed(tokenizer):
    task = counter_task(user_turns=[{"role": "user", "content": "Thanks. Add 5 again."}])
    answers = iter(['<tool_call>{"name": "add", "arguments": {"n": 5}}</tool_call>', "It is 5.", '<tool_call>{"name": "add", "arguments": {"n": 5}}</tool_call>', "It is 10."])
    eng, _ = engine(tokenizer, "real", reply=lambda _: next(answers))
    [[traj]] = eng.run([task], progress=False)
    assert [c.user_turn for c in traj.tool_calls] == [0, 1]
    assert traj.observations == [{"value": 5}, {"value": 10}]
    assert Role.USER in traj.roles
    assert traj.final_answer == "It is 10."


def test_k_rollouts_per_task_grouped(tokenizer):
    eng, _ = engine(tokenizer, "real")
    groups = eng.run([counter_task(), counter_task(3)], k=3, progress=False)
    assert [len(g) for g in groups] == [3, 3]
    assert [t.group for t in groups[1]] == [0, 1, 2]


def test_simulator_grounding_shows_true_results_of_reference_calls(tokenizer):
    seen = []
    sim = ScriptedGenerator(tokenizer, lambda text: seen.append(text) or '{"value": 5}')
    eng = RolloutEngine(ScriptedGenerator(tokenizer, agent), WorldEnvironment(), RolloutConfig(mode="simulator", grounding=True), simulator=sim)
    eng.run([counter_task(4)], progress=False)
    assert 'call {"name": "add", "arguments": {"n": 4}} -> {"value": 4}' in seen[0]
