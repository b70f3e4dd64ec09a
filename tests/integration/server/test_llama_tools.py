"""Llama 3.x JSON tool calls (`parsing.LLAMA3_JSON`): the whole assistant text is `{"name": ..., "parameters":
{...}}` (or "arguments", or several such objects separated by `;`, as vLLM's llama3_json parser reads them),
optionally after `<|python_tag|>`; anything else is content. Streamed deltas add up to the same parse, a call
only at the end."""

from __future__ import annotations

import functools
import json

import pytest
from family_templates import family_tokenizer
from fuzzing import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from test_family_templates import (
    TOOL,
    char_tokens,
    check_extends,
    check_splice,
    check_trajectory,
    record,
    reply,
    user_part,
)

from exactrl.chat.parsing import HERMES, LLAMA3_JSON, StreamParser, parse_assistant_text
from exactrl.chat.splice import MonotonicityError, Splicer
from exactrl.chat.trajectory import Session


def calls_of(text: str, fmt: str = LLAMA3_JSON) -> tuple[str, list]:
    p = parse_assistant_text(text, tool_format=fmt)
    json.dumps(p.to_message(), ensure_ascii=False).encode("utf-8")  # what the server sends
    return p.content, [(c.name, c.arguments) for c in p.tool_calls]


@pytest.mark.parametrize(
    "text, calls",
    [
        ('{"name": "calculator", "parameters": {"expression": "2+2"}}', [("calculator", {"expression": "2+2"})]),
        ('{"name": "calculator", "arguments": {"expression": "2+2"}}', [("calculator", {"expression": "2+2"})]),
        ('\n  {"name": "f", "parameters": {}}\n\n', [("f", {})]),  # whitespace around
        ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}', [("f", {"a": 1})]),
        (' <|python_tag|> {"name": "f", "parameters": {"a": 1}}', [("f", {"a": 1})]),
        (
            '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {"b": [1, 2]}}',
            [("f", {"a": 1}), ("g", {"b": [1, 2]})],
        ),
        (
            '{"name": "f", "parameters": {"a": 1}};{"name": "f", "parameters": {"a": 2}}',
            [("f", {"a": 1}), ("f", {"a": 2})],
        ),
        # nested arguments, unicode (escaped or not), arguments as a JSON string
        (
            '{"name": "search", "parameters": {"q": {"text": "naïve", "tags": ["a", {"b": null}]}, "n": 3.5}}',
            [("search", {"q": {"text": "naïve", "tags": ["a", {"b": None}]}, "n": 3.5})],
        ),
        ('{"name": "echo", "parameters": {"s": "\\u00e9\\ud83d\\ude00 日本"}}', [("echo", {"s": "é😀 日本"})]),
        ('{"name": "f", "parameters": "{\\"a\\": 1}"}', [("f", {"a": 1})]),
    ],
)
def test_valid_calls(text, calls):
    content, got = calls_of(text)
    assert got == calls and content == ""
    assert parse_assistant_text(text, tool_format=LLAMA3_JSON).to_message()["content"] is None


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 4.",
        "",
        "{not json}",
        '{"name": "f", "parameters": {"a": 1}',  # unclosed
        '{"name": "f", "parameters": {"a": 1}} and more',  # text after the call
        'Sure: {"name": "f", "parameters": {"a": 1}}',  # text before it (vLLM would take the call)
        '{"name": "f", "parameters": {}};',  # a `;` with no call after it
        '{"name": "f", "parameters": {}}; hello',
        '{"a": 1}',  # JSON that is not a call
        '[{"name": "f", "parameters": {}}]',
        '"f"',
        '{"name": "f"}',  # no arguments: JSON data, not a call
        '{"name": "f", "parameters": {}, "arguments": {}}',  # both
        '{"name": "f", "parameters": {}, "id": 1}',  # a key the call has no place for
        '{"name": "f", "name": "g", "parameters": {}}',  # a key twice
        '{"name": "f", "parameters": {"a": 1, "a": 2}}',
        '{"name": "bad name!", "parameters": {}}',
        '{"name": 5, "parameters": {}}',
        '{"name": "f", "parameters": [1]}',  # arguments not an object
        '{"name": "f", "parameters": {"a": NaN}}',  # not strict JSON
        '{"name": "f", "parameters": {"a": 1e999}}',
        '{"name": "f", "parameters": {"x": "\\ud800"}}',  # a lone surrogate: not UTF-8
        '{"name": "f", "parameters": {"x": ' + "1" * 4301 + "}}",  # past Python's digit limit
        '{"name": "f", "parameters": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}}",  # nesting too deep
        "<|python_tag|>",
        '<|python_tag|>brave_search.call(query="x")',  # a built-in tool call (pythonic): not JSON
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',  # Hermes is not this format
    ],
)
def test_everything_else_is_content(text):
    content, calls = calls_of(text)
    assert calls == [] and content == text.strip()


