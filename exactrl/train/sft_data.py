"""SFT data: JSONL records to token ids with a loss mask over the assistant's tokens, and a resumable stream.

One record per line, of either kind:

    {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": ...}, ...], "tools": [...]}
    {"prompt": ..., "completion": ...}

Messages are OpenAI chat messages, checked as the server checks them (exactrl/chat/messages.py: text parts,
tool calls, no special-token text written into a field). A chat is rendered with the tokenizer's chat
template prefix by prefix: after each message, and before each assistant message with the generation
prompt (the assistant's header). Each rendering must extend the one before it; a template that rewrites
earlier text as the conversation grows (Qwen3's drops the reasoning of earlier assistant turns) is refused,
naming the record, since its assistant tokens cannot be told apart from the rest. The text between two
renderings is tokenized on its own and the pieces are laid end to end, so the tokens before an assistant
turn are the prompt the engine is given (`apply_chat_template(..., add_generation_prompt=True)`) and the
turn's tokens are its reply as the engine samples it. The loss mask covers an assistant piece up to and
including its first stop token (end of turn or eos): what the template writes after it (a newline) is never
sampled. Everything else (system, user and tool turns, the headers) is masked.

A prompt/completion record with text fields is, by `data.prompt_format`: `chat`, the prompt as one user turn
and the completion as the assistant's reply (the tokens RL's prompts have: envs/prompts.py); `raw`, the
prompt's tokens, then the completion's and eos, no template (a base model's). With lists of messages in both
fields (TRL's conversational prompt-completion) it is the chat prompt + completion, trained on the
completion's assistant turns only.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exactrl.chat.messages import check_rendered_text, check_tool_replies, template_message, validate_tools
from exactrl.envs.dataset import ResumableStream, load_json_line
from exactrl.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class Example:
    """One training sequence."""

    tokens: list[int]  # the whole sequence
    loss_mask: list[bool]  # loss_mask[t]: token t is trained on, predicted from tokens[:t] (never t = 0)
    where: str  # what it was built from (file:line), for errors

    @property
    def first(self) -> int:
        """The first trained position (`token_logprobs`' `first`)."""
        return self.loss_mask.index(True)


def chat_example(
    tok: Tokenizer, messages: list[dict], where: str, tools: list[dict] | None = None, train_from: int = 0
) -> Example:
    """The example of a chat whose assistant turns from index `train_from` on are trained (module docstring).
    `messages` are in the template's form (`template_message`)."""
    stops = tok.stop_token_ids
    tokens: list[int] = []
    mask: list[bool] = []
    text = ""
    for i, m in enumerate(messages):
        marks = [(True, False)] if m["role"] == "assistant" else []  # the header: its piece is never trained
        for generation_prompt, trained in [*marks, (False, m["role"] == "assistant" and i >= train_from)]:
            upto = messages[: i + 1 - generation_prompt]
            if not upto:
                raise ValueError(f"{where}: messages[0] is an assistant turn with nothing before it to answer")
            try:
                rendered = tok.render_chat(upto, tools, add_generation_prompt=generation_prompt)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            if not rendered.startswith(text):
                raise ValueError(
                    f"{where}: the chat template's text for messages[:{len(upto)}]"
                    f"{' with the generation prompt' if generation_prompt else ''} does not extend its text for "
                    f"the messages before: the template rewrites earlier turns as the conversation grows (e.g. "
                    f"it drops the reasoning of earlier assistant turns), so the assistant's tokens cannot be "
                    f"located; use a template that keeps earlier turns as they were"
                )
            piece = tok.encode(rendered[len(text) :])
            text = rendered
            if trained:
                end = next((j for j, t in enumerate(piece) if t in stops), None)
                if end is None:
                    raise ValueError(
                        f"{where}: the chat template closes messages[{i}] (assistant) with no stop token "
                        f"({tok.decode(sorted(stops))!r}): a model trained on it would never learn to stop"
                    )
                mask += [True] * (end + 1) + [False] * (len(piece) - end - 1)
            else:
                mask += [False] * len(piece)
            tokens += piece
    return _example(tokens, mask, where)


def raw_example(tok: Tokenizer, prompt: str, completion: str, where: str) -> Example:
    """The prompt's tokens, then the completion's and eos (trained), no template."""
    p = tok.encode(prompt)
    if not p:
        raise ValueError(f"{where}: 'prompt' is empty: the completion's first token has nothing to follow")
    c = tok.encode(completion) + [tok.eos_token_id]
    return _example(p + c, [False] * len(p) + [True] * len(c), where)


def _example(tokens: list[int], mask: list[bool], where: str) -> Example:
    mask = [False] + mask[1:] if mask else mask  # the first token is predicted from nothing
    if not any(mask):
        raise ValueError(f"{where}: no assistant token to train on")
    return Example(tokens, mask, where)


def record_example(tok: Tokenizer, row: Any, where: str, prompt_format: str = "chat") -> Example:
    """The example of one parsed JSONL record; a ValueError naming `where` and the problem."""
    if not isinstance(row, dict):
        raise ValueError(
            f"{where}: expected a JSON object with 'messages' or 'prompt' and 'completion', got {type(row).__name__}"
        )
    if "messages" in row and ("prompt" in row or "completion" in row):
        raise ValueError(f"{where}: holds both 'messages' and 'prompt'/'completion': one record is one kind")
    try:
        if "messages" in row:
            return _chat_record(tok, row["messages"], row.get("tools"), where, 0)
        missing = [k for k in ("prompt", "completion") if k not in row]
        if missing:
            raise ValueError(
                f"missing field {' and '.join(repr(k) for k in missing)}: each line needs 'messages' (a chat) "
                f"or 'prompt' and 'completion'"
            )
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, list) and isinstance(completion, list):  # a conversational prompt and completion
            return _chat_record(tok, prompt + completion, row.get("tools"), where, len(prompt))
        if not (isinstance(prompt, str) and isinstance(completion, str)):
            raise ValueError(
                f"'prompt' and 'completion' must both be strings or both lists of messages, got "
                f"{type(prompt).__name__} and {type(completion).__name__}"
            )
        for name, text in (("prompt", prompt), ("completion", completion)):
            hits = sorted((text.find(t), t) for t in _special_texts(tok) if t in text)
            if hits:
                raise ValueError(
                    f"'{name}' holds the text of the special token {hits[0][1]!r} (at character {hits[0][0]}), "
                    f"which would be encoded as that token (a forged turn boundary); escape or remove it"
                )
        if prompt_format == "raw":
            return raw_example(tok, prompt, completion, where)
        msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        return chat_example(tok, msgs, where)
    except ValueError as e:
        text = str(e)
        raise ValueError(text if text.startswith(where) else f"{where}: {text}") from None


