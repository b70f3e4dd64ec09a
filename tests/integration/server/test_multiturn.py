"""Multi-turn conversations through the real openai client: the tokens a turn is trained on are exactly
the tokens generated, and the logprobs the server reports equal the trainer's `sequence_logprobs` bitwise."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
from serving import check_trajectory, check_turns, served, trainer_logprobs

USERS = ["Compute 12*7", "hello world, and again?", "the quick brown fox", "and 3+4?"]


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9, top_k=40)])
def test_multi_turn_tokens_and_logprobs_are_exact(sampling):
    s = served()
    client, tok = s.client(), s.tokenizer
    messages, turns = [{"role": "system", "content": "You are terse."}], []
    extra = {"top_k": sampling.pop("top_k")} if "top_k" in sampling else {}
    for k, user in enumerate(USERS):
        messages.append({"role": "user", "content": user})
        r = client.chat.completions.create(
            model=s.model, messages=messages, max_tokens=12, seed=100 + k, extra_body=extra, **sampling
        )
        msg = r.choices[0].message
        assert len(msg.generation_token_ids) == len(msg.generation_log_probs) == r.usage.completion_tokens
        turns.append(msg)
        messages.append(msg)  # sent back unchanged (the pydantic object keeps the extra fields)
    check_turns(tok, turns, sampling["temperature"], extra.get("top_k", -1), sampling.get("top_p", 1.0))
    # the point of splicing: the generated text does not re-tokenize to the generated tokens
    gens = [
        m.generation_token_ids[:-1] if m.generation_token_ids[-1] in tok.stop_token_ids else m.generation_token_ids
        for m in turns
    ]
    assert any(tok.encode(tok.decode(g)) != g for g in gens)
    # and a re-templated history would not be the prompt the model actually saw
    plain = [
        {"role": m["role"], "content": m["content"]}
        if isinstance(m, dict)
        else {"role": "assistant", "content": m.content or ""}
        for m in messages
    ]
    assert tok.apply_chat_template(plain[:-1]) != turns[-1].prompt_token_ids


def test_dict_messages_and_streaming_give_the_same_turns():
    s = served()
    client = s.client()
    base = [{"role": "user", "content": "Compute 12*7"}]
    r = client.chat.completions.create(model=s.model, messages=base, max_tokens=16, seed=7)
    ref = r.choices[0].message
    chunks = list(
        client.chat.completions.create(
            model=s.model, messages=base, max_tokens=16, seed=7, stream=True, stream_options={"include_usage": True}
        )
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    final = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1 and final[0].generation_token_ids == ref.generation_token_ids
    assert (
        final[0].generation_log_probs == ref.generation_log_probs and final[0].prompt_token_ids == ref.prompt_token_ids
    )
    assert content == (ref.content or "")
    assert chunks[-1].usage.completion_tokens == len(ref.generation_token_ids)
    # a client that rebuilds the message from the stream (plain dict) splices exactly too
    msg = {
        "role": "assistant",
        "content": content,
        "prompt_token_ids": final[0].prompt_token_ids,
        "generation_token_ids": final[0].generation_token_ids,
        "generation_log_probs": final[0].generation_log_probs,
    }
    r2 = client.chat.completions.create(
        model=s.model, messages=base + [msg, {"role": "user", "content": "more"}], max_tokens=8, seed=8
    )
    check_turns(s.tokenizer, [ref, r2.choices[0].message])


def test_n_choices_seed_and_stop_strings():
    s = served()
    client = s.client()
    msgs = [{"role": "user", "content": "hello world"}]
    a = client.chat.completions.create(model=s.model, messages=msgs, max_tokens=24, seed=3, n=3)
    b = client.chat.completions.create(model=s.model, messages=msgs, max_tokens=24, seed=3, n=3)
    assert [c.message.generation_token_ids for c in a.choices] == [c.message.generation_token_ids for c in b.choices]
    assert len({tuple(c.message.generation_token_ids) for c in a.choices}) > 1  # samples differ
    for c in a.choices:
        check_turns(s.tokenizer, [c.message])
    # a stop string cuts the text; the tokens are the prefix the model generated, up to the one that completed it
    ref = a.choices[0].message
    text = ref.content
    stop = next(
        text[i : i + 2] for i in range(1, len(text) - 2) if text[i : i + 2].strip() and text.find(text[i : i + 2]) == i
    )
    r = client.chat.completions.create(model=s.model, messages=msgs, max_tokens=24, seed=3, stop=[stop])
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and m.content == text[: text.find(stop)].strip()
    assert ref.generation_token_ids[: len(m.generation_token_ids)] == m.generation_token_ids
    assert s.tokenizer.decode(m.generation_token_ids).find(stop) >= 0


def test_logprobs_and_top_logprobs():
    s = served()
    r = s.client().chat.completions.create(
        model=s.model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=12,
        seed=1,
        temperature=0.8,
        logprobs=True,
        top_logprobs=3,
    )
    m, lp = r.choices[0].message, r.choices[0].logprobs.content
    assert [e.logprob for e in lp] == m.generation_log_probs
    assert [e.token for e in lp] == [s.tokenizer.decode([t]) for t in m.generation_token_ids]
    raw = bytes(b for e in lp for b in e.bytes)  # raw bytes, even of pieces of a UTF-8 character
    assert raw.decode("utf-8", errors="replace") == s.tokenizer.decode(m.generation_token_ids)
    for e in lp:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and e.logprob <= tops[0]


def test_completions_endpoint():
    s = served()
    client, tok = s.client(), s.tokenizer
    r = client.completions.create(model=s.model, prompt="hello world", max_tokens=8, n=2, seed=5, logprobs=2)
    assert len(r.choices) == 2
    for c in r.choices:
        extra = c.model_extra
        assert extra["prompt_token_ids"] == tok.encode("hello world")
        full = extra["prompt_token_ids"] + extra["generation_token_ids"]
        lps = trainer_logprobs(full)[len(extra["prompt_token_ids"]) - 1 :]
        assert c.logprobs.token_logprobs == extra["generation_log_probs"] == lps
        assert all(len(t) <= 3 for t in c.logprobs.top_logprobs)  # the top 2 and the chosen token
        # as OpenAI and vLLM: the chosen token is in its row, with its logprob
        assert [t[tok_] for t, tok_ in zip(c.logprobs.top_logprobs, c.logprobs.tokens)] == lps
    zero = client.completions.create(model=s.model, prompt="hello world", max_tokens=4, seed=5, logprobs=0)
    lp0 = zero.choices[0].logprobs
    assert [list(t.items()) for t in lp0.top_logprobs] == [[(x, v)] for x, v in zip(lp0.tokens, lp0.token_logprobs)]
    ids = tok.encode("the quick")
    e = client.completions.create(model=s.model, prompt=ids, max_tokens=4, seed=5, echo=True, logprobs=0)
    assert e.choices[0].text.startswith("the quick") and e.choices[0].logprobs.token_logprobs[0] is None
    full = ids + e.choices[0].model_extra["generation_token_ids"]
    assert e.choices[0].logprobs.token_logprobs[1:] == trainer_logprobs(full)
    long = [(7 * i) % 200 + 5 for i in range(300)]  # echo scored over more rows than one head chunk (256)
    e = client.completions.create(model=s.model, prompt=long, max_tokens=4, seed=5, echo=True, logprobs=1)
    full = long + e.choices[0].model_extra["generation_token_ids"]
    assert e.choices[0].logprobs.token_logprobs[1:] == trainer_logprobs(full)
    stream = list(client.completions.create(model=s.model, prompt=[ids, ids], max_tokens=5, seed=9, stream=True))
    texts = {}
    for ch in stream:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    ref = client.completions.create(model=s.model, prompt=[ids, ids], max_tokens=5, seed=9)
    assert texts == {c.index: c.text for c in ref.choices}


def test_32_concurrent_clients():
    s = served()
    tok = s.tokenizer

    async def conversation(k: int, client):
        messages, turns = [{"role": "user", "content": USERS[k % len(USERS)]}], []
        for t in range(2):
            r = await client.chat.completions.create(
                model=s.model, messages=messages, max_tokens=8 + k % 5, seed=1000 * k + t, temperature=1.0
            )
            turns.append(r.choices[0].message)
            messages += [r.choices[0].message, {"role": "user", "content": "go on"}]
        return turns

    async def main():
        async with s.async_client(http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=64))) as c:
            return await asyncio.gather(*(conversation(k, c) for k in range(32)))

    results = asyncio.run(main())
    for turns in results:
        check_turns(tok, turns)
    # batching does not change a sample: a lone rerun of one conversation's first turn gives the same tokens
    r = s.client().chat.completions.create(
        model=s.model, messages=[{"role": "user", "content": USERS[5 % 4]}], max_tokens=8, seed=5000, temperature=1.0
    )
    assert r.choices[0].message.generation_token_ids == results[5][0].generation_token_ids


def test_session_records_training_trajectories():
    s = served()
    tok = s.tokenizer
    sid = "test-session"
    import openai

    client = openai.OpenAI(base_url=f"{s.url}/sessions/{sid}/v1", api_key="test", max_retries=0)
    messages, turns = [{"role": "user", "content": "Compute 12*7"}], []
    for k in range(3):
        r = client.chat.completions.create(model=s.model, messages=messages, max_tokens=10, seed=k)
        turns.append(r.choices[0].message)
        messages += [r.choices[0].message, {"role": "user", "content": f"turn {k}"}]
    (t,) = httpx.get(f"{s.url}/sessions/{sid}/trajectories").json()["trajectories"]
    check_trajectory(t, turns)
    masked = [x for x, m in zip(t["completion_ids"], t["loss_mask"]) if m == 0]
    assert tok.decode(masked).count("<|im_start|>user") == 2
    assert httpx.delete(f"{s.url}/sessions/{sid}").json()["deleted"]


def test_echoed_prompt_tokens_outside_top_k_have_no_logprob_and_the_turn_is_recorded_once():
    """echo + logprobs under top_k: a prompt token the truncated distribution leaves out scores -inf, which
    JSON cannot carry (the answer was a 500, after the session had recorded the turn); it reads null."""
    s = served()
    ids = s.tokenizer.encode("hello world, the quick brown fox")
    r = httpx.post(
        f"{s.url}/sessions/echo-top-k/v1/completions",
        timeout=60,
        json={"model": s.model, "prompt": ids, "max_tokens": 3, "seed": 1, "logprobs": 1, "echo": True, "top_k": 2},
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    prompt_lps = choice["logprobs"]["token_logprobs"][: len(ids)]
    want = trainer_logprobs(ids + choice["generation_token_ids"], top_k=2)[: len(ids) - 1]
    assert prompt_lps[0] is None and None in prompt_lps[1:]  # some prompt token is outside the top 2
    assert prompt_lps[1:] == [lp if math.isfinite(lp) else None for lp in want]
    trajectories = httpx.get(f"{s.url}/sessions/echo-top-k/trajectories", timeout=60).json()
    assert len(trajectories["trajectories"]) == 1