def test_the_formats_do_not_read_each_other():
    hermes = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    llama = '{"name": "f", "parameters": {"a": 1}}'
    assert calls_of(hermes, HERMES)[1] == calls_of(llama, LLAMA3_JSON)[1] == [("f", {"a": 1})]
    assert calls_of(llama, HERMES) == (llama, []) and calls_of(hermes, LLAMA3_JSON) == (hermes, [])
    assert parse_assistant_text(llama, parse_tools=False, tool_format=LLAMA3_JSON).content == llama
    with pytest.raises(ValueError, match="tool_format"):
        parse_assistant_text(llama, tool_format="pythonic")
    with pytest.raises(ValueError, match="tool_format"):
        StreamParser(True, "pythonic")


def test_reasoning_before_a_call():
    p = parse_assistant_text('<think>\nadd\n</think>\n\n{"name": "f", "parameters": {}}', tool_format=LLAMA3_JSON)
    assert p.reasoning == "add" and [c.name for c in p.tool_calls] == ["f"] and p.content == ""


def stream(text: str, cuts: list[int], tools: bool = True) -> tuple[list, str, list]:
    """(per-feed deltas, content, calls) of `text` streamed in pieces of the `cuts` sizes."""
    sp, deltas, i, k = StreamParser(tools, LLAMA3_JSON), [], 0, 0
    while i < len(text):
        j = i + cuts[k % len(cuts)]
        deltas.append(sp.feed(text[i:j]))
        i, k = j, k + 1
    deltas.append(sp.finish())
    return (
        deltas,
        "".join(d.reasoning + d.content for d in deltas),
        [(c.name, c.arguments) for d in deltas for c in d.tool_calls],
    )


def test_stream_holds_what_could_still_be_a_call():
    call = '<|python_tag|>{"name": "f", "parameters": {"a": "é"}}'
    deltas, content, calls = stream(call, [3])
    assert all(not d for d in deltas[:-1]) and content == "" and calls == [("f", {"a": "é"})]
    # a call, then more text: held until the text shows it is not a call, then all of it is content
    deltas, content, calls = stream('{"name": "f", "parameters": {}}  ok', [1])
    n = len('{"name": "f", "parameters": {}}  o')
    assert all(not d for d in deltas[: n - 1]) and deltas[n - 1].content == '{"name": "f", "parameters": {}}  o'
    assert content == '{"name": "f", "parameters": {}}  ok' and calls == []
    # plain text is sent as it comes (trailing whitespace held)
    deltas, content, calls = stream("Hello there", [1])
    assert [d.content for d in deltas[:6]] == ["H", "e", "l", "l", "o", ""] and content == "Hello there"


atoms = st.sampled_from(
    [
        '{"name": "f", "parameters": {"a": 1}}',
        '{"name": "g", "arguments": {}}',
        "{",
        "}",
        ";",
        " ",
        "\n",
        "<|python_tag|>",
        "<|python",
        "_tag|>",
        '"name"',
        ": ",
        '"f"',
        ", ",
        '"parameters"',
        '{"a": [1, {"b": "é"}]}',
        "x",
        "<think>",
        "</think>",
        "[",
        "]",
        "\ufffd",
    ]
)


