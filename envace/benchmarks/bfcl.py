"""BFCL-v4 through its own package (`pip install --no-deps bfcl-eval==2026.3.23 mpmath` plus the
few pure-python/small deps listed in docs/benchmarks.md).

Everything benchmark-specific is BFCL's own code: task files and ground truth
(`load_dataset_entry`, `load_ground_truth_entry`), tool schemas (`convert_to_tool`, OpenAI
function-calling style, as BFCL's OpenAI FC handler compiles them), executable tool classes and
their executor (`execute_multi_turn_func_call`), and the scorers (`multi_turn_checker`,
`ast_checker`). This module only translates between them and envace's Task/Trajectory.

Episode rules (`Task.rules`):
  added_tools          miss_func only: BFCL's held-out functions, added to the tool list when their
                       user turn starts (its user message is BFCL's "I have updated some more
                       functions ..."). The world executes them at any time, as BFCL's executor does;
                       only the advertised list changes.
  max_steps_per_turn   BFCL's step limit per user turn (exceeding it fails the task in BFCL)
  stop_after_first_act single-turn only: BFCL queries the model once; only the calls of the first ACT
                       output are scored

Task metadata (besides benchmark/category):
  bfcl_id              BFCL's entry id
  multi_turn           True for the multi-turn categories
  memory               memory categories only: {"scenario", "backend" (BFCL's MemoryAPI class),
                       "system" (BFCL's own system message of the entry, or None)}
  prerequisite         True for a memory scenario's prerequisite conversation (`prerequisites`), in
                       which the policy writes the memory the scored questions read; not scored
  depends_on           the prerequisite conversations (ids) that must have run before this one
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import json
import os
import re
import shutil
import sys
import tempfile
import types
import uuid
import weakref
from pathlib import Path
from typing import Any

from envace.benchmarks.base import BENCHMARKS, Benchmark, UnexecutableWorld, assistant_texts, category_accuracy, completed, requirements
from envace.envs.base import ToolWorld, error
from envace.types import AddedTools, EpisodeRules, Task, ToolCall, Trajectory

PIP = ("pip install --no-deps bfcl-eval==2026.3.23 mpmath tree_sitter==0.21.3 tree-sitter-java==0.21.0 "
       "tree-sitter-javascript==0.21.4 tenacity overrides==7.7.0 rank-bm25==0.2.2")
# The model name BFCL's checkers see: an OpenAI-style function-calling model, whose tool names had
# "." replaced by "_" (BFCL's `underscore_to_dot`).
CHECKER_MODEL = "envace_fc"
IDENTIFIER = re.compile(r"[A-Za-z_]\w*\Z")

MULTI_TURN = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context")
MEMORY = ("memory_kv", "memory_rec_sum")  # memory_vector needs an embedding model from the hub
NON_LIVE = ("simple_python", "simple_java", "simple_javascript", "multiple", "parallel", "parallel_multiple", "irrelevance")
LIVE = ("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple", "live_irrelevance", "live_relevance")
UNSUPPORTED = {
    "web_search_base": "needs a paid web-search API (SerpAPI key)",
    "web_search_no_snippet": "needs a paid web-search API (SerpAPI key)",
    "memory_vector": "loads a sentence-transformers embedding model from the hub",
}
# BFCL's overall: weight of each group (eval_runner_helper.generate_leaderboard_csv).
GROUP_WEIGHTS = {"non_live": 10, "live": 10, "irrelevance": 10, "multi_turn": 30, "agentic": 40}


@functools.lru_cache(maxsize=1)
def bfcl() -> types.SimpleNamespace:
    """BFCL's modules, imported once. BFCL writes result/score/lock folders under its project root
    at import time: default it to a cache folder instead of site-packages."""
    os.environ.setdefault("BFCL_PROJECT_ROOT", str(Path.home() / ".cache" / "envace" / "bfcl"))
    with requirements(PIP):
        from bfcl_eval import utils
        from bfcl_eval.constants import default_prompts, enums, executable_backend_config, type_mappings
        from bfcl_eval.eval_checker.agentic_eval.agentic_checker import agentic_checker
        from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker, multi_turn_utils
        from bfcl_eval.model_handler import utils as handler_utils

        return types.SimpleNamespace(
            utils=utils, enums=enums, prompts=default_prompts, backends=executable_backend_config,
            types=type_mappings, checker=multi_turn_checker, executor=multi_turn_utils, handler=handler_utils,
            ast_checker=_ast_checker(), agentic_checker=agentic_checker,
        )


def _ast_checker():
    """BFCL's AST checker. It reads one flag (`underscore_to_dot`) from BFCL's model table, whose
    module imports every provider SDK; the lean install lacks them, so a table holding only our
    checker model stands in for it there."""
    name = "bfcl_eval.constants.model_config"
    try:
        model_config = __import__(name, fromlist=["MODEL_CONFIG_MAPPING"])
    except ImportError:
        model_config = types.ModuleType(name)
        model_config.MODEL_CONFIG_MAPPING = {}
        sys.modules[name] = model_config
    model_config.MODEL_CONFIG_MAPPING.setdefault(CHECKER_MODEL.replace("_", "/"), types.SimpleNamespace(underscore_to_dot=True))
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker

    return ast_checker


# ---- BFCL <-> envace conversions ---------------------------------------------------------

def openai_tools(function_docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """BFCL function docs -> OpenAI tool schemas, by BFCL's own converter (FC style)."""
    b = bfcl()
    return b.handler.convert_to_tool(function_docs, b.types.GORILLA_TO_OPENAPI, b.enums.ModelStyle.OPENAI_COMPLETIONS)


