"""Assistant text -> (reasoning, content, tool calls), for clients only.

The parse is a view of the generated text for the client; it never feeds the
training tokens (those are the generated IDs, docs/design.md §7). The same function
also checks, on the next turn, that an assistant message sent back still says
what its tokens say (see splice.py).

An optional leading `<think>…</think>` block is the reasoning (`</think>`
missing = the generation stopped inside it; a template that writes `<think>`
into the generation prompt itself, as some "thinking" checkpoints' do, leaves
reasoning and `</think>` in the content). The rest is read in one of two tool
call formats, a property of the chat template (`Splicer.tool_call_format`
finds it by rendering a call and parsing it back):

  * `HERMES` (Qwen2.5, Qwen3, the project's template): every
    `<tool_call>{"name": …, "arguments": {…}}</tool_call>` block whose body is
    a valid call becomes a tool call; everything else is content. A block with
    an invalid body stays in the content as text.
  * `LLAMA3_JSON` (Llama 3.1 / 3.2 custom tools): the whole text after the
    reasoning is the call, a bare JSON object `{"name": …, "parameters": {…}}`
    (leading whitespace and a `<|python_tag|>` prefix allowed). As in vLLM's
    `llama3_json` parser (vllm/entrypoints/openai/tool_parsers/
    llama_tool_parser.py), the arguments may be under "arguments" instead, and
    several objects separated by `;` are several calls. Stricter than vLLM's:
    text around the JSON, malformed JSON, or any object that is not a valid
    call makes the whole text content (vLLM picks a JSON object out of
    surrounding text), so nothing the model wrote is lost.

`StreamParser` emits the same result as append-only deltas: text that might
still turn into a tag, an open tool call, or trailing whitespace is held back
until it is decided, so the concatenated deltas equal `parse_assistant_text`.
In `LLAMA3_JSON` the calls are known only when the text is complete (one more
`;` or word would change them): text that could still be calls is held until
then, text that no longer can is content at once (but a value that does not
decode yet, such as a number past Python's digit limit, is held to the end too).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
HERMES, LLAMA3_JSON = "hermes", "llama3_json"  # tool call formats (vLLM's --tool-call-parser names)
TOOL_FORMATS = (HERMES, LLAMA3_JSON)
PYTHON_TAG = "<|python_tag|>"  # Llama 3.x: may open a tool call (vLLM's bot_token)
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # fullmatch: `$` would let a trailing newline through


@dataclass
class ToolCall:
    name: str
    arguments: dict  # parsed JSON object; sent to clients as a JSON string
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }


@dataclass
class ParsedAssistant:
    reasoning: str | None  # the <think> block's text, stripped of newlines at both ends
    content: str  # text outside reasoning and tool calls, stripped
    tool_calls: list[ToolCall]

    def to_message(self) -> dict:
        """The OpenAI assistant message (content null when there are only tool calls)."""
        msg = {"role": "assistant", "content": self.content if (self.content or not self.tool_calls) else None}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [tc.to_openai() for tc in self.tool_calls]
        return msg


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """json object hook: a key written twice is not a call (which of the two would the client get?)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError("duplicate key")
    return obj


def parse_tool_call_body(body: str) -> ToolCall | None:
    """A `<tool_call>` body as a call, or None if it is not a valid one: a JSON object of `name` and
    optional `arguments` only (another key, e.g. `parameters`, would be dropped from the call), no
    key twice, and arguments that strict JSON can carry (no NaN or Infinity) in UTF-8."""
    try:  # ValueError: also a number past Python's digit limit; RecursionError: nesting too deep
        obj = json.loads(body, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError):
        return None
    return _call_of(obj, ("arguments",), required=False)


