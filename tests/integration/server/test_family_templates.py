"""Token-exact multi-turn with chat templates that behave like real families' (family_templates.py): Qwen3
(reasoning dropped from turns before the last user query, grouped tool results), Qwen2.5 (Hermes tools,
default system prompt) and Llama 3.1 (bos written by the template, `<|eot_id|>` / `<|eom_id|>`; its JSON
tool calls and `ipython` tool results: test_llama_tools.py). Every spliced prompt holds the earlier turns'
exact ids followed by the tokenization of what the template renders for the new messages; the trajectories
mask exactly the generated tokens."""

from __future__ import annotations

import pytest
from family_templates import family_server, family_tokenizer

from exactrl.chat.parsing import HERMES, LLAMA3_JSON, parse_assistant_text
from exactrl.chat.splice import MonotonicityError, Splicer
from exactrl.chat.trajectory import Session

FAMILIES = ("qwen3", "qwen2.5", "llama3")
QWEN = ("qwen3", "qwen2.5")
TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'


def user_part(family: str, text: str) -> str:
    """What the family's template renders after an end-of-turn token for a user turn + generation prompt."""
    if family == "llama3":
        return (
            f"<|start_header_id|>user<|end_header_id|>\n\n{text}<|eot_id|>"
            f"<|start_header_id|>assistant<|end_header_id|>\n\n"
        )
    return f"\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def char_tokens(tok, text: str) -> list[int]:
    """A non-canonical tokenization (one token per character): re-tokenizing its text would change it."""
    return [t for ch in text for t in tok.encode(ch)]


def reply(tok, sp: Splicer, prompt: list[int], gen: list[int], stop: int | None = None) -> dict:
    """The assistant message the server returns for `gen` (+ the stop token `stop`, default end of turn), tool
    calls read in the template's format."""
    gen = gen + [tok.end_of_turn_id if stop is None else stop]
    msg = parse_assistant_text(sp.generation_text(gen), tool_format=sp.tool_call_format or HERMES).to_message()
    return msg | {"prompt_token_ids": prompt, "generation_token_ids": gen, "generation_log_probs": [-0.25] * len(gen)}


def check_extends(tok, prompt_ids: list[int], prev: dict, new_text: str) -> int:
    """(i) the previous turn's exact ids (+ the end of turn the template closes it with), then (ii) exactly the
    tokenization of the new text. Returns how many ids were reused."""
    hist = prev["prompt_token_ids"] + prev["generation_token_ids"]
    if hist[-1] != tok.end_of_turn_id:
        hist = hist + [tok.end_of_turn_id]
    assert prompt_ids == hist + tok.encode(new_text)
    return len(hist)


def check_splice(tok, plan, prev: dict, new_text: str) -> None:
    assert plan.kind == "spliced" and plan.reused == check_extends(tok, plan.prompt_ids, prev, new_text)


def check_trajectory(session: Session, turns: list[dict]) -> None:
    """(iii) one trajectory: the last turn's tokens, mask 1 exactly on each turn's generated tokens."""
    (t,) = session.trajectories()
    full = turns[-1]["prompt_token_ids"] + turns[-1]["generation_token_ids"]
    assert t.prompt_ids + t.completion_ids == full and t.prompt_ids == turns[0]["prompt_token_ids"]
    want = [0] * len(full)
    for m in turns:
        a = len(m["prompt_token_ids"])
        want[a : a + len(m["generation_token_ids"])] = [1] * len(m["generation_token_ids"])
    assert t.loss_mask == want[len(t.prompt_ids) :] and t.num_turns == len(turns)
    assert t.behav_logprobs == [-0.25 if m else 0.0 for m in t.loss_mask]


def record(session: Session, m: dict, kind: str = "spliced") -> None:
    gen = m["generation_token_ids"]
    session.record(m["prompt_token_ids"], gen, m["generation_log_probs"], [0] * len(gen), kind)


