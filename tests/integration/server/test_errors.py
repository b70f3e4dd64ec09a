"""Every error comes back as OpenAI's error JSON with the right status, through the real client, and the
server keeps serving; a client that disconnects aborts its generation and frees its KV pages."""

from __future__ import annotations

import json
import shutil
import time

import httpx
import openai
import pytest
from serving import model_dir, served

from exactrl.envs.tool_use import CALCULATOR_TOOL

MSGS = [{"role": "user", "content": "hello"}]


def post(path: str, **kw) -> httpx.Response:
    return httpx.post(served().url + path, timeout=60, **kw)


def assert_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"], err["message"]
    return err


def test_malformed_json_and_missing_fields():
    s = served()
    r = post(
        "/v1/chat/completions", content=b'{"model": "x", "messages": [', headers={"content-type": "application/json"}
    )
    assert_error(r, 400, "malformed JSON")
    assert_error(post("/v1/chat/completions", json={"model": s.model}), 400, "missing", "messages")
    assert_error(post("/v1/chat/completions", json={"messages": MSGS}), 400, "model")
    assert_error(post("/v1/completions", json={"model": s.model}), 400, "prompt")
    assert_error(post("/v1/chat/completions", json=[1, 2]), 400)
    assert_error(
        post("/v1/chat/completions", json={"model": s.model, "messages": MSGS, "temperature": "hot"}),
        400,
        "temperature",
    )
    # a tiny temperature would overflow z / T: refused up front, it never reaches (and fails) a shared engine step
    assert_error(
        post("/v1/chat/completions", json={"model": s.model, "messages": MSGS, "temperature": 1e-39}),
        400,
        "temperature",
    )
    with pytest.raises(openai.BadRequestError):
        s.client().chat.completions.create(model=s.model, messages=[])
    with pytest.raises(openai.BadRequestError, match="role"):
        s.client().chat.completions.create(model=s.model, messages=[{"role": "wizard", "content": "x"}])


@pytest.mark.parametrize(
    "body, content_type, words",
    [
        # FastAPI's own answer to these, "There was an error parsing the body", names nothing
        (
            b'{"model": "m\xff", "messages": []}',
            "application/json",
            ["not valid UTF-8", "invalid start byte (byte 12)"],
        ),
        (
            b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            "application/json",
            ["malformed JSON body", "nested too deeply"],
        ),
        (b'{"model": "m", "seed": ' + b"9" * 5000 + b"}", "application/json", ["malformed JSON body", "4300 digits"]),
        # read as bytes, not JSON: it read "must be a JSON object, got b'{...'"
        (
            json.dumps({"model": "m", "messages": MSGS}).encode(),
            "text/plain",
            ["must be JSON sent with Content-Type: application/json, got Content-Type 'text/plain'"],
        ),
        (json.dumps({"model": "m", "messages": MSGS}).encode(), None, ["application/json, got no Content-Type"]),
        # a field name that is not Unicode: it read "must be a JSON object, got '\\ud800'"
        (b'{"model": "m", "messages": [], "\\ud800": 1}', "application/json", ["field name that is not valid Unicode"]),
    ],
)
def test_a_body_that_cannot_be_read_as_json_says_why(body, content_type, words):
    r = post("/v1/chat/completions", content=body, headers={"content-type": content_type} if content_type else {})
    assert assert_error(r, 400, *words)["param"] is None
    assert served().client().chat.completions.create(model=served().model, messages=MSGS, max_tokens=1).choices


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("model", "m" * 100_000, ["The model 'mmmmmmmmmmmm...mmmmmmmmmmmmm' does not exist"]),
        ("repetition_penalty", list(range(100_000)), ["repetition_penalty=[0, 1, 2, 3, 4, 5, ...] is not supported"]),
        ("messages", [{"role": "r" * 100_000, "content": "x"}], ["messages[0].role must be one of"]),
        ("tools", [{"type": "function", "function": {"name": "f " * 50_000}}], ["tools[0].function.name must match"]),
        ("tool_choice", "c" * 100_000, ["tool_choice must be"]),
    ],
)
def test_an_error_quotes_a_long_value_shortened(field, value, words):
    """The message names the value it refuses, shortened: not a copy of the whole (the client's 100 kB again)."""
    r = post("/v1/chat/completions", json={"model": served().model, "messages": MSGS, "max_tokens": 1, field: value})
    err = assert_error(r, 404 if field == "model" else 400, *words)
    assert err["param"] == field and len(err["message"]) < 300, err["message"][:300]