@settings(max_examples=examples(300), deadline=None)
@given(
    parts=st.lists(atoms, max_size=12), cuts=st.lists(st.integers(1, 5), min_size=1, max_size=40), tools=st.booleans()
)
def test_stream_deltas_equal_the_parse(parts, cuts, tools):
    text = "".join(parts)
    full = parse_assistant_text(text, tools, LLAMA3_JSON)
    deltas, _, calls = stream(text, cuts, tools)
    assert "".join(d.reasoning for d in deltas) == (full.reasoning or "")
    assert "".join(d.content for d in deltas) == full.content
    assert calls == [(c.name, c.arguments) for c in full.tool_calls]
    assert all(not d.tool_calls for d in deltas[:-1])  # a call only when the text is complete


# --------------------------------------------------------------------------- the splice, Llama 3.1-like template


def llama_call(expr: str, key: str = "parameters") -> str:
    return f'{{"name": "calculator", "{key}": {{"expression": "{expr}"}}}}'


# what the template renders for a tool result (role `ipython`, a string through tojson) + the generation prompt
TOOL_RESULT = (
    '<|start_header_id|>ipython<|end_header_id|>\n\n"{}"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'
)


@pytest.mark.parametrize(
    "key, tag, char", [("parameters", "", False), ("arguments", "", True), ("parameters", "<|python_tag|>", True)]
)
def test_llama_call_result_and_answer_keep_exact_ids(key, tag, char):
    """user -> a JSON call (ended by `<|eom_id|>`, as Llama 3.1 ends a turn that waits for a tool) -> the tool
    result, which the template renders as an `ipython` turn (its text through tojson) -> the answer -> a user
    turn. Each prompt is the earlier turns' exact ids (also a non-canonical tokenization, a `<|python_tag|>`
    and "arguments" where the template would write "parameters") + the tokenization of the new turns; one
    trajectory masked on the generated tokens."""
    tok = family_tokenizer("llama3")
    eom = tok.hf.convert_tokens_to_ids("<|eom_id|>")
    sp, session = Splicer(tok, stop_token_ids=[eom]), Session()  # the server's: generation_config's eos ids
    msgs = [{"role": "user", "content": "compute 2+2"}]
    p1 = sp.build(msgs, [TOOL]).prompt_ids
    text = llama_call("2+2", key)
    gen = (tok.encode(tag) if tag else []) + (char_tokens(tok, text) if char else tok.encode(text))
    a1 = reply(tok, sp, p1, gen, stop=eom)
    assert a1["content"] is None and [
        (c["function"]["name"], c["function"]["arguments"]) for c in a1["tool_calls"]
    ] == [("calculator", '{"expression": "2+2"}')]
    record(session, a1, "fresh")
    msgs += [a1, {"role": "tool", "tool_call_id": a1["tool_calls"][0]["id"], "content": "4"}]
    plan = sp.build(msgs, [TOOL])
    check_splice(tok, plan, a1, TOOL_RESULT.format(4))
    a2 = reply(tok, sp, plan.prompt_ids, tok.encode("2+2 is 4"))
    assert a2["content"] == "2+2 is 4" and "tool_calls" not in a2
    record(session, a2)
    msgs += [a2, {"role": "user", "content": "thanks"}]
    plan = sp.build(msgs, [TOOL])
    check_splice(tok, plan, a2, user_part("llama3", "thanks"))
    a3 = reply(tok, sp, plan.prompt_ids, tok.encode("welcome"))
    record(session, a3)
    check_trajectory(session, [a1, a2, a3])


def test_llama_a_changed_call_no_longer_matches_its_tokens():
    """The call is checked by parsing the tokens' text as the template's format: other arguments, or the call
    turned into content, are a history the tokens do not say; the call's text as content (what
    tool_choice='none' returned) still is."""
    tok = family_tokenizer("llama3")
    sp = Splicer(tok)
    msgs = [{"role": "user", "content": "compute 2+2"}]
    p1 = sp.build(msgs, [TOOL]).prompt_ids
    a1 = reply(tok, sp, p1, tok.encode(llama_call("2+2")))
    result = {"role": "tool", "tool_call_id": a1["tool_calls"][0]["id"], "content": "4"}
    edited = json.loads(json.dumps(a1))
    edited["tool_calls"][0]["function"]["arguments"] = '{"expression": "3+3"}'
    with pytest.raises(MonotonicityError, match="no longer says what its generation_token_ids say"):
        sp.build(msgs + [edited, result], [TOOL])
    as_content = {k: v for k, v in a1.items() if k != "tool_calls"} | {"content": llama_call("2+2")}
    plan = sp.build(msgs + [as_content, {"role": "user", "content": "go on"}], [TOOL])
    check_splice(tok, plan, as_content, user_part("llama3", "go on"))
    with pytest.raises(MonotonicityError):
        sp.build(msgs + [as_content | {"content": "something else"}, {"role": "user", "content": "go on"}], [TOOL])


