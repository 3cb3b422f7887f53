import json
import re

import pytest

from envace.backends.scripted import ScriptedGenerator
from envace.envs.environment import WorldEnvironment
from envace.rewards import Context, compute_rewards
from envace.rollout import RolloutConfig, RolloutEngine
from envace.types import AddedTools, CallStatus, EndReason, EpisodeRules, Role, Task
from tests.worlds import Counter

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
    assert traj.real_observations == [{"value": 5}]


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
    assert traj.end_error["error"]["code"] == "MALFORMED_TOOL_CALL" and traj.outputs(Role.ACT)[-1].malformed
    assert traj.observations == []  # no call was made, so nothing answered one


def test_malformed_rehearsal_is_observation_penalty_and_end(tokenizer):
    def reply(text):
        return "value is five" if text.rsplit("<|im_start|>", 1)[-1].startswith("tool") else agent(text)

    eng, _ = engine(tokenizer, "rehearse", reply=reply)
    [[traj]] = eng.run([counter_task()], progress=False)
    assert traj.end_reason == EndReason.MALFORMED_REHEARSAL
    assert traj.penalties == {"rehearse": 1}
    assert traj.turns[-1].role == Role.REHEARSE


def test_malformed_act_with_continue_shows_the_error_and_goes_on(tokenizer):
    """on_malformed="continue": the parse error answers as a tool response, ACT tries again; only
    the malformed output is flagged, and tool_calls/observations stay aligned."""
    replies = iter(['<tool_call>{"name": "add", "arguments": {n: 5}}</tool_call>'])

    def reply(text):
        return next(replies, None) or agent(text)

    eng, _ = engine(tokenizer, "real", reply=reply, on_malformed="continue")
    [[traj]] = eng.run([counter_task()], progress=False)
    assert traj.end_reason == EndReason.ANSWERED and traj.final_answer == "The counter is 5."
    assert traj.penalties == {"act": 1} and [t.malformed for t in traj.outputs(Role.ACT)] == [True, False, False]
    assert [c.to_dict() for c in traj.tool_calls] == [{"name": "add", "arguments": {"n": 5}}] and traj.observations == [{"value": 5}]
    error = traj.messages[3]
    assert error["role"] == "tool" and error["content"]["error"]["code"] == "MALFORMED_TOOL_CALL"
    assert [t.role for t in traj.turns if t.role != Role.PROMPT][:3] == [Role.ACT, Role.ENV, Role.ACT]
    assert "MALFORMED_TOOL_CALL" in tokenizer.decode(traj.token_ids)  # ACT read the error


def test_malformed_rehearsal_with_continue_is_read_as_generated(tokenizer):
    def reply(text):
        if text.rsplit("<|im_start|>", 1)[-1].startswith("tool"):
            return "value is five"
        return "Done." if "value is five" in text else agent(text)

    eng, _ = engine(tokenizer, "rehearse", reply=reply, on_malformed="continue")
    [[traj]] = eng.run([counter_task()], progress=False)
    assert traj.end_reason == EndReason.ANSWERED and traj.final_answer == "Done."
    assert traj.penalties == {"rehearse": 1} and [t.malformed for t in traj.outputs(Role.REHEARSE)] == [True]
    assert traj.observations[0]["error"]["code"] == "MALFORMED_REHEARSAL"  # the call's observation, aligned


def test_empty_output_ends_even_with_continue(tokenizer):
    eng, _ = engine(tokenizer, "real", reply=lambda _: "", on_malformed="continue")
    [[traj]] = eng.run([counter_task()], progress=False)
    assert traj.end_reason == EndReason.EMPTY_OUTPUT and traj.penalties == {"act": 1} and traj.outputs(Role.ACT)[0].malformed


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


# ---- task metadata the engine honours (benchmarks) and simulated users --------------------------

ADD5 = '<tool_call>{"name": "add", "arguments": {"n": 5}}</tool_call>'


def after_last_user(text):
    return text.rsplit("<|im_start|>user", 1)[-1]


def turn_agent(text):
    """Calls add(5) once per user turn, then answers with the value it saw."""
    tail = after_last_user(text)
    if "<|im_start|>tool" not in tail:
        return ADD5
    return "It is " + str(json.loads(tail.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0])["value"]) + "."


