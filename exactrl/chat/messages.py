"""OpenAI chat messages -> chat-template messages, token fields, tool schemas.

Everything here is validation with messages a client can act on: a bad
message raises `ValueError` (the server answers 400). The template sees plain
dicts in the Hugging Face convention: `content` a string, `reasoning_content`
for `<think>` text, tool-call `arguments` as a dict.

Text the template renders is encoded with special tokens recognised (as
transformers does), so a user message holding the text `<|im_end|>` would
become a real end-of-turn token: a forged turn the model trains on, and one
turn too many for the splicer's end-of-turn count. `check_rendered_text`
therefore refuses the text of a tokenizer's special tokens in every field a
client wrote (system, user and tool messages, tools, assistant messages sent
without token fields) instead of silently escaping it; a generated assistant
message (token fields present) keeps what the model wrote, since its tokens,
not its text, are the history. A tool message must answer a call of the
assistant turn just before its run of tool messages (`check_tool_replies`).
"""

from __future__ import annotations

import json
import math
import reprlib
from dataclasses import dataclass
from typing import Any

from exactrl.chat.parsing import TOOL_NAME

TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
ROLES = ("system", "developer", "user", "assistant", "tool")
# variables a client may not set through chat_template_kwargs: those transformers' apply_chat_template sets or
# takes itself (a clash is a TypeError there), the functions a template calls (transformers' and Jinja's globals:
# a value would replace them), and the special tokens it passes (`bos_token`, ...: a client's value would be
# rendered as that token)
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "chat_template",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "conversation",
        "conversations",
        "self",
        "sanitize_control_tokens",
        "raise_exception",
        "strftime_now",
        "range",
        "dict",
        "lipsum",
        "cycler",
        "joiner",
        "namespace",
    }
)
# JSON nesting allowed in tool arguments and tool schemas: the chat template renders them recursively, and a
# few hundred levels exhaust Python's recursion (a 500 for what is the request's fault)
MAX_NESTING = 64


def _check_nesting(obj: Any, where: str, depth: int = 0) -> None:
    if depth > MAX_NESTING:
        raise ValueError(f"{where} is nested deeper than {MAX_NESTING} levels")
    for v in obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else ():
        _check_nesting(v, where, depth + 1)


class InconsistentTokenFieldsError(ValueError):
    """An assistant message's token fields are partial or contradict each other."""


@dataclass
class TokenFields:
    """The exact tokens of one assistant turn, as the server returned them."""

    prompt_token_ids: list[int]  # everything the model saw before this turn's generation
    generation_token_ids: list[int]  # what it generated (the stop token included)
    generation_log_probs: list[float]  # behaviour logprob of each generated token

    @property
    def history(self) -> list[int]:
        return self.prompt_token_ids + self.generation_token_ids


