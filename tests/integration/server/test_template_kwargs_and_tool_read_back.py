"""Review of the chat template kwargs, the tool call format probe, Llama 3 JSON calls and the sorted session
index: edge cases and property tests (what a response says, the next turn's splice must read back the same)."""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path

import pytest
from family_templates import family_dir, family_tokenizer
from fuzzing import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from session_reference import Quadratic

from exactrl.chat.messages import template_message, token_fields, validate_template_kwargs
from exactrl.chat.parsing import LLAMA3_JSON, StreamParser, parse_assistant_text
from exactrl.chat.splice import Splicer
from exactrl.chat.trajectory import Session
from exactrl.model.tokenizer import load_tokenizer


def with_template(family: str, template: str):
    """The family's tokenizer with another chat template."""
    d = Path(tempfile.mkdtemp(prefix="exactrl-review-tok-"))
    shutil.copytree(family_dir(family), d, dirs_exist_ok=True)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": template}))
    return load_tokenizer(d)


# a plain ChatML template that writes a call's arguments as they come (OpenAI's JSON string): `+` on the dict the
# probe passes is a TypeError, not a TemplateError
STRING_ARGS_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}{% if m.content %}{{ m.content }}{% endif %}"
    '{% for c in m.tool_calls or [] %}{{ \'<tool_call>{"name": "\' + c.function.name + \'", "arguments": \' '
    "+ c.function.arguments + '}</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_template_whose_probe_render_raises_a_type_error_still_serves_plain_chat():
    tok = with_template("qwen2.5", STRING_ARGS_TEMPLATE)
    sp = Splicer(tok)  # was: TypeError, so the server did not start
    assert sp.tool_call_format is None
    plan = sp.build([{"role": "user", "content": "hi"}])
    assert tok.decode(plan.prompt_ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "family, kwargs",
    [
        ("llama3", {"date_string": 5}),  # `'Today Date: ' + date_string`: str + int
        ("llama3", {"date_string": ["26 Jul 2024"]}),
        ("qwen3", {"namespace": 1}),  # the template's own Jinja function, replaced
        ("qwen3", {"conversations": []}),  # a parameter name of transformers' render
        ("qwen3", {"self": 1}),  # of apply_chat_template's
    ],
)
def test_template_kwargs_the_template_cannot_take_are_a_value_error(family, kwargs):
    """The server answers a ValueError with a 400 (server/chat.py); a TypeError was a 500."""
    sp = Splicer(family_tokenizer(family))
    with pytest.raises(ValueError):
        sp.build([{"role": "user", "content": "hi"}], template_kwargs=kwargs)


@pytest.mark.parametrize(
    "name", ["self", "conversations", "sanitize_control_tokens", "raise_exception", "strftime_now", "namespace"]
)
def test_template_kwargs_naming_transformers_own_parameters_and_functions_are_refused(name):
    with pytest.raises(ValueError, match="chat_template_kwargs may not set"):
        validate_template_kwargs({name: 1})


def test_live_template_kwargs_of_the_wrong_type_or_reserved_are_a_400():
    import openai
    from test_family_templates import client

    msgs = [{"role": "user", "content": "hi"}]
    for family, bad, why in (
        ("llama3", {"date_string": 5}, "cannot render"),
        ("qwen3", {"namespace": 1}, "chat_template_kwargs may not set"),
        ("qwen3", {"self": 1}, "chat_template_kwargs may not set"),
        ("qwen3", {"sanitize_control_tokens": True}, "chat_template_kwargs may not set"),
    ):
        c, state, _ = client(family)
        with pytest.raises(openai.BadRequestError, match=why):
            c.chat.completions.create(
                model=state.config.model_name, messages=msgs, max_tokens=2, extra_body={"chat_template_kwargs": bad}
            )


# --------------------------------------------------------------------------- response vs splice


def matched(sp: Splicer, gen: list[int], shown: str) -> bool:
    """Does the splice read back the message the server answered for `gen` whose visible text was `shown`?"""
    msg = parse_assistant_text(shown, True, sp.tool_call_format).to_message()
    msg |= {"prompt_token_ids": [1], "generation_token_ids": gen, "generation_log_probs": [-0.5] * len(gen)}
    return sp.matches(template_message(msg, 1), token_fields(msg, 1, sp.vocab_size))


CALL = '{"name": "calculator", "parameters": {"expression": "2+2"}}'