def rehearsing_turn_agent(text):
    """turn_agent that also plays the tool when asked (rehearse mode)."""
    return '{"value": 5}' if text.rsplit("<|im_start|>", 1)[-1].startswith("tool") else turn_agent(text)


class ScriptedUser:
    """A UserSimulator: asks twice, then ends; records what it was given."""

    def __init__(self):
        self.seen = []

    def start(self, task, world=None):
        self.seen.append(("start", world))
        return "Please add 5."

    def respond(self, task, messages, world=None):
        self.seen.append(("respond", world, [m["role"] for m in messages]))
        return "Add 5 again." if sum(m["role"] == "user" for m in messages) < 2 else None


def chat_task():
    return Task(id="chat", world=WORLD, messages=[{"role": "system", "content": "Be brief."}, {"role": "assistant", "content": "Hi! How can I help?"}],
                initial_state={"value": 0}, rules=EpisodeRules(simulated_user=True))


def test_simulated_user_opens_after_the_agents_greeting_and_sees_the_world(tokenizer):
    user = ScriptedUser()
    policy = ScriptedGenerator(tokenizer, turn_agent)
    [[traj]] = RolloutEngine(policy, WorldEnvironment(), RolloutConfig(), user_simulator=user).run([chat_task()], progress=False)
    assert traj.end_reason == EndReason.ANSWERED and traj.observations == [{"value": 5}, {"value": 10}]
    assert [c.user_turn for c in traj.tool_calls] == [0, 1]
    assert [r for r in traj.roles if r == Role.USER] and sum(t.role == Role.USER for t in traj.turns) == 2
    assert user.seen[0][0] == "start" and user.seen[0][1] is not None  # real mode: the live world
    # The greeting renders as an assistant message, the simulated user's first message after it.
    assert traj.messages[0]["content"].startswith("Be brief.")  # then the world's documentation
    rendered = tokenizer.apply_chat_template([
        traj.messages[0], {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Please add 5."}, {"role": "assistant", "content": ADD5}, {"role": "tool", "content": '{"value": 5}'},
        {"role": "assistant", "content": "It is 5."}, {"role": "user", "content": "Add 5 again."}, {"role": "assistant", "content": ADD5},
        {"role": "tool", "content": '{"value": 10}'}, {"role": "assistant", "content": "It is 10."}], tokenize=False)
    assert tokenizer.decode(traj.token_ids) == rendered.rstrip("\n")
    assert [m["role"] for m in traj.messages][:3] == ["system", "assistant", "user"]


def test_the_environments_user_simulator_is_used_and_required(tokenizer):
    class Env(WorldEnvironment):
        user_simulator = ScriptedUser()

    [[traj]] = RolloutEngine(ScriptedGenerator(tokenizer, turn_agent), Env(), RolloutConfig()).run([chat_task()], progress=False)
    assert traj.tool_calls and Env.user_simulator.seen[0][0] == "start" and traj.user_source == "simulator"
    with pytest.raises(ValueError, match="needs a user simulator"):
        RolloutEngine(ScriptedGenerator(tokenizer, turn_agent), WorldEnvironment()).run([chat_task()], progress=False)


def imagining_agent(text):
    """rehearsing_turn_agent that also plays the user when asked to (the imagined user's prompt)."""
    if "You play the user" in text:
        asked = text.count("user: ")
        return "Please add 5." if asked == 0 else "###STOP###"
    return rehearsing_turn_agent(text)


def test_off_real_mode_the_rehearsing_model_imagines_the_user_and_the_real_simulator_is_never_called(tokenizer):
    user = ScriptedUser()
    eng = RolloutEngine(ScriptedGenerator(tokenizer, imagining_agent), WorldEnvironment(), RolloutConfig(mode="rehearse"), user_simulator=user)
    [[traj]] = eng.run([chat_task()], progress=False)
    assert user.seen == [] and traj.user_source == "imagined"
    # The imagined user asked once (after the greeting), then stopped after the agent's answer.
    assert [m["content"] for m in traj.messages if m["role"] == "user"] == ["Please add 5."]
    assert traj.end_reason == EndReason.ANSWERED and traj.observations == [{"value": 5}] and traj.real_env_calls == 0


def test_resume_counts_the_simulated_first_message_as_user_turn_zero(tokenizer):
    user = ScriptedUser()
    eng = RolloutEngine(ScriptedGenerator(tokenizer, imagining_agent), WorldEnvironment(), RolloutConfig(mode="rehearse", max_turns=1), user_simulator=user)
    [[prefix]] = eng.run([chat_task()], progress=False)
    prefix.end_reason = None  # cut after its first ACT turn
    [cont] = eng.resume(chat_task(), prefix)
    assert [c.user_turn for c in cont.tool_calls] == [0]


def test_added_tools_join_at_their_user_turn(tokenizer):
    add_only = [s for s in Counter.tool_schemas() if s["function"]["name"] == "add"]
    get = [s for s in Counter.tool_schemas() if s["function"]["name"] == "get"]
    task = counter_task(user_turns=[{"role": "user", "content": "Now read it."}], tools=add_only, rules=EpisodeRules(added_tools=[AddedTools(1, get)]))
    replies = iter([ADD5, "It is 5.", '<tool_call>{"name": "get", "arguments": {}}</tool_call>', "Still 5."])
    eng, _ = engine(tokenizer, "real", reply=lambda _: next(replies))
    [[traj]] = eng.run([task], progress=False)
    assert "get() - Read the counter." not in traj.messages[0]["content"]  # not advertised before its turn
    second_user = [m for m in traj.messages if m["role"] == "user"][1]["content"]
    assert second_user.startswith("Now read it.") and "<tools>\nget() - Read the counter." in second_user  # SmolLM2: fallback signatures
    assert traj.observations == [{"value": 5}, {"value": 5}]


def test_stop_after_first_act_records_the_calls_without_running_them(tokenizer):
    eng, _ = engine(tokenizer, "real", reply=lambda _: ADD5 + "\n" + ADD5)
    [[traj]] = eng.run([counter_task(rules=EpisodeRules(stop_after_first_act=True))], progress=False)
    assert traj.end_reason == EndReason.ANSWERED and len(traj.tool_calls) == 2
    assert traj.observations == [] and traj.real_env_calls == 0 and len(traj.outputs(Role.ACT)) == 1


def test_a_stop_tool_ends_the_trajectory_and_replaces_its_output(tokenizer):
    replies = iter([ADD5, ADD5 + '\n<tool_call>{"name": "get", "arguments": {}}</tool_call>'])
    eng, _ = engine(tokenizer, "real", reply=lambda _: next(replies))
    [[traj]] = eng.run([counter_task(rules=EpisodeRules(stop_tools=["get"]))], progress=False)
    assert traj.end_reason == EndReason.ANSWERED and [c.name for c in traj.tool_calls] == ["add", "get"]
    assert traj.real_env_calls == 1  # the add next to the stop call never ran


def test_max_steps_per_turn_counts_act_turns_per_user_turn(tokenizer):
    def three_adds(text):
        return ADD5 if after_last_user(text).count("<|im_start|>tool") < 3 else "Done."

    later = [{"role": "user", "content": "Again."}]
    eng, _ = engine(tokenizer, "real", reply=three_adds, max_turns=5)
    [[per_turn]] = eng.run([counter_task(user_turns=later, rules=EpisodeRules(max_steps_per_turn=4))], progress=False)
    assert per_turn.end_reason == EndReason.ANSWERED and len(per_turn.outputs(Role.ACT)) == 8  # 4 + 4 > max_turns
    [[capped]] = eng.run([counter_task(user_turns=later, rules=EpisodeRules(max_steps_per_turn=2))], progress=False)
    assert capped.end_reason == EndReason.MAX_TURNS and len(capped.outputs(Role.ACT)) == 2


def test_rollout_record_is_kept_for_the_scorer(tokenizer):
    class Env(WorldEnvironment):
        def rollout_record(self, task, world):
            return {"final": world.snapshot()}

    policy = ScriptedGenerator(tokenizer, agent)
    [[real]] = RolloutEngine(policy, Env(), RolloutConfig()).run([counter_task()], progress=False)
    assert real.benchmark_record == {"final": {"value": 5}}
    [[rehearsed]] = RolloutEngine(policy, Env(), RolloutConfig(mode="rehearse")).run([counter_task()], progress=False)
    assert rehearsed.benchmark_record is None  # no world ran


def test_max_active_bounds_rollouts_in_flight_and_keeps_the_order(tokenizer):
    tasks = [counter_task() for _ in range(5)]
    for i, t in enumerate(tasks):
        t.id = f"t{i}"
    eng, policy = engine(tokenizer, "real", max_active=2)
    sizes, generate = [], policy.generate
    policy.generate = lambda sessions, *a: sizes.append(len(policy.sequences)) or generate(sessions, *a)
    groups = eng.run(tasks, k=2, progress=False)
    assert max(sizes) == 2 and len(sizes) > 2 * 2  # never more than 2 sessions open; the 10 rollouts queued
    assert [[t.task_id for t in g] for g in groups] == [[f"t{i}"] * 2 for i in range(5)] and [t.group for g in groups for t in g] == [0, 1] * 5
    unbounded, _ = engine(tokenizer, "real")
    assert [t.final_answer for g in groups for t in g] == [t.final_answer for g in unbounded.run(tasks, k=2, progress=False) for t in g]


def test_a_user_who_leaves_at_once_ends_the_trajectory_not_the_run(tokenizer):
    class Leaving(ScriptedUser):
        def start(self, task, world=None):
            return None if task.id == "leaves" else super().start(task, world)

    tasks = [chat_task(), Task(**{**chat_task().__dict__, "id": "leaves"})]
    policy = ScriptedGenerator(tokenizer, turn_agent)
    [[stays], [left]] = RolloutEngine(policy, WorldEnvironment(), RolloutConfig(), user_simulator=Leaving()).run(tasks, progress=False)
    assert stays.end_reason == EndReason.ANSWERED and stays.tool_calls
    assert left.end_reason == EndReason.USER_ENDED and not left.tool_calls and [m["role"] for m in left.messages] == ["system", "assistant"]
    assert policy.sequences == {}  # its session was closed too


# ---- token budgets, per episode ---------------------------------------------------------------

LONG_ANSWER = "The counter is five. " * 8  # about 50 tokens, well under max_turn_tokens


def padded_task(task_id: str, padding_words: int) -> Task:
    """A task whose prompt is `padding_words` words longer: less room left under max_total_tokens."""
    task = counter_task()
    task.id = task_id
    task.messages = [{"role": "user", "content": "Tell me the counter. " + "pad " * padding_words}]
    return task


def test_each_episode_generates_within_its_own_budget_whatever_else_is_in_the_batch(tokenizer):
    """Defect: one batch used the smallest remaining budget of any row, so an episode near
    max_total_tokens cut every other episode's output short (ended max_turn_tokens, reward 0)."""
    roomy, tight = padded_task("roomy", 0), padded_task("tight", 120)
    probe, _ = engine(tokenizer, "real")
    prompt_tokens = {t.id: len(probe.transcript.prompt(t.messages, *WorldEnvironment().describe(t)).token_ids) for t in (roomy, tight)}
    total = prompt_tokens["tight"] + 30  # the tight episode has 30 tokens left, the roomy one plenty
    assert total - prompt_tokens["roomy"] > 100
    cfg = dict(max_turn_tokens=100, max_total_tokens=total)
    batch_eng, _ = engine(tokenizer, "real", reply=lambda _: LONG_ANSWER, **cfg)
    [[roomy_b], [tight_b]] = batch_eng.run([roomy, tight], progress=False)
    alone = {t.id: engine(tokenizer, "real", reply=lambda _: LONG_ANSWER, **cfg)[0].run([t], progress=False)[0][0] for t in (roomy, tight)}
    # The roomy episode answers in full although the tight one had fewer than 50 tokens left.
    room_tight = total - prompt_tokens["tight"]
    assert room_tight < len(roomy_b.outputs(Role.ACT)[0].token_ids) < 100
    assert roomy_b.end_reason == EndReason.ANSWERED and roomy_b.final_answer == LONG_ANSWER.strip()
    assert tight_b.end_reason == EndReason.MAX_TOTAL_TOKENS and len(tight_b.outputs(Role.ACT)[0].token_ids) == room_tight
    # Batch composition changes nothing.
    for traj in (roomy_b, tight_b):
        assert traj.token_ids == alone[traj.task_id].token_ids and traj.end_reason == alone[traj.task_id].end_reason


# ---- call statuses: what was committed --------------------------------------------------------


def test_calls_carry_what_became_of_them(tokenizer):
    two_calls = ADD5 + "\n" + ADD5
    [[real]] = engine(tokenizer, "real", reply=lambda t: "Done." if "<|im_start|>tool" in t else two_calls)[0].run([counter_task()], progress=False)
    assert [c.status for c in real.tool_calls] == [CallStatus.EXECUTED] * 2 and len(real.committed_calls) == 2
    [[reh]] = engine(tokenizer, "rehearse")[0].run([counter_task()], progress=False)
    assert [c.status for c in reh.tool_calls] == [CallStatus.REHEARSED]
    assert reh.committed_exchanges() == [(reh.tool_calls[0], {"value": 5})]
    # The first response does not fit under the total-token limit: the world ran that call (its
    # effect is real, so it stays committed), the episode ends, and the second call never runs.
    first_env = [i for i, t in enumerate(real.turns) if t.role == Role.ENV][0]
    limit = sum(len(t.token_ids) for t in real.turns[:first_env]) + 1
    [[cut]] = engine(tokenizer, "real", reply=lambda t: "Done." if "<|im_start|>tool" in t else two_calls, max_total_tokens=limit)[0].run([counter_task()], progress=False)
    assert cut.end_reason == EndReason.MAX_TOTAL_TOKENS
    assert [c.status for c in cut.tool_calls] == [CallStatus.EXECUTED, CallStatus.UNANSWERED] and cut.real_env_calls == 1


def test_stop_and_single_response_calls_are_recorded_not_committed(tokenizer):
    eng, _ = engine(tokenizer, "real", reply=lambda _: ADD5)
    [[traj]] = eng.run([counter_task(rules=EpisodeRules(stop_after_first_act=True))], progress=False)
    assert [c.status for c in traj.tool_calls] == [CallStatus.RECORDED] and traj.committed_calls == []


def test_a_truncated_rehearsal_ends_the_episode_without_penalty_in_both_layouts(tokenizer):
    """One rule for a REHEARSE output that hits its token limit, transcript or isolated layout:
    the trajectory ends there (max_turn_tokens), unpenalised, like a truncated ACT output."""
    rambling = '{"value": ' + "5" * 400 + "}"

    def reply(text):
        last = text.rsplit("<|im_start|>", 1)[-1]
        return rambling if last.startswith("tool") or "precise tool simulator" in text or "Simulate" in text else ADD5

    for layout in ("transcript", "isolated"):
        [[traj]] = engine(tokenizer, "rehearse", reply=reply, rehearse_layout=layout, max_rehearse_tokens=16)[0].run([counter_task()], progress=False)
        assert traj.end_reason == EndReason.MAX_TURN_TOKENS, layout
        assert traj.penalties == {} and not any(t.malformed for t in traj.turns + [r for row in traj.side_rows for r in row.turns]), layout
        assert [c.status for c in traj.tool_calls] == [CallStatus.UNANSWERED], layout


# ---- the recorded reference answers (world-free) -------------------------------------------


def recorded_counter_task(**kw) -> Task:
    """counter_task, world-free: its tools and a reference whose add(5) recorded {"value": 5}."""
    reference = [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"n": 5}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"value": 5}'},
        {"role": "assistant", "content": "The counter is 5."},
    ]
    return Task(id="free", world=None, messages=counter_task().messages, tools=Counter.tool_schemas(), documentation=Counter.description,
                reference=reference, **kw)


