import pytest

from envace.transcript import FALLBACK_TOOLS_TEMPLATE, TemplateError, Transcript, derive_layout, simulator_messages
from envace.types import Role, ToolCall

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add n.", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}}]

# A Qwen2.5-style template: native <tools> block, tool responses grouped in a user turn.
QWEN_LIKE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '\\n\\n# Tools\\n<tools>' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages[1:] %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.previtem is not defined or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.nextitem is not defined or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_smollm2_layout_is_chatml_without_native_tools(tokenizer):
    layout = derive_layout(tokenizer)
    assert layout.act_to_tool == "<|im_end|>\n<|im_start|>tool\n"
    assert layout.tool_to_act == "<|im_end|>\n<|im_start|>assistant\n"
    assert layout.act_marker == layout.rehearse_marker == "<|im_end|>"
    assert not layout.native_tools


def test_fallback_tools_go_into_system_prompt(tokenizer):
    turn = Transcript(tokenizer).prompt([{"role": "user", "content": "hi"}], "A counter world.", TOOLS)
    assert turn.role == Role.PROMPT
    assert "A counter world." in turn.text and "add(n?: integer) - Add n." in turn.text
    assert FALLBACK_TOOLS_TEMPLATE.splitlines()[0] in turn.text
    assert turn.text.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(turn.token_ids) == turn.text


def test_qwen_like_template_native_tools_and_closing_tag_marker(tokenizer):
    original = tokenizer.chat_template
    tokenizer.chat_template = QWEN_LIKE
    try:
        layout = derive_layout(tokenizer)
        assert layout.native_tools
        assert layout.act_to_tool == "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
        assert layout.tool_to_tool == "\n</tool_response>\n<tool_response>\n"
        assert layout.rehearse_marker == "</tool_response>"
        tr = Transcript(tokenizer)
        forced = tr.forced_after('{"value": 1}\n</tool_response>', layout.tool_to_act)
        assert forced.text == "<|im_end|>\n<|im_start|>assistant\n"
        prompt = tr.prompt([{"role": "user", "content": "hi"}], "Doc.", TOOLS)
        assert "<tools>" in prompt.text and "reply with one line per call" not in prompt.text
    finally:
        tokenizer.chat_template = original


def test_forced_after_skips_only_the_emitted_marker(tokenizer):
    tr = Transcript(tokenizer)
    forced = tr.forced_after("hello<|im_end|>", tr.layout.act_to_tool)
    assert forced.text == "\n<|im_start|>tool\n" and forced.role == Role.PROMPT
    assert tr.strip_marker("hello<|im_end|>", "<|im_end|>") == "hello"


def test_template_without_chat_template_is_rejected(tokenizer):
    original = tokenizer.chat_template
    tokenizer.chat_template = None
    try:
        with pytest.raises(TemplateError, match="no chat template"):
            derive_layout(tokenizer)
    finally:
        tokenizer.chat_template = original


def test_tool_signature_marks_optional_enums_and_lists():
    from envace.transcript import tool_signature

    tool = {"name": "f", "description": "Do f.", "parameters": {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "string"}, "day": {"type": "string", "enum": ["mon", "tue"]}, "ids": {"type": "array", "items": {"type": "integer"}}}}}
    assert tool_signature(tool) == 'f(a: string, day?: "mon" | "tue", ids?: list[integer]) - Do f.'


def test_simulator_prompt_holds_schema_history_call_and_grounding():
    msgs = simulator_messages("Doc.", TOOLS, [(ToolCall("add", {"n": 1}), {"value": 1})], ToolCall("add", {"n": 2}), "add things", [({"name": "add", "arguments": {"n": 9}}, {"value": 9})])
    assert msgs[0]["role"] == "system" and "precise tool simulator" in msgs[0]["content"]
    user = msgs[1]["content"]
    for piece in ('"n": 2', '-> {"value": 1}', "add things", '{"value": 9}', '"description": "Add n."'):
        assert piece in user
