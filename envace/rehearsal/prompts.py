"""The prompts of private rehearsal: documented format strings, overridable in code or from YAML.

Placeholders each template may use (`{name}`; literal braces are written `{{` and `}}`):

  evaluate        task, documentation, attempt     -> user message asking for a self-evaluation
  attempt_record  index, transcript, evaluation    -> one attempt as later prompts show it
  revise          attempts                         -> system-message section of sequential attempt k
  summarize       task, documentation, attempts, memory_tokens -> user message asking for the memory
  memory          memory                           -> system-message section of the committed run

`task` is the text of the task's opening user message(s), `documentation` the world's description,
`attempt`/`transcript` one attempt rendered by `render_attempt`, `attempts` the earlier attempts
each rendered with `attempt_record`. Every template must use its starred placeholder
(evaluate: attempt, attempt_record: transcript, revise: attempts, summarize: attempts,
memory: memory): without it the model would not see what it is asked about.
"""

from __future__ import annotations

import dataclasses
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from envace.transcript import compact_json
from envace.types import Task, Trajectory

EVALUATE = """You privately rehearsed a task: you played both the agent and the tools, so every tool response below was imagined by you, not real.

# Environment
{documentation}

# Task
{task}

# Your rehearsal
{attempt}

Evaluate the rehearsal in three short lines:
Goal reached: yes or no, and why.
Wrong call: the first call that looked wrong and what was wrong with it, or none.
Advice: what the next attempt should do differently."""

ATTEMPT_RECORD = """## Attempt {index}
{transcript}
Evaluation: {evaluation}"""

REVISE = """# Private rehearsal so far
You are rehearsing this task privately: nothing below really happened and every tool response was imagined. Your earlier attempts, each with your own evaluation:

{attempts}

Try again: keep what worked and fix what the evaluations say went wrong."""

SUMMARIZE = """You privately rehearsed a task several times: you played both the agent and the tools, so every tool response below was imagined.

# Environment
{documentation}

# Task
{task}

# Your rehearsal attempts
{attempts}

Now write notes for yourself before doing the task for real: the plan that works (which tools, in which order, with which arguments) and the mistakes to avoid. At most {memory_tokens} tokens, no preamble."""

MEMORY = """# Private rehearsal notes
Before this conversation you rehearsed the task privately, with imagined tool responses. Your notes:
{memory}"""

# template field -> (allowed placeholders, the placeholder it must use)
PLACEHOLDERS: dict[str, tuple[frozenset[str], str]] = {
    "evaluate": (frozenset({"task", "documentation", "attempt"}), "attempt"),
    "attempt_record": (frozenset({"index", "transcript", "evaluation"}), "transcript"),
    "revise": (frozenset({"attempts"}), "attempts"),
    "summarize": (frozenset({"task", "documentation", "attempts", "memory_tokens"}), "attempts"),
    "memory": (frozenset({"memory"}), "memory"),
}


class PromptError(ValueError):
    """A template that uses an unknown placeholder or lacks its required one."""


def _placeholders(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}


@dataclass(frozen=True)
class RehearsalPrompts:
    """The five templates (see the module docstring for their placeholders). Checked on creation."""

    evaluate: str = EVALUATE
    attempt_record: str = ATTEMPT_RECORD
    revise: str = REVISE
    summarize: str = SUMMARIZE
    memory: str = MEMORY

    def __post_init__(self) -> None:
        for name, (allowed, required) in PLACEHOLDERS.items():
            template = getattr(self, name)
            if not isinstance(template, str):
                raise PromptError(f"rehearsal prompt {name!r} must be a string, got {type(template).__name__}")
            used = _placeholders(template)
            if used - allowed:
                raise PromptError(f"rehearsal prompt {name!r} uses unknown placeholder(s) {sorted(used - allowed)}; allowed: {sorted(allowed)}")
            if required not in used:
                raise PromptError(f"rehearsal prompt {name!r} must use the placeholder {{{required}}}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RehearsalPrompts:
        """Defaults overridden by `values` (any subset of the five templates)."""
        unknown = sorted(set(values) - set(PLACEHOLDERS))
        if unknown:
            raise PromptError(f"unknown rehearsal prompt(s) {unknown}; known: {sorted(PLACEHOLDERS)}")
        return dataclasses.replace(cls(), **values)

    @classmethod
    def from_yaml(cls, path: str | Path) -> RehearsalPrompts:
        """Load overrides from a YAML mapping of template name -> format string."""
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise PromptError(f"{path} must hold a mapping of template name -> format string")
        return cls.from_dict(loaded)


def task_text(task: Task) -> str:
    """What the user asked: the task's opening user message(s)."""
    return "\n".join(str(m["content"]) for m in task.messages if m["role"] == "user")


_SPEAKERS = {"assistant": "agent", "tool": "tool (imagined)", "user": "user"}


def render_attempt(traj: Trajectory) -> str:
    """An attempt as readable lines, from the agent's first message on (the prompt is not repeated)."""
    first = next((i for i, m in enumerate(traj.messages) if m["role"] == "assistant"), len(traj.messages))
    lines = []
    for m in traj.messages[first:]:
        content = m["content"] if isinstance(m["content"], str) else compact_json(m["content"])
        lines.append(f"{_SPEAKERS.get(m['role'], m['role'])}: {content.strip()}")
    # Malformed outputs end an attempt without a message; the end reason says what happened.
    lines.append(f"[attempt ended: {traj.end_reason.value if traj.end_reason else 'unfinished'}]")
    return "\n".join(lines)