class NoWorlds(WorldEnvironment):
    def make_world(self, task):
        raise AssertionError("a world was made")


def test_recorded_mode_answers_from_the_reference_in_the_real_mode_layout(tokenizer):
    policy = ScriptedGenerator(tokenizer, agent)
    [[recorded]] = RolloutEngine(policy, NoWorlds(), RolloutConfig(mode="recorded")).run([recorded_counter_task()], progress=False)
    [[real]] = engine(tokenizer, "real")[0].run([counter_task()], progress=False)
    assert recorded.token_ids == real.token_ids and recorded.roles == real.roles  # forced ENV tokens, as in real mode
    assert [c.status for c in recorded.tool_calls] == [CallStatus.REFERENCE] and recorded.real_env_calls == 0
    # A call the reference never made is answered with an error, not an invented response.
    [[other]] = RolloutEngine(ScriptedGenerator(tokenizer, lambda t: "ok" if "<|im_start|>tool" in t else '<tool_call>{"name": "get", "arguments": {}}</tool_call>'),
                              NoWorlds(), RolloutConfig(mode="recorded")).run([recorded_counter_task()], progress=False)
    assert other.observations[0]["error"]["code"] == "NOT_RECORDED" and other.tool_calls[0].status == CallStatus.UNRECORDED


