"""One transcript for both roles.

The agent's conversation is rendered with the model's own chat template. ACT spans are the
assistant turns; REHEARSE spans are the tool-response turns. In real mode the tool turn's tokens
are forced (role ENV); in rehearse mode the policy samples them (role REHEARSE). Either way the
token layout is identical, so the policy acts on the same layout in training and deployment.

Token ids are never re-derived from text: the prompt and each piece of template scaffolding is
tokenised once, on its own, and generated ids are kept as sampled. The scaffolding between turns
is read off the chat template itself by rendering a probe conversation with sentinel contents
(`TemplateLayout`), so any chat template that renders messages in order works.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from envace.types import Role, ToolCall, Turn

_SA, _ST1, _ST2, _SB, _SU = (f"\u2063ENVACE{i}\u2063" for i in range(5))

# Documented fallback for templates that ignore `tools` (e.g. SmolLM2): schemas go into the
# system prompt and calls use the same <tool_call> tags as Qwen-style native templates.
FALLBACK_TOOLS_TEMPLATE = """# Tools
You may call these tools (an argument marked ? is optional):
<tools>
{tools}
</tools>
To call tools, reply with one line per call and nothing else:
<tool_call>{{"name": "<tool name>", "arguments": {{...}}}}</tool_call>
Each tool answers in the next message (role "tool") with a JSON object.
When you are done, reply to the user in plain text without any tool call."""


class TemplateError(ValueError):
    pass


@dataclass(frozen=True)
class TemplateLayout:
    """Scaffolding text between turns, as the chat template renders it."""

    act_to_tool: str  # after an assistant message, before the first tool response
    tool_to_tool: str  # between two tool responses of the same assistant message
    tool_to_act: str  # after the last tool response, up to the next assistant's content
    act_to_user: str  # after an assistant message, before a later user message
    user_to_act: str  # after a user message, up to the next assistant's content
    native_tools: bool  # the template renders the `tools` argument itself
    eos_text: str

    def end_marker(self, following: str) -> str:
        """The text that ends a generated span: the first special token or closing tag of what
        follows it. The policy emits it; the rest of `following` is forced."""
        stripped = following.lstrip()
        if self.eos_text and stripped.startswith(self.eos_text):
            return self.eos_text
        close = stripped.find(">")
        if stripped.startswith("</") and close > 0:
            return stripped[: close + 1]
        return self.eos_text or stripped.split("\n", 1)[0]

    @property
    def act_marker(self) -> str:
        return self.end_marker(self.act_to_tool)

    @property
    def rehearse_marker(self) -> str:
        return self.end_marker(self.tool_to_act)


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False)


def _between(text: str, start: str, end: str) -> str:
    i = text.index(start) + len(start)
    return text[i : text.index(end, i)]


def derive_layout(tokenizer: Any) -> TemplateLayout:
    """Read the inter-turn scaffolding off the chat template with a sentinel probe conversation."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise TemplateError("the tokenizer has no chat template; envace needs an instruct/chat model")
    system = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    probe = system + [
        {"role": "assistant", "content": _SA},
        {"role": "tool", "content": _ST1},
        {"role": "tool", "content": _ST2},
        {"role": "assistant", "content": _SB},
        {"role": "user", "content": _SU},
    ]
    try:
        full = _render(tokenizer, probe, None, True)
    except Exception as exc:  # templates that reject a 'tool' role raise arbitrary errors
        raise TemplateError(f"the chat template cannot render tool messages: {exc}") from exc
    prompt = _render(tokenizer, system, None, True)
    if not full.startswith(prompt[: prompt.rindex("u") + 1]):
        raise TemplateError("the chat template does not render messages as an append-only sequence")
    gen_header = prompt[prompt.rindex("u") + 1 :]  # e.g. "<|im_end|>\n<|im_start|>assistant\n"
    tail = full[full.index(_SU) + len(_SU) :]
    tool_schema = [{"type": "function", "function": {"name": "probe_tool", "description": "d", "parameters": {"type": "object", "properties": {}}}}]
    native = "probe_tool" in _render(tokenizer, system, tool_schema, True)
    return TemplateLayout(
        act_to_tool=_between(full, _SA, _ST1),
        tool_to_tool=_between(full, _ST1, _ST2),
        tool_to_act=_between(full, _ST2, _SB),
        act_to_user=_between(full, _SB, _SU),
        user_to_act=tail if tail else gen_header,
        native_tools=native,
        eos_text=tokenizer.eos_token or "",
    )


def compact_json(obj: Any) -> str:
    return json.dumps(obj, separators=(", ", ": "), ensure_ascii=False)


def _type_of(schema: dict[str, Any]) -> str:
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"])
    if schema.get("type") == "array":
        return f"list[{_type_of(schema.get('items', {}))}]"
    kind = schema.get("type", "any")
    return " | ".join(kind) if isinstance(kind, list) else kind


def tool_signature(tool: dict[str, Any]) -> str:
    """`name(arg: type, opt?: type) - description`: a schema in a third of the tokens of its JSON,
    which matters for small models with short contexts."""
    fn = tool.get("function", tool)
    params = fn.get("parameters", {})
    required = set(params.get("required", []))
    args = ", ".join(f"{name}{'' if name in required else '?'}: {_type_of(spec)}" for name, spec in params.get("properties", {}).items())
    return f"{fn['name']}({args}) - {fn.get('description', '').strip()}"


