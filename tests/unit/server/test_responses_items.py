"""Responses items <-> chat messages (exactrl/server/responses_items.py): one generation's output items, sent
back, are the chat route's assistant message again; runs of output items group by generation; errors name
the item."""

from __future__ import annotations

import json

import pytest

from exactrl.server.responses_items import Origins, chat_messages, chat_tool_choice, chat_tools, output_items

IDS = {"reasoning": "rs_1", "message": "msg_1"}
F1 = {"prompt_token_ids": [1, 2], "generation_token_ids": [3, 4], "generation_log_probs": [-0.5, -0.25]}
F2 = {"prompt_token_ids": [1, 2, 3, 4, 5], "generation_token_ids": [6], "generation_log_probs": [-1.0]}


def call(i: int, name: str = "calculator", args: dict | None = None) -> dict:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args or {})}}


ASSISTANT_MESSAGES = [
    {"role": "assistant", "content": "4"},
    {"role": "assistant", "content": ""},
    {"role": "assistant", "content": None, "tool_calls": [call(0, args={"expression": "2+2"})]},
    {"role": "assistant", "content": "let me see", "tool_calls": [call(0), call(1, "other")]},
    {"role": "assistant", "content": "4", "reasoning_content": "2+2 is 4"},
    {"role": "assistant", "content": "", "reasoning_content": "hmm"},
    {"role": "assistant", "content": None, "reasoning_content": "add", "tool_calls": [call(7)]},
]


@pytest.mark.parametrize("msg", ASSISTANT_MESSAGES)
def test_output_items_sent_back_are_the_assistant_message(msg):
    msg = msg | F1
    out = output_items(msg, IDS, with_tokens=True, incomplete=False)
    assert all(f not in item for item in out[:-1] for f in F1) and all(out[-1][f] == v for f, v in F1.items())
    kinds = [o["type"] for o in out]
    assert kinds == sorted(kinds, key=["reasoning", "message", "function_call"].index)
    back, origins = chat_messages([{"role": "user", "content": "q"}, *out], None)
    assert back == [{"role": "user", "content": "q"}, msg]
    assert origins.of == ["input[0]", f"input[{len(out)}]"]  # the item carrying the token fields


def test_runs_of_output_items_group_by_generation():
    a = output_items({"role": "assistant", "content": "x", "tool_calls": [call(0)]} | F1, IDS, True, False)
    b = output_items({"role": "assistant", "content": "y"} | F2, IDS, True, False)
    msgs, _ = chat_messages([{"role": "user", "content": "q"}, *a, *b], None)
    assert [m.get("content") for m in msgs] == ["q", "x", "y"]  # other token fields: another generation
    # the same fields on every item (another server's layout) are one generation
    every = [item | F1 for item in a]
    assert len(chat_messages(every, None)[0]) == 1
    # an item after a token-carrying one, without any, starts a new assistant message
    plain = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "z"}]}
    msgs, origins = chat_messages([*a, plain], None)
    assert [m.get("content") for m in msgs] == ["x", "z"] and origins.of == ["input[1]", "input[2]"]


def test_instructions_fold_leading_system_messages():
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "be brief"}]},
        {"role": "user", "content": "hi"},
    ]
    msgs, origins = chat_messages(items, "You are a calculator.")
    assert msgs == [
        {"role": "system", "content": "You are a calculator.\n\nbe brief"},
        {"role": "user", "content": "hi"},
    ]
    assert origins.of == ["instructions", "input[1]"]
    assert chat_messages("hi", None)[0] == [{"role": "user", "content": "hi"}]
    assert chat_messages("hi", "sys")[0][0] == {"role": "system", "content": "sys"}


def test_function_call_output_is_a_tool_message():
    items = [
        {"type": "function_call", "call_id": "call_1", "name": "calculator", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "4"}]},
    ]
    msgs, _ = chat_messages(items, None)
    assert msgs[1] == {"role": "tool", "tool_call_id": "call_1", "content": "4"}
    assert msgs[0]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": "{}"}


def test_chat_shaped_items_nemo_gym_reads_too():
    items = [
        {"role": "assistant", "content": None, "tool_calls": [call(0)]},
        {"role": "tool", "tool_call_id": "call_0", "content": [{"type": "input_text", "text": "4"}]},
    ]
    msgs, _ = chat_messages(items, None)
    assert msgs == [
        {"role": "assistant", "content": None, "tool_calls": [call(0)]},
        {"role": "tool", "tool_call_id": "call_0", "content": "4"},
    ]
    with pytest.raises(ValueError, match=r"input\[0\].tool_call_id must be a string"):
        chat_messages([{"role": "tool", "content": "4"}], None)


@pytest.mark.parametrize(
    "items, needle",
    [
        ([{"type": "web_search_call"}], "input[0].type 'web_search_call' is not supported"),
        ([{"foo": 1}], "input[0].type None"),
        ([{"role": "robot", "content": "x"}], "input[0].role must be one of"),
        ([{"role": "user", "content": [{"type": "input_image"}]}], "input[0].content[0] must be a text part"),
        ([{"role": "assistant", "content": [{"type": "input_text", "text": "x"}]}], "input[0].content[0]"),
        ([{"role": "user", "content": None}], "input[0].content must be"),
        ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}], "input[0].arguments must be"),
        ([{"type": "function_call_output", "output": "4"}], "input[0].call_id must be a string"),
        ([{"role": "user", "content": "x"} | F1], "token fields belong on the model's output items"),
        ([], "non-empty list"),
        ([3], "input[0] must be an object"),
    ],
)
def test_bad_items_are_named(items, needle):
    with pytest.raises(ValueError) as e:
        chat_messages(items, None)
    assert needle in str(e.value)


def test_tools_and_tool_choice():
    flat = {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True}
    tools = chat_tools([flat])
    assert tools == [
        {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
    ]
    assert chat_tool_choice({"type": "function", "name": "f"}, tools) == {"type": "function", "function": {"name": "f"}}
    assert chat_tool_choice("auto", tools) == "auto"
    assert chat_tool_choice("auto", None) is None and chat_tool_choice("none", []) is None  # OpenAI's default
    assert chat_tool_choice("required", None) == "required"  # (the chat route refuses it)
    with pytest.raises(ValueError, match="'g', which is not among the tools"):
        chat_tool_choice({"type": "function", "name": "g"}, tools)
    with pytest.raises(ValueError, match="tool_choice must be"):
        chat_tool_choice({"type": "allowed_tools"}, tools)
    with pytest.raises(ValueError, match=r"tools\[0\].type must be 'function'"):
        chat_tools([{"type": "file_search"}])


def test_origins_name_the_clients_fields():
    o = Origins(["instructions", "input[0]", "input[3]"])
    assert o.rename("messages[2] no longer says; messages[0]") == "input[3] no longer says; instructions"
    assert o.rename("tools[1].function.name must match") == "tools[1].name must match"
    assert o.rename("lower max_completion_tokens to 5") == "lower max_output_tokens to 5"