def call_strings(calls: list[ToolCall]) -> list[str]:
    """ToolCalls -> BFCL's executable call strings (its FC decoder, `convert_to_function_call`).
    Calls whose name or argument names are not identifiers are dropped: BFCL would `eval` them,
    and they could only fail there (an unknown call changes no state and adds no expected result)."""
    safe = [c for c in calls if IDENTIFIER.match(c.name) and all(IDENTIFIER.match(str(k)) for k in c.arguments)]
    return bfcl().handler.convert_to_function_call([{c.name: c.arguments} for c in safe])


def _method_signatures(involved_classes: list[str]) -> dict[str, inspect.Signature]:
    b = bfcl()
    sigs = {}
    for class_name in involved_classes:
        cls = getattr(importlib.import_module(b.backends.CLASS_FILE_PATH_MAPPING[class_name]), class_name)
        for name, fn in inspect.getmembers(cls, inspect.isfunction):
            if not name.startswith("_"):
                sigs[name] = inspect.signature(fn)
    return sigs


def parse_call(text: str, signatures: dict[str, inspect.Signature]) -> dict[str, Any]:
    """A ground-truth call string such as "sort('a.pdf')" -> {"name", "arguments"} (positional
    arguments named from the tool class's method signature)."""
    node = ast.parse(text, mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a plain function call: {text!r}")
    args = [ast.literal_eval(a) for a in node.args]
    kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    bound = signatures[node.func.id].bind_partial(None, *args, **kwargs)  # None stands for self
    arguments = {k: v for k, v in bound.arguments.items() if k != "self"}
    return {"name": node.func.id, "arguments": arguments}


def _observation(result: str) -> dict[str, Any]:
    """BFCL's execution result (a string) -> a JSON-object observation."""
    prefix = "Error during execution: "
    if result.startswith(prefix):
        return error("EXECUTION_ERROR", result[len(prefix) :])
    try:
        parsed = json.loads(result)
    except json.JSONDecodeError:
        parsed = None
    return parsed if isinstance(parsed, dict) else {"result": result}


class _Instances:
    """BFCL's executor keeps the tool-class instances of a run in module globals, keyed by model
    name and entry id. Each world/scoring run uses its own key and drops its instances after."""

    def __init__(self):
        self.key = f"envace_{uuid.uuid4().hex}"

    def forget(self) -> None:
        store = vars(bfcl().executor)
        for name in [n for n in store if n.startswith(self.key)]:
            del store[name]


# ---- worlds --------------------------------------------------------------------------------

class BFCLWorld(ToolWorld):
    """A multi-turn task's tool classes, loaded and run by BFCL's own executor. Observations are
    BFCL's execution results (parsed when they are JSON objects)."""

    name = "bfcl"

    def __init__(self, task: Task, initial_config: dict[str, Any] | None = None):
        self.meta = task.metadata
        self.initial_config = task.metadata.get("initial_config", {}) if initial_config is None else initial_config
        self.tools = list(task.tools or []) + [t for added in task.rules.added_tools for t in added.tools]
        self._run: _Instances | None = None
        self.instances: dict[str, Any] = {}
        super().__init__()

    def reset(self, state: dict[str, Any] | None = None) -> None:
        if state:  # None or {} (a task's default): the task's own initial_config
            raise ValueError("a BFCL world restarts from its task's initial_config; it cannot load another state")
        if self._run is not None:
            self._run.forget()
        self._run = _Instances()
        weakref.finalize(self, self._run.forget)
        self.state = {}
        self._execute([])

    def _execute(self, calls: list[str]) -> list[str]:
        m = self.meta
        results, self.instances = bfcl().executor.execute_multi_turn_func_call(
            calls, self.initial_config, m["involved_classes"], self._run.key, m["bfcl_id"], long_context=m["long_context"]
        )
        return results

    def tool_schemas(self) -> list[dict[str, Any]]:
        return self.tools

    def tool_names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def call(self, name: str, arguments: Any) -> dict[str, Any]:
        try:
            return self._bfcl_call(name, arguments)
        except Exception as exc:  # BFCL reports a tool's own errors as text; anything else is a TOOL_EXCEPTION
            return self.tool_exception(name, exc)

    def _bfcl_call(self, name: str, arguments: Any) -> dict[str, Any]:
        if not isinstance(arguments, dict):
            return error("INVALID_ARGUMENTS", f"arguments must be a JSON object, got {type(arguments).__name__}")
        strings = call_strings([ToolCall(name, arguments)])
        if not strings:
            return error("INVALID_CALL", f"{name!r} or one of its argument names is not an identifier")
        return _observation(self._execute(strings)[0])

    def snapshot(self) -> dict[str, Any]:
        """The public attributes of every tool instance (what BFCL's state checker compares)."""
        view = {c: {k: v for k, v in vars(obj).items() if not k.startswith("_")} for c, obj in self.instances.items()}
        return json.loads(json.dumps(view, default=str))


# ---- the benchmark ---------------------------------------------------------------------------

def _turn_message(turn: list[dict[str, Any]], held_out: bool) -> dict[str, Any]:
    """One BFCL multi-turn user turn as one message; a held-out turn gets BFCL's own prompt."""
    if held_out:
        return {"role": "user", "content": bfcl().prompts.DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC}
    if len(turn) != 1:
        raise ValueError(f"expected one message per BFCL user turn, got {len(turn)}")
    return dict(turn[0])


def multi_turn_task(entry: dict[str, Any], ground_truth: list[list[str]], category: str) -> Task:
    held_out = {int(k): docs for k, docs in entry.get("missed_function", {}).items()}
    later_turns = [_turn_message(t, i in held_out) for i, t in enumerate(entry["question"]) if i]
    signatures = _method_signatures(entry["involved_classes"])
    reference = [{**parse_call(c, signatures), "user_turn": i} for i, calls in enumerate(ground_truth) for c in calls]
    return Task(
        id=entry["id"], world=BFCL.name, messages=[dict(m) for m in entry["question"][0]], user_turns=later_turns,
        tools=openai_tools(entry["function"]), reference_calls=reference, split="test",
        rules=EpisodeRules(max_steps_per_turn=bfcl().prompts.MAXIMUM_STEP_LIMIT,
                           added_tools=[AddedTools(i, openai_tools(docs)) for i, docs in sorted(held_out.items())]),
        metadata={
            "benchmark": BFCL.name, "category": category, "bfcl_id": entry["id"], "multi_turn": True,
            "involved_classes": entry["involved_classes"],
            "initial_config": entry.get("initial_config", {}), "long_context": "long_context" in category,
            "ground_truth": ground_truth,
        },
    )


def memory_task(entry: dict[str, Any], category: str, ground_truth: list[str] | None = None) -> Task:
    """A memory entry: a scored question (`ground_truth`: BFCL's accepted answers) or, without one,
    a prerequisite conversation. BFCL's system message of the entry (a question's answer-format
    prompt) moves to metadata: `BFCL.describe` rebuilds the whole system message, with the memory as
    it stands when the episode opens, as BFCL's handler does."""
    first = [dict(m) for m in entry["question"][0]]
    system = first.pop(0)["content"] if first and first[0]["role"] == "system" else None
    return Task(
        id=entry["id"], world=BFCL.name, messages=first, user_turns=[_turn_message(t, False) for t in entry["question"][1:]],
        tools=openai_tools(entry["function"]), split="test",
        rules=EpisodeRules(max_steps_per_turn=bfcl().prompts.MAXIMUM_STEP_LIMIT),
        metadata={
            "benchmark": BFCL.name, "category": category, "bfcl_id": entry["id"], "multi_turn": True,
            "involved_classes": entry["involved_classes"], "long_context": False, "ground_truth": ground_truth,
            "memory": {"scenario": entry["scenario"], "backend": entry["involved_classes"][0], "system": system},
            "prerequisite": ground_truth is None, "depends_on": list(entry["depends_on"]),
        },
    )


def single_turn_task(entry: dict[str, Any], scoring_docs: list[dict[str, Any]], ground_truth: list | None, category: str) -> Task:
    """`entry` carries BFCL's model-facing docs (with its language hints); `scoring_docs` the plain
    docs its AST checker reads."""
    docs = {d["name"]: d for d in scoring_docs}
    reference = [reference_call(name, args, docs[name]) for call in ground_truth or [] for name, args in call.items()]
    return Task(
        id=entry["id"], world=BFCL.name, messages=[dict(m) for m in entry["question"][0]],
        tools=openai_tools(entry["function"]), reference_calls=reference, split="test",
        rules=EpisodeRules(stop_after_first_act=True),
        metadata={
            "benchmark": BFCL.name, "category": category, "bfcl_id": entry["id"], "multi_turn": False,
            "function_docs": scoring_docs, "ground_truth": ground_truth,
        },
    )


def _pick(options: list[Any]) -> Any:
    """A concrete value from BFCL's list of accepted values: the first that is not "" (BFCL's
    mark for "may be left out"). Dict parameters usually hold accepted-value lists in turn."""
    value = next((v for v in options if v != ""), "")
    if _nested(value):
        return {k: _pick(o) for k, o in value.items() if "" not in o}
    if isinstance(value, list) and value and all(_nested(v) for v in value):
        return [{k: _pick(o) for k, o in v.items() if "" not in o} for v in value]
    return value


def _nested(value: Any) -> bool:
    """A dict of accepted-value lists (BFCL's form for dict parameters), not a literal dict."""
    return isinstance(value, dict) and all(isinstance(o, list) for o in value.values())


def reference_call(name: str, args: dict[str, list[Any]], doc: dict[str, Any]) -> dict[str, Any]:
    """One ground-truth answer as a call the model could make: OpenAI tool name ("." -> "_", as
    BFCL's converter does) and, per parameter, the first accepted value; optional parameters are
    left out unless the function doc requires them. Java/JS values stay in the checker's typed form
    (a model sends them as source strings)."""
    required = set(doc["parameters"].get("required", []))
    arguments = {k: _pick(o) for k, o in args.items() if k in required or "" not in o}
    return {"name": name.replace(".", "_"), "arguments": arguments}


def first_act_calls(trajectory: Trajectory) -> list[ToolCall]:
    """The calls of the first ACT output: as many as the tool results right after the first
    assistant message; all calls when nothing follows it (the engine recorded them without running
    them: `stop_after_first_act`) or for hand-built trajectories without a chat."""
    msgs = trajectory.messages
    first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), None)
    if first is None or first + 1 == len(msgs):
        return list(trajectory.tool_calls)
    n = 0
    while first + 1 + n < len(msgs) and msgs[first + 1 + n]["role"] == "tool":
        n += 1
    return trajectory.tool_calls[:n]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