@pytest.mark.parametrize("family", FAMILIES)
def test_end_of_turn_and_fresh_prompt(family):
    tok = family_tokenizer(family)
    eot = {"llama3": "<|eot_id|>"}.get(family, "<|im_end|>")
    assert tok.end_of_turn_id == tok.hf.convert_tokens_to_ids(eot) and tok.end_of_turn_id in tok.stop_token_ids
    msgs = [{"role": "user", "content": "hello world"}]
    ids = Splicer(tok).build(msgs).prompt_ids
    assert ids == tok.encode(tok.render_chat(msgs))
    if family == "llama3":  # the template writes the bos; the chat ids hold it once (tok(text) would add another)
        assert ids[0] == tok.hf.bos_token_id and ids[1] != tok.hf.bos_token_id
        assert tok(tok.render_chat(msgs))["input_ids"][:2] == [tok.hf.bos_token_id] * 2


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_turns_keep_exact_ids(family):
    tok = family_tokenizer(family)
    sp, session = Splicer(tok), Session()
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hello world"}]
    prompt, turns = sp.build(msgs).prompt_ids, []
    for k, (answer, nxt) in enumerate([("the quick brown fox", "and the lazy dog?"), ("jumps over", "compute 7+8")]):
        gen = char_tokens(tok, answer)
        assert tok.encode(answer) != gen
        m = reply(tok, sp, prompt, gen)
        assert m["content"] == answer
        turns.append(m)
        record(session, m, "fresh" if k == 0 else "spliced")
        msgs += [m, {"role": "user", "content": nxt}]
        plan = sp.build(msgs)
        check_splice(tok, plan, m, user_part(family, nxt))
        prompt = plan.prompt_ids
    last = reply(tok, sp, prompt, tok.encode("15"))
    record(session, last)
    check_trajectory(session, turns + [last])


@pytest.mark.parametrize("family", QWEN)
def test_hermes_tool_calls_and_grouped_results(family):
    """Two calls in one turn (Qwen3 with reasoning first) are parsed; their results are one user turn of
    `<tool_response>` blocks, which is exactly what follows the generation in the next prompt."""
    tok = family_tokenizer(family)
    sp, session = Splicer(tok), Session()
    msgs = [{"role": "user", "content": "compute 2+2 and 3*3"}]
    p1 = sp.build(msgs, [TOOL]).prompt_ids
    think = "<think>\nuse the calculator twice\n</think>\n\n" if family == "qwen3" else ""
    a1 = reply(tok, sp, p1, tok.encode(think + CALL.format("2+2") + "\n" + CALL.format("3*3")))
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in a1["tool_calls"]] == [
        ("calculator", '{"expression": "2+2"}'),
        ("calculator", '{"expression": "3*3"}'),
    ]
    assert a1["content"] is None and a1.get("reasoning_content") == ("use the calculator twice" if think else None)
    record(session, a1, "fresh")
    msgs += [a1] + [{"role": "tool", "tool_call_id": c["id"], "content": r} for c, r in zip(a1["tool_calls"], "49")]
    plan = sp.build(msgs, [TOOL])
    check_splice(
        tok,
        plan,
        a1,
        "\n<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\n9\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n",
    )
    a2 = reply(tok, sp, plan.prompt_ids, tok.encode(think + "4 and 9"))
    record(session, a2)
    msgs += [a2, {"role": "user", "content": "thanks"}]
    plan = sp.build(msgs, [TOOL])
    check_splice(tok, plan, a2, user_part(family, "thanks"))
    a3 = reply(tok, sp, plan.prompt_ids, tok.encode("welcome"))
    record(session, a3)
    check_trajectory(session, [a1, a2, a3])


def test_qwen3_old_reasoning_stays_in_the_spliced_prompt():
    """(iv) Qwen3's template drops the reasoning of turns before the last user query; the splice keeps the
    tokens the model generated, reasoning included. A client that removes the reasoning from the message it
    sends back no longer says what its tokens say: refused (`raise`), or a fresh render (`split`)."""
    tok = family_tokenizer("qwen3")
    sp = Splicer(tok)
    msgs = [{"role": "user", "content": "2+2?"}]
    p1 = sp.build(msgs).prompt_ids
    a1 = reply(tok, sp, p1, tok.encode("<think>\nadd them\n</think>\n\n4"))
    assert (a1["reasoning_content"], a1["content"]) == ("add them", "4")
    msgs += [a1, {"role": "user", "content": "and 3+3?"}]
    plan = sp.build(msgs)
    check_splice(tok, plan, a1, user_part("qwen3", "and 3+3?"))
    assert "add them" in tok.decode(plan.prompt_ids)
    rendered = tok.render_chat(msgs)
    assert "add them" not in rendered and "<|im_start|>assistant\n4<|im_end|>" in rendered
    stripped = msgs[:1] + [{k: v for k, v in a1.items() if k != "reasoning_content"}] + msgs[2:]
    with pytest.raises(MonotonicityError, match="no longer says what its generation_token_ids say"):
        sp.build(stripped)
    split = sp.build(stripped, policy="split")
    assert split.kind == "split" and split.prompt_ids == tok.encode(rendered)