def test_llama_two_calls_parse_but_the_template_takes_one():
    """Two `;`-separated calls are two tool calls (vLLM's reading); Llama 3.1's template refuses to render a turn
    with more than one, so the next request is a 400 (ValueError) naming the template's reason."""
    tok = family_tokenizer("llama3")
    sp = Splicer(tok)
    msgs = [{"role": "user", "content": "compute 2+2 and 3*3"}]
    a1 = reply(tok, sp, sp.build(msgs, [TOOL]).prompt_ids, tok.encode(llama_call("2+2") + "; " + llama_call("3*3")))
    assert [c["function"]["arguments"] for c in a1["tool_calls"]] == ['{"expression": "2+2"}', '{"expression": "3*3"}']
    results = [{"role": "tool", "tool_call_id": c["id"], "content": r} for c, r in zip(a1["tool_calls"], "49")]
    with pytest.raises(ValueError, match="single tool-calls"):
        sp.build(msgs + [a1] + results, [TOOL])


# --------------------------------------------------------------------------- through a live server

QUESTION = {"role": "user", "content": "compute 2+2"}
ANSWER = "2+2 is 4"


@functools.cache
def taught_llama():
    """(ServerThread, ServerState, model dir, transcript ids) serving a tiny Llama-3.1-like model taught (a few
    hundred Adam steps on two sequences) to answer QUESTION greedily with `llama_call("2+2")` + `<|eom_id|>`,
    and the tool result "4" with ANSWER + `<|eot_id|>`."""
    import atexit

    import torch
    import transformers
    from family_templates import _model_dir

    from exactrl.model.tokenizer import load_tokenizer
    from exactrl.server.app import ServerThread, build_state, create_app

    d = _model_dir("llama3", None)
    tok = load_tokenizer(d)
    eom = tok.hf.convert_tokens_to_ids("<|eom_id|>")
    sp = Splicer(tok, stop_token_ids=[eom])
    p1 = sp.build([QUESTION], [TOOL]).prompt_ids
    g1 = tok.encode(llama_call("2+2")) + [eom]
    a1 = reply(tok, sp, p1, g1[:-1], stop=eom)
    p2 = sp.build(
        [QUESTION, a1, {"role": "tool", "tool_call_id": a1["tool_calls"][0]["id"], "content": "4"}], [TOOL]
    ).prompt_ids
    g2 = tok.encode(ANSWER) + [tok.end_of_turn_id]
    # the tools in the first user turn make a ~500-token prompt: a longer context than the tiny default
    model = transformers.LlamaForCausalLM.from_pretrained(d, max_position_embeddings=1024).train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(600):  # noqa: B007 (named by the failure message)
        loss = 0.0
        greedy = True
        for p, g in ((p1, g1), (p2, g2)):
            out = model(torch.tensor([p + g]), labels=torch.tensor([[-100] * len(p) + g]))
            loss = loss + out.loss
            top2 = out.logits[0, len(p) - 1 : -1].topk(2, dim=-1)
            greedy &= top2.indices[:, 0].tolist() == g and bool((top2.values[:, 0] - top2.values[:, 1] > 1.0).all())
        if greedy:  # every generated token wins by more than one logit: no rounding can change the argmax
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert greedy, f"not taught after {step} steps (loss {loss.item():.3f})"
    model.eval().save_pretrained(d)
    state = build_state(str(d), kv_budget_tokens=4096)
    thread = ServerThread(create_app(state)).start()
    atexit.register(thread.stop)
    return thread, state, d, (p1, g1, p2, g2)