def _call_of(obj, arg_keys: tuple[str, ...], required: bool) -> ToolCall | None:
    """A decoded JSON value as a call: an object of `name` and at most one of `arg_keys` (exactly one if
    `required`), nothing else; arguments an object (or a JSON string of one) that strict JSON carries in UTF-8."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not TOOL_NAME.fullmatch(obj["name"]):
        return None
    keys = set(obj) - {"name"}
    if keys - set(arg_keys) or len(keys) > 1 or (required and not keys):
        return None
    args = obj[keys.pop()] if keys else {}
    try:
        if isinstance(args, str):  # some models emit the arguments as a JSON string
            args = json.loads(args, object_pairs_hook=_unique_keys)
        # what a client is sent must be strict JSON in UTF-8: not 1e999 (inf), NaN, or a lone
        # surrogate escape ("\ud800")
        json.dumps(args, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
        return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], args)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning or None, rest). Reasoning only when the text opens with `<think>`."""
    if not text.startswith(THINK_OPEN):
        return None, text
    body = text[len(THINK_OPEN) :]
    end = body.find(THINK_CLOSE)
    if end < 0:
        return body.strip("\n"), ""
    return body[:end].strip("\n"), body[end + len(THINK_CLOSE) :]


def split_tool_calls(text: str) -> tuple[list[str], list[ToolCall]]:
    """(content pieces, tool calls) of text after the reasoning."""
    pieces, calls, i = [], [], 0
    while True:
        start = text.find(CALL_OPEN, i)
        if start < 0:
            pieces.append(text[i:])
            return pieces, calls
        end = text.find(CALL_CLOSE, start)
        if end < 0:  # unclosed: plain text
            pieces.append(text[i:])
            return pieces, calls
        call = parse_tool_call_body(text[start + len(CALL_OPEN) : end])
        pieces.append(text[i:start] if call else text[i : end + len(CALL_CLOSE)])
        if call:
            calls.append(call)
        i = end + len(CALL_CLOSE)


_JSON = json.JSONDecoder(object_pairs_hook=_unique_keys)
_UNDECIDED = object()


def _json_calls(text: str, partial: bool = False):
    """`text` (after the reasoning) read as Llama 3 JSON calls: the list of calls if the whole text is
    `[<|python_tag|>] call (; call)*` with whitespace around; None if it is not. With `partial`, `_UNDECIDED`
    if some continuation of `text` could still be such calls (or is: the calls are final only at the end)."""
    t = text.lstrip()
    if partial and PYTHON_TAG.startswith(t):
        return _UNDECIDED
    if t.startswith(PYTHON_TAG):
        t = t[len(PYTHON_TAG) :]
    calls = []
    while True:
        t = t.lstrip()
        if not t:
            return _UNDECIDED if partial else None  # nothing, or a `;` with no call after it
        if t[0] != "{":
            return None
        try:
            obj, end = _JSON.raw_decode(t)
        except json.JSONDecodeError:  # malformed, or (mid-stream) not yet complete: held to the end
            return _UNDECIDED if partial else None
        except (ValueError, RecursionError):  # a key twice, a number past the digit limit, nesting too deep:
            return _UNDECIDED if partial else None  # (mid-stream, the number's exponent may be still to come)
        call = _call_of(obj, ("arguments", "parameters"), required=True)
        if call is None:
            return None
        calls.append(call)
        t = t[end:].lstrip()
        if not t:
            return _UNDECIDED if partial else calls
        if t[0] != ";":
            return None
        t = t[1:]


def json_call_ends(text: str) -> list[int]:
    """Where Llama 3 JSON calls at the start of `text` (after the reasoning) may end: the offset just past each
    JSON object of its leading `[<|python_tag|>] {...} (; {...})*`. A stop string that cut calls from the text
    after them cut it at one of these (and whitespace)."""
    t = text.lstrip()
    if t.startswith(PYTHON_TAG):
        t = t[len(PYTHON_TAG) :]
    ends = []
    while (t := t.lstrip()).startswith("{"):
        try:
            _, end = _JSON.raw_decode(t)
        except (ValueError, RecursionError):
            break
        t = t[end:]
        ends.append(len(text) - len(t))
        t = t.lstrip()
        if not t.startswith(";"):
            break
        t = t[1:]
    return ends


