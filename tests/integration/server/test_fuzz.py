"""Property-based fuzz of the server's request handling: bad input always gets a clear error that names the
problem, and a bad request does not kill the server.

Each example starts from a valid /v1/chat/completions or /v1/completions body and mutates it (fields dropped,
duplicated or replaced by values of the wrong type, edge values, garbage messages / tool calls / token
fields), or sends bytes that are not a JSON object at all. Every answer must be a 200 with a well-formed
OpenAI body (a well-formed SSE stream ending in [DONE] when streamed) or a 4xx with OpenAI's error JSON
whose message names a field the example touched (or the body); never a 5xx, a traceback, a huge echo of
the input, or a hang (the client's timeout). After each example the server still answers a valid request,
on the same keep-alive connection.
"""

from __future__ import annotations

import json
import math
import re

import httpx
import pytest
from fuzzing import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import served

from exactrl.server.schemas import DISTRIBUTION_EXTRAS, ChatCompletionRequest, CompletionRequest

FUZZ = settings(
    max_examples=examples(60),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# characters: an error quotes the value it refuses shortened, not a megabyte of it (a whole integer may be
# quoted: Python's JSON reads at most 4300 digits)
MAX_MESSAGE = 5000
LEAKS = ("Traceback", 'File "', " object at 0x", "<class ", "There was an error parsing the body")
# a change to one field can make another field's value invalid: the error may name either
RELATED = {
    "stream": {"stream_options", "logprobs", "top_logprobs"},
    "logprobs": {"top_logprobs"},
    "n": {"best_of", "prompt"},
    "tools": {"tool_choice"},
    "prompt": {"max_tokens"},
    "messages": {"max_tokens", "max_completion_tokens"},
    "max_tokens": {"prompt", "messages"},
    "max_completion_tokens": {"messages"},
}


@pytest.fixture(scope="module")
def http():
    s = served()
    with httpx.Client(base_url=s.url, timeout=30) as client:  # a hang fails the example (ReadTimeout)
        yield client


# ---------------------------------------------------------------- values
SPECIAL = st.sampled_from(
    [
        0,
        -1,
        1,
        2**31,
        2**63,
        -(2**63) - 1,
        10**30,
        -(10**30),
        0.5,
        -0.0,
        1e-39,
        1e308,
        float("nan"),
        float("inf"),
        float("-inf"),
        "",
        " ",
        "1",
        "true",
        "null",
        "\ud800",
        "\x00",
        "é😀",
        True,
        False,
        None,
        [],
        {},
        [None],
        {"": None},
    ]
)
HUGE = st.sampled_from(
    [
        "x" * 20_000,
        list(range(3000)),
        {f"k{i}": i for i in range(500)},
        [[[[[[[[1]]]]]]]] * 200,
        int("9" * 4000),
        -(int("9" * 4000)),
    ]
)
SCALARS = st.one_of(SPECIAL, st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12))
GARBAGE = st.one_of(
    SCALARS,
    HUGE,
    st.recursive(
        SCALARS,
        lambda xs: st.lists(xs, max_size=3) | st.dictionaries(st.text(max_size=6), xs, max_size=3),
        max_leaves=8,
    ),
)

# per-field values near their edges, besides GARBAGE
EDGES = {
    "max_tokens": st.sampled_from([0, 1, 511, 512, 10**6, 2.0, 2.5, "3", None]),
    "max_completion_tokens": st.sampled_from([0, 1, 511, 512, 10**6, None]),
    "n": st.sampled_from([0, 1, 2, 64, 65, 2.0, True, None]),
    "temperature": st.sampled_from([0, 0.0, 1e-6, 2, 2.0001, -0.0]),
    "top_p": st.sampled_from([0, 1e-9, 1, 1.0001]),
    "top_k": st.sampled_from([-2, -1, 0, 1, 511, 512, 513, 2**63]),
    "seed": st.sampled_from([2**63 - 1, 2**63, -1]),
    "stop": st.sampled_from(["", [""], ["a"] * 5, ["\n", "e"], "hello", [" "]]),
    "stop_token_ids": st.sampled_from([[], [0], [511], [512], [-1], [True]]),
    "logprobs": st.sampled_from([True, False, 0, 1, 20, 21, -1]),
    "top_logprobs": st.sampled_from([0, 1, 20, 21, -1]),
    "stream": st.booleans(),
    "echo": st.booleans(),
    "ignore_eos": st.booleans(),
    "stream_options": st.sampled_from([{"include_usage": True}, {"include_usage": False}, {}]),
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "function": {"name": "f"}}]),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {}]),
    "monotonicity": st.sampled_from(["raise", "split", "truncate", "never"]),
    "model": st.sampled_from(["gpt-4", "", "m" * 20_000]),
    "prompt": st.sampled_from(
        [[5] * 510, [5] * 511, [5] * 512, [[5], [6, 7]], ["a", "b"], [511], [512], [[]], [], "", "\ud800"]
    ),
}
FIELDS = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields) | set(DISTRIBUTION_EXTRAS)
TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "calculate",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
    },
}
EXTRAS = st.sampled_from(
    [
        "repetition_penalty",
        "min_p",
        "min_tokens",
        "guided_json",
        "best_of",
        "suffix",
        "logit_bias",
        "presence_penalty",
        "frequency_penalty",
        "user",
        "parallel_tool_calls",
        "return_token_ids",
        "whatever",
    ]
)