def test_unknown_model_and_route_are_404():
    s = served()
    with pytest.raises(openai.NotFoundError) as e:
        s.client().chat.completions.create(model="gpt-17", messages=MSGS)
    assert e.value.body["code"] == "model_not_found"
    assert_error(httpx.get(s.url + "/v1/nothing-here"), 404)
    assert [m.id for m in s.client().models.list().data] == [s.model]


def test_prompt_too_long():
    s = served()
    long = " ".join(["hello world"] * 300)
    with pytest.raises(openai.BadRequestError) as e:
        s.client().chat.completions.create(model=s.model, messages=[{"role": "user", "content": long}])
    assert e.value.body["code"] == "context_length_exceeded" and "maximum context length is 512" in e.value.message
    assert "KV cache" not in e.value.message  # the model's context is the limit (8192 KV tokens)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        s.client().chat.completions.create(model=s.model, messages=MSGS, max_tokens=600)
    with pytest.raises(openai.BadRequestError, match="context"):
        s.client().completions.create(model=s.model, prompt=[5] * 600)


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=-1),
        dict(temperature=2.5),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(n=0),
        dict(max_tokens=0),
        dict(max_completion_tokens=0),
        dict(extra_body={"top_k": 0}),
        dict(logprobs=True, top_logprobs=21),
        dict(top_logprobs=2),
        dict(presence_penalty=0.5),
        dict(frequency_penalty=1.0),
        dict(logit_bias={"5": 10}),
        dict(stop=["a", "b", "c", "d", "e"]),
        dict(stop=[""]),
        dict(n=1000),
        dict(response_format={"type": "json_object"}),
        dict(stream=True, logprobs=True, top_logprobs=2),
    ],
)
def test_invalid_sampling_values(kw):
    s = served()
    with pytest.raises(openai.BadRequestError):
        s.client().chat.completions.create(model=s.model, messages=MSGS, **kw)


@pytest.mark.parametrize(
    "path, field",
    [
        ("/v1/chat/completions", "top_k"),
        ("/v1/chat/completions", "n"),
        ("/v1/chat/completions", "temperature"),
        ("/v1/chat/completions", "max_tokens"),
        ("/v1/chat/completions", "seed"),
        ("/v1/completions", "logprobs"),
        ("/v1/completions", "top_p"),
    ],
)
def test_true_or_false_is_no_number(path, field):
    """pydantic's lax mode read `top_k: true` as 1 (greedy) and `n: true` as 1: a 400 naming the field."""
    s = served()
    body = {"model": s.model, "max_tokens": 2, field: True}
    body.update({"messages": MSGS} if "chat" in path else {"prompt": "hello"})
    err = assert_error(post(path, json=body), 400, f"invalid {field}: must be a number, not true; got True")
    assert err["param"] == field
    assert post(path, json={**body, field: 1}).status_code == 200  # the server keeps serving


def test_structured_output_is_refused_on_both_endpoints():
    """response_format json_object / json_schema would need constrained decoding: a 400 naming it, on
    /v1/completions too (not accepted there and ignored), while type text is fine."""
    s = served()
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}):
        with pytest.raises(openai.BadRequestError) as e:
            s.client().completions.create(
                model=s.model, prompt=[1, 2, 3], max_tokens=2, extra_body={"response_format": fmt}
            )
        assert e.value.body["param"] == "response_format"
    s.client().completions.create(
        model=s.model, prompt=[1, 2, 3], max_tokens=2, extra_body={"response_format": {"type": "text"}}
    )
    s.client().chat.completions.create(model=s.model, messages=MSGS, max_tokens=2, response_format={"type": "text"})


@pytest.mark.parametrize(
    "tools, tool_choice",
    [
        ([{"type": "function", "function": {"name": "no spaces allowed"}}], None),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None),
        ([{"type": "code_interpreter"}], None),
        ([CALCULATOR_TOOL, CALCULATOR_TOOL], None),
        ([CALCULATOR_TOOL], "required"),
        ([CALCULATOR_TOOL], {"type": "function", "function": {"name": "calculator"}}),
        (None, "auto"),
    ],
)
def test_invalid_tools(tools, tool_choice):
    s = served()
    kw = {"tools": tools} if tools is not None else {}
    if tool_choice is not None:
        kw["tool_choice"] = tool_choice
    with pytest.raises(openai.BadRequestError) as e:
        s.client().chat.completions.create(model=s.model, messages=MSGS, **kw)
    assert e.value.body["param"] in ("tools", "tool_choice")


def _nested(levels: int) -> dict:
    d = {}
    for _ in range(levels):
        d = {"a": d}
    return d