def split_json_calls(text: str) -> tuple[list[str], list[ToolCall]]:
    """(content pieces, tool calls) of text after the reasoning, in the Llama 3 JSON format: all calls or
    all content."""
    calls = _json_calls(text)
    return ([""], calls) if calls else ([text], [])


def _split(text: str, parse_tools: bool, tool_format: str) -> tuple[list[str], list[ToolCall]]:
    if not parse_tools:
        return [text], []
    if tool_format == HERMES:
        return split_tool_calls(text)
    if tool_format == LLAMA3_JSON:
        return split_json_calls(text)
    raise ValueError(f"tool_format must be one of {list(TOOL_FORMATS)}, got {tool_format!r}")


def parse_assistant_text(text: str, parse_tools: bool = True, tool_format: str = HERMES) -> ParsedAssistant:
    """`text` as reasoning, content and tool calls (`tool_format`: HERMES or LLAMA3_JSON, module docstring)."""
    reasoning, rest = split_reasoning(text)
    pieces, calls = _split(rest, parse_tools, tool_format)
    return ParsedAssistant(reasoning, "".join(pieces).strip(), calls)


def _held_tag_prefix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), 0, -1):
            if text.endswith(tag[:n]):
                best = max(best, n)
                break
    return best


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self):
        return bool(self.reasoning or self.content or self.tool_calls)


class StreamParser:
    """Incremental `parse_assistant_text`: feed text chunks, get append-only deltas."""

    def __init__(self, parse_tools: bool = True, tool_format: str = HERMES):
        _split("", parse_tools, tool_format)  # checks the format
        self.parse_tools, self.tool_format = parse_tools, tool_format
        self.text = ""
        self._sent_reasoning = 0  # characters of the final reasoning already sent
        self._sent_content = 0  # characters of the stripped content already sent
        self._sent_calls = 0

    def feed(self, chunk: str) -> Delta:
        self.text += chunk
        return self._delta(final=False)

    def finish(self) -> Delta:
        return self._delta(final=True)

    def _delta(self, final: bool) -> Delta:
        text, d = self.text, Delta()
        if not final and THINK_OPEN.startswith(text):  # might still become "<think>"
            return d
        reasoning, rest = split_reasoning(text)
        if reasoning is not None:
            closed = THINK_CLOSE in text
            if not closed and not final:
                body = text[len(THINK_OPEN) :]
                body = body[: len(body) - _held_tag_prefix(body, (THINK_CLOSE,))]
                reasoning = body.lstrip("\n").rstrip("\n")  # trailing newlines may be stripped at the end
            d.reasoning = reasoning[self._sent_reasoning :]
            self._sent_reasoning = len(reasoning)
            if not closed and not final:
                return d
        if not final:
            rest = self._decided_prefix(rest)
        pieces, calls = _split(rest, self.parse_tools, self.tool_format)
        content = "".join(pieces).lstrip()
        content = content.rstrip() if final else content[: len(content.rstrip())]
        d.content = content[self._sent_content :]
        self._sent_content = len(content)
        d.tool_calls = calls[self._sent_calls :]
        self._sent_calls = len(calls)
        return d

    def _decided_prefix(self, rest: str) -> str:
        """The part of `rest` whose parse can no longer change."""
        if self.parse_tools and self.tool_format == LLAMA3_JSON:
            return "" if _json_calls(rest, partial=True) is _UNDECIDED else rest
        if self.parse_tools:
            open_at = rest.rfind(CALL_OPEN)
            if open_at >= 0 and rest.find(CALL_CLOSE, open_at) < 0:
                return rest[:open_at]  # inside an open tool call: undecided
            return rest[: len(rest) - _held_tag_prefix(rest, (CALL_OPEN,))]
        return rest
