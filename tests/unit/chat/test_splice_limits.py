"""The splicer keeps generations that hold end-of-turn tokens (ignore_eos) exact, accepts every id of the model's
vocabulary, renders the template a bounded number of times, and refuses over-long conversations first."""

from __future__ import annotations

import random

import pytest
from fuzzing import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_splice import SYSTEM, USER, byte_tokens, sp, tok, turn  # noqa: F401 (sp, tok: fixtures)

from exactrl.chat.messages import InconsistentTokenFieldsError
from exactrl.chat.splice import MonotonicityError, PromptTooLongError, Splicer

FOLLOW = {"role": "user", "content": "more"}


@pytest.mark.parametrize("eot", [True, False])
@pytest.mark.parametrize("policy", ["raise", "split", "truncate"])
def test_generation_with_end_of_turn_inside_splices_exactly(tok, sp, eot, policy):
    p1 = sp.build([USER]).prompt_ids
    gen = (
        byte_tokens(tok, "84")
        + [tok.end_of_turn_id]
        + tok.encode("\n<|im_start|>user\nok")
        + [tok.end_of_turn_id]
        + byte_tokens(tok, "fine")
    )
    a1 = turn(tok, p1, gen, eot=eot)
    assert "<|im_end|>" in a1["content"]
    plan = sp.build([USER, a1, FOLLOW], policy=policy)
    hist = a1["prompt_token_ids"] + a1["generation_token_ids"]
    assert plan.kind == "spliced" and plan.prompt_ids[: len(hist)] == hist
    # the next turn chains on it
    a2 = turn(tok, plan.prompt_ids, byte_tokens(tok, "yes"))
    plan2 = sp.build([USER, a1, FOLLOW, a2, FOLLOW], policy=policy)
    assert plan2.kind == "spliced" and plan2.prompt_ids[: len(plan.prompt_ids)] == plan.prompt_ids


def test_edited_generation_with_end_of_turn_inside_is_still_non_monotonic(tok, sp):
    p1 = sp.build([USER]).prompt_ids
    gen = byte_tokens(tok, "84") + [tok.end_of_turn_id] + byte_tokens(tok, "fine")
    a1 = turn(tok, p1, gen)
    edited = a1 | {"content": a1["content"].replace("fine", "good")}
    with pytest.raises(MonotonicityError):
        sp.build([USER, edited, FOLLOW])
    dropped = {k: v for k, v in a1.items()} | {"content": "84"}
    with pytest.raises(MonotonicityError):
        sp.build([USER, dropped, FOLLOW])


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), turns=st.integers(1, 3))
def test_random_generations_with_end_of_turn_tokens_splice_exactly(tok, sp, seed, turns):
    """As test_splice's random test, but the generations may hold end-of-turn tokens anywhere (ignore_eos)."""
    rng = random.Random(seed)
    banned = set(tok.stop_token_ids) - {tok.end_of_turn_id}
    ids = [t for t in range(tok.vocab_size) if t not in banned]
    msgs = [SYSTEM, USER]
    prompt = sp.build(msgs).prompt_ids
    for _ in range(turns):
        gen = [rng.choice(ids) for _ in range(rng.randint(1, 12))] + [tok.end_of_turn_id]
        gen = gen[: rng.randint(1, len(gen))]
        msgs = msgs + [turn(tok, prompt, gen, eot=False), FOLLOW]
        plan = sp.build(msgs)
        assert plan.kind == "spliced"
        assert plan.prompt_ids[: len(prompt) + len(gen)] == prompt + gen
        prompt = plan.prompt_ids


def test_ids_of_the_models_padded_vocabulary_are_accepted(tok):
    sp = Splicer(tok, vocab_size=tok.vocab_size + 88)
    p1 = sp.build([USER]).prompt_ids
    a1 = turn(tok, p1, [tok.vocab_size + 5, tok.vocab_size + 87], eot=False, content="")
    plan = sp.build([USER, a1, FOLLOW])
    assert plan.kind == "spliced" and plan.prompt_ids[: len(p1) + 2] == p1 + [tok.vocab_size + 5, tok.vocab_size + 87]
    a1["generation_token_ids"] = [tok.vocab_size + 88, 5]
    with pytest.raises(InconsistentTokenFieldsError, match="outside the vocabulary"):
        sp.build([USER, a1, FOLLOW])


def test_template_renders_do_not_grow_with_the_message_count(tok, monkeypatch):
    sp = Splicer(tok)
    calls = []
    render = type(tok).render_chat  # Tokenizer is a frozen dataclass: count on the class
    monkeypatch.setattr(type(tok), "render_chat", lambda self, *a, **kw: calls.append(1) or render(self, *a, **kw))
    p1 = sp.build([USER]).prompt_ids
    a1 = turn(tok, p1, byte_tokens(tok, "84"))
    chatter = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}] * 100
    calls.clear()
    with pytest.raises(MonotonicityError):
        sp.build([USER] + chatter + [a1, FOLLOW])
    assert len(calls) <= 3
    calls.clear()  # many copies of a token-carrying message: refused without one render each
    with pytest.raises(MonotonicityError):
        sp.build([USER] + [a1, FOLLOW] * 100)
    assert len(calls) <= 3


def test_conversation_beyond_the_context_is_refused_first(tok, sp):
    chatter = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}] * 100
    with pytest.raises(PromptTooLongError) as e:
        sp.build(chatter + [FOLLOW], max_len=512)
    assert e.value.length >= 512 and "512" in str(e.value)
    p1 = sp.build([USER]).prompt_ids
    a1 = turn(tok, p1, byte_tokens(tok, "84"))
    with pytest.raises(PromptTooLongError):  # before the (failing) history check
        sp.build([USER, a1] + chatter + [FOLLOW], max_len=512)
    assert sp.build([USER, a1, FOLLOW], max_len=512).kind == "spliced"


def test_generation_ending_with_end_of_turn_shown_in_its_text_splices_exactly(tok, sp):
    """ignore_eos, cut by length right after an end-of-turn: the text shows it; stopped by it: the text does not."""
    p1 = sp.build([USER]).prompt_ids
    eot = tok.end_of_turn_id
    for gen, shown in [
        (byte_tokens(tok, "84") + [eot], True),
        (byte_tokens(tok, "84") + [eot, eot], True),
        (byte_tokens(tok, "84") + [eot, eot], False),
    ]:
        text = tok.decode(gen if shown else gen[:-1])
        a1 = turn(tok, p1, gen, eot=False, content=text)
        plan = sp.build([USER, a1, FOLLOW])
        assert plan.kind == "spliced" and plan.prompt_ids[: len(p1) + len(gen)] == p1 + gen
        assert plan.prompt_ids[len(p1) + len(gen)] != eot


def test_a_length_cut_generation_ending_on_end_of_turn_inside_its_reasoning_splices(tok, sp):
    """ignore_eos, cut by length right after an end-of-turn while still in `<think>`: the server's message
    carries the end-of-turn's text in reasoning_content; the matcher compared it with the text without it
    (as if the token had stopped the generation) and refused the turn (hypothesis found it: seed 227428)."""
    p1 = sp.build([USER]).prompt_ids
    eot = tok.end_of_turn_id
    gen = tok.encode("<think>") + byte_tokens(tok, "ab") + [eot]
    a1 = turn(tok, p1, gen, eot=False)
    assert a1["reasoning_content"].endswith(tok.decode([eot]))
    plan = sp.build([USER, a1, FOLLOW])
    assert plan.kind == "spliced" and plan.prompt_ids[: len(p1) + len(gen)] == p1 + gen
