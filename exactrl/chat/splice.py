"""Token-exact multi-turn prompts: earlier turns' exact IDs + a tokenization of what is new.

An assistant message the server returned carries `prompt_token_ids`,
`generation_token_ids` and `generation_log_probs`. The history H of a new
request is the last such message's prompt + generation (+ one end-of-turn
token if the generation did not end with one: the template closes every turn).
The new prompt is

    H + R[cut:]

where R is the tokenized render of the whole new conversation (generation
prompt included) and `cut` is just after R's k-th end-of-turn token, k the
number of end-of-turn tokens in H. Every turn ends with exactly one
end-of-turn token (Qwen's templates make a run of tool results one user
turn; Llama's end a turn with `<|eot_id|>`) and special tokens split the
text, so R[cut:] is exactly the tokenization of what is new (tool results,
user turn, generation prompt), and no old text is ever re-tokenized.

H is only used if the conversation still says what H says (monotonicity).
H and R are cut into segments after each end-of-turn token; segment j of H
must match segment j of R:
  * a segment holding generated tokens matches if its assistant message is
    the one at that place of the conversation and still says what the tokens
    say (same reasoning, content and tool calls, `parsing.py`, the calls read
    in the template's format, `tool_call_format`) — never by
    comparing templates, which may re-render tool calls or drop old reasoning
    (Qwen3's drops it before the last user query: the spliced prompt keeps the
    reasoning tokens the model generated, where a re-render would not show
    them; a client that removes `reasoning_content` no longer matches, and the
    policy decides);
  * any other segment matches if its text is the same (the token IDs may
    differ: that is the re-tokenization this module exists to avoid).
A generation may itself hold end-of-turn tokens (ignore_eos): its message then
covers several segments of H, all matched by the message, and its re-render
holds as many end-of-turn tokens (the returned text keeps them), so the
message must end in R's segment where its tokens end in H. (When such a
generation's last token is an end-of-turn, its text shows it too; that one is
the turn's end, which the template renders itself.)
An earlier token-carrying message whose tokens are a prefix of H is matched
as a generation; one whose tokens are not (a turn from before a `split` or
`truncate`, which H holds re-rendered from its text) is matched by its text,
like any other turn, so one split does not make every later turn split again.
The tokens between a generation and the end of the turn before it must say
what the template's generation prompt says (nothing else may sit in the
context unseen). The first mismatch
is handled by the policy: `raise` (MonotonicityError naming the first
differing token position of H), `split` (a fresh render: a new training
segment, the old one stays whole) or `truncate` (H up to the last matching
turn boundary + a fresh render of the rest).

Cost: the template is rendered once for the whole conversation and once per
token-carrying message that passes the cheap token checks (to find the turn it
ends in), never once per message; with `max_len`, a conversation whose every
possible prompt would exceed the context is refused before those renders, and
one whose text alone is too long for the context before it is tokenized
(`min_tokens`: a token stands for at most `max_token_chars` characters of the
normalized text, so a multi-megabyte message is not tokenized).
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

from exactrl.chat.messages import (
    TokenFields,
    check_rendered_text,
    check_tool_replies,
    template_message,
    token_fields,
    validate_template_kwargs,
)
from exactrl.chat.parsing import LLAMA3_JSON, TOOL_FORMATS, json_call_ends, parse_assistant_text, split_reasoning

POLICIES = ("raise", "split", "truncate")
CUT_WINDOW = 16  # characters past a cut answer's last field where the cut may lie (a tag and its whitespace)


class PromptTooLongError(ValueError):
    """Every prompt the conversation could give is longer than the context."""

    def __init__(self, length: int, limit: int):
        self.length, self.limit = length, limit
        super().__init__(f"the conversation needs a prompt of at least {length} tokens, the context holds {limit}")


class MonotonicityError(ValueError):
    """The conversation does not extend its earlier token history (policy `raise`)."""

    def __init__(self, position: int, detail: str):
        self.position, self.detail = position, detail
        super().__init__(
            f"conversation does not extend its earlier tokens: first differing token at position {position} "
            f"of the previous turn's prompt_token_ids + generation_token_ids ({detail}). Send the assistant "
            f"messages back unchanged, or choose the monotonicity policy 'split' or 'truncate'"
        )


@dataclass
class PromptPlan:
    """The prompt of a chat request and how it was built."""

    prompt_ids: list[int]
    kind: str  # "fresh" (no token history) | "spliced" | "split" | "truncate"
    reused: int  # leading tokens taken verbatim from the token history
    divergence: int | None = None  # first differing position of the history (split / truncate)
    history: list[int] | None = None  # the token history a truncate cut (its records leave training)


@dataclass
class _Mismatch:
    segment: int  # first segment of H that does not match
    position: int  # first differing token of H
    detail: str


def _first_diff(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _ends(ids: list[int], eot: int) -> list[int]:
    return [i for i, t in enumerate(ids) if t == eot]


class Splicer:
    """Builds chat prompts for one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer, vocab_size: int | None = None, stop_token_ids=()):
        self.tok = tokenizer
        # the model's vocabulary, which may exceed the tokenizer's (padded rows): any id it samples is valid
        self.vocab_size = tokenizer.vocab_size if vocab_size is None else vocab_size
        self.eot = tokenizer.end_of_turn_id
        self.eot_text = tokenizer.decode([self.eot], skip_special_tokens=False)
        # `stop_token_ids`: what else the engine stops on (the model's generation_config eos ids): a generation
        # ending with one is a stopped turn whose text does not show it
        self.stop_ids = frozenset(tokenizer.stop_token_ids) | {self.eot} | frozenset(stop_token_ids)
        # texts the encoder turns into special tokens: refused in what a client wrote (messages.py)
        self.special_texts = tuple(
            t.content for t in tokenizer.hf.added_tokens_decoder.values() if t.special and t.content
        )
        # how the template writes a tool call, so how generated text is read (here, not on first use: the
        # probe's renders are not the cost of whichever request comes first)
        self.tool_call_format = self._tool_call_format()

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of normalized text one token stands for: its piece's length (a byte-level piece
        has a character per byte, a SentencePiece piece '▁' for a space, an added token its text)."""
        hf = self.tok.hf
        return max(len(p) for p in hf.convert_ids_to_tokens(list(range(len(hf)))) if p)

    def min_tokens(self, text: str, limit: int) -> int:
        """At least this many tokens encode `text` (for a tokenizer whose pieces spell the normalized text:
        byte-level BPE, SentencePiece), found without tokenizing it. The text is normalized only when its raw
        length reaches `limit` tokens' worth: a normalizer may merge characters (NFC, Qwen's) or drop them (accents).
        A ValueError for text that is not valid Unicode, as `Tokenizer.encode`."""
        need = -(-len(text) // self.max_token_chars)
        normalizer = self.tok.hf.backend_tokenizer.normalizer
        if need >= limit and normalizer is not None:
            try:
                need = -(-len(normalizer.normalize_str(text)) // self.max_token_chars)
            except UnicodeEncodeError as e:
                raise ValueError(
                    f"text is not valid Unicode: a lone surrogate {text[e.start]!r} at character {e.start}"
                ) from None
        return need

    def _tool_call_format(self) -> str | None:
        """The format the chat template writes a tool call in (`parsing.py`): HERMES (`<tool_call>` blocks:
        Qwen2.5, Qwen3, ours) or LLAMA3_JSON (bare `{"name": ..., "parameters": ...}`: Llama 3.1, 3.2), found
        by rendering one call and parsing it back; None if neither reads it back (the template refuses tools,
        or writes calls some other way: its calls would come back as content)."""
        tools = [
            {
                "type": "function",
                "function": {
                    "name": "probe",
                    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
                },
            }
        ]
        user = {"role": "user", "content": "probe"}
        call = {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "id": "call_0", "function": {"name": "probe", "arguments": {"x": 1}}}],
        }
        try:
            prompt = self.tok.render_chat([user], tools)
            turn = self.tok.render_chat([user, call], tools, add_generation_prompt=False)
        except ValueError:  # the template refuses tools or tool calls
            return None
        if not turn.startswith(prompt):
            return None
        text = turn[len(prompt) :].split(self.eot_text)[0]
        for fmt in TOOL_FORMATS:
            calls = parse_assistant_text(text, tool_format=fmt).tool_calls
            if [(c.name, c.arguments) for c in calls] == [("probe", {"x": 1})]:
                return fmt
        return None

    def build(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        policy: str = "raise",
        max_len: int | None = None,
        template_kwargs: dict | None = None,
    ) -> PromptPlan:
        """The prompt; with `max_len`, PromptTooLongError if no prompt of the conversation would be shorter.
        `template_kwargs`: more chat template variables (`validate_template_kwargs`), for every render."""
        if policy not in POLICIES:
            raise ValueError(f"monotonicity policy must be one of {list(POLICIES)}, got {policy!r}")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        tmsgs = [template_message(m, i) for i, m in enumerate(messages)]
        fields = {i: f for i, m in enumerate(messages) if (f := token_fields(m, i, self.vocab_size)) is not None}
        check_tool_replies(tmsgs)
        kw = validate_template_kwargs(template_kwargs)
        check_rendered_text(tmsgs, tools, self.special_texts, set(fields), kw)
        for i, f in fields.items():
            tmsgs[i] = self._closing_eot_as_template(tmsgs[i], f)
        hist = self.history(fields[max(fields)]) if fields else []
        text = self.tok.render_chat(tmsgs, tools, add_generation_prompt=True, **kw)
        if max_len is not None:  # refused before tokenizing: the least any prompt needs, as below, from the text
            need = self.min_tokens(self._after_ends(text, hist.count(self.eot)), max_len)
            if need >= max_len:
                raise PromptTooLongError(need, max_len)
        full = self.tok.encode(text)
        # a generation may spell the end-of-turn marker in ordinary tokens: rendered, that text would become a
        # real end-of-turn token and shift every later turn. The turns are counted without it (those
        # messages' rendered tokens are never part of a spliced prompt: the history holds their tokens)
        rmsgs = [self._without_spelled_eots(m, fields[i]) if i in fields else m for i, m in enumerate(tmsgs)]
        counted = (
            full
            if rmsgs == tmsgs
            else self.tok.apply_chat_template(rmsgs, tools=tools, add_generation_prompt=True, **kw)
        )
        if max_len is not None:  # every policy's prompt ends with R after its k-th end-of-turn token (or all of R)
            r_ends = _ends(full, self.eot)
            k = min(len(_ends(hist, self.eot)), len(r_ends))
            shortest = len(full) - (r_ends[k - 1] + 1 if k else 0)
            if shortest >= max_len:
                raise PromptTooLongError(shortest, max_len)
        if not fields:
            return PromptPlan(list(full), "fresh", 0)
        bad = self._check(tmsgs, rmsgs, tools, fields, hist, counted, kw)
        if bad is None:
            k = len(_ends(hist, self.eot))
            cut = _ends(counted, self.eot)[k - 1] + 1
            return PromptPlan(hist + counted[cut:], "spliced", len(hist))
        if policy == "raise":
            raise MonotonicityError(bad.position, bad.detail)
        if policy == "split":
            return PromptPlan(list(full), "split", 0, bad.position)
        keep = 0 if bad.segment == 0 else _ends(hist, self.eot)[bad.segment - 1] + 1
        cut = 0 if bad.segment == 0 else _ends(counted, self.eot)[bad.segment - 1] + 1
        return PromptPlan(hist[:keep] + counted[cut:], "truncate", keep, bad.position, hist)

    def _after_ends(self, text: str, k: int) -> str:
        """`text` after its k-th end-of-turn marker, or its last if it has fewer (all of it for k = 0)."""
        start = 0
        for _ in range(k):
            at = text.find(self.eot_text, start)
            if at < 0:
                return text[start:]
            start = at + len(self.eot_text)
        return text[start:]

    def _closing_eot_as_template(self, tmsg: dict, f: TokenFields) -> dict:
        """A generation not stopped by its last token, which is an end-of-turn (ignore_eos), shows that token in
        its text; it is also the turn's end, which the template renders: the text's copy is dropped."""
        gen = f.generation_token_ids
        content = tmsg.get("content")
        if gen[-1] != self.eot or not isinstance(content, str) or not content.endswith(self.eot_text):
            return tmsg
        shown = content.count(self.eot_text) + (tmsg.get("reasoning_content") or "").count(self.eot_text)
        if shown != gen.count(self.eot):  # the stop token is not in the text: the ending one is generated text
            return tmsg
        return tmsg | {"content": content[: -len(self.eot_text)]}

    def _without_spelled_eots(self, tmsg: dict, f: TokenFields) -> dict:
        """The message with the end-of-turn marker's text removed where its generation holds no end-of-turn
        token before its last one: every such text was spelled by the model in ordinary tokens."""
        if self.eot in f.generation_token_ids[:-1]:  # ignore_eos: real ones are shown in the text too
            return tmsg
        return tmsg | {
            k: tmsg[k].replace(self.eot_text, "")
            for k in ("content", "reasoning_content")
            if isinstance(tmsg.get(k), str) and self.eot_text in tmsg[k]
        }

    def history(self, f: TokenFields) -> list[int]:
        """The exact tokens of the conversation up to the end of that assistant turn."""
        h = f.history
        return h if h[-1] == self.eot else h + [self.eot]

    # ------------------------------------------------------------ monotonicity
    def _check(
        self, tmsgs, rmsgs, tools, fields: dict[int, TokenFields], hist: list[int], full: list[int], kw: dict
    ) -> _Mismatch | None:
        """The first mismatch of H against R (`full`, rendered from `rmsgs`); `tmsgs`: the messages as sent."""
        h_ends, r_ends = _ends(hist, self.eot), _ends(full, self.eot)
        h_start = [0] + [e + 1 for e in h_ends]
        r_start = [0] + [e + 1 for e in r_ends]
        # what the template puts between a turn's end and a generation (as this request renders it)
        gen_prompt = self._text(full[r_start[-1] :])
        found: list[_Mismatch] = []
        spans = self._generated_spans(fields, hist, h_ends, h_start, gen_prompt, found)
        gen_seg = self._moved_turns(rmsgs, tools, kw, spans, h_start, found)
        found += self._changed_turn(tmsgs, fields, hist, full, h_ends, r_ends, h_start, r_start, gen_seg)
        return min(found, key=lambda m: m.position) if found else None

    def _generated_spans(self, fields, hist, h_ends, h_start, gen_prompt, found) -> dict[int, tuple[int, int]]:
        """The token-carrying messages whose tokens H holds, each as the span [first, last] of H's segments it
        covers; a message generated after a foreign generation prompt, or at a turn an earlier message already
        covers, goes to `found` and ends the walk."""
        spans: dict[int, tuple[int, int]] = {}
        covered = -1  # last segment of H covered by the token-carrying messages so far
        for i, f in fields.items():
            h = self.history(f)
            if _first_diff(h, hist) < len(h):  # from before a split: H holds its text, compared below
                continue
            first, last = bisect.bisect_left(h_ends, len(f.prompt_token_ids)), bisect.bisect_left(h_ends, len(h) - 1)
            if self._text(hist[h_start[first] : len(f.prompt_token_ids)]) != gen_prompt:
                why = f"the tokens before messages[{i}]'s generation are not the chat template's generation prompt"
                found.append(_Mismatch(first, h_start[first], why))
                break
            if first <= covered:  # cheap: no render for a duplicated or reordered turn
                why = f"messages[{i}] was generated at turn {first}, which an earlier message's tokens already cover"
                found.append(_Mismatch(first, h_start[first], why))
                break
            spans[i], covered = (first, last), last
        return spans

    def _moved_turns(self, rmsgs, tools, kw, spans, h_start, found) -> dict[int, int]:
        """Which message generated each of H's segments ({segment: message}), from one render per token-carrying
        message; a message that now ends in another turn of R than it was generated as goes to `found`."""
        gen_seg = {}
        for i, (first, last) in spans.items():
            rendered = self.tok.render_chat(rmsgs[: i + 1], tools=tools, add_generation_prompt=False, **kw)
            now = rendered.count(self.eot_text) - 1
            gen_seg |= {j: i for j in range(first, last + 1)}
            if last != now:
                seg = max(0, min(first, now))
                why = f"messages[{i}] was generated as turn {last} but is now turn {now}: "
                why += "messages were inserted or removed"
                found.append(_Mismatch(seg, h_start[seg], why))
        return gen_seg

    def _changed_turn(self, tmsgs, fields, hist, full, h_ends, r_ends, h_start, r_start, gen_seg) -> list[_Mismatch]:
        """The first of H's turns that R does not hold: a generated turn whose message no longer says what its
        tokens say, another turn whose text changed, or a turn R no longer has."""
        matched: dict[int, bool] = {}
        for j in range(len(h_ends)):
            if j >= len(r_ends):
                why = (
                    f"the conversation now has only {len(r_ends)} turns before "
                    f"the generation prompt, the token history has {len(h_ends)}"
                )
                return [_Mismatch(j, h_start[j], why)]
            hseg, rseg = hist[h_start[j] : h_start[j + 1]], full[r_start[j] : r_start[j + 1]]
            if j in gen_seg:
                i = gen_seg[j]
                if i not in matched:
                    matched[i] = self.matches(tmsgs[i], fields[i])
                if matched[i]:
                    continue
                why = f"messages[{i}] (assistant) no longer says what its generation_token_ids say"
            elif self._text(hseg) == self._text(rseg):
                continue
            else:
                why = f"the text of turn {j} changed"
            return [_Mismatch(j, h_start[j] + _first_diff(hseg, rseg), why)]
        return []

    def _text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def generation_text(self, gen: list[int]) -> str:
        """The text of a generation without its stop token."""
        return self._text(gen[:-1] if gen and gen[-1] in self.stop_ids else gen)

    def matches(self, msg: dict, f: TokenFields) -> bool:
        """Does the assistant message still say what its generated tokens say? The text is parsed as the
        server parsed it: tool calls in the template's format (`tool_call_format`) or, if the request had no
        tools (or a template with no format, which only answers tool_choice 'none'), none."""
        text = self.generation_text(f.generation_token_ids)
        stopped = f.generation_token_ids[-1] in self.stop_ids
        want_calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])]
        want_content = (msg.get("content") or "").strip()
        want_reasoning = (msg.get("reasoning_content") or "").strip()
        fmt = self.tool_call_format
        parses = [(True, fmt), (False, fmt)] if fmt else [(False, TOOL_FORMATS[0])]

        def same(t: str, content_prefix: bool) -> bool:
            return any(
                ((p := parse_assistant_text(t, tools, f)).reasoning or "").strip() == want_reasoning
                and [(c.name, c.arguments) for c in p.tool_calls] == want_calls
                and (p.content == want_content or (content_prefix and p.content.startswith(want_content)))
                for tools, f in parses
            )

        # the response parsed calls only if tools were enabled; a stop string ends the content early without
        # a stop token: its text is cut from the content
        if same(text, not stopped):
            return True
        if stopped:  # or, under ignore_eos, a run to max_tokens whose last sampled token is the stop
            return same(self._text(f.generation_token_ids), False)  # token: finish "length", its text is content
        # a stop string may have cut the text anywhere: in the reasoning, or in a tag. The answer was the
        # parse of a prefix of the text, which ends just after the last field it shows (or a tag's few
        # characters later)
        if want_calls and fmt == LLAMA3_JSON:  # calls, and only calls, after the reasoning: cut just past one
            rest = split_reasoning(text)[1]
            return any(same(text[: len(text) - len(rest) + k], False) for k in json_call_ends(rest))
        anchor = want_content or want_reasoning
        at = text.find(anchor) if anchor else 0
        if at < 0:
            return False
        at += len(anchor)
        return any(same(text[:k], False) for k in range(at, min(len(text), at + CUT_WINDOW) + 1))