@pytest.mark.parametrize(
    "text",
    [
        CALL + "END",
        CALL + "\nObservation:",
        "<|python_tag|>" + CALL + ";x",
        "<think>\nadd\n</think>\n\n" + CALL + " END",
        CALL + "; " + CALL + "\n\nEND",
    ],
)
def test_llama_a_call_ended_by_a_stop_string_is_read_back(text):
    """A stop string ends the text the response parses (a call) but its tokens are in the generation: the next
    turn found the call followed by more text, which is content, and refused the unchanged message."""
    tok = family_tokenizer("llama3")
    sp = Splicer(tok)
    cut = max(text.rfind("END"), text.rfind("\nObservation:"), text.rfind(";x"))
    assert parse_assistant_text(text[:cut], tool_format=LLAMA3_JSON).tool_calls
    assert matched(sp, tok.encode(text), text[:cut])


ATOMS = [
    '{"name": "f", "parameters": {"a": 1}}',
    '{"name": "g", "arguments": {}}',
    "{",
    "}",
    ";",
    " ",
    "\n",
    "<|python_tag|>",
    "<think>",
    "</think>",
    "x",
    "END",
    '"',
    ": ",
    "ab",
    "<tool_call>",
    "</tool_call>",
    '<tool_call>\n{"name": "f", "arguments": {"a": [1]}}\n</tool_call>',
]


@settings(max_examples=examples(150), deadline=None)
@given(
    parts=st.lists(st.sampled_from(ATOMS), max_size=8),
    stop=st.sampled_from(["END", ";", "x", "\n", "}"]),
    family=st.sampled_from(["llama3", "qwen3"]),
)
def test_a_stop_string_cut_answer_is_read_back(parts, stop, family):
    """Whatever the model wrote before a stop string, the message the server answered is the tokens' message."""
    tok = family_tokenizer(family)
    sp = Splicer(tok)
    text = "".join(parts) + stop
    gen = tok.encode(text)
    if tok.decode(gen) != text or stop in tok.decode(gen[:-1]):  # the server stops at the token completing it
        return
    assert matched(sp, gen, text[: text.find(stop)])


def test_a_stream_mid_number_past_the_digit_limit_is_held():
    """A number of 4301 digits is past Python's int limit but, with an exponent to come, a float: the stream
    sent the call's text as content and then the call too; the answer is only the call."""
    text = '{"name": "f", "parameters": {"x": ' + "1" * 4301 + "e-4290}}"
    full = parse_assistant_text(text, tool_format=LLAMA3_JSON)
    assert full.content == "" and len(full.tool_calls) == 1
    sp = StreamParser(True, LLAMA3_JSON)
    deltas = [sp.feed(text[:-8]), sp.feed(text[-8:]), sp.finish()]
    assert "".join(d.content for d in deltas) == "" and sum(len(d.tool_calls) for d in deltas) == 1


# --------------------------------------------------------------------------- the sorted index

tokens = st.lists(st.integers(0, 3), max_size=6)


@settings(max_examples=examples(300), deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.integers(0, 20),
            st.integers(0, 6),
            tokens,
            tokens,
            st.sampled_from(["spliced", "fresh", "split", "truncate"]),
            tokens,
            st.booleans(),
        ),
        max_size=25,
    )
)
def test_the_index_answers_as_the_quadratic_definitions_hypothesis(ops):
    """Prompts taken from (parts of) recorded sequences, equal records, empty prompts and generations, cut
    histories from records or from nowhere (sharing nothing with any record)."""
    new, old, seqs = Session(), Quadratic(), []
    for pick, keep, extra, gen, kind, cut_extra, cut_from_record in ops:
        base = seqs[pick % len(seqs)] if seqs else []
        prompt = base[:keep] + extra
        turn = dict(prompt=prompt, generated=gen, logprobs=[-0.5] * len(gen), versions=[0] * len(gen), kind=kind)
        if kind == "truncate":
            turn["cut_history"] = (seqs[(pick + 1) % len(seqs)] if seqs and cut_from_record else []) + cut_extra
        new.record(**turn)
        old.record(**turn)
        seqs.append(prompt + gen)
        assert new.records == old.records
        assert [t.to_json() for t in new.trajectories()] == [t.to_json() for t in old.trajectories()]
    assert new.index == sorted((r.tokens_T, i) for i, r in enumerate(new.records))


def test_many_identical_records_and_a_long_session():
    rng = random.Random(0)
    new, old = Session(), Quadratic()
    for _ in range(300):
        p = [1, 2] * rng.randint(0, 3)
        for s in (new, old):
            s.record(p, [3], [-0.1], [0], kind=rng.choice(["spliced", "truncate"]), cut_history=[1, 2, 1, 2, 9])
    assert new.records == old.records
    assert [t.to_json() for t in new.trajectories()] == [t.to_json() for t in old.trajectories()]