@BENCHMARKS.register("bfcl")
class BFCL(Benchmark):
    name = "bfcl"
    categories = MULTI_TURN + MEMORY + NON_LIVE + LIVE

    @functools.cached_property
    def memory_dir(self) -> Path:
        """Where the memory categories' snapshots live for this instance (BFCL's `model_result_dir`):
        each prerequisite conversation saves the memory there and the next entry of its scenario
        loads it. A temporary folder, removed with the instance."""
        path = Path(tempfile.mkdtemp(prefix="envace-bfcl-memory-"))
        weakref.finalize(self, shutil.rmtree, path, ignore_errors=True)
        return path

    def load_tasks(self, split: str = "test", limit: int | None = None, categories: list[str] | None = None) -> list[Task]:
        """Tasks of the given categories (default: all that run offline), `limit` per category."""
        if split != "test":
            raise ValueError(f"BFCL has one split, 'test' (got {split!r})")
        tasks = []
        for category in categories or self.categories:
            if category not in self.categories:
                raise ValueError(f"BFCL category {category!r}: {UNSUPPORTED.get(category, 'unknown')}; known: {', '.join(self.categories)}")
            tasks.extend(self._load_category(category, limit))
        return tasks

    def _load_category(self, category: str, limit: int | None) -> list[Task]:
        u = bfcl().utils
        if category in MEMORY:
            return self._load_memory(category, limit)
        entries = u.load_dataset_entry(category)[:limit]
        if category in MULTI_TURN:
            truth = u.load_ground_truth_entry(category)
            return [multi_turn_task(e, g["ground_truth"], category) for e, g in zip(entries, truth)]
        plain = u.load_dataset_entry(category, include_prereq=False, include_language_specific_hint=False)
        truth = None if u.is_relevance_or_irrelevance(category) else u.load_ground_truth_entry(category)
        return [single_turn_task(e, p["function"], truth[i]["ground_truth"] if truth else None, category) for i, (e, p) in enumerate(zip(entries, plain))]

    def _load_memory(self, category: str, limit: int | None) -> list[Task]:
        """The scored questions, in BFCL's order; their scenarios' prerequisite conversations come
        from `prerequisites`."""
        u = bfcl().utils
        truth = {g["id"].replace("memory", category, 1): g["ground_truth"] for g in u.load_ground_truth_entry(category)}
        questions = sorted((e for e in u.load_dataset_entry(category) if not u.is_memory_prereq(e["id"])), key=u.sort_key)
        return [memory_task(e, category, truth[e["id"]]) for e in questions[:limit]]

    def prerequisites(self, tasks: list[Task]) -> list[Task]:
        """BFCL's prerequisite conversations of the memory scenarios among `tasks`: the policy under
        evaluation writes the memory in them (chained by `depends_on`), the questions read it."""
        u = bfcl().utils
        needed = {(t.metadata["category"], t.metadata["memory"]["scenario"]) for t in tasks if "memory" in t.metadata}
        return [
            memory_task(e, category)
            for category in sorted({c for c, _ in needed})
            for e in sorted(u.load_dataset_entry(category), key=u.sort_key)
            if u.is_memory_prereq(e["id"]) and (category, e["scenario"]) in needed
        ]

    def _memory_config(self, task: Task) -> dict[str, Any]:
        """BFCL's initial_config of a memory entry (`populate_initial_settings_for_memory_test_cases`)
        over `memory_dir`. Every entry but a scenario's first prerequisite loads the memory the
        previous one saved; without it BFCL would start empty, so that is an error here."""
        m, u = task.metadata, bfcl().utils
        entry = {"id": m["bfcl_id"], "scenario": m["memory"]["scenario"], "involved_classes": m["involved_classes"]}
        [entry] = u.populate_initial_settings_for_memory_test_cases([entry], self.memory_dir)
        # The snapshot path as BFCL's MemoryAPI._prepare_snapshot lays it out.
        saved = self.memory_dir / u.get_directory_structure_by_id(m["bfcl_id"]) / "memory_snapshot" / f"{m['memory']['scenario']}_final.json"
        if not u.is_first_memory_prereq_entry(m["bfcl_id"]) and not saved.exists():
            raise RuntimeError(f"{task.id}: the memory of scenario {m['memory']['scenario']!r} has not been written yet: roll out "
                               "bench.prerequisites(tasks) first, in real mode and dependency order (envace eval does)")
        return entry["initial_config"]

    def describe(self, task: Task) -> tuple[str, list[dict[str, Any]]]:
        """Memory entries: BFCL's memory system prompt with the memory's current content (built by
        BFCL's `add_memory_instruction_system_prompt`), followed by the entry's own system message."""
        memory = task.metadata.get("memory")
        if memory is None:
            return super().describe(task)
        instance = self.make_world(task).instances[memory["backend"]]
        turn = [{"role": "system", "content": memory["system"]}] if memory["system"] else [{"role": "user", "content": ""}]
        [[system, *_]] = bfcl().handler.add_memory_instruction_system_prompt([turn], task.metadata["category"], memory["scenario"], instance)
        return system["content"], list(task.tools or [])

    def rollout_record(self, task: Task, world: ToolWorld) -> dict[str, Any]:
        """Memory entries: the memory after the rollout. A prerequisite conversation also saves it
        for the next entry of its scenario, as BFCL's handler does at the end of one."""
        memory = task.metadata.get("memory")
        if memory is None:
            return {}
        if task.metadata["prerequisite"]:
            world.instances[memory["backend"]]._flush_memory_to_local_file()
        return {"memory": world.snapshot()[memory["backend"]]}

    def make_world(self, task: Task) -> ToolWorld:
        if "memory" in task.metadata:
            return BFCLWorld(task, self._memory_config(task))
        if task.metadata["multi_turn"]:
            return BFCLWorld(task)
        return UnexecutableWorld("BFCL single-turn categories score the calls of one response; nothing is executed")

    def score(self, task: Task, trajectory: Trajectory) -> tuple[float, dict[str, Any]]:
        category = task.metadata["category"]
        if "memory" in task.metadata:
            result = self._score_memory(task, trajectory)
        elif task.metadata["multi_turn"]:
            result = self._score_multi_turn(task, trajectory)
        elif bfcl().utils.is_relevance_or_irrelevance(category):
            called = bool(first_act_calls(trajectory))
            result = {"valid": called != ("irrelevance" in category)}
        else:
            result = self._score_ast(task, trajectory)
        return (1.0 if result["valid"] else 0.0), result

    def _score_multi_turn(self, task: Task, trajectory: Trajectory) -> dict[str, Any]:
        m = task.metadata
        truth = m["ground_truth"]
        if not completed(trajectory):
            # BFCL fails an entry whose inference was force-terminated (step limit) outright.
            return {"valid": False, "error_type": "multi_turn:force_terminated", "end_reason": trajectory.end_reason.value}
        per_turn: list[list[ToolCall]] = [[] for _ in truth]
        for call in trajectory.tool_calls:
            per_turn[call.user_turn].append(call)
        decoded = [[strings] if (strings := call_strings(calls)) else [] for calls in per_turn]
        entry = {"id": m["bfcl_id"], "initial_config": m["initial_config"], "involved_classes": m["involved_classes"]}
        run = _Instances()
        try:
            result = bfcl().checker.multi_turn_checker(decoded, truth, entry, m["category"], run.key)
        finally:
            run.forget()
        return json.loads(json.dumps(result, default=str))

    def _score_memory(self, task: Task, trajectory: Trajectory) -> dict[str, Any]:
        """BFCL's agentic checker on the agent's last message that is not a tool call: one of the
        accepted answers must appear in it (case, whitespace and some punctuation ignored)."""
        if task.metadata["prerequisite"]:
            raise ValueError(f"{task.id} is a memory prerequisite conversation: BFCL does not score it")
        texts = assistant_texts(trajectory)
        if not texts:
            return {"valid": False, "error_type": "agentic:no_last_message", "error": ["no agent message that is not a tool call"]}
        return {**bfcl().agentic_checker(texts[-1], task.metadata["ground_truth"]), "answer": texts[-1]}

    def _score_ast(self, task: Task, trajectory: Trajectory) -> dict[str, Any]:
        b = bfcl()
        category = task.metadata["category"]
        language = b.enums.Language.JAVA if b.utils.is_java(category) else b.enums.Language.JAVASCRIPT if b.utils.is_js(category) else b.enums.Language.PYTHON
        output = [{c.name: c.arguments} for c in first_act_calls(trajectory)]
        if not output:
            return {"valid": False, "error": ["no function call"], "error_type": "ast_decoder:decoder_wrong_output_format"}
        return b.ast_checker(task.metadata["function_docs"], output, task.metadata["ground_truth"], language, category, CHECKER_MODEL)

    def offline_status(self) -> dict[str, str]:
        return {**{c: "ok" for c in self.categories}, **UNSUPPORTED}

    def aggregate(self, results: list[dict[str, Any]]) -> dict[str, Any]:
        """Per-category accuracy and BFCL's own grouping/weighting, applied to the categories present:
        non-live = unweighted mean of (simple = mean of python/java/js simple, multiple, parallel,
        parallel_multiple); live = task-weighted mean of its four AST categories; irrelevance = mean of
        irrelevance and live_irrelevance; multi-turn = unweighted mean of its four; agentic = memory =
        unweighted mean of its backends present (web search never is); overall = BFCL's 10/10/10/30/40
        group weights, renormalised over the groups present."""
        acc = category_accuracy(results)
        a = {c: v["accuracy"] for c, v in acc.items()}

        def present(*names: str) -> list[str]:
            return [n for n in names if n in a]

        simple = _mean([a[c] for c in present("simple_python", "simple_java", "simple_javascript")])
        non_live = [v for v in [simple] + [a[c] for c in present("multiple", "parallel", "parallel_multiple")] if v is not None]
        live = present("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")
        groups = {
            "non_live": _mean(non_live),
            "live": sum(a[c] * acc[c]["count"] for c in live) / sum(acc[c]["count"] for c in live) if live else None,
            "irrelevance": _mean([a[c] for c in present("irrelevance", "live_irrelevance")]),
            "multi_turn": _mean([a[c] for c in present(*MULTI_TURN)]),
            # BFCL: agentic = mean(web search, memory), memory = mean of its backends; offline only memory.
            "agentic": _mean([a[c] for c in present(*MEMORY)]),
        }
        groups = {g: v for g, v in groups.items() if v is not None}
        weight = sum(GROUP_WEIGHTS[g] for g in groups)
        overall = sum(v * GROUP_WEIGHTS[g] for g, v in groups.items()) / weight if weight else 0.0
        extra = {"relevance": a["live_relevance"]} if "live_relevance" in a else {}
        return {"categories": acc, "groups": {**groups, **extra}, "overall": overall,
                "weighting": "BFCL-v4 group weights non_live 10, live 10, irrelevance 10, multi_turn 30, agentic 40 "
                             "(memory kv/rec_sum only: web search and memory_vector cannot run offline), renormalised over the groups present"}