def tool_calls_of(calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls or []]


def test_live_llama_tool_episode_keeps_exact_ids():
    """Through the server, a Llama-3.1-like template: the call comes back as a tool call (finish_reason
    'tool_calls', no content), the same streamed; the tool result, the answer and a user turn are spliced after
    the exact ids; the session holds one trajectory masked on the generated tokens, whose logprobs equal the
    trainer's bitwise."""
    import httpx
    import openai

    import exactrl

    thread, state, d, (p1, g1, p2, g2) = taught_llama()
    tok, name = state.tokenizer, state.config.model_name
    c = openai.OpenAI(base_url=f"{thread.url}/sessions/llama-tools/v1", api_key="test", max_retries=0)
    r1 = c.chat.completions.create(model=name, messages=[QUESTION], tools=[TOOL], temperature=0, max_tokens=40)
    ch = r1.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert tool_calls_of(ch.message.tool_calls) == [("calculator", {"expression": "2+2"})]
    assert (ch.message.prompt_token_ids, ch.message.generation_token_ids) == (p1, g1)
    # streamed (outside the session): the call arrives once, whole, with the closing delta
    plain = openai.OpenAI(base_url=f"{thread.url}/v1", api_key="test", max_retries=0)
    chunks = [
        x
        for x in plain.chat.completions.create(
            model=name, messages=[QUESTION], tools=[TOOL], temperature=0, max_tokens=40, stream=True
        )
        if x.choices
    ]
    deltas = [x.choices[0].delta for x in chunks]
    assert "".join(dl.content or "" for dl in deltas) == ""
    assert [dl.tool_calls is not None for dl in deltas] == [False] * (len(deltas) - 1) + [True]
    assert tool_calls_of(deltas[-1].tool_calls) == tool_calls_of(ch.message.tool_calls)
    assert deltas[-1].tool_calls[0].index == 0 and chunks[-1].choices[0].finish_reason == "tool_calls"

    m1 = ch.message.model_dump(exclude_none=True)
    msgs = [QUESTION, m1, {"role": "tool", "tool_call_id": m1["tool_calls"][0]["id"], "content": "4"}]
    ch2 = c.chat.completions.create(model=name, messages=msgs, tools=[TOOL], temperature=0, max_tokens=20).choices[0]
    m2 = ch2.model_dump(exclude_none=True)["message"]
    check_extends(tok, m2["prompt_token_ids"], m1, TOOL_RESULT.format(4))
    assert (m2["prompt_token_ids"], m2["generation_token_ids"]) == (p2, g2)
    assert m2["content"] == ANSWER and "tool_calls" not in m2 and ch2.finish_reason == "stop"
    msgs += [m2, {"role": "user", "content": "thanks"}]
    r3 = c.chat.completions.create(model=name, messages=msgs, tools=[TOOL], max_tokens=4, seed=0)
    m3 = r3.choices[0].message.model_dump(exclude_none=True)
    check_extends(tok, m3["prompt_token_ids"], m2, user_part("llama3", "thanks"))

    (t,) = httpx.get(f"{thread.url}/sessions/llama-tools/trajectories", timeout=30).json()["trajectories"]
    full = m3["prompt_token_ids"] + m3["generation_token_ids"]
    assert t["prompt_ids"] == p1 and t["prompt_ids"] + t["completion_ids"] == full
    want = [0] * len(full)
    for m in (m1, m2, m3):
        a = len(m["prompt_token_ids"])
        want[a : a + len(m["generation_token_ids"])] = [1] * len(m["generation_token_ids"])
    assert t["loss_mask"] == want[len(p1) :] and t["num_turns"] == 3
    lps = exactrl.sequence_logprobs(exactrl.load_model(d), [full], 1.0)[0].tolist()
    for m in (m1, m2, m3):  # temperature 0 reports the T = 1 logprobs
        a = len(m["prompt_token_ids"])
        assert lps[a - 1 : a - 1 + len(m["generation_token_ids"])] == m["generation_log_probs"]  # bitwise