# ---------------------------------------------------------------- valid bodies
TEMPERATURES = st.one_of(st.just(0.0), st.floats(1e-5, 2))  # 0 is greedy; below 1e-5 logits / T overflow fp32


def _content():
    return st.one_of(
        st.sampled_from(["hello", "", "what is 2+3?", "é😀 \n\t"]),
        st.just([{"type": "text", "text": "hi"}, {"type": "text", "text": " there"}]),
    )


@st.composite
def chat_bodies(draw) -> dict:
    msgs = [{"role": "user", "content": draw(_content())}]
    if draw(st.booleans()):
        msgs.insert(0, {"role": draw(st.sampled_from(["system", "developer"])), "content": "be brief"})
    if draw(st.booleans()):
        call = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"x": "1+1"}'}}
        msgs += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "2"},
        ]
    body = {
        "model": served().model,
        "messages": msgs,
        "max_tokens": draw(st.integers(1, 3)),
        "n": draw(st.integers(1, 2)),
        "stream": draw(st.booleans()),
        "seed": draw(st.integers(0, 9)),
    }
    if draw(st.booleans()):
        body["tools"] = [TOOL]
    if draw(st.booleans()):
        body["logprobs"] = True
        if not body["stream"]:
            body["top_logprobs"] = draw(st.integers(0, 3))
    if body["stream"] and draw(st.booleans()):
        body["stream_options"] = {"include_usage": True}
    for k, v in (
        ("temperature", TEMPERATURES),
        ("top_p", st.floats(0.1, 1)),
        ("top_k", st.integers(1, 512)),
        ("stop", st.sampled_from(["\n", ["e", "l"]])),
    ):
        if draw(st.booleans()):
            body[k] = draw(v)
    return body


@st.composite
def completion_bodies(draw) -> dict:
    prompt = draw(st.sampled_from(["hello world", [5, 6, 7], ["hi", "the quick"], [[5], [6, 7]]]))
    body = {
        "model": served().model,
        "prompt": prompt,
        "max_tokens": draw(st.integers(1, 3)),
        "n": draw(st.integers(1, 2)),
        "stream": draw(st.booleans()),
        "echo": draw(st.booleans()),
        "seed": draw(st.integers(0, 9)),
    }
    if not body["stream"] and draw(st.booleans()):
        body["logprobs"] = draw(st.integers(0, 3))
    for k, v in (("temperature", TEMPERATURES), ("top_k", st.integers(1, 512)), ("stop", st.just(["o"]))):
        if draw(st.booleans()):
            body[k] = draw(v)
    return body


