"""Assistant text -> reasoning, content, tool calls; streamed deltas add up to the same parse."""

from __future__ import annotations

import json
import re

import pytest
from fuzzing import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from exactrl.chat.messages import check_tool_choice, template_message, validate_tools
from exactrl.chat.parsing import StreamParser, parse_assistant_text
from exactrl.envs.tool_use import CALCULATOR_TOOL

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>'


def test_reasoning_content_and_calls():
    p = parse_assistant_text(f"<think>\nadd them\n</think>\n\nSure. {CALL}\n{CALL}")
    assert p.reasoning == "add them" and p.content == "Sure."
    assert [(c.name, c.arguments) for c in p.tool_calls] == [("calculator", {"expression": "1+2"})] * 2
    msg = p.to_message()
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"expression": "1+2"}
    assert msg["tool_calls"][0]["id"] != msg["tool_calls"][1]["id"]


@pytest.mark.parametrize(
    "text, content, n_calls",
    [
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", 0),  # kept as text
        ('<tool_call>{"name": "calculator"', '<tool_call>{"name": "calculator"', 0),  # unclosed
        ('<tool_call>{"name": "bad name!", "arguments": {}}</tool_call>', None, 0),
        ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", 1),  # arguments as a JSON string
        ("  plain  ", "plain", 0),
        # what a client could not be sent: a lone surrogate (not UTF-8), a number past Python's digit limit,
        # nesting deeper than the recursion limit (each would fail the response with a 500)
        ('<tool_call>{"name": "f", "arguments": {"x": "\\ud800"}}</tool_call>', None, 0),
        ('<tool_call>{"name": "f", "arguments": {"x": ' + "1" * 4301 + "}}</tool_call>", None, 0),
        ('<tool_call>{"name": "f", "arguments": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}}</tool_call>", None, 0),
        ('<tool_call>{"name": "f", "arguments": "{\\"x\\": \\"\\\\ud800\\"}"}</tool_call>', None, 0),
        # strict JSON parsers (JS, Go) refuse NaN and Infinity, which json.dumps writes back
        (
            '<tool_call>{"name": "f", "arguments": {"a": 1e999}}</tool_call>',
            '<tool_call>{"name": "f", "arguments": {"a": 1e999}}</tool_call>',
            0,
        ),
        ('<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>', None, 0),
        ('<tool_call>{"name": "f", "arguments": "{\\"a\\": Infinity}"}</tool_call>', None, 0),
        # a key the call has no place for (the model's arguments as "parameters" would be dropped), a key twice
        (
            '<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>',
            '<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>',
            0,
        ),
        ('<tool_call>{"name": "f", "arguments": {}, "note": "x"}</tool_call>', None, 0),
        ('<tool_call>{"name": "f", "name": "g"}</tool_call>', None, 0),
        ('<tool_call>{"name": "f", "arguments": {"a": 1, "a": 2}}</tool_call>', None, 0),
    ],
)
def test_invalid_calls_stay_text(text, content, n_calls):
    p = parse_assistant_text(text)
    assert len(p.tool_calls) == n_calls
    json.dumps(p.to_message(), ensure_ascii=False).encode("utf-8")  # what the server sends
    if content is not None:
        assert p.content == content


def test_tools_off_keeps_calls_as_text():
    p = parse_assistant_text(CALL, parse_tools=False)
    assert p.tool_calls == [] and p.content == CALL
    assert parse_assistant_text("<think>unfinished").reasoning == "unfinished"


pieces = st.lists(
    st.sampled_from(
        [
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "\n",
            " ",
            "ab",
            "<",
            "</",
            "think",
            '{"name": "f", "arguments": {}}',
            "x",
            "tool_call>",
            "\ufffd",
        ]
    ),
    max_size=14,
)


@settings(max_examples=examples(300), deadline=None)
@given(parts=pieces, cuts=st.lists(st.integers(1, 5), min_size=1, max_size=40), tools=st.booleans())
def test_stream_deltas_equal_the_parse(parts, cuts, tools):
    text = "".join(parts)
    full = parse_assistant_text(text, tools)
    sp, reasoning, content, calls, i, k = StreamParser(tools), "", "", [], 0, 0
    while i < len(text):
        j = i + cuts[k % len(cuts)]
        d = sp.feed(text[i:j])
        reasoning, content, calls, i, k = reasoning + d.reasoning, content + d.content, calls + d.tool_calls, j, k + 1
    d = sp.finish()
    reasoning, content, calls = reasoning + d.reasoning, content + d.content, calls + d.tool_calls
    assert reasoning == (full.reasoning or "") and content == full.content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in full.tool_calls]


@pytest.mark.parametrize(
    "tools, match",
    [
        ("calculator", "must be a list"),
        ([{"type": "retrieval"}], "'type': 'function'"),
        ([{"type": "function", "function": {"name": "has space"}}], "must match"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "JSON Schema object"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "x"}}}],
            "required",
        ),
        ([CALCULATOR_TOOL, CALCULATOR_TOOL], "defined twice"),
    ],
)
def test_invalid_tool_schemas(tools, match):
    with pytest.raises(ValueError, match=match):
        validate_tools(tools)


def test_tool_choice():
    tools = validate_tools([CALCULATOR_TOOL])
    assert check_tool_choice(None, tools) and check_tool_choice("auto", tools)
    assert not check_tool_choice("none", tools) and not check_tool_choice(None, None)
    for bad in ("required", {"type": "function", "function": {"name": "calculator"}}, "sometimes"):
        with pytest.raises(ValueError):
            check_tool_choice(bad, tools)


@pytest.mark.parametrize(
    "call, words",
    [
        (
            {"type": "xx", "function": {"name": "f", "arguments": "{}"}},
            "messages[1].tool_calls[0].type must be 'function', got 'xx'",
        ),
        (
            {"id": 5, "function": {"name": "f", "arguments": "{}"}},
            "messages[1].tool_calls[0].id must be a string, got 5",
        ),
    ],
)
def test_a_tool_call_of_another_type_or_with_a_non_string_id_is_named(call, words):
    """OpenAI's tool calls are {'id': str, 'type': 'function', ...}: an id 5 or a type 'xx' passed unchecked."""
    with pytest.raises(ValueError, match=re.escape(words)):
        template_message({"role": "assistant", "content": None, "tool_calls": [call]}, 1)
    ok = {**call, "type": "function", "id": "call_0"}
    assert (
        template_message({"role": "assistant", "content": None, "tool_calls": [ok]}, 1)["tool_calls"][0]["id"]
        == "call_0"
    )