def test_qwen3_reasoning_after_the_last_query_is_kept_by_the_template_too():
    """Within one query (a tool loop) the template keeps the reasoning: the splice and a re-render agree on
    the text, and the spliced prompt still holds the generated ids."""
    tok = family_tokenizer("qwen3")
    sp = Splicer(tok)
    msgs = [{"role": "user", "content": "compute 2+2"}]
    p1 = sp.build(msgs, [TOOL]).prompt_ids
    a1 = reply(tok, sp, p1, char_tokens(tok, "<think>\nadd\n</think>\n\n") + tok.encode(CALL.format("2+2")))
    msgs += [a1, {"role": "tool", "tool_call_id": a1["tool_calls"][0]["id"], "content": "4"}]
    plan = sp.build(msgs, [TOOL])
    assert tok.decode(plan.prompt_ids) == tok.render_chat(msgs, [TOOL])
    assert plan.prompt_ids != tok.encode(tok.render_chat(msgs, [TOOL]))  # the ids differ: char tokens kept


@pytest.mark.parametrize("family", FAMILIES)
def test_n_branches_each_keep_their_tokens(family):
    """n = 2: both samples share the prompt; each branch continues from its own tokens and is a trajectory."""
    tok = family_tokenizer(family)
    sp, session = Splicer(tok), Session()
    msgs = [{"role": "user", "content": "hello"}]
    p1 = sp.build(msgs).prompt_ids
    samples = [reply(tok, sp, p1, tok.encode(t)) for t in ("the quick fox", "the lazy dog")]
    for m in samples:
        record(session, m, "fresh")
    seconds = []
    for m in samples:
        plan = sp.build(msgs + [m, {"role": "user", "content": "more"}])
        check_splice(tok, plan, m, user_part(family, "more"))
        m2 = reply(tok, sp, plan.prompt_ids, tok.encode("world"))
        record(session, m2)
        seconds.append(m2)
    trajs = session.trajectories()
    assert len(trajs) == 2
    for t, m1, m2 in zip(trajs, samples, seconds):
        assert t.prompt_ids + t.completion_ids == m2["prompt_token_ids"] + m2["generation_token_ids"]
        n1, n2 = len(m1["generation_token_ids"]), len(m2["generation_token_ids"])
        gap = len(m2["prompt_token_ids"]) - len(p1) - n1
        assert t.loss_mask == [1] * n1 + [0] * gap + [1] * n2


# --------------------------------------------------------------------------- through a live server


def client(family: str, force: str | None = None, session: str | None = None):
    import openai

    thread, state = family_server(family, force)
    base = f"{thread.url}/sessions/{session}/v1" if session else f"{thread.url}/v1"
    return openai.OpenAI(base_url=base, api_key="test", max_retries=0), state, thread.url


def as_dict(m) -> dict:
    return m.model_dump(exclude_none=True)


def test_live_qwen3_turns_and_branches():
    """Through the server: n = 2 on the first turn, each branch continued; every prompt extends its branch's
    exact ids, and the session holds one trajectory per branch, masked on the generated tokens."""
    import httpx

    c, state, url = client("qwen3", session="branches")
    tok = state.tokenizer
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hello world"}]
    r = c.chat.completions.create(model=state.config.model_name, messages=msgs, n=2, max_tokens=6, seed=1)
    firsts = [as_dict(ch.message) for ch in r.choices]
    seconds = []
    for m in firsts:
        r2 = c.chat.completions.create(
            model=state.config.model_name,
            max_tokens=6,
            seed=2,
            messages=msgs + [m, {"role": "user", "content": "and again?"}],
        )
        m2 = as_dict(r2.choices[0].message)
        check_extends(tok, m2["prompt_token_ids"], m, user_part("qwen3", "and again?"))
        seconds.append(m2)
    trajs = httpx.get(f"{url}/sessions/branches/trajectories", timeout=30).json()["trajectories"]
    assert len(trajs) == 2
    for t, m1, m2 in zip(trajs, firsts, seconds):
        assert t["prompt_ids"] + t["completion_ids"] == m2["prompt_token_ids"] + m2["generation_token_ids"]
        n1, n2 = len(m1["generation_token_ids"]), len(m2["generation_token_ids"])
        gap = len(m2["prompt_token_ids"]) - len(m1["prompt_token_ids"]) - n1
        assert t["loss_mask"] == [1] * n1 + [0] * gap + [1] * n2


