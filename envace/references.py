"""A task's recorded reference trajectory (`Task.reference`): OpenAI-style chat messages made
when the trajectory was recorded, tool responses included. What world-free training reads
instead of executing a world: the reference calls, the recorded (call, response) pairs, the
expert's message on each ACT turn, and the later user turns.

    [{"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
       "function": {"name": "transfer", "arguments": "{\\"amount\\": 5}"}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "{\\"ok\\": true}"},
     {"role": "assistant", "content": "Done."},
     {"role": "user", "content": "And now ..."}, ...]

`arguments` may be a JSON string (as OpenAI sends it) or an object; a tool message's `content`
a JSON string or an object (a response that is not a JSON object is wrapped as {"result": ...},
as `ToolWorld.call` does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from envace.transcript import compact_json


class ReferenceError(ValueError):
    """A malformed `reference`; the message names the message index and the fix."""


@dataclass
class ReferenceTurn:
    """One assistant message of the reference: its calls (with their recorded responses) or its answer."""

    user_turn: int  # the user turn it answers (0 = the opening request)
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)  # [{"name", "arguments", "user_turn"}]
    responses: list[dict[str, Any]] = field(default_factory=list)  # recorded, one per call


def _arguments(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as exc:
            raise ReferenceError(f"{where}: arguments are not JSON ({exc.msg}); fix: give an object or a JSON string of one") from None
    if not isinstance(raw, dict):
        raise ReferenceError(f"{where}: arguments must be an object, got {type(raw).__name__}")
    return raw


def _response(raw: Any) -> dict[str, Any]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            return {"result": raw}
    return raw if isinstance(raw, dict) else {"result": raw}


def parse_reference(reference: list[dict[str, Any]]) -> tuple[list[ReferenceTurn], list[str]]:
    """(assistant turns in order, later user messages). Every tool call must be answered by a tool
    message (matched by `tool_call_id`, else in order) before the next assistant message."""
    turns: list[ReferenceTurn] = []
    later_users: list[str] = []
    open_calls: dict[str, int] = {}  # tool_call_id -> index into the last turn's calls
    for i, m in enumerate(reference):
        where = f"reference[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role == "assistant":
            _check_answered(turns, i)
            turn = ReferenceTurn(len(later_users), m.get("content") or "")
            for j, tc in enumerate(m.get("tool_calls") or []):
                fn = tc.get("function", tc) if isinstance(tc, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ReferenceError(f"{where}.tool_calls[{j}]: not a tool call; fix: write {{\"function\": {{\"name\": ..., \"arguments\": ...}}}}")
                turn.calls.append({"name": fn["name"], "arguments": _arguments(fn.get("arguments", {}), f"{where}.tool_calls[{j}]"), "user_turn": turn.user_turn})
                open_calls[tc.get("id") or f"#{j}"] = j
            turns.append(turn)
        elif role == "tool":
            if not turns or len(turns[-1].responses) >= len(turns[-1].calls):
                raise ReferenceError(f"{where}: a tool response without a pending call; fix: put it after the assistant message that made the call")
            key = m.get("tool_call_id")
            expected = len(turns[-1].responses)
            if key is not None and key in open_calls and open_calls[key] != expected:
                raise ReferenceError(f"{where}: tool responses must follow the order of their calls")
            turns[-1].responses.append(_response(m.get("content")))
        elif role == "user":
            _check_answered(turns, i)
            later_users.append(m.get("content") or "")
        else:
            raise ReferenceError(f"{where}: role must be assistant, tool or user, got {role!r}")
    _check_answered(turns, len(reference))
    return turns, later_users


def _check_answered(turns: list[ReferenceTurn], index: int) -> None:
    if turns and len(turns[-1].responses) < len(turns[-1].calls):
        missing = turns[-1].calls[len(turns[-1].responses)]["name"]
        raise ReferenceError(f"reference[{index}]: the call to {missing} has no recorded tool response before this point; "
                             "fix: add its {\"role\": \"tool\", \"content\": ...} message")


def reference_calls(reference: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The reference's calls in order ({"name", "arguments", "user_turn"})."""
    return [c for turn in parse_reference(reference)[0] for c in turn.calls]


def recorded_exchanges(reference: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(call, recorded response) pairs in order: the grounding of world-free rehearsal."""
    return [(c, r) for turn in parse_reference(reference)[0] for c, r in zip(turn.calls, turn.responses)]


def expert_replies(reference: list[dict[str, Any]]) -> list[str]:
    """What the expert writes on each ACT turn, in the transcript's call format: one
    `<tool_call>` line per call (after any text), or the answer."""
    replies = []
    for turn in parse_reference(reference)[0]:
        lines = [turn.content.strip()] if turn.content.strip() else []
        lines += [f"<tool_call>{compact_json({'name': c['name'], 'arguments': c['arguments']})}</tool_call>" for c in turn.calls]
        replies.append("\n".join(lines))
    return replies


def call_key(name: str, arguments: dict[str, Any]) -> str:
    """A call's identity for matching against the reference: its name and canonical arguments."""
    return json.dumps({"name": name, "arguments": arguments}, sort_keys=True)
