"""Strict parsers for the two roles.

ACT text -> tool calls or a final answer. REHEARSE text -> one JSON object observation.
A malformed output raises `ParseError`; the rollout turns it into an error observation, a
penalty flag for that role, and ends the trajectory.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from envace.types import ToolCall

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FENCED = re.compile(r"```(?:json)?\s*(\{.*?\})\s*```", re.DOTALL)
_EXECUTION_RESULT = re.compile(r"<execution_result>(.*?)</execution_result>", re.DOTALL)


class ParseError(ValueError):
    """A malformed policy output; `code` names the problem for the error observation."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code

    def observation(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": str(self)}}


@dataclass
class ActOutput:
    calls: list[ToolCall]
    text: str  # the message with tool-call blocks removed (the answer when there are no calls)

    @property
    def is_answer(self) -> bool:
        return not self.calls


def _call_from_json(raw: str, index: int) -> ToolCall:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ParseError("MALFORMED_TOOL_CALL", f"tool call {index} is not valid JSON: {exc.msg} at char {exc.pos}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ParseError("MALFORMED_TOOL_CALL", f'tool call {index} must be an object with a string "name"')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models emit arguments as a JSON string, as the OpenAI API does
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise ParseError("MALFORMED_TOOL_CALL", f'tool call {index}: "arguments" is a string that is not JSON') from None
    if not isinstance(args, dict):
        raise ParseError("MALFORMED_TOOL_CALL", f'tool call {index}: "arguments" must be a JSON object')
    return ToolCall(name=obj["name"], arguments=args, id=f"call_{index}")


def _is_bare_call(text: str) -> bool:
    """The whole message is one JSON object with a string "name": a call written without tags."""
    body = text.strip()
    if not (body.startswith("{") and body.endswith("}")):
        return False
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("name"), str)


def parse_act(text: str, accept_fenced_json: bool = False) -> ActOutput:
    """Parse an assistant message. `<tool_call>{json}</tool_call>` blocks are calls; an opening
    tag without a parsable block is malformed. `accept_fenced_json` also reads ```json {"name":..}```
    blocks, and a message that is nothing but one bare `{"name": ..}` object (Qwen2.5-Coder
    writes both) — off by default."""
    blocks = _TOOL_CALL.findall(text)
    if not blocks and "<tool_call>" in text:
        raise ParseError("MALFORMED_TOOL_CALL", "found <tool_call> without a closing </tool_call>")
    if not blocks and accept_fenced_json:
        blocks = [b for b in _FENCED.findall(text) if '"name"' in b]
        remainder = _FENCED.sub("", text) if blocks else text
        if not blocks and _is_bare_call(text):
            blocks, remainder = [text], ""
    else:
        remainder = _TOOL_CALL.sub("", text)
    calls = [_call_from_json(b.strip(), i) for i, b in enumerate(blocks)]
    answer = remainder.strip()
    if not calls and not answer:
        raise ParseError("EMPTY_OUTPUT", "the assistant message is empty")
    return ActOutput(calls=calls, text=answer)


def parse_rehearsal(text: str) -> dict[str, Any]:
    """Parse a rehearsed tool response: one JSON object (optionally in <execution_result> tags)."""
    wrapped = _EXECUTION_RESULT.search(text)
    body = (wrapped.group(1) if wrapped else text).strip()
    if not body:
        raise ParseError("EMPTY_OUTPUT", "the rehearsed tool response is empty")
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        raise ParseError("MALFORMED_REHEARSAL", f"rehearsed tool response is not valid JSON: {exc.msg} at char {exc.pos}") from None
    if not isinstance(obj, dict):
        raise ParseError("MALFORMED_REHEARSAL", f"rehearsed tool response must be a JSON object, got {type(obj).__name__}")
    return obj
