"""Responses API items <-> the chat route's messages: one conversation, two spellings, nothing lost.

Invariant: `chat_messages` turns a Responses `input` (+ `instructions`) into chat messages such that every
model output item the server returned, sent back unchanged, becomes the assistant message the chat route
returned for the same generation, token fields included; `output_items` is its inverse on one generation.
So a Responses conversation is spliced by token id exactly as a chat one (chat/splice.py).

The mapping is NeMo Gym's (`nemo_gym/responses_converter.py`, its `vllm_model` server with
`return_token_id_information: true`):
  * a string input is one user message; `instructions` is a system message in front, with the leading
    system / developer messages folded into it ("\\n\\n"-joined), as chat templates take one system turn;
  * `message` items (roles user, system, developer, assistant; content a string or `input_text` /
    `output_text` parts) are messages; `function_call_output` items are tool messages; chat-shaped
    items NeMo Gym also reads are too: role `tool` with `tool_call_id`, an assistant's `tool_calls`;
  * a run of model output items (`reasoning`, assistant `message`, `function_call`) is one assistant
    message: reasoning -> `reasoning_content`, text -> `content`, calls -> `tool_calls`;
  * one generation's output items are [reasoning] [message] [function_call ...]: the message only if it
    has text or nothing else was generated; the three token fields (`prompt_token_ids`,
    `generation_token_ids`, `generation_log_probs`) are on its LAST item only, as NeMo Gym puts them
    (its trainers add up `generation_token_ids` over the output items: a copy on every item would count
    a generation twice).
An item carrying other token fields than the run so far, or an item after a token-carrying one without
any, starts a new assistant message: it belongs to another generation.

Every error is a ValueError naming the item (`input[k]...`); `Origins` maps a chat message's index back
to the item it came from, so the chat route's errors name the client's fields.
"""

from __future__ import annotations

import re
import reprlib
from dataclasses import dataclass, field
from typing import Any

from exactrl.chat.messages import TOKEN_FIELDS

ROLES = ("user", "system", "developer", "assistant", "tool")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_MESSAGE_REF = re.compile(r"messages\[(\d+)\]")
_TOOL_REF = re.compile(r"tools\[(\d+)\]\.function\.")


@dataclass
class Origins:
    """Where each chat message came from ("instructions", "input[k]"), to name the client's fields."""

    of: list[str] = field(default_factory=list)

    def rename(self, text: str) -> str:
        """`messages[i]` -> the item it came from; `tools[k].function.x` -> `tools[k].x` (flat tools)."""
        text = _MESSAGE_REF.sub(lambda m: self._of(int(m.group(1))), text)
        return _TOOL_REF.sub(r"tools[\1].", text).replace("max_completion_tokens", "max_output_tokens")

    def _of(self, i: int) -> str:
        return self.of[i] if 0 <= i < len(self.of) else f"input message {i}"


def _text(content: Any, where: str, part_types: tuple[str, ...]) -> str | None:
    """A message content (string, list of text parts, or None) as one string."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of content parts")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in part_types or not isinstance(part.get("text"), str):
            raise ValueError(
                f"{where}[{j}] must be a text part {{'type': {' or '.join(map(repr, part_types))}, 'text': ...}}, "
                f"got type {reprlib.repr(kind)} (only text is supported)"
            )
        out.append(part["text"])
    return "".join(out)


def _string(item: dict, key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise ValueError(f"{where}.{key} must be a string, got {reprlib.repr(v)}")
    return v


def _tokens(item: dict) -> tuple | None:
    """The item's token fields (as sent: checked by the splicer), or None without any."""
    values = tuple(item.get(f) for f in TOKEN_FIELDS)
    return None if all(v is None for v in values) else values


def _reasoning(item: dict, where: str) -> str:
    parts = [("summary", "summary_text"), ("content", "reasoning_text")]
    texts = {key: _text(item.get(key), f"{where}.{key}", (kind,)) or "" for key, kind in parts}
    return texts["summary"] or texts["content"]


def _user_side(item: dict, kind: str, where: str) -> dict:
    """A message of role user / system / developer, or a function_call_output, as a chat message."""
    if kind == "function_call_output":
        output = _text(item.get("output"), f"{where}.output", ("input_text", "output_text"))
        if output is None:
            raise ValueError(f"{where}.output must be a string or a list of input_text parts")
        return {"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": output}
    if item["role"] == "tool":
        content = _text(item.get("content"), f"{where}.content", ("input_text",))
        if content is None:
            raise ValueError(f"{where}.content must be a string or a list of input_text parts")
        return {"role": "tool", "tool_call_id": _string(item, "tool_call_id", where), "content": content}
    content = _text(item.get("content"), f"{where}.content", ("input_text",))
    if content is None:
        raise ValueError(f"{where}.content must be a string or a list of input_text parts")
    return {"role": item["role"], "content": content}


