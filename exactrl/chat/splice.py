"""Token-exact multi-turn prompts: earlier turns' exact IDs + a tokenization of what is new.

An assistant message the server returned carries `prompt_token_ids`,
`generation_token_ids` and `generation_log_probs`. The history H of a new
request is the last such message's prompt + generation (+ one end-of-turn
token if the generation did not end with one: the template closes every turn).
The new prompt is

    H + R[cut:]

where R is the tokenized render of the whole new conversation (generation
prompt included) and `cut` is just after R's k-th end-of-turn token, k the
number of end-of-turn tokens in H. Every message ends with exactly one
end-of-turn token and special tokens split the text, so R[cut:] is exactly
the tokenization of what is new (tool results, user turn, generation prompt),
and no old text is ever re-tokenized.

H is only used if the conversation still says what H says (monotonicity).
H and R are cut into segments after each end-of-turn token; segment j of H
must match segment j of R:
  * a segment holding generated tokens matches if its assistant message is
    the one at that place of the conversation and still says what the tokens
    say (same reasoning, content and tool calls, `parsing.py`) — never by
    comparing templates, which may re-render tool calls or drop old reasoning;
  * any other segment matches if its text is the same (the token IDs may
    differ: that is the re-tokenization this module exists to avoid).
Earlier token-carrying messages must be prefixes of H. The first mismatch
is handled by the policy: `raise` (MonotonicityError naming the first
differing token position of H), `split` (a fresh render: a new training
segment, the old one stays whole) or `truncate` (H up to the last matching
turn boundary + a fresh render of the rest).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from exactrl.chat.messages import TokenFields, template_message, token_fields
from exactrl.chat.parsing import parse_assistant_text

POLICIES = ("raise", "split", "truncate")


class MonotonicityError(ValueError):
    """The conversation does not extend its earlier token history (policy `raise`)."""

    def __init__(self, position: int, detail: str):
        self.position, self.detail = position, detail
        super().__init__(
            f"conversation does not extend its earlier tokens: first differing token at position {position} "
            f"of the previous turn's prompt_token_ids + generation_token_ids ({detail}). Send the assistant "
            f"messages back unchanged, or choose the monotonicity policy 'split' or 'truncate'")


@dataclass
class PromptPlan:
    """The prompt of a chat request and how it was built."""

    prompt_ids: list[int]
    kind: str  # "fresh" (no token history) | "spliced" | "split" | "truncate"
    reused: int  # leading tokens taken verbatim from the token history
    divergence: int | None = None  # first differing position of the history (split / truncate)


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

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.eot = tokenizer.end_of_turn_id
        self.eot_text = tokenizer.decode([self.eot], skip_special_tokens=False)
        self.stop_ids = frozenset(tokenizer.stop_token_ids) | {self.eot}

    def build(self, messages: list[dict], tools: list[dict] | None = None, policy: str = "raise") -> PromptPlan:
        if policy not in POLICIES:
            raise ValueError(f"monotonicity policy must be one of {list(POLICIES)}, got {policy!r}")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        tmsgs = [template_message(m, i) for i, m in enumerate(messages)]
        fields = {i: f for i, m in enumerate(messages)
                  if (f := token_fields(m, i, self.tok.vocab_size)) is not None}
        full = self.tok.apply_chat_template(tmsgs, tools=tools, add_generation_prompt=True)
        if not fields:
            return PromptPlan(list(full), "fresh", 0)
        hist = self.history(fields[max(fields)])
        bad = self._check(tmsgs, tools, fields, hist, full)
        if bad is None:
            k = len(_ends(hist, self.eot))
            cut = _ends(full, self.eot)[k - 1] + 1
            return PromptPlan(hist + full[cut:], "spliced", len(hist))
        if policy == "raise":
            raise MonotonicityError(bad.position, bad.detail)
        if policy == "split":
            return PromptPlan(list(full), "split", 0, bad.position)
        keep = 0 if bad.segment == 0 else _ends(hist, self.eot)[bad.segment - 1] + 1
        cut = 0 if bad.segment == 0 else _ends(full, self.eot)[bad.segment - 1] + 1
        return PromptPlan(hist[:keep] + full[cut:], "truncate", keep, bad.position)

    def history(self, f: TokenFields) -> list[int]:
        """The exact tokens of the conversation up to the end of that assistant turn."""
        h = f.history
        return h if h[-1] == self.eot else h + [self.eot]

    # ------------------------------------------------------------ monotonicity
    def _check(self, tmsgs, tools, fields: dict[int, TokenFields], hist: list[int], full: list[int]) -> _Mismatch | None:
        h_ends, r_ends = _ends(hist, self.eot), _ends(full, self.eot)
        h_start = [0] + [e + 1 for e in h_ends]
        r_start = [0] + [e + 1 for e in r_ends]
        found: list[_Mismatch] = []

        def seg_of(pos: int) -> int:  # segment of H holding position pos
            return bisect.bisect_left(h_ends, pos)

        # earlier token-carrying turns must be prefixes of H
        for i, f in fields.items():
            d = _first_diff(self.history(f), hist)
            if d < len(self.history(f)):
                found.append(_Mismatch(seg_of(d), d, f"messages[{i}]'s tokens are not a prefix of the last "
                                                     f"assistant message's tokens"))
        # which segment of R each message ends in
        last = max(fields)
        msg_seg = [self.tok.render_chat(tmsgs[:i + 1], tools=tools, add_generation_prompt=False).count(self.eot_text) - 1
                   for i in range(last + 1)]
        gen_seg = {}
        for i, f in fields.items():
            s = seg_of(len(f.prompt_token_ids))
            gen_seg[s] = i
            if s != msg_seg[i]:
                found.append(_Mismatch(min(s, msg_seg[i]), h_start[min(s, msg_seg[i])],
                                       f"messages[{i}] was generated as turn {s} but is now turn {msg_seg[i]}: "
                                       f"messages were inserted or removed"))
        for j in range(len(h_ends)):
            hseg = hist[h_start[j]:h_start[j + 1]]
            if j >= len(r_ends):
                found.append(_Mismatch(j, h_start[j], f"the conversation now has only {len(r_ends)} turns before "
                                                      f"the generation prompt, the token history has {len(h_ends)}"))
                break
            rseg = full[r_start[j]:r_start[j + 1]]
            if j in gen_seg:
                i = gen_seg[j]
                if self.matches(tmsgs[i], fields[i]):
                    continue
                why = f"messages[{i}] (assistant) no longer says what its generation_token_ids say"
            elif self._text(hseg) == self._text(rseg):
                continue
            else:
                why = f"the text of turn {j} changed"
            found.append(_Mismatch(j, h_start[j] + _first_diff(hseg, rseg), why))
            break
        return min(found, key=lambda m: m.position) if found else None

    def _text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def generation_text(self, gen: list[int]) -> str:
        """The text of a generation without its stop token."""
        return self._text(gen[:-1] if gen and gen[-1] in self.stop_ids else gen)

    def matches(self, msg: dict, f: TokenFields) -> bool:
        """Does the assistant message still say what its generated tokens say?"""
        text = self.generation_text(f.generation_token_ids)
        stopped = f.generation_token_ids[-1] in self.stop_ids
        want_calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])]
        want_content = (msg.get("content") or "").strip()
        want_reasoning = (msg.get("reasoning_content") or "").strip()
        for parse_tools in (True, False):  # the response parsed calls only if tools were enabled
            p = parse_assistant_text(text, parse_tools)
            if (p.reasoning or "").strip() != want_reasoning or [(c.name, c.arguments) for c in p.tool_calls] != want_calls:
                continue
            # a stop string ends the content early without a stop token: its text is cut from the content
            if p.content == want_content or (not stopped and p.content.startswith(want_content)):
                return True
        return False