# ---------------------------------------------------------------- mutations
def _bad_message(draw) -> dict:
    """A message with one field wrong: an unknown role, garbage content, malformed tool calls or token fields."""
    msg = {"role": "assistant", "content": "x"}
    kind = draw(st.sampled_from(["role", "content", "tool_calls", "call", "tokens", "tool_call_id", "extra"]))
    if kind == "role":
        msg["role"] = draw(st.one_of(st.sampled_from(["wizard", "function", "USER", "", "tool "]), GARBAGE))
    elif kind == "content":
        msg["content"] = draw(
            st.one_of(
                GARBAGE,
                st.just([{"type": "image_url", "image_url": {"url": "x"}}]),
                st.lists(st.dictionaries(st.sampled_from(["type", "text"]), GARBAGE), max_size=2),
            )
        )
    elif kind == "tool_calls":
        msg["tool_calls"] = draw(GARBAGE)
    elif kind == "call":
        fn = {
            "name": draw(st.one_of(st.just("calculator"), GARBAGE)),
            "arguments": draw(
                st.one_of(st.sampled_from(['{"x": "1"}', "{", "[1]", "", "null", '{"x": NaN}']), GARBAGE)
            ),
        }
        call = {
            "id": draw(st.one_of(st.just("c9"), GARBAGE)),
            "type": draw(st.one_of(st.just("function"), GARBAGE)),
            "function": draw(st.one_of(st.just(fn), GARBAGE)),
        }
        msg["tool_calls"] = [draw(st.fixed_dictionaries({}, optional={k: st.just(v) for k, v in call.items()}))]
    elif kind == "tokens":
        ok = {"prompt_token_ids": [5, 6], "generation_token_ids": [7], "generation_log_probs": [-1.0]}
        field = draw(st.sampled_from(sorted(ok)))
        ok[field] = draw(st.one_of(GARBAGE, st.sampled_from([[], [512], [-1], [0.5], [float("nan")], [1.0], [True]])))
        msg |= draw(st.fixed_dictionaries({}, optional={k: st.just(v) for k, v in ok.items()}))
    elif kind == "tool_call_id":
        msg = {"role": "tool", "content": "2", "tool_call_id": draw(GARBAGE)}
    else:
        msg[draw(st.sampled_from(["reasoning_content", "name", "tool_call_id", "weird"]))] = draw(GARBAGE)
    return msg


@st.composite
def mutated(draw, bodies) -> tuple[dict, set, list]:
    """(body, the fields touched, keys to send twice)"""
    body = draw(bodies)
    touched, dup = set(), []
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["drop", "garbage", "edge", "edge", "extra", "message", "duplicate"]))
        key = draw(st.sampled_from(sorted(body) + sorted(EDGES)))
        if op == "drop" and key in body:
            del body[key]
        elif op == "garbage":
            body[key] = draw(GARBAGE)
        elif op == "edge" and key in EDGES:
            body[key] = draw(EDGES[key])
        elif op == "extra":
            key = draw(EXTRAS)
            body[key] = draw(st.one_of(GARBAGE, st.sampled_from([1, 1.0, 0, 0.0, 2.0, "x"])))
        elif op == "message" and isinstance(body.get("messages"), list):
            key = "messages"
            i = draw(st.integers(0, len(body["messages"])))
            body["messages"] = body["messages"][:i] + [_bad_message(draw)] + body["messages"][i:]
        elif op == "duplicate" and key in body:
            dup.append(key)  # sent first with a garbage value, then with the body's (JSON's last one wins)
        touched.add(key)
    return body, touched, dup


def _encode(body: dict, dup: list, garbage) -> bytes:
    text = json.dumps(body, allow_nan=True)
    for k in dup:
        text = "{" + json.dumps(k) + ": " + json.dumps(garbage, allow_nan=True) + ", " + text[1:]
    return text.encode()


# ---------------------------------------------------------------- checks
def check_error(r: httpx.Response, names: set[str]) -> dict:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:2000])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    msg = err["message"]
    assert isinstance(msg, str) and msg and len(msg) <= MAX_MESSAGE, msg[:2000]
    assert not any(leak in msg for leak in LEAKS), msg
    if names:  # it names the field the example touched (or one its change made invalid), by param or in words
        allowed = names | {n for k in names for n in RELATED.get(k, ())}
        assert err["param"] in allowed or any(re.search(rf"\b{re.escape(n)}\b", msg) for n in allowed), (names, err)
    else:  # the body itself
        assert err["param"] is None and any(w in msg for w in ("body", "JSON", "Content-Type")), err
    return err


def _check_tokens(holder: dict) -> None:
    gen, lps = holder["generation_token_ids"], holder["generation_log_probs"]
    assert holder["prompt_token_ids"] and all(type(t) is int for t in holder["prompt_token_ids"] + gen)
    assert len(gen) == len(lps) and all(math.isfinite(lp) and lp <= 0 for lp in lps), holder