def _chat_record(tok: Tokenizer, messages: Any, tools: Any, where: str, train_from: int) -> Example:
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of chat messages")
    tmsgs = [template_message(m, i) for i, m in enumerate(messages)]
    tools = validate_tools(tools)
    check_rendered_text(tmsgs, tools, _special_texts(tok))
    check_tool_replies(tmsgs)
    if not any(m["role"] == "assistant" for m in tmsgs[train_from:]):
        what = "the completion has" if train_from else "the record has"
        raise ValueError(f"{what} no assistant turn: nothing to train on")
    return chat_example(tok, tmsgs, where, tools, train_from)


def _special_texts(tok: Tokenizer) -> tuple[str, ...]:
    """Texts the encoder turns into special tokens: refused in a record's fields (a forged turn boundary)."""
    return tuple(t.content for t in tok.hf.added_tokens_decoder.values() if t.special and t.content)


def read_sft_jsonl(path: str | Path, tok: Tokenizer, prompt_format: str = "chat") -> list[Example]:
    """Every record of a JSONL file as an Example; blank lines are skipped, a bad line is a ValueError naming
    file:line."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"data.train_jsonl {path} is a directory: give the JSONL file in it")
    if not path.is_file():
        raise ValueError(f"data.train_jsonl {path} does not exist")
    out = []
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ValueError(f"cannot read data.train_jsonl {path}: {e.strerror or e}") from None
    with f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:  # a byte-order mark at the start is not part of the first line
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                row = load_json_line(line, where)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            out.append(record_example(tok, row, where, prompt_format))
    if not out:
        raise ValueError(f"data.train_jsonl {path} holds no records")
    return out


class ExampleStream(ResumableStream[Example]):
    """The SFT examples as an endless, resumable stream (envs/dataset.py `ResumableStream`); its fingerprint is
    the tokens trained on, so another file or tokenizer is another stream."""

    order_key = "exactrl.sft"
    what = "its data position"
    fix = "resume with the same data file, tokenizer, seed and shuffle setting"

    def __init__(self, examples: list[Example], seed: int, shuffle: bool = True):
        h = hashlib.sha256()
        for e in examples:
            h.update(json.dumps([e.tokens, e.loss_mask]).encode() + b"\n")
        super().__init__(examples, seed, shuffle, h.hexdigest()[:16])

    @property
    def examples(self) -> list[Example]:
        return self.items
