import pytest

from envace.parsing import ParseError, parse_act, parse_rehearsal


def test_tool_calls_and_answer_text():
    out = parse_act('Let me check.\n<tool_call>{"name": "get", "arguments": {"id": "A1"}}</tool_call>\n<tool_call>{"name": "add", "arguments": {"n": 2}}</tool_call>')
    assert [(c.name, c.arguments) for c in out.calls] == [("get", {"id": "A1"}), ("add", {"n": 2})]
    assert out.text == "Let me check."
    assert not out.is_answer


def test_plain_text_is_the_final_answer():
    out = parse_act("The total is 42.")
    assert out.is_answer and out.text == "The total is 42."


def test_arguments_as_json_string_are_accepted():
    out = parse_act('<tool_call>{"name": "add", "arguments": "{\\"n\\": 1}"}</tool_call>')
    assert out.calls[0].arguments == {"n": 1}


@pytest.mark.parametrize(
    "text,code",
    [
        ('<tool_call>{"name": "add", "arguments": {n: 1}}</tool_call>', "MALFORMED_TOOL_CALL"),
        ('<tool_call>{"arguments": {}}</tool_call>', "MALFORMED_TOOL_CALL"),
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "MALFORMED_TOOL_CALL"),
        ('<tool_call>{"name": "add"', "MALFORMED_TOOL_CALL"),
        ("   ", "EMPTY_OUTPUT"),
    ],
)
def test_malformed_act(text, code):
    with pytest.raises(ParseError) as err:
        parse_act(text)
    assert err.value.code == code
    assert err.value.observation()["error"]["code"] == code


def test_fenced_json_only_when_lenient():
    text = '```json\n{"name": "get", "arguments": {}}\n```'
    assert parse_act(text).is_answer
    assert parse_act(text, accept_fenced_json=True).calls[0].name == "get"


def test_a_bare_json_call_only_when_lenient():
    # What Qwen2.5-Coder-0.5B writes on the built-in worlds: the call object, no tags, no fence.
    text = ' {"name": "checkout", "arguments": {"order_total": 25.5}}\n'
    assert parse_act(text).text == text.strip()  # strict: an answer
    (call,) = parse_act(text, accept_fenced_json=True).calls
    assert (call.name, call.arguments) == ("checkout", {"order_total": 25.5})
    assert parse_act(text, accept_fenced_json=True).text == ""
    # Prose around an object, an object without a name, or invalid JSON stay answers.
    for answer in ('The order is {"name": "x"}', '{"total": 5}', '{"name": "x", }'):
        out = parse_act(answer, accept_fenced_json=True)
        assert out.is_answer and out.text == answer


def test_rehearsal_json_object():
    assert parse_rehearsal(' {"value": 5} ') == {"value": 5}
    assert parse_rehearsal('<execution_result>{"ok": true}</execution_result>') == {"ok": True}


@pytest.mark.parametrize("text,code", [("value is 5", "MALFORMED_REHEARSAL"), ("[1, 2]", "MALFORMED_REHEARSAL"), ("", "EMPTY_OUTPUT")])
def test_malformed_rehearsal(text, code):
    with pytest.raises(ParseError) as err:
        parse_rehearsal(text)
    assert err.value.code == code