def check_answer(r: httpx.Response, path: str) -> None:
    assert r.status_code == 200, r.text[:2000]
    body = r.json()
    assert body["object"] == ("chat.completion" if path == CHAT else "text_completion")
    choices = body["choices"]
    assert [c["index"] for c in choices] == list(range(len(choices))) and choices
    for c in choices:
        assert c["finish_reason"] in ("stop", "length", "tool_calls")
        _check_tokens(c["message"] if path == CHAT else c)
        if path == CHAT and c["logprobs"] is not None:
            assert len(c["logprobs"]["content"]) == len(c["message"]["generation_token_ids"])
    u = body["usage"]
    gen = sum(len((c["message"] if path == CHAT else c)["generation_token_ids"]) for c in choices)
    assert u["completion_tokens"] == gen and u["total_tokens"] == u["prompt_tokens"] + gen


def check_stream(r: httpx.Response, path: str) -> None:
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text[:2000]
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", r.text[-2000:]
    finished = []
    for e in map(json.loads, events[:-1]):
        assert "error" not in e, e  # nothing failed inside the engine: an error event is a server bug
        assert e["object"] == ("chat.completion.chunk" if path == CHAT else "text_completion")
        for c in e["choices"]:
            if c["finish_reason"] is not None:
                finished.append(c["index"])
                _check_tokens(c["delta"] if path == CHAT else c)
    assert sorted(finished) == list(range(len(finished))) and finished  # each choice closed once


def still_serving(http: httpx.Client) -> None:
    r = http.post(
        CHAT, json={"model": served().model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    )
    assert r.status_code == 200, r.text


def send(http: httpx.Client, path: str, content: bytes, headers: dict | None = None) -> httpx.Response:
    r = http.post(path, content=content, headers={"content-type": "application/json"} if headers is None else headers)
    assert r.status_code < 500, (r.status_code, r.text[:2000])
    return r


# ---------------------------------------------------------------- properties
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_valid_bodies_are_answered(http, path):
    @FUZZ
    @given(body=chat_bodies() if path == CHAT else completion_bodies(), session=st.booleans())
    def run(body, session):
        r = send(http, ("/sessions/fuzz" if session else "") + path, json.dumps(body).encode())
        (check_stream if body["stream"] else check_answer)(r, path)

    run()
    http.delete("/sessions/fuzz")


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_mutated_bodies_are_answered_or_refused_by_name(http, path):
    @FUZZ
    @given(case=mutated(chat_bodies() if path == CHAT else completion_bodies()), garbage=GARBAGE)
    def run(case, garbage):
        body, touched, dup = case
        r = send(http, path, _encode(body, dup, garbage))
        if r.status_code != 200:
            check_error(r, touched)
        elif r.headers["content-type"].startswith("text/event-stream"):
            check_stream(r, path)
        else:
            check_answer(r, path)
        still_serving(http)

    run()


CONTENT_TYPES = st.sampled_from(
    [
        None,
        "application/json",
        "application/json; charset=utf-8",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/vnd.api+json",
        "",
    ]
)


@st.composite
def raw_bodies(draw) -> bytes:
    """Bytes that are not a JSON object: a valid body cut, spliced with invalid UTF-8 or nested too deep, or
    another JSON value, or noise."""
    text = json.dumps(draw(chat_bodies())).encode()
    kind = draw(st.sampled_from(["cut", "splice", "deep", "value", "noise", "bigint"]))
    if kind == "cut":
        return text[: draw(st.integers(0, len(text) - 1))]
    if kind == "splice":
        i = draw(st.integers(0, len(text)))
        junk = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"'", b"}", b","]))
        return text[:i] + junk + text[i:]
    if kind == "deep":
        depth = draw(st.sampled_from([200, 2000, 100_000]))
        return b'{"model": "m", "messages": ' + b"[" * depth + b"]" * depth + b"}"
    if kind == "value":
        return json.dumps(draw(GARBAGE.filter(lambda v: not isinstance(v, dict))), allow_nan=True).encode()
    if kind == "bigint":
        return text[:-1] + b', "seed": ' + b"9" * draw(st.sampled_from([4301, 50_000])) + b"}"
    return draw(st.binary(max_size=64))


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_bytes_that_are_not_a_json_object_are_refused_by_name(http, path):
    @FUZZ
    @given(raw=raw_bodies(), content_type=CONTENT_TYPES)
    def run(raw, content_type):
        r = send(http, path, raw, {} if content_type is None else {"content-type": content_type})
        if r.status_code != 200:  # (a splice may leave valid JSON: a space, a brace inside a string)
            err = check_error(r, FIELDS if r.json()["error"]["param"] is not None else set())
            assert err["param"] is None or content_type and "json" in content_type, err  # only JSON is read
        still_serving(http)

    run()