def test_isolated_grounding_comes_from_the_recorded_reference_without_a_world(tokenizer):
    seen = []

    def simulator(text):
        seen.append(text)
        return '{"value": 5}' if "precise tool simulator" in text or "Simulate" in text else agent(text)

    policy = ScriptedGenerator(tokenizer, simulator)
    cfg = RolloutConfig(mode="rehearse", rehearse_layout="isolated", grounding=True)
    [[traj]] = RolloutEngine(policy, NoWorlds(), cfg).run([recorded_counter_task()], progress=False)
    assert traj.grounding_calls == 0 and traj.observations == [{"value": 5}]
    assert any('{"value": 5}' in t and '"n": 5' in t and "add" in t for t in seen if "Simulate" in t or "simulator" in t)
    # A world task without a recorded reference grounds by executing its reference calls, counted.
    [[world_traj]] = RolloutEngine(ScriptedGenerator(tokenizer, simulator), WorldEnvironment(), cfg).run([counter_task()], progress=False)
    assert world_traj.grounding_calls == 1


# ---- continuous batching ----------------------------------------------------------------------


def target_task(target: int) -> Task:
    task = counter_task(target)
    task.id = f"add{target}"
    return task


def uneven_agent(session_text: str) -> str:
    """The counter agent with outputs whose lengths grow with the task's target, so that the rows of
    one batch finish at different steps: add(target), a rehearsed response padded by the target,
    then an answer padded by the target."""
    target = int(re.search(r"Add (\d+) to the counter", session_text).group(1))
    if session_text.rsplit("<|im_start|>", 1)[-1].startswith("tool"):
        return json.dumps({"value": target, "note": "ok " * target})
    if "<|im_start|>tool" in session_text.split("<|im_start|>user", 1)[-1]:
        return f"The counter is {target}." + " Done." * target
    return '<tool_call>{"name": "add", "arguments": {"n": %d}}</tool_call>' % target