def system_prompt(description: str, tools: list[dict[str, Any]], native_tools: bool) -> str:
    """The system message: world documentation, plus tool signatures when the template lacks native tools."""
    parts = [description.strip()] if description.strip() else []
    if not native_tools and tools:
        parts.append(FALLBACK_TOOLS_TEMPLATE.format(tools="\n".join(tool_signature(t) for t in tools)))
    return "\n\n".join(parts)


class Transcript:
    """Builds role-tagged token spans for one model. Stateless apart from tokenizer caches."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.layout = derive_layout(tokenizer)
        self._encoded: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _scaffold(self, text: str) -> list[int]:
        # Scaffolding strings repeat every turn: tokenise each distinct one once.
        if text not in self._encoded:
            self._encoded[text] = self.encode(text)
        return self._encoded[text]

    def prompt_messages(self, messages: list[dict[str, Any]], description: str, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The task's messages with the world documentation (and fallback tool block) in the system message."""
        extra = system_prompt(description, tools, self.layout.native_tools)
        msgs = [dict(m) for m in messages]
        if msgs and msgs[0]["role"] == "system":
            msgs[0]["content"] = "\n\n".join(p for p in (msgs[0]["content"], extra) if p)
        elif extra:
            msgs.insert(0, {"role": "system", "content": extra})
        return msgs

    def prompt(self, messages: list[dict[str, Any]], description: str, tools: list[dict[str, Any]]) -> Turn:
        msgs = self.prompt_messages(messages, description, tools)
        text = _render(self.tokenizer, msgs, tools if self.layout.native_tools else None, True)
        return Turn(Role.PROMPT, self.encode(text), text=text)

    def forced_after(self, generated_text: str, following: str) -> Turn:
        """Scaffolding forced after a generated span: `following` minus the end marker the policy
        already emitted. If the policy stopped on EOS instead of the marker, only the EOS is skipped."""
        marker = self.layout.end_marker(following)
        stripped = following.lstrip()
        if generated_text.rstrip().endswith(marker):
            rest = stripped[len(marker) :]
        elif self.layout.eos_text and generated_text.endswith(self.layout.eos_text) and self.layout.eos_text in stripped:
            rest = stripped[stripped.index(self.layout.eos_text) + len(self.layout.eos_text) :]
        else:
            rest = following
        return Turn(Role.PROMPT, list(self._scaffold(rest)), text=rest)

    def scaffold(self, text: str) -> Turn:
        return Turn(Role.PROMPT, list(self._scaffold(text)), text=text)

    def tool_response(self, observation: dict[str, Any], role: Role = Role.ENV) -> Turn:
        """A forced tool response (real world or external simulator): content + end marker."""
        text = compact_json(observation) + self.layout.rehearse_marker
        return Turn(role, self.encode(text), text=text)

    def user_message(self, content: str) -> Turn:
        return Turn(Role.USER, self.encode(content), text=content)

    def strip_marker(self, text: str, marker: str) -> str:
        text = text.rstrip()
        for end in (marker, self.layout.eos_text):
            if end and text.endswith(end):
                return text[: -len(end)]
        return text


# ---- isolated simulator layout (the reference's separate simulator prompt) ----------------

SIMULATOR_SYSTEM = """You are a precise tool simulator. You play the environment behind a tool-using agent.
First validate the call: if the tool is not in the list answer {"error": {"code": "TOOL_NOT_FOUND", ...}};
if arguments are missing or of the wrong type answer {"error": {"code": "INVALID_ARGUMENTS", ...}}.
Otherwise produce the tool's result, consistent with the documentation and with every earlier
result in the history. Answer with one JSON object and nothing else."""


def simulator_messages(
    description: str,
    tools: list[dict[str, Any]],
    history: list[tuple[ToolCall, dict[str, Any]]],
    call: ToolCall,
    task_text: str = "",
    grounding: list[tuple[dict[str, Any], dict[str, Any]]] | None = None,
) -> list[dict[str, Any]]:
    """A fresh two-message chat per call (it does not share the agent's context)."""
    schema = next((t for t in tools if t.get("function", t).get("name") == call.name), None)
    parts = [f"# Environment documentation\n{description.strip()}" if description.strip() else ""]
    parts.append("# Available tools\n" + "\n".join(compact_json(t.get("function", t)) for t in tools))
    if task_text:
        parts.append(f"# The user's request\n{task_text}")
    if grounding:
        parts.append("# Example calls and true results\n" + "\n".join(f"call {compact_json(c)} -> {compact_json(r)}" for c, r in grounding))
    if history:
        parts.append("# Calls so far and their results\n" + "\n".join(f"call {compact_json(c.to_dict())} -> {compact_json(r)}" for c, r in history))
    parts.append(f"# Tool to simulate\nschema: {compact_json(schema.get('function', schema)) if schema else 'not available'}\ncall: {compact_json(call.to_dict())}")
    return [{"role": "system", "content": SIMULATOR_SYSTEM}, {"role": "user", "content": "\n\n".join(p for p in parts if p)}]