def _text(content: Any, where: str) -> str | None:
    """A message field (string, list of text parts or None) as one string; `where` names the field."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"{where}[{k}]: only text parts ({{'type': 'text', 'text': ...}}) are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"{where} must be a string, a list of text parts or null")


def token_fields(msg: dict, index: int, vocab_size: int) -> TokenFields | None:
    """The message's token fields: all three or none; checked for shape and range."""
    present = [f for f in TOKEN_FIELDS if msg.get(f) is not None]
    if not present:
        return None
    where = f"messages[{index}]"
    if len(present) != len(TOKEN_FIELDS):
        missing = [f for f in TOKEN_FIELDS if f not in present]
        raise InconsistentTokenFieldsError(
            f"{where} has {present} but not {missing}: send all three token fields exactly as returned, or none"
        )
    if msg.get("role") != "assistant":
        raise InconsistentTokenFieldsError(
            f"{where}: token fields are only valid on assistant messages, not role {msg.get('role')!r}"
        )
    ids = {}
    for f in ("prompt_token_ids", "generation_token_ids"):
        v = msg[f]
        if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            raise InconsistentTokenFieldsError(f"{where}.{f} must be a list of integer token ids")
        bad = [t for t in v if not 0 <= t < vocab_size]
        if bad:
            raise InconsistentTokenFieldsError(
                f"{where}.{f} holds id {bad[0]} outside the vocabulary [0, {vocab_size})"
            )
        ids[f] = v
    lps = msg["generation_log_probs"]
    if not isinstance(lps, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in lps):
        raise InconsistentTokenFieldsError(f"{where}.generation_log_probs must be a list of numbers")
    if not ids["prompt_token_ids"] or not ids["generation_token_ids"]:
        raise InconsistentTokenFieldsError(f"{where}: prompt_token_ids and generation_token_ids must be non-empty")
    if len(lps) != len(ids["generation_token_ids"]):
        raise InconsistentTokenFieldsError(
            f"{where}: {len(ids['generation_token_ids'])} generation_token_ids but {len(lps)} generation_log_probs"
        )
    if not all(math.isfinite(x) and x <= 0 for x in lps):
        raise InconsistentTokenFieldsError(f"{where}.generation_log_probs must be finite and <= 0")
    return TokenFields(ids["prompt_token_ids"], ids["generation_token_ids"], [float(x) for x in lps])


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise ValueError(f"{where}.tool_calls must be a list")
    out = []
    for k, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(
                f"{where}.tool_calls[{k}] must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}"
            )
        if not TOOL_NAME.fullmatch(fn["name"]):  # the name is rendered raw: it could close the turn; the parser
            # would never read such a call back from the model's text either
            raise ValueError(
                f"{where}.tool_calls[{k}].function.name must match ^[A-Za-z0-9_-]{{1,64}}$, got "
                f"{reprlib.repr(fn['name'])}"
            )
        if c.get("type", "function") != "function":
            raise ValueError(f"{where}.tool_calls[{k}].type must be 'function', got {reprlib.repr(c['type'])}")
        if c.get("id") is not None and not isinstance(c["id"], str):
            raise ValueError(f"{where}.tool_calls[{k}].id must be a string, got {reprlib.repr(c['id'])}")
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}.tool_calls[{k}].function.arguments is not valid JSON: {e}") from None
        except RecursionError:
            raise ValueError(
                f"{where}.tool_calls[{k}].function.arguments is nested deeper than {MAX_NESTING} levels"
            ) from None
        if not isinstance(args, dict):
            raise ValueError(f"{where}.tool_calls[{k}].function.arguments must encode a JSON object")
        _check_nesting(args, f"{where}.tool_calls[{k}].function.arguments")
        try:  # rendered with tojson: NaN or 1e999 would render as text no JSON parser (ours included) reads back
            json.dumps(args, allow_nan=False)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}.tool_calls[{k}].function.arguments must be strict JSON: {e}") from None
        out.append({"type": "function", "id": c.get("id"), "function": {"name": fn["name"], "arguments": args}})
    return out


def template_message(msg: dict, index: int) -> dict:
    """One OpenAI message as the chat template expects it (token fields dropped)."""
    where = f"messages[{index}]"
    if not isinstance(msg, dict):
        raise ValueError(f"{where} must be an object")
    role = msg.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}.role must be one of {list(ROLES)}, got {reprlib.repr(role)}")
    out: dict = {
        "role": "system" if role == "developer" else role,
        "content": _text(msg.get("content"), where + ".content"),
    }
    for key, owner in (("tool_calls", "assistant"), ("reasoning_content", "assistant"), ("tool_call_id", "tool")):
        if msg.get(key) and role != owner:  # the template would drop it without a word
            raise ValueError(f"{where}.{key} belongs on {owner!r} messages, not on role {role!r}")
    if role == "assistant":
        if msg.get("reasoning_content") is not None:
            out["reasoning_content"] = _text(msg["reasoning_content"], where + ".reasoning_content")
        if msg.get("tool_calls"):
            out["tool_calls"] = _tool_calls(msg["tool_calls"], where)
        if out["content"] is None and "tool_calls" not in out:
            out["content"] = ""
    elif out["content"] is None:
        raise ValueError(f"{where} (role {role!r}) needs a content")
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if msg.get(key) is not None:
                if not isinstance(msg[key], str):  # str() made {"x": 1} the id "{'x': 1}"
                    raise ValueError(f"{where}.{key} must be a string, got {type(msg[key]).__name__}")
                out[key] = msg[key]
    return out