@pytest.mark.parametrize(
    "where, kw",
    [
        (
            "tools",
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "properties": _nested(600)}},
                    }
                ]
            },
        ),
        (
            "messages",
            {
                "messages": MSGS
                + [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "type": "function",
                                "id": "c1",
                                "function": {"name": "f", "arguments": "[" * 100_000 + "]" * 100_000},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "1"},
                ]
            },
        ),
        (
            "messages",
            {
                "messages": MSGS
                + [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"type": "function", "id": "c1", "function": {"name": "f", "arguments": _nested(600)}}
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "1"},
                ]
            },
        ),
    ],
)
def test_deeply_nested_tool_json_is_a_400_naming_the_field(where, kw):
    """The template renders tool schemas and arguments recursively: a few hundred levels are a 400 naming
    the field, not a 500 (RecursionError) with thousands of lines of traceback in the log."""
    s = served()
    r = httpx.post(
        f"{s.url}/v1/chat/completions", timeout=60, json={"model": s.model, "messages": MSGS, "max_tokens": 2} | kw
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == where and "nested deeper than 64 levels" in r.json()["error"]["message"]
    assert s.client().chat.completions.create(model=s.model, messages=MSGS, max_tokens=2).choices


def test_token_fields_and_monotonicity_policies():
    s = served()
    client = s.client()
    r = client.chat.completions.create(model=s.model, messages=MSGS, max_tokens=6, seed=0)
    msg = r.choices[0].message.model_dump(exclude_none=True)
    follow = {"role": "user", "content": "more"}
    partial = {k: v for k, v in msg.items() if k != "generation_log_probs"}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=s.model, messages=MSGS + [partial, follow])
    assert e.value.body["code"] == "inconsistent_token_fields"
    edited = [{"role": "user", "content": "hellO"}, msg, follow]  # history changed under the tokens
    before = httpx.get(s.url + "/metrics").json()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=s.model, messages=edited, max_tokens=4)
    assert e.value.body["code"] == "non_monotonic_history" and "first differing token at position" in e.value.message
    split = client.chat.completions.create(
        model=s.model, messages=edited, max_tokens=4, extra_body={"monotonicity": "split"}
    )
    assert split.choices[0].message.prompt_token_ids == s.tokenizer.apply_chat_template(
        [edited[0], {"role": "assistant", "content": msg["content"]}, follow]
    )
    client.chat.completions.create(
        model=s.model, messages=edited, max_tokens=4, extra_body={"monotonicity": "truncate"}
    )
    after = httpx.get(s.url + "/metrics").json()
    for k in ("raise", "split", "truncate"):
        assert after[f"chat/monotonicity_{k}"] == before[f"chat/monotonicity_{k}"] + 1
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=s.model, messages=edited, extra_body={"monotonicity": "sometimes"})


def test_completions_bad_prompts():
    s = served()
    for prompt in ([], [[]], [10**6], ""):
        with pytest.raises(openai.BadRequestError):
            s.client().completions.create(model=s.model, prompt=prompt, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="suffix"):
        s.client().completions.create(model=s.model, prompt="hi", suffix="x")
    # in a list, the message names the prompt it is about
    for prompt, kw, needle in (
        (["hi", ""], {}, "prompt[1] must be non-empty"),
        ([[5, 6], [5, 10**6]], {}, "prompt[1] holds token id 1000000 outside"),
        (["a", "hi\ud800"], {}, "prompt[1]: "),
        ([[5, 6], [5] * 9000], {}, "prompt[1]: This model's maximum context length is"),
        ([5] * 9000, {}, "This model's maximum context length is"),
    ):
        body = json.dumps({"model": s.model, "prompt": prompt, "max_tokens": 2} | kw)  # "\ud800" escaped
        r = post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert assert_error(r, 400)["message"].startswith(needle), (needle, r.text)


def test_update_weights_from_a_damaged_directory_is_400_and_the_server_keeps_serving(tmp_path):
    s = served()
    version = s.state.engine.version
    bad = {name: shutil.copytree(model_dir(), tmp_path / name) for name in ("nokey", "trunc", "nojson")}
    (bad["nokey"] / "config.json").write_text('{"model_type": "qwen3", "vocab_size": 512}')
    (bad["trunc"] / "model.safetensors").write_bytes((bad["trunc"] / "model.safetensors").read_bytes()[:100])
    (bad["nojson"] / "config.json").write_text("{")
    for name, words in [
        ("nokey", ["config.json is missing 'hidden_size'"]),
        ("trunc", [f"{bad['trunc'] / 'model.safetensors'} is not a valid safetensors file"]),
        ("nojson", [f"{bad['nojson'] / 'config.json'} is not valid JSON"]),
    ]:
        err = assert_error(post("/update_weights_from_disk", json={"model_path": str(bad[name])}), 400, *words)
        assert err["param"] == "model_path"
    assert s.state.engine.version == version
    r = s.client().chat.completions.create(model=s.model, messages=MSGS, max_tokens=2)
    assert r.choices[0].message.generation_token_ids  # still serving