def test_live_a_generation_config_eos_ends_the_turn_as_a_stop_token():
    """Llama 3.1's generation_config.json lists `<|eom_id|>` (and Qwen's `<|endoftext|>`) beside the
    tokenizer's eos: the engine stops on it, so the server shows it as the stop token it is, not as text,
    and the next turn splices after it (the template's `<|eot_id|>` closing the turn)."""
    c, state, _ = client("llama3", force="<|eom_id|>")
    tok = state.tokenizer
    eom = tok.hf.convert_tokens_to_ids("<|eom_id|>")
    msgs = [{"role": "user", "content": "hello"}]
    r = c.chat.completions.create(model=state.config.model_name, messages=msgs, max_tokens=4)
    m = as_dict(r.choices[0].message)
    assert m["generation_token_ids"] == [eom] and r.choices[0].finish_reason == "stop"
    assert m["content"] == ""
    chunks = list(c.chat.completions.create(model=state.config.model_name, messages=msgs, max_tokens=4, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ""
    msgs += [m, {"role": "user", "content": "again"}]
    r2 = c.chat.completions.create(model=state.config.model_name, messages=msgs, max_tokens=4)
    check_extends(tok, r2.choices[0].message.prompt_token_ids, m, user_part("llama3", "again"))
    assert r2.choices[0].message.prompt_token_ids[len(m["prompt_token_ids"]) :][:2] == [eom, tok.end_of_turn_id]


def test_the_tool_call_format_is_the_templates():
    """The format is found by rendering a call and parsing it back: Hermes `<tool_call>` blocks for Qwen2.5,
    Qwen3 and the project's template, bare JSON for Llama 3.1; a template that writes calls otherwise
    (`<function=...>`) has none."""
    from chat_helpers import tokenizer

    for family in QWEN:
        assert Splicer(family_tokenizer(family)).tool_call_format == HERMES
    assert Splicer(tokenizer()).tool_call_format == HERMES
    assert Splicer(family_tokenizer("llama3")).tool_call_format == LLAMA3_JSON
    assert Splicer(family_tokenizer("llama3-fn")).tool_call_format is None


def test_live_a_template_of_neither_format_refuses_tool_parsing():
    """A template whose calls neither parser reads back (`<function=NAME>{...}</function>`): the model's calls
    would come back as content, so a request that asks for tool calls to be parsed is refused with a 400
    naming the reason; tool_choice='none' returns the text as content, as asked."""
    import openai

    c, state, _ = client("llama3-fn", force="<|eom_id|>")
    msgs = [{"role": "user", "content": "compute 2+2"}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="neither format") as e:
            c.chat.completions.create(
                model=state.config.model_name, messages=msgs, tools=[TOOL], max_tokens=4, stream=stream
            )
        assert e.value.body["param"] == "tools" and e.value.body["code"] == "unsupported_tool_call_format"
    r = c.chat.completions.create(
        model=state.config.model_name, messages=msgs, tools=[TOOL], tool_choice="none", max_tokens=4
    )
    assert "Given the following functions" in state.tokenizer.decode(r.choices[0].message.prompt_token_ids)


def test_live_qwen3_enable_thinking_false_reaches_the_template():
    """`chat_template_kwargs` (vLLM's field: how Qwen3 users turn thinking off) is passed to the template: the
    generation prompt ends with the empty think block, and the next turn with the same kwargs splices after
    it. Kwargs that change the earlier generation prompt are a history the tokens do not show (400), and
    kwargs naming the template's own variables are refused."""
    import openai

    c, state, _ = client("qwen3")
    tok, name = state.tokenizer, state.config.model_name
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    msgs = [{"role": "user", "content": "hello"}]
    r = c.chat.completions.create(model=name, messages=msgs, max_tokens=4, seed=3, extra_body=off)
    m = as_dict(r.choices[0].message)
    assert tok.decode(m["prompt_token_ids"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    msgs += [m, {"role": "user", "content": "again"}]
    r2 = c.chat.completions.create(model=name, messages=msgs, max_tokens=4, extra_body=off)
    check_extends(
        tok, r2.choices[0].message.prompt_token_ids, m, user_part("qwen3", "again") + "<think>\n\n</think>\n\n"
    )
    with pytest.raises(openai.BadRequestError, match="generation prompt"):
        c.chat.completions.create(model=name, messages=msgs, max_tokens=4)
    for bad in ({"messages": []}, {"add_generation_prompt": False}, ["enable_thinking"]):
        with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
            c.chat.completions.create(
                model=name, messages=msgs[:1], max_tokens=4, extra_body={"chat_template_kwargs": bad}
            )


def test_a_template_whose_text_changes_between_requests_is_non_monotonic():
    """Llama 3.1/3.2 templates write today's date into the system header: a conversation that crosses
    midnight re-renders its first turn differently, which the history's tokens do not say (docs/serving.md)."""
    tok = family_tokenizer("llama3")
    sp = Splicer(tok)
    msgs = [{"role": "user", "content": "hello"}]
    p1 = sp.build(msgs, template_kwargs={"date_string": "26 Jul 2024"}).prompt_ids
    assert "Today Date: 26 Jul 2024" in tok.decode(p1)
    msgs += [reply(tok, sp, p1, tok.encode("hi")), {"role": "user", "content": "more"}]
    check_splice(
        tok, sp.build(msgs, template_kwargs={"date_string": "26 Jul 2024"}), msgs[1], user_part("llama3", "more")
    )
    with pytest.raises(MonotonicityError, match="the text of turn 0 changed"):
        sp.build(msgs, template_kwargs={"date_string": "27 Jul 2024"})