def validate_tools(tools: Any) -> list[dict] | None:
    """OpenAI `tools` checked and returned in the template's form."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of {'type': 'function', 'function': {...}}")
    seen = set()
    for k, t in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ValueError(
                f"{where} must be {{'type': 'function', 'function': {{'name', 'description', 'parameters'}}}}"
            )
        _check_nesting(t, where)
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise ValueError(f"{where}.function.name must match ^[A-Za-z0-9_-]{{1,64}}$, got {reprlib.repr(name)}")
        if name in seen:
            raise ValueError(f"{where}.function.name {name!r} is defined twice")
        seen.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ValueError(f"{where}.function.description must be a string")
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict) or params.get("type", "object") != "object":
                raise ValueError(
                    f"{where}.function.parameters must be a JSON Schema object "
                    f"({{'type': 'object', 'properties': ...}})"
                )
            if "properties" in params and not isinstance(params["properties"], dict):
                raise ValueError(f"{where}.function.parameters.properties must be an object")
            req = params.get("required", [])
            if not isinstance(req, list) or not all(isinstance(r, str) for r in req):
                raise ValueError(f"{where}.function.parameters.required must be a list of property names")
    return [{"type": "function", "function": dict(t["function"])} for t in tools]


def validate_template_kwargs(kwargs: Any) -> dict:
    """`chat_template_kwargs` (vLLM's field): more variables for the chat template, e.g. Qwen3's
    `{"enable_thinking": false}`. Their strings are checked with the messages' (`check_rendered_text`)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be an object of template variables, got {type(kwargs).__name__}")
    for key in kwargs:
        if (
            not isinstance(key, str)
            or not key.isidentifier()
            or key in RESERVED_TEMPLATE_KWARGS
            or key.endswith("_token")
        ):
            raise ValueError(
                f"chat_template_kwargs may not set {reprlib.repr(key)}: the server sets the "
                f"template's messages, tools, generation prompt, special tokens and functions itself"
            )
    _check_nesting(kwargs, "chat_template_kwargs")
    return dict(kwargs)


def check_tool_choice(tool_choice: Any, tools: list[dict] | None) -> bool:
    """Whether tool calls are parsed from the output. Only 'auto' and 'none' are honoured."""
    if tool_choice is None:
        return bool(tools)
    if tool_choice == "none":
        return False
    if tool_choice == "auto":
        if not tools:
            raise ValueError("tool_choice='auto' needs tools")
        return True
    if tool_choice == "required" or isinstance(tool_choice, dict):
        raise ValueError(
            "tool_choice 'required' or a named function needs constrained decoding, which this server "
            "does not implement (it would put forced tokens into the generation); use 'auto' or 'none'"
        )
    raise ValueError(
        f"tool_choice must be 'auto', 'none', 'required' or a named function, got {reprlib.repr(tool_choice)}"
    )


def _strings(obj: Any, where: str):
    """(field path, string) of every string in a JSON-like value, dict keys included."""
    if isinstance(obj, str):
        yield where, obj
    elif isinstance(obj, dict):
        for key, v in obj.items():
            yield from _strings(key, f"{where} key")
            yield from _strings(v, f"{where}.{key}")
    elif isinstance(obj, list):
        for k, v in enumerate(obj):
            yield from _strings(v, f"{where}[{k}]")


def check_rendered_text(
    tmsgs: list[dict],
    tools: list[dict] | None,
    specials: tuple[str, ...],
    generated: set[int] = frozenset(),
    template_kwargs: dict | None = None,
) -> None:
    """Every string the template renders is valid Unicode, and none a client wrote spells a special token
    (`specials`, their texts); `generated`: indices of messages carrying token fields, whose text the model
    wrote (see the module docstring). Names the field, so the client knows what to escape."""
    fields = [(f"messages[{i}]", m, i not in generated) for i, m in enumerate(tmsgs)]
    fields += [(f"tools[{k}]", t, True) for k, t in enumerate(tools or [])]
    fields += [("chat_template_kwargs", template_kwargs, True)] if template_kwargs else []
    for root, value, written in fields:
        for where, s in _strings(value, root):
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(
                    f"{where} is not valid Unicode: a lone surrogate {s[e.start]!r} at character {e.start}"
                ) from None
            hits = sorted((s.find(t), t) for t in specials if t in s) if written else []
            if hits:
                raise ValueError(
                    f"{where} holds the text of the special token {hits[0][1]!r} (at character "
                    f"{hits[0][0]}), which would be encoded as that token (a forged turn boundary); "
                    f"escape or remove it"
                )


def check_tool_replies(tmsgs: list[dict]) -> None:
    """Each tool message answers a call of the assistant message before its run of tool messages (and, if both
    carry ids, one of its ids): a reply to no call is a tool result the model never asked for."""
    calls = None  # ids of the open assistant turn's calls; None: no turn with calls is open
    for i, m in enumerate(tmsgs):
        if m["role"] != "tool":
            calls = [c.get("id") for c in m.get("tool_calls", [])] or None
            continue
        if calls is None:
            raise ValueError(
                f"messages[{i}] (role 'tool') answers no tool call: the message before its run of tool "
                f"messages must be an assistant message with tool_calls"
            )
        cid = m.get("tool_call_id")
        if cid is not None and None not in calls and cid not in calls:
            raise ValueError(
                f"messages[{i}].tool_call_id {reprlib.repr(cid)} matches none of the calls it answers "
                f"({', '.join(calls)})"
            )