def _wait_idle(url: str, timeout: float = 20.0) -> dict:
    t0 = time.time()
    while True:
        m = httpx.get(url + "/metrics").json()
        if m["engine/unfinished_requests"] == 0 and m["engine/kv_pages_free"] == m["engine/kv_pages_total"]:
            return m
        assert time.time() - t0 < timeout, m
        time.sleep(0.02)


def _long_request(stream: bool) -> dict:
    return {
        "model": served().model,
        "messages": MSGS,
        "max_tokens": 480,
        "n": 8,
        "ignore_eos": True,
        "seed": 1,
        "stream": stream,
    }


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_stream_its_client_left_is_aborted_without_the_garbage_collector(path):
    """The stream's generation is aborted when the response ends, not when Python's cycle collector happens
    to finalize the abandoned body (until then the engine would decode on for nobody, holding its pages)."""
    import gc

    s = served()
    body = _long_request(True)
    if "chat" not in path:
        body = {k: v for k, v in body.items() if k != "messages"} | {"prompt": "hello"}
    before = _wait_idle(s.url)
    gc.disable()
    try:
        with httpx.stream("POST", s.url + path, json=body, timeout=60) as r:
            lines = r.iter_lines()
            for _ in range(6):  # a few chunks, then hang up
                next(lines)
        after = _wait_idle(s.url)
    finally:
        gc.enable()
    assert after["engine/aborted"] == before["engine/aborted"] + 1
    assert after.get("server/generation_tokens", 0) == before.get("server/generation_tokens", 0)


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_generation(stream, monkeypatch):
    s = served()
    before = _wait_idle(s.url)
    # each engine step a little slower, so the request outlasts the client's patience on any machine: on a
    # fast CPU 16 x 480 tokens can finish before the hang-up is seen
    engine, step = s.state.loop.engine, s.state.loop.engine.step
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(0.002), step())[1])
    if stream:
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=_long_request(True), timeout=60) as r:
            lines = r.iter_lines()
            for _ in range(6):  # a few chunks, then hang up
                next(lines)
    else:
        # 16 x 480 tokens: at least 480 steps of 2 ms, 4x the client's patience
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + "/v1/chat/completions", json=_long_request(False) | {"n": 16}, timeout=0.25)
    after = _wait_idle(s.url)
    assert after["engine/aborted"] == before["engine/aborted"] + 1
    assert after["server/client_disconnects"] == before.get("server/client_disconnects", 0) + 1
    generated = after.get("server/generation_tokens", 0) - before.get("server/generation_tokens", 0)
    assert generated == 0  # nothing was completed (8 or 16 x 480 tokens would have been)
    # the server is still up and serving
    r = s.client().chat.completions.create(model=s.model, messages=MSGS, max_tokens=3)
    assert r.choices[0].message.generation_token_ids


def test_top_logprobs_are_not_scored_under_weights_that_sampled_nothing():
    """Weights updated between sampling and scoring (an agent trainer's sync): the alternatives would come from
    another distribution than the sampled token, so the request gets a 409 naming both versions."""
    from types import SimpleNamespace

    from exactrl.server.generation import score_top_logprobs
    from exactrl.server.schemas import APIError

    with pytest.raises(APIError, match=r"changed between sampling \(version 0\) and scoring .* \(version 1\)") as e:
        score_top_logprobs(SimpleNamespace(version=1), [1, 2, 3], 2, None, 3, versions=[0, 0])
    assert e.value.status == 409 and e.value.code == "weights_changed"


def test_a_failed_prompt_of_a_list_aborts_its_siblings():
    """One prompt of a /v1/completions list fails (non-finite logits in its request alone): the error goes
    back, and the other prompts' generations are aborted with it, not left decoding for nobody."""
    from exactrl.engine import NonFiniteLogitsError

    s = served()
    eng, poison = s.state.engine, [7, 7, 7]
    step = eng.step

    def poisoned_step():
        for rid, req in list(eng._requests.items()):
            if list(req.prompt) == poison:
                eng.abort(rid)
                raise NonFiniteLogitsError([rid])
        return step()

    before = _wait_idle(s.url)
    eng.step = poisoned_step
    try:
        r = post(
            "/v1/completions",
            json={"model": s.model, "prompt": [[5, 6, 8], poison], "max_tokens": 480, "n": 4, "ignore_eos": True},
        )
        assert r.status_code == 500, r.text
        after = _wait_idle(s.url)
    finally:
        eng.step = step
    assert after["engine/aborted"] == before["engine/aborted"] + 1  # the sibling, not left to run its 4 x 480
