"""Property-based fuzz of how the external rollout backend (exactrl/rollout/external.py) reads a server's answers.

A tiny stdlib HTTP server in a thread answers /v1/completions with what each example planned: a valid
answer in one of the three dialects (exactrl, vLLM, SGLang), the same with a field dropped, replaced by
junk or given a wrong value, an HTTP error with or without OpenAI's error body, bytes that are not JSON,
or a broken connection, a stall or a trickle. Every outcome is one of two:
  - completions the trainer can use (ids ints in the vocabulary, one finite logprob <= 0 (LOGPROB_SLACK) per token,
    indexes 0..n-1, the prompt sent, finish_reason stop/length), equal bitwise to the valid answer's
    when only fields nobody reads changed;
  - an ExternalEngineError naming the server URL, the prompt and (for a malformed answer) the field,
    never a KeyError / TypeError / IndexError from inside.
Requests are not retried (external.py documents none): each prompt is sent once. The engine keeps
working after every failure. Timeouts are short (0.3 s), so the file runs in well under a minute.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fuzzing import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exactrl.engine import SamplingParams
from exactrl.rollout.external import LOGPROB_SLACK, ExternalEngine, ExternalEngineError, RolloutBackendSettings

FUZZ = settings(
    max_examples=examples(60),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
V = 50  # the trainer's vocabulary in these tests
TIMEOUT = 1.5  # well above a local answer on a busy machine, well below the stall and the trickle
FP32_MAX = 3.4028234663852886e38  # the trainer reads logprobs in fp32
DIALECTS = ("exactrl", "vllm", "sglang")
LP_FIELD = {
    "exactrl": "generation_log_probs",
    "vllm": "logprobs.token_logprobs",
    "sglang": "meta_info.output_token_logprobs",
}

junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=4)
    | st.sampled_from([10**400, -(10**400), -1e39]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=5,
)


# ---------------------------------------------------------------- the fake server
class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(body)
        self.server.plan(self, body)

    def reply(self, status: int, data: bytes, headers=()):
        self.send_response(status)
        for k, v in [("Content-Type", "application/json"), *headers]:
            self.send_header(k, v)
        if not any(k == "Content-Length" for k, _ in headers):
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    srv.handle_error = lambda *_: None  # the client hung up on a stalled or trickling answer: as planned
    srv.requests, srv.plan = [], None
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    yield srv
    srv.shutdown()


@pytest.fixture(scope="module")
def engine(server):
    eng = ExternalEngine(
        RolloutBackendSettings(kind="openai", base_url=server.url, model="m", timeout_s=TIMEOUT, max_concurrency=2),
        vocab_size=V,
    )
    yield eng
    eng.close()


def answering(server, answers: dict):
    """Plan: each request gets the JSON of answers[its prompt's first token]."""
    server.requests.clear()
    server.plan = lambda h, body: h.reply(200, json.dumps(answers[body["prompt"][0]]).encode())


# ---------------------------------------------------------------- valid answers
def make_choice(dialect: str, k: int, ids, lps, finish: str, echo) -> dict:
    c = {"index": k, "text": "x" * len(ids), "finish_reason": finish}
    if echo is not None:
        c["prompt_token_ids"] = echo
    if dialect == "exactrl":
        c |= {"logprobs": None, "generation_token_ids": ids, "generation_log_probs": lps}
    elif dialect == "vllm":
        c |= {"token_ids": ids, "logprobs": {"tokens": ["t"] * len(ids), "token_logprobs": lps, "top_logprobs": None}}
    else:
        c["meta_info"] = {"output_token_logprobs": [[lp, t, None] for t, lp in zip(ids, lps)]}
    return c


@st.composite
def valid_answers(draw, prompt: list[int], sp: SamplingParams):
    """(answer, truth): truth[j] = (ids, logprobs, finish_reason) of sample j."""
    dialect = draw(st.sampled_from(DIALECTS))
    echo = draw(st.booleans())
    truth, choices = [], []
    for k in range(sp.n):
        L = draw(st.integers(0, sp.max_tokens))
        ids = draw(st.lists(st.integers(0, V - 1), min_size=L, max_size=L))
        lps = draw(st.lists(st.floats(-40.0, 0.0), min_size=L, max_size=L))
        finish = draw(st.sampled_from(["stop", "length"]))
        truth.append((ids, lps, finish))
        choices.append(make_choice(dialect, k, ids, lps, finish, list(prompt) if echo else None))
    order = draw(st.permutations(range(sp.n)))
    return (
        {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [choices[i] for i in order]},
        truth,
        dialect,
    )


# (prompts, n, max_tokens, prompt tokens after the first)
requests_ = st.tuples(
    st.integers(1, 3), st.integers(1, 3), st.integers(1, 5), st.lists(st.integers(0, V - 1), max_size=4)
)


def batch(k: int, n: int, max_tokens: int, rest: list[int]):
    prompts = [[j, *rest] for j in range(k)]  # the first token says which prompt a request is
    return prompts, SamplingParams(max_tokens=max_tokens, n=n, seed=1)


def usable(outs, prompts, sp) -> None:
    """What the trainer may receive: nothing it would have to doubt."""
    assert len(outs) == len(prompts)
    for p, group in zip(prompts, outs):
        assert [c.index for c in group] == list(range(sp.n)) and all(type(c.index) is int for c in group)
        for c in group:
            assert c.prompt_token_ids == p and c.finish_reason in ("stop", "length")
            assert len(c.logprobs) == len(c.token_ids) == len(c.versions) <= sp.max_tokens
            assert all(type(t) is int and 0 <= t < V for t in c.token_ids), c.token_ids
            assert all(type(x) is float and -FP32_MAX <= x <= LOGPROB_SLACK for x in c.logprobs), c.logprobs


def names_server(e: ExternalEngineError, server, k: int | None = None) -> str:
    msg = str(e)
    assert server.url in msg, msg
    if k is not None:
        assert f"/v1/completions (prompt {k})" in msg, msg
    assert len(msg) < 2000, msg
    return msg


def still_works(engine, server) -> None:
    """After any failure the same engine samples a valid answer."""
    ok = make_choice("exactrl", 0, [1, 2], [-0.5, -1.5], "length", None)
    answering(server, {7: {"choices": [ok]}})
    (group,) = engine.generate([[7]], SamplingParams(max_tokens=2))
    assert group[0].token_ids == [1, 2] and group[0].logprobs == [-0.5, -1.5]


# ---------------------------------------------------------------- answers: valid, harmlessly changed, mutated
@given(data=st.data(), req=requests_)
@FUZZ
def test_valid_answers_and_fields_nobody_reads_pass_bitwise(server, engine, data, req):
    prompts, sp = batch(*req)
    drawn = [data.draw(valid_answers(p, sp)) for p in prompts]
    answers = {}
    for k, (answer, _, _) in enumerate(drawn):
        # extra keys (names no dialect reads) at the top and in choices; a changed text
        for obj in [answer, *answer["choices"]]:
            for key, v in data.draw(
                st.dictionaries(st.text(min_size=1, max_size=6).map("x_".__add__), junk, max_size=2)
            ).items():
                obj[key] = v
        for c in answer["choices"]:
            c["text"] = data.draw(st.text(max_size=5))
        answers[k] = answer
    answering(server, answers)
    outs = engine.generate(prompts, sp)
    usable(outs, prompts, sp)
    for group, (_, truth, _) in zip(outs, drawn):
        assert [(c.token_ids, c.logprobs, c.finish_reason) for c in group] == truth
    assert sorted(r["prompt"][0] for r in server.requests) == list(range(len(prompts)))  # each sent once


def paths(obj, at=()):
    yield at
    if isinstance(obj, dict):
        for key, v in obj.items():
            yield from paths(v, (*at, key))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from paths(v, (*at, i))


def mutate(answer, path, how: str, value):
    if not path:
        return value
    parent = answer
    for key in path[:-1]:
        parent = parent[key]
    if how == "drop":
        del parent[path[-1]]
    elif how == "replace":
        parent[path[-1]] = value
    elif isinstance(parent[path[-1]], dict):
        parent[path[-1]][json.dumps(value)[:6]] = value
    elif isinstance(parent[path[-1]], list):
        parent[path[-1]].append(value)
    return answer


def valid_batch(data, req) -> tuple[list, SamplingParams, int, dict]:
    """(prompts, params, the prompt whose answer goes wrong, a valid answer for each prompt)."""
    prompts, sp = batch(*req)
    bad = data.draw(st.integers(0, len(prompts) - 1))
    return prompts, sp, bad, {k: data.draw(valid_answers(p, sp))[0] for k, p in enumerate(prompts)}


@given(data=st.data(), req=requests_)
@FUZZ
def test_any_mutated_answer_is_usable_or_a_named_error(server, engine, data, req):
    prompts, sp, bad, answers = valid_batch(data, req)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(list(paths(answers[bad]))))
        how = data.draw(st.sampled_from(["drop", "replace", "add"]))
        answers[bad] = mutate(answers[bad], path, how, data.draw(junk))
    answering(server, answers)
    try:
        outs = engine.generate(prompts, sp)
    except ExternalEngineError as e:
        names_server(e, server, bad)
    else:
        usable(outs, prompts, sp)
    still_works(engine, server)