def chat_messages(input_: Any, instructions: str | None) -> tuple[list[dict], Origins]:
    """The chat messages of a Responses input (module docstring), and where each came from."""
    if isinstance(input_, str):
        items: list = [{"type": "message", "role": "user", "content": input_}]
    elif isinstance(input_, list) and input_:
        items = input_
    else:
        raise ValueError("input must be a string or a non-empty list of input items")
    msgs: list[dict] = []
    origins = Origins()
    run: dict | None = None  # the assistant message the current run of output items builds
    run_tokens: tuple | None = None
    for k, item in enumerate(items):
        where = f"input[{k}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be an object (an input item), got {reprlib.repr(item)}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in ITEM_TYPES:
            raise ValueError(f"{where}.type {reprlib.repr(kind)} is not supported: one of {', '.join(ITEM_TYPES)}")
        role = item.get("role")
        if kind == "message" and role not in ROLES:
            raise ValueError(f"{where}.role must be one of {', '.join(ROLES)}, got {reprlib.repr(role)}")
        tokens = _tokens(item)
        if kind in ("function_call_output", "message") and role != "assistant":
            if tokens is not None:
                raise ValueError(
                    f"{where}: token fields belong on the model's output items (an assistant message, a "
                    f"function_call, a reasoning item), not on a {kind} item"
                    + (f" of role {role!r}" if kind == "message" else "")
                )
            run = None
            msgs.append(_user_side(item, kind, where))
            origins.of.append(where)
            continue
        if run is None or (run_tokens is not None and tokens != run_tokens):  # another generation's item
            run, run_tokens = {"role": "assistant", "content": None}, None
            msgs.append(run)
            origins.of.append(where)
        if tokens is not None:
            if run_tokens is None:
                run |= {f: v for f, v in zip(TOKEN_FIELDS, tokens) if v is not None}
                origins.of[-1] = where
            run_tokens = tokens
        _add_output_item(run, item, kind, where)
    for m in msgs:
        if m["role"] == "assistant" and m["content"] is None and not m.get("tool_calls"):
            m["content"] = ""
    return _with_instructions(msgs, origins, instructions)


def _add_output_item(run: dict, item: dict, kind: str, where: str) -> None:
    if kind == "message":
        text = _text(item.get("content"), f"{where}.content", ("output_text",))
        if text is not None:
            run["content"] = (run["content"] or "") + text
        calls = item.get("tool_calls")  # chat-shaped: checked with the rest of the message by the chat route
        if calls:
            if not isinstance(calls, list):
                raise ValueError(f"{where}.tool_calls must be a list")
            run.setdefault("tool_calls", []).extend(calls)
    elif kind == "reasoning":
        run["reasoning_content"] = (run.get("reasoning_content") or "") + _reasoning(item, where)
    else:
        call = {
            "id": _string(item, "call_id", where),
            "type": "function",
            "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)},
        }
        run.setdefault("tool_calls", []).append(call)


def _with_instructions(msgs: list[dict], origins: Origins, instructions: str | None) -> tuple[list[dict], Origins]:
    if instructions is None or instructions == "":
        return msgs, origins
    parts = [instructions]
    while msgs and msgs[0]["role"] in ("system", "developer"):
        parts.append(msgs.pop(0)["content"])
        origins.of.pop(0)
    return [{"role": "system", "content": "\n\n".join(parts)}, *msgs], Origins(["instructions", *origins.of])


def chat_tools(tools: Any) -> list[dict] | None:
    """Responses function tools (`{"type": "function", "name", "description", "parameters", "strict"}`) in the
    chat form; `strict` is accepted and not enforced (the chat route's rule: the call's arguments are parsed
    as JSON, not checked against the schema)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of function tools")
    out = []
    for k, t in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else t
            raise ValueError(
                f"{where}.type must be 'function' (only function tools are served), got {reprlib.repr(kind)}"
            )
        if "function" in t:
            raise ValueError(
                f"{where} is in the chat completions form; the Responses API's is flat: "
                f"{{'type': 'function', 'name': ..., 'parameters': ...}}"
            )
        fn = {key: t[key] for key in ("name", "description", "parameters") if t.get(key) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any, tools: list[dict] | None) -> Any:
    """A Responses tool_choice in the chat form: "auto" | "none" | "required" pass; a named function
    must name one of the tools (the chat route then refuses it: it needs constrained decoding)."""
    if not tools and choice in ("auto", "none"):  # the Responses API's default, sent without tools too
        return None
    if choice is None or isinstance(choice, str):
        return choice
    if not isinstance(choice, dict) or choice.get("type") != "function":
        kind = choice.get("type") if isinstance(choice, dict) else choice
        raise ValueError(
            f"tool_choice must be 'auto', 'none', 'required' or {{'type': 'function', 'name': ...}}, "
            f"got type {reprlib.repr(kind)}"
        )
    names = [t["function"].get("name") for t in tools or []]
    name = choice.get("name")
    if name not in names:
        raise ValueError(
            f"tool_choice names the function {reprlib.repr(name)}, which is not among the tools "
            f"({', '.join(map(str, names)) or 'none given'})"
        )
    return {"type": "function", "function": {"name": name}}


def output_items(msg: dict, ids: dict[str, str], with_tokens: bool, incomplete: bool) -> list[dict]:
    """One generation's output items (module docstring) from the chat route's assistant message `msg`;
    `ids`: the reasoning and message items' ids (chosen before streaming); token fields on the last."""
    status = "incomplete" if incomplete else "completed"
    items = []
    if msg.get("reasoning_content"):
        items.append(reasoning_item(ids["reasoning"], msg["reasoning_content"]))
    calls = msg.get("tool_calls") or []
    if msg.get("content") or not (items or calls):
        items.append(message_item(ids["message"], msg.get("content") or "", status))
    items += [function_call_item(c) for c in calls]  # a call is whole once parsed, even in a cut generation
    if with_tokens:
        items[-1] |= {f: msg[f] for f in TOKEN_FIELDS}
    return items


def reasoning_item(item_id: str, text: str) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [{"type": "summary_text", "text": text}]}


def message_item(item_id: str, text: str, status: str) -> dict:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def function_call_item(call: dict, status: str = "completed") -> dict:
    fn = call["function"]
    return {
        "id": "fc_" + call["id"].removeprefix("call_"),
        "type": "function_call",
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"],
        "status": status,
    }