@pytest.mark.parametrize("mode", ["rehearse", "real"])
def test_continuous_batching_changes_the_schedule_not_the_trajectories(tokenizer, mode):
    """Rows that finish start their next turn (a REHEARSE response beside other rows' ACT turns)
    while the others are paused, not waiting for the longest row; every trajectory is the one the
    round-by-round schedule writes."""
    tasks = [target_task(t) for t in (1, 4, 9, 16)]
    rounds, _ = engine(tokenizer, mode, reply=uneven_agent)
    together, policy = engine(tokenizer, mode, reply=uneven_agent, continuous_batching=True)
    roles_per_call, generate = [], policy.generate

    def recording(sessions, new_tokens, params, pause_at=None):
        headers = [policy.tokenizer.decode(policy.sequences[s] + new).rsplit("<|im_start|>", 1)[-1] for s, new in zip(sessions, new_tokens)]
        roles_per_call.append({"rehearse" if h.startswith("tool") else "act" for h in headers})
        return generate(sessions, new_tokens, params, pause_at=pause_at)

    policy.generate = recording
    expected = rounds.run(tasks, k=2, progress=False)
    got = together.run(tasks, k=2, progress=False)
    for want, have in zip((t for g in expected for t in g), (t for g in got for t in g)):
        assert have.token_ids == want.token_ids and [t.role for t in have.turns] == [t.role for t in want.turns]
        assert have.end_reason == want.end_reason == EndReason.ANSWERED
        assert [c.status for c in have.tool_calls] == [c.status for c in want.tool_calls]
    if mode == "rehearse":
        assert {"act", "rehearse"} in roles_per_call  # some call batched one row's REHEARSE with another's ACT
    assert policy._paused == {} and policy.sequences == {}


def test_continuous_batching_needs_a_generator_that_pauses_rows(tokenizer):
    class Plain(ScriptedGenerator):
        pauses_rows = False

    with pytest.raises(ValueError, match="Plain cannot.*--continuous-batching"):
        RolloutEngine(Plain(tokenizer, agent), WorldEnvironment(), RolloutConfig(mode="rehearse", continuous_batching=True))