def set_tokens(dialect: str, c: dict, ids, lps) -> None:
    """Sets the token ids and logprobs of choice c, in its dialect's fields."""
    if dialect == "sglang":
        c["meta_info"]["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(ids, lps)]
        if len(ids) != len(lps):  # SGLang's triples cannot say it: a logprob without its token id
            c["meta_info"]["output_token_logprobs"].append([-1.0])
    elif dialect == "vllm":
        c["token_ids"], c["logprobs"] = ids, {"token_logprobs": lps}
    else:
        c["generation_token_ids"], c["generation_log_probs"] = ids, lps


@st.composite
def wrong_answers(draw, prompt, sp):
    """(answer, words the error must hold): a valid answer with one field wrong."""
    answer, truth, dialect = draw(valid_answers(prompt, sp))
    choices = answer["choices"]
    c = draw(st.sampled_from(choices))
    ids, lps, _ = truth[c["index"]]
    kind = draw(
        st.sampled_from(
            [
                "no_choices",
                "count",
                "index",
                "id_type",
                "id_range",
                "lp_value",
                "lp_length",
                "finish",
                "echo",
                "too_long",
                "not_a_dict",
            ]
        )
    )
    if kind == "no_choices":
        del answer["choices"]
        return answer, "choices"
    if kind == "count":
        answer["choices"] = draw(st.sampled_from([choices[1:], choices + [choices[0]], []]))
        return answer, "choices"
    if kind == "index":
        c["index"] = draw(st.sampled_from([sp.n, -1, None, "0", True, float(c["index"]), [0]]))
        return answer, "index"
    if kind == "not_a_dict":
        choices[choices.index(c)] = draw(junk.filter(lambda v: not isinstance(v, dict)))
        return answer, "choices"
    if kind == "finish":
        c["finish_reason"] = draw(junk.filter(lambda v: v not in ("stop", "length")))
        return answer, "finish_reason"
    if kind == "echo":
        c["prompt_token_ids"] = draw(st.lists(st.integers(0, V - 1), max_size=5).filter(lambda e: e != prompt))
        return answer, "prompt"
    if kind == "too_long":
        more = sp.max_tokens + 1 - len(ids)
        set_tokens(dialect, c, ids + [1] * more, lps + [-1.0] * more)
        return answer, "max_tokens"
    if kind in ("id_type", "id_range", "lp_value", "lp_length") and not ids:
        ids, lps = [3], [-1.0]
    j = draw(st.integers(0, len(ids) - 1))
    if kind == "id_type":
        ids[j] = draw(st.sampled_from([1.0, "3", None, True, [3]]))
        set_tokens(dialect, c, ids, lps)
        return answer, "token id"
    if kind == "id_range":
        ids[j] = draw(st.integers(V, 2**70) | st.integers(-(2**70), -1))
        set_tokens(dialect, c, ids, lps)
        return answer, "vocabulary"
    if kind == "lp_value":
        lps[j] = draw(
            st.sampled_from([math.nan, math.inf, -math.inf, -1e39, 10**400, -(10**400), 1])
            | st.floats(min_value=LOGPROB_SLACK, exclude_min=True)
            | st.sampled_from([None, "-1", True, [-1.0]])
        )
        set_tokens(dialect, c, ids, lps)
        return answer, re.escape(LP_FIELD[dialect])
    set_tokens(dialect, c, ids, draw(st.sampled_from([lps[1:], lps + [-1.0]])))
    return answer, re.escape(LP_FIELD[dialect]) if dialect != "sglang" else "malformed"


@given(data=st.data(), req=requests_)
@FUZZ
def test_a_wrong_field_is_an_error_naming_server_prompt_and_field(server, engine, data, req):
    prompts, sp, bad, answers = valid_batch(data, req)
    answers[bad], words = data.draw(wrong_answers(prompts[bad], sp))
    answering(server, answers)
    with pytest.raises(ExternalEngineError) as e:
        engine.generate(prompts, sp)
    assert re.search(words, names_server(e.value, server, bad)), (words, str(e.value))


# ---------------------------------------------------------------- HTTP and transport failures
@given(status=st.integers(400, 599), message=st.text(max_size=40), openai=st.booleans(), raw=st.binary(max_size=60))
@FUZZ
def test_http_errors_name_server_status_and_message(server, engine, status, message, openai, raw):
    body = json.dumps({"error": {"message": message, "type": "x", "code": status}}).encode() if openai else raw
    server.requests.clear()
    server.plan = lambda h, _: h.reply(status, body)
    with pytest.raises(ExternalEngineError) as e:
        engine.generate([[1]], SamplingParams(max_tokens=1))
    msg = names_server(e.value, server)
    assert f"HTTP {status}" in msg
    if openai:
        assert json.dumps(message)[1:-1] in msg
    assert len(server.requests) == 1  # not retried


@given(body=st.binary(max_size=80) | st.text(max_size=40).map(str.encode) | junk.map(lambda v: json.dumps(v).encode()))
@FUZZ
def test_a_body_that_is_not_an_answer_is_a_named_error(server, engine, body):
    server.plan = lambda h, _: h.reply(200, body)
    with pytest.raises(ExternalEngineError) as e:
        engine.generate([[1]], SamplingParams(max_tokens=1))
    names_server(e.value, server, None)


def close(h):
    h.close_connection = True


def reset(h):
    h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    h.close_connection = True


def stall(h):
    time.sleep(4 * TIMEOUT)
    h.reply(200, b"{}")


def trickle(h):  # headers at once, then the body one byte per 0.1 s: 3 s in all, each read well within TIMEOUT
    ok = json.dumps({"choices": [make_choice("exactrl", 0, [1], [-0.5], "stop", None)]}).encode()
    h.send_response(200)
    h.send_header("Content-Length", str(len(ok)))
    h.end_headers()
    for b in ok[:30]:
        h.wfile.write(bytes([b]))
        h.wfile.flush()
        time.sleep(0.1)
    h.close_connection = True


@pytest.mark.parametrize(
    "plan, words",
    [
        (close, "the connection to the rollout server at .* broke before an answer"),
        (reset, "the connection to the rollout server at .* broke before an answer"),
        # the server answered, then went away: not "cannot reach ... is it running?" as it first said
        (
            lambda h: h.reply(200, b'{"choices": [', [("Content-Length", "1000")]) or close(h),
            "answered HTTP 200, then the connection broke mid-answer",
        ),
        (lambda h: h.reply(200, b"not gzip at all", [("Content-Encoding", "gzip")]), "decod|gzip"),
        (
            lambda h: h.reply(200, gzip.compress(b"[" * 100_000 + b"]" * 100_000), [("Content-Encoding", "gzip")]),
            "JSON",
        ),
        (lambda h: h.reply(200, b"[" * 100_000 + b"]" * 100_000), "JSON"),
        (lambda h: h.reply(200, b"1" * 5000), "JSON"),
        (stall, "no answer within rollout_backend.timeout_s=1.5s"),
        (trickle, "no answer within rollout_backend.timeout_s=1.5s"),
    ],
)
def test_transport_failures_are_named_errors_and_not_retried(server, engine, plan, words):
    server.requests.clear()
    server.plan = lambda h, _: plan(h)
    with pytest.raises(ExternalEngineError) as e:  # stall, trickle: the whole answer's timeout fired (each
        engine.generate([[1]], SamplingParams(max_tokens=1))  # trickled byte comes within it)
    assert re.search(words, names_server(e.value, server, None)), str(e.value)
    assert len(server.requests) == 1
    still_works(engine, server)


def test_a_refused_connection_is_a_named_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    eng = ExternalEngine(RolloutBackendSettings(kind="openai", base_url=url, model="m", timeout_s=TIMEOUT))
    with pytest.raises(ExternalEngineError, match=f"cannot reach the rollout server at {url}"):
        eng.generate([[1]], SamplingParams(max_tokens=1))
