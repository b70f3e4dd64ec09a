"""Requests that could take the server down, fail other clients' requests or lose exact tokens: each is
refused up front with a 400 naming its field, or served as asked; streams end with an error event and [DONE]."""

from __future__ import annotations

import contextlib
import json
import shutil
import threading

import httpx
import pytest
from conftest import make_hf_model
from serving import check_turns, model_dir, served

from exactrl.engine import SamplingParams
from exactrl.server.app import ServerThread, build_state, create_app

MSGS = [{"role": "user", "content": "hello"}]


def post(path: str, url: str | None = None, **kw) -> httpx.Response:
    return httpx.post((url or served().url) + path, timeout=60, **kw)


def error_of(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def chat(**kw) -> dict:
    return {"model": served().model, "messages": MSGS} | kw


def events(r: httpx.Response) -> list:
    """The SSE payloads of a stream: dicts, and the string "[DONE]"."""
    out = []
    for line in r.iter_lines():
        if line.startswith("data: "):
            out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return out


# ---------------------------------------------------------------- 1. n
@pytest.mark.parametrize("n", [10**30, 2**63, 65, 1000])
@pytest.mark.parametrize("stream", [False, True])
def test_n_beyond_the_engine_is_400_naming_n_before_anything_is_built(n, stream):
    s = served()  # a request for 10**30 samples once grew the server to 24 GB before the engine refused it
    err = error_of(post("/v1/chat/completions", json=chat(n=n, max_tokens=1, stream=stream)))
    assert err["param"] == "n" and "max_num_seqs" in err["message"]
    err = error_of(
        post("/v1/completions", json={"model": s.model, "prompt": "hi", "n": n, "max_tokens": 1, "stream": stream})
    )
    assert err["param"] == "n"


# ---------------------------------------------------------------- 2. top_k and the shared engine step
@pytest.mark.parametrize("top_k", [10**30, 2**63, 2**63 - 1, 513])
def test_top_k_beyond_the_vocabulary_is_400_naming_top_k(top_k):
    s = served()
    err = error_of(post("/v1/chat/completions", json=chat(top_k=top_k, max_tokens=1)))
    assert err["param"] == "top_k" and "512" in err["message"]
    err = error_of(post("/v1/completions", json={"model": s.model, "prompt": "hi", "top_k": top_k, "max_tokens": 1}))
    assert err["param"] == "top_k"


def test_top_k_equal_to_the_vocabulary_is_accepted():
    r = post("/v1/chat/completions", json=chat(top_k=512, max_tokens=2))
    assert r.status_code == 200, r.text


def test_sampling_params_refuse_values_that_cannot_reach_the_step():
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=2**63)
    for seed in (2**63, -(2**63) - 1, 2**64):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=seed)
    SamplingParams(top_k=2**63 - 1, seed=-(2**63))
    SamplingParams(seed=2**63 - 1)


def test_a_bad_request_does_not_fail_requests_in_flight(monkeypatch):
    """The victim is held inside the engine's step while the bad request comes, so it is surely in flight
    (a bad value that reached the shared step would fail it once the step runs)."""
    with held_in_engine(monkeypatch, "/v1/chat/completions", chat(max_tokens=200, ignore_eos=True, seed=5)) as got:
        bad = post("/v1/chat/completions", json=chat(max_tokens=2, top_k=10**30))
    victim = got["r"]
    assert error_of(bad)["param"] == "top_k"
    assert victim.status_code == 200, victim.text
    assert len(victim.json()["choices"][0]["message"]["generation_token_ids"]) == 200


# ---------------------------------------------------------------- 3. model vocabulary > tokenizer vocabulary
@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """A server whose model has 600 rows for the tokenizer's 512 ids (as Qwen's checkpoints pad theirs)."""
    d = tmp_path_factory.mktemp("padded-vocab")
    for f in model_dir().iterdir():
        if "token" in f.name or f.name.endswith(".jinja") or f.name == "vocab.json" or f.name == "merges.txt":
            shutil.copy(f, d / f.name)
    tok = served().tokenizer
    make_hf_model(d, "qwen3", seed=1, vocab_size=600, eos_token_id=tok.end_of_turn_id, pad_token_id=tok.pad_token_id)
    state = build_state(str(d), kv_budget_tokens=4096)
    thread = ServerThread(create_app(state)).start()
    yield thread.url, state
    thread.stop()


def test_padded_vocabulary_ids_are_served_and_accepted_back(padded):
    url, state = padded
    r = post(
        "/v1/chat/completions",
        url,
        json={
            "model": state.config.model_name,
            "messages": MSGS,
            "n": 8,
            "max_tokens": 16,
            "seed": 0,
            "logprobs": True,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text
    choice = next(c for c in r.json()["choices"] if max(c["message"]["generation_token_ids"]) >= 512)
    msg = choice["message"]
    for t, entry in zip(msg["generation_token_ids"], choice["logprobs"]["content"]):
        if t >= 512:
            assert entry["bytes"] == [] and entry["token"] == ""
    follow = [MSGS[0], msg, {"role": "user", "content": "more"}]
    r2 = post("/v1/chat/completions", url, json={"model": state.config.model_name, "messages": follow, "max_tokens": 2})
    assert r2.status_code == 200, r2.text
    hist = msg["prompt_token_ids"] + msg["generation_token_ids"]
    assert r2.json()["choices"][0]["message"]["prompt_token_ids"][: len(hist)] == hist
    r3 = post(
        "/v1/completions",
        url,
        json={"model": state.config.model_name, "prompt": [5, 590, 599], "max_tokens": 2, "logprobs": 2, "echo": True},
    )
    assert r3.status_code == 200, r3.text
    assert (
        error_of(
            post("/v1/completions", url, json={"model": state.config.model_name, "prompt": [600], "max_tokens": 2})
        )["param"]
        == "prompt"
    )


# ---------------------------------------------------------------- 4. prompt building off the event loop
def test_prompt_is_built_off_the_event_loop(monkeypatch):
    s = served()
    threads = []
    build = s.state.splicer.build

    def spy(*a, **kw):
        threads.append(threading.current_thread().name)
        return build(*a, **kw)

    monkeypatch.setattr(s.state.splicer, "build", spy)
    assert post("/v1/chat/completions", json=chat(max_tokens=1)).status_code == 200
    assert threads and threads[0] != "exactrl-http"


def test_a_conversation_beyond_the_context_is_refused_before_its_history_is_checked():
    bogus = {
        "role": "assistant",
        "content": "x",
        "prompt_token_ids": [5],
        "generation_token_ids": [6],
        "generation_log_probs": [-1.0],
    }
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}] * 200 + [bogus, MSGS[0]]
    err = error_of(post("/v1/chat/completions", json=chat(messages=msgs, max_tokens=1)))
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"


# ---------------------------------------------------------------- 5. errors inside a stream
@pytest.fixture
def failing_step(monkeypatch):
    """The engine's next step raises (as a kernel bug would); later steps run normally."""
    engine = served().state.engine
    real = engine.step

    def step():
        monkeypatch.setattr(engine, "step", real)
        raise RuntimeError("injected step failure")

    def arm():
        monkeypatch.setattr(engine, "step", step)

    return arm


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_engine_failure_in_a_stream_is_an_error_event_then_done(path, failing_step):
    s = served()
    body = (
        chat(max_tokens=8, stream=True)
        if "chat" in path
        else {"model": s.model, "prompt": "hello", "max_tokens": 8, "stream": True}
    )
    before = httpx.get(s.url + "/metrics").json()
    failing_step()
    with httpx.stream("POST", s.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        got = events(r)
    assert got[-1] == "[DONE]"
    err = got[-2]["error"]
    assert "injected step failure" in err["message"] and err["type"] == "internal_error"
    after = httpx.get(s.url + "/metrics").json()
    assert after.get("server/client_disconnects", 0) == before.get("server/client_disconnects", 0)
    assert after["server/errors_500"] == before.get("server/errors_500", 0) + 1
    assert post(path, json=body | {"stream": False}).status_code == 200  # still serving


def test_an_internal_error_is_a_500_and_the_connection_stays_usable(monkeypatch):
    """Starlette's handler for Exception raised the error again after its 500, and the server then closed the
    connection: the client's next request on it failed with a reset."""
    s = served()
    real = s.state.metrics

    def broken():
        monkeypatch.setattr(s.state, "metrics", real)
        raise RuntimeError("injected metrics failure")

    monkeypatch.setattr(s.state, "metrics", broken)
    with httpx.Client(base_url=s.url, timeout=60) as client:
        r = client.get("/metrics")
        assert r.status_code == 500 and "injected metrics failure" in r.json()["error"]["message"]
        assert client.post("/v1/chat/completions", json=chat(max_tokens=1)).status_code == 200  # same connection


def test_weights_from_disk_must_be_finite(tmp_path):
    """NaN weights loaded by /update_weights_from_disk would fail every later request: a 400 names the weight,
    and the served weights stay."""
    from safetensors.torch import load_file, save_file
    from serving import model_dir

    d = shutil.copytree(model_dir(), tmp_path / "m")
    w = load_file(d / "model.safetensors")
    name = sorted(w)[0]
    w[name][0] = float("nan")
    save_file(w, d / "model.safetensors", metadata={"format": "pt"})
    version = served().state.engine.version
    err = error_of(post("/update_weights_from_disk", json={"model_path": str(d)}))
    assert f"weight {name} holds NaN or infinite values" in err["message"] and err["param"] == "model_path"
    assert served().state.engine.version == version
    assert post("/v1/chat/completions", json=chat(max_tokens=2)).status_code == 200


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_text_that_is_not_unicode_is_a_400(path):
    """A lone surrogate ("\\ud800" in the JSON) cannot be tokenized: a 400 naming it, not a 500."""
    body = f'{{"model": "{served().model}", "max_tokens": 1, ' + (
        '"messages": [{"role": "user", "content": "\\ud800 x"}]}' if "chat" in path else '"prompt": "\\ud800 x"}'
    )
    err = error_of(post(path, content=body, headers={"content-type": "application/json"}))
    assert "lone surrogate" in err["message"] and err["param"] in ("messages", "prompt")


# ---------------------------------------------------------------- 6. ignore_eos generations in multi-turn chat
@pytest.mark.parametrize("policy", ["raise", "split", "truncate"])
def test_generation_holding_end_of_turn_tokens_splices_exactly(policy):
    s = served()
    tok = s.tokenizer
    client = s.client()
    r = client.chat.completions.create(
        model=s.model, messages=MSGS, max_tokens=200, n=16, seed=3, extra_body={"ignore_eos": True}
    )
    pick = next(c.message for c in r.choices if tok.end_of_turn_id in c.message.generation_token_ids[:-1])
    msg = pick.model_dump(exclude_none=True)
    follow = [MSGS[0], msg, {"role": "user", "content": "more"}]
    r2 = client.chat.completions.create(
        model=s.model, messages=follow, max_tokens=3, seed=0, extra_body={"monotonicity": policy}
    )
    assert r2.choices[0].message.prompt_token_ids[: len(pick.prompt_token_ids) + 200] == (
        pick.prompt_token_ids + pick.generation_token_ids
    )
    check_turns(tok, [pick, r2.choices[0].message])


# ---------------------------------------------------------------- 7. /v1/completions streaming options
def test_completion_stream_echo_and_usage_match_the_json_answer():
    s = served()
    body = {"model": s.model, "prompt": ["hello world", "the quick"], "max_tokens": 5, "seed": 0, "echo": True, "n": 2}
    js = post("/v1/completions", json=body).json()
    with httpx.stream(
        "POST",
        s.url + "/v1/completions",
        timeout=60,
        json=body | {"stream": True, "stream_options": {"include_usage": True}},
    ) as r:
        got = events(r)
    assert got[-1] == "[DONE]" and got[-2]["choices"] == [] and got[-2]["usage"] == js["usage"]
    texts = {}
    for e in got[:-2]:
        assert "usage" not in e
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {c["index"]: c["text"] for c in js["choices"]}
    assert all(t.startswith(p) for t, p in zip(texts.values(), ["hello world"] * 2 + ["the quick"] * 2))
    with httpx.stream("POST", s.url + "/v1/completions", timeout=60, json=body | {"stream": True}) as r:
        assert all("usage" not in e for e in events(r) if e != "[DONE]")


# ---------------------------------------------------------------- 8. extras that change the distribution
@pytest.mark.parametrize(
    "field, value",
    [
        ("repetition_penalty", 2.0),
        ("min_p", 0.9),
        ("min_tokens", 50),
        ("allowed_token_ids", [5]),
        ("bad_words", ["x"]),
        ("guided_json", {"type": "object"}),
        ("guided_regex", "a+"),
        ("use_beam_search", True),
        ("structured_outputs", {"json": {}}),
        ("typical_p", 0.5),
        ("min_p", True),
        ("best_of", 3),  # chat ignored it: plain samples answered to a client that asked for the best of 3
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_distribution_changing_extras_are_400_naming_the_field(field, value, path):
    s = served()
    body = chat(max_tokens=1) if "chat" in path else {"model": s.model, "prompt": "hi", "max_tokens": 1}
    err = error_of(post(path, json=body | {field: value}))
    assert err["param"] == field and field in err["message"]


def test_neutral_extras_are_accepted():
    r = post(
        "/v1/chat/completions",
        json=chat(
            max_tokens=1,
            repetition_penalty=1.0,
            min_p=0,
            min_tokens=0,
            allowed_token_ids=None,
            bad_words=[],
            use_beam_search=False,
            best_of=1,
        ),
    )
    assert r.status_code == 200, r.text
    r = post("/v1/chat/completions", json=chat(max_tokens=1, n=2, best_of=2))
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text


# ---------------------------------------------------------------- 9. seeds, messages, bools
def test_distinct_seeds_draw_distinct_samples_and_out_of_range_seeds_are_400():
    def tokens(seed):
        r = post("/v1/chat/completions", json=chat(max_tokens=12, seed=seed, ignore_eos=True))
        return r.json()["choices"][0]["message"]["generation_token_ids"]

    assert tokens(-(2**63)) != tokens(0)
    assert tokens(2**63 - 1) != tokens(-1)
    assert tokens(-(2**63)) == tokens(-(2**63))
    for seed in (2**63, 2**64 - 1, -(2**63) - 1):
        assert error_of(post("/v1/chat/completions", json=chat(max_tokens=1, seed=seed)))["param"] == "seed"


@pytest.mark.parametrize(
    "body, param, words",
    [
        (None, None, ["body is empty"]),
        ({"prompt": [1, "x"]}, "prompt", ["prompt must be one of", "[1, 'x']"]),
        ({"prompt": [True, False]}, "prompt", ["prompt must be one of"]),
        ({"prompt": [[1, True]]}, "prompt", ["prompt"]),
        ({"prompt": "hi", "n": "two"}, "n", ["invalid n", "two"]),
        ({"prompt": "hi", "temperature": 1e-6}, "temperature", ["temperature"]),
        ({"prompt": "hi", "n": 100}, "n", ["n must be"]),
        ({"prompt": "hi", "stop_token_ids": [True]}, "stop_token_ids", ["stop_token_ids"]),
        ({"prompt": "hi", "stop_token_ids": [512]}, "stop_token_ids", ["stop_token_ids"]),
    ],
)
def test_error_messages_name_the_field(body, param, words):
    s = served()
    r = (
        post("/v1/completions", content=b"", headers={"content-type": "application/json"})
        if body is None
        else post("/v1/completions", json={"model": s.model, "max_tokens": 1} | body)
    )
    err = error_of(r)
    assert err["param"] == param
    for w in words:
        assert w in err["message"], err["message"]


def test_null_takes_the_default_as_openai_allows():
    s = served()
    nulls = {"n": None, "stream": None, "ignore_eos": None, "temperature": None, "seed": None}
    r = post("/v1/completions", json={"model": s.model, "prompt": "hi", "max_tokens": 2, "echo": None} | nulls)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    r = post("/v1/chat/completions", json=chat(max_tokens=2, logprobs=None, **nulls))
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text


def test_a_completions_request_of_too_many_sequences_is_refused():
    from exactrl.server.schemas import MAX_SEQUENCES

    s = served()
    r = post(
        "/v1/completions", json={"model": s.model, "prompt": [[5]] * (MAX_SEQUENCES // 4 + 1), "n": 4, "max_tokens": 1}
    )
    assert "sequences in one request" in error_of(r)["message"] and error_of(r)["param"] == "prompt"


def test_streamed_completions_refuse_logprobs_rather_than_drop_them():
    s = served()
    err = error_of(
        post("/v1/completions", json={"model": s.model, "prompt": "hi", "max_tokens": 2, "stream": True, "logprobs": 0})
    )
    assert err["param"] == "logprobs" and "generation_log_probs" in err["message"]


def test_context_errors_name_the_field_the_client_sent():
    s = served()
    long = {"model": s.model, "prompt": [5] * 600}
    assert error_of(post("/v1/completions", json=long | {"max_tokens": 1}))["param"] == "prompt"
    err = error_of(post("/v1/chat/completions", json=chat(max_completion_tokens=100000)))
    assert err["param"] == "max_completion_tokens" and "max_completion_tokens is 100000" in err["message"]
    # no max_tokens sent: OpenAI's default of 16 shrinks to the room the prompt leaves
    r = post("/v1/completions", json={"model": s.model, "prompt": [5] * 500, "ignore_eos": True})
    assert r.status_code == 200 and len(r.json()["choices"][0]["generation_token_ids"]) == 12, r.text


def test_tool_choice_of_the_wrong_type_names_tool_choice():
    err = error_of(post("/v1/chat/completions", json=chat(tool_choice=5)))
    assert err["param"] == "tool_choice" and "tool_choice" in err["message"]


# ---------------------------------------------------------------- 8. sessions deleted while a request runs
@contextlib.contextmanager
def held_in_engine(monkeypatch, path: str, body: dict):
    """POSTs `body` to `path` on a thread; the engine holds its first step until the block ends. Yields
    a dict that holds the response as "r" after the block."""
    engine, real = served().state.engine, served().state.engine.step
    stepping, release = threading.Event(), threading.Event()

    def held_step():
        stepping.set()
        release.wait(30)
        return real()

    monkeypatch.setattr(engine, "step", held_step)
    got: dict = {}
    thread = threading.Thread(target=lambda: got.update(r=post(path, json=body)))
    thread.start()
    try:
        assert stepping.wait(30), "the request never reached the engine"
        yield got
    finally:
        release.set()
        thread.join(60)
        monkeypatch.setattr(engine, "step", real)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_session_deleted_during_a_request_stays_deleted(path, stream, monkeypatch):
    """The request records into the session it started in: DELETE drops that record too, and a new
    session under the same id starts empty (the late record does not bring the deleted session back)."""
    s = served()
    sid = f"del-{stream}-{path.rsplit('/', 1)[-1]}"
    body = (
        chat(max_tokens=4, stream=stream)
        if "chat" in path
        else {"model": s.model, "prompt": "hello", "max_tokens": 4, "stream": stream}
    )
    with held_in_engine(monkeypatch, f"/sessions/{sid}" + path, body) as got:
        deleted = httpx.delete(f"{s.url}/sessions/{sid}").json()["deleted"]
    assert deleted  # the session exists from its first request's start
    assert got["r"].status_code == 200 and ("[DONE]" in got["r"].text if stream else got["r"].json()["choices"])
    assert httpx.get(f"{s.url}/sessions/{sid}/trajectories").status_code == 404
    assert post(f"/sessions/{sid}" + path, json=body).status_code == 200  # the id starts a fresh session
    assert len(httpx.get(f"{s.url}/sessions/{sid}/trajectories").json()["trajectories"]) == 1


# ---------------------------------------------------------------- 9. idle sessions expire, busy ones stay
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_idle_sessions_are_dropped_and_sessions_in_use_are_kept(path, stream, monkeypatch):
    """A session no request used for --session-ttl seconds is dropped (a crashed trainer never deletes
    its own); one with a request running is kept however long it runs, and keeps that request's record."""
    s = served()
    monkeypatch.setattr(s.state.config, "session_ttl_s", 100.0)
    tag = f"{stream}-{path.rsplit('/', 1)[-1]}"
    idle, busy = f"idle-{tag}", f"busy-{tag}"
    body = (
        chat(max_tokens=4, stream=stream)
        if "chat" in path
        else {"model": s.model, "prompt": "hello", "max_tokens": 4, "stream": stream}
    )
    assert post(f"/sessions/{idle}" + path, json=body).status_code == 200
    assert s.state.sessions[idle].busy == 0  # the finished request gave it back
    s.state.sessions[idle].last_used -= 1000  # as if unused for 1000 s
    s.state._next_sweep = 0.0
    before = s.state.counters["server/sessions_expired"]
    with held_in_engine(monkeypatch, f"/sessions/{busy}" + path, body) as got:
        s.state.sessions[busy].last_used -= 1000  # its request has been running for 1000 s
        s.state._next_sweep = 0.0  # sweeps are at most every ttl/100 s: let this one look now
        metrics = httpx.get(f"{s.url}/metrics").json()  # a sweep
    assert metrics["server/sessions_expired"] == before + 1
    assert idle not in s.state.sessions and busy in s.state.sessions
    err = error_of(httpx.get(f"{s.url}/sessions/{idle}/trajectories"), 404)
    assert "was dropped after 100 s without a request: --session-ttl" in err["message"]
    assert got["r"].status_code == 200 and s.state.sessions[busy].busy == 0
    assert len(httpx.get(f"{s.url}/sessions/{busy}/trajectories").json()["trajectories"]) == 1
    httpx.delete(f"{s.url}/sessions/{busy}")


def test_sessions_never_expire_with_ttl_0(monkeypatch):
    s = served()
    monkeypatch.setattr(s.state.config, "session_ttl_s", 0.0)
    assert (
        post("/sessions/kept/v1/completions", json={"model": s.model, "prompt": "hi", "max_tokens": 2}).status_code
        == 200
    )
    s.state.sessions["kept"].last_used -= 10**9
    httpx.get(f"{s.url}/metrics")
    assert httpx.get(f"{s.url}/sessions/kept/trajectories").status_code == 200
    httpx.delete(f"{s.url}/sessions/kept")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_stream_its_client_left_gives_its_session_back(path):
    s = served()
    sid = f"left-{path.rsplit('/', 1)[-1]}"
    body = {"model": s.model, "max_tokens": 64, "stream": True, "ignore_eos": True} | (
        {"messages": MSGS} if "chat" in path else {"prompt": "hello"}
    )
    with httpx.stream("POST", f"{s.url}/sessions/{sid}" + path, json=body, timeout=60) as r:
        next(r.iter_lines())  # the first event, then the client goes
    for _ in range(200):
        if s.state.sessions[sid].busy == 0:
            break
        threading.Event().wait(0.05)
    assert s.state.sessions[sid].busy == 0
    httpx.delete(f"{s.url}/sessions/{sid}")


def test_a_negative_session_ttl_is_refused_by_name():
    from exactrl.cli import build_parser
    from exactrl.server.app import ServerConfig

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--session-ttl", "-1"])
    for bad in (-1, 10**400, "5", None):  # "5" (text) would fail each session sweep as an HTTP 500
        with pytest.raises(ValueError, match="session_ttl_s"):
            ServerConfig("m", session_ttl_s=bad)


# ---------------------------------------------------------------- 10. streamed text around stop strings
def test_a_streamed_delta_never_sends_the_start_of_a_stop_string_before_a_split_character():
    """'x😀' as a stop string, the emoji's 4 bytes split over tokens: while the text ends in an incomplete
    character, the held-back characters are counted before it, so 'x' is not streamed."""
    from types import SimpleNamespace as NS

    from exactrl.server.app import _BYTE_OF
    from exactrl.server.generation import Generation

    tok = served().state.tokenizer
    char_of = {b: c for c, b in _BYTE_OF.items()}
    ids = [tok.hf.convert_tokens_to_ids(char_of[b]) for b in b"ab" + b"x" + "😀".encode() + b"yz"]
    g = Generation(NS(tokenizer=tok, loop=None), [1], SamplingParams(max_tokens=100), ["x😀"], track_text=True)
    c, sent = g.choices[0], ""
    for k in range(1, len(ids) + 1):
        g._advance(
            c,
            NS(
                token_ids=ids[:k],
                logprobs=[0.0] * k,
                versions=[0] * k,
                finish_reason=None if k < len(ids) else "length",
            ),
        )
        sent += c.text_delta(g.hold)
        if c.done:
            break
    assert c.stop_string and c.text == "ab" and sent == "ab"


# ---------------------------------------------------------------- 11. logprob bytes of both tokenizer kinds
def test_logprob_bytes_of_a_sentencepiece_byte_fallback_tokenizer():
    """Llama-2/Mistral style pieces: <0x0A> is the byte 10 and '▁' a space (they read as byte-level BPE
    characters before); the byte-level tokenizer keeps its own mapping."""
    from types import SimpleNamespace as NS

    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from exactrl.model.tokenizer import Tokenizer as Tok
    from exactrl.server.app import ServerState

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    vocab |= {"\u2581hello": len(vocab), "hello": len(vocab) + 1}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    t.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    st = NS(tokenizer=NS(hf=hf, decode=hf.decode), _token_str={}, _token_bytes={})
    st.token_str = lambda i: ServerState.token_str(st, i)
    st.tokenizer.byte_level = Tok.byte_level.func(st.tokenizer)
    assert not st.tokenizer.byte_level
    assert ServerState.token_bytes(st, vocab["<0x0A>"]) == [10]
    assert ServerState.token_bytes(st, vocab["<0xC3>"]) == [0xC3]
    assert ServerState.token_bytes(st, vocab["\u2581hello"]) == list(b" hello")
    s = served().state
    assert s.tokenizer.byte_level and s.token_bytes(s.tokenizer.encode("\n")[0]) == [10]


def test_a_sentencepiece_generation_keeps_its_leading_space():
    """Llama-2/Mistral's decoder strips the first space of every decode: " Paris." decoded alone read
    "Paris.", so echo gave "The capital isParis." and the stop string " Paris" never matched."""
    from types import SimpleNamespace as NS

    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from exactrl.engine import SamplingParams
    from exactrl.server.generation import Generation

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    vocab |= {"\u2581The": 259, "\u2581capital": 260, "\u2581is": 261, "\u2581Paris": 262, ".": 263}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    t.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok = NS(hf=hf, byte_level=False, decode=lambda ids, skip_special_tokens=False: hf.decode(ids))
    prompt, gen = [1, 259, 260, 261], [262, 263]
    assert hf.decode(gen) == "Paris."  # the decoder's own view, alone
    params = SamplingParams(max_tokens=2, stop_token_ids=[2])
    g = Generation(NS(tokenizer=tok), prompt, params, [], False)
    assert g.visible_text(gen, "length") == " Paris."
    assert hf.decode(prompt) + g.visible_text(gen, "length") == hf.decode(prompt + gen)  # echo
    assert Generation(NS(tokenizer=tok), [1], params, [], False).visible_text(gen, "length") == " Paris."
    g = Generation(NS(tokenizer=tok), prompt, params, [" Paris"], False)
    c = g.choices[0]
    g._advance(c, NS(token_ids=gen, logprobs=[0.0, 0.0], versions=[0, 0], finish_reason="length"))
    assert (c.finish_reason, c.text) == ("stop", "")


def test_streamed_text_is_decoded_incrementally_and_exactly():
    """Each update decodes only the tokens since the last whole character, and the text is always the
    whole decode: split multi-byte characters, invalid bytes and special tokens included."""
    import random
    from types import SimpleNamespace as NS

    from exactrl.server.app import _BYTE_OF
    from exactrl.server.generation import Generation

    tok = served().state.tokenizer
    char_of = {b: c for c, b in _BYTE_OF.items()}
    rng = random.Random(0)
    ids = []
    for _ in range(300):
        piece = rng.choice(["é", "😀", "ab", " x", "\n"]).encode()
        ids += [tok.hf.convert_tokens_to_ids(char_of[b]) for b in piece]
        if rng.random() < 0.1:
            ids.append(rng.choice([tok.hf.convert_tokens_to_ids(char_of[0xFF]), tok.end_of_turn_id]))
    decoded = []

    class Counting:  # the tokenizer, counting the tokens each decode call reads
        byte_level = True

        def decode(self, xs, skip_special_tokens=False):
            decoded.append(len(xs))
            return tok.decode(xs, skip_special_tokens)

    g = Generation(NS(tokenizer=Counting(), loop=None), [1], SamplingParams(max_tokens=5000), [], track_text=True)
    c = g.choices[0]
    for k in range(1, len(ids) + 1):
        g._advance(c, NS(token_ids=ids[:k], logprobs=[0.0] * k, versions=[0] * k, finish_reason=None))
        assert c.text == tok.decode(ids[:k]), k
    assert sum(decoded) < 5 * len(ids)  # the whole generation each time would be ~len(ids)² / 2


# ---------------------------------------------------------------- 12. choices, messages, models and limits
def test_a_streamed_completion_closes_each_choice_once(monkeypatch):
    """Updates queued while the consumer lags send a finished choice's last chunk (finish_reason, token
    fields) once, not again for each of them. The consumer is made to lag here: it checks for a disconnect
    before each update."""
    import asyncio

    from starlette.requests import Request

    check = Request.is_disconnected

    async def slow(self):
        await asyncio.sleep(0.02)
        return await check(self)

    monkeypatch.setattr(Request, "is_disconnected", slow)
    s = served()
    body = {
        "model": s.model,
        "prompt": ["hello world", "the quick"],
        "max_tokens": 8,
        "stream": True,
        "n": 2,
        "seed": 0,
    }
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
        evs = events(r)
    closing = [c["index"] for e in evs if e != "[DONE]" for c in e["choices"] if c["finish_reason"]]
    assert sorted(closing) == [0, 1, 2, 3]
    answer = post("/v1/completions", json=body | {"stream": False}).json()["choices"]
    streamed = {c["index"]: c for e in evs if e != "[DONE]" for c in e["choices"] if c["finish_reason"]}
    assert [streamed[c["index"]]["generation_token_ids"] for c in answer] == [c["generation_token_ids"] for c in answer]


def test_a_failed_completion_under_a_session_records_no_trajectory(monkeypatch):
    """A 409 (weights changed before the top logprobs were scored) answered no choice: nothing of the
    request may be trained on."""
    from exactrl.server import completions
    from exactrl.server.schemas import APIError

    async def weights_changed(*_a, **_k):
        raise APIError(409, "the weights changed", code="weights_changed")

    monkeypatch.setattr(completions, "_completion_logprobs", weights_changed)
    s = served()
    body = {"model": s.model, "prompt": "hello", "max_tokens": 4, "logprobs": 1, "n": 2}
    assert error_of(post("/sessions/failed-409/v1/completions", json=body), 409)["code"] == "weights_changed"
    assert httpx.get(s.url + "/sessions/failed-409/trajectories").json()["trajectories"] == []
    monkeypatch.undo()
    assert post("/sessions/failed-409/v1/completions", json=body).status_code == 200
    assert len(httpx.get(s.url + "/sessions/failed-409/trajectories").json()["trajectories"]) == 2


def test_a_choice_a_stop_string_ends_frees_its_engine_sample_while_the_others_go_on():
    s = served()
    body = {"model": s.model, "prompt": [7] * 20, "max_tokens": 120, "ignore_eos": True, "n": 2, "seed": 11}
    full = post("/v1/completions", json=body).json()["choices"]
    t0, t1 = full[0]["text"], full[1]["text"]
    stop = next(
        t0[i : i + 4]
        for i in range(len(t0) - 4)
        if "\ufffd" not in t0[i : i + 4]
        and t0[i : i + 4] not in t1
        and len(t0[: i + 4].encode()) < len(t0.encode()) // 2
    )  # well before choice 0's end
    before = s.state.loop.stats.aborted
    cut = post("/v1/completions", json=body | {"stop": [stop]}).json()["choices"]
    assert cut[0]["finish_reason"] == "stop" and stop not in cut[0]["text"] and t0.startswith(cut[0]["text"])
    assert cut[1]["generation_token_ids"] == full[1]["generation_token_ids"]  # the other sample, unchanged
    assert s.state.loop.stats.aborted == before + 1  # sample 0 alone, as soon as its stop string showed


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("reasoning_content", 5, "messages[1].reasoning_content must be a string, a list of text parts or null"),
        ("reasoning_content", [{"type": "image"}], "messages[1].reasoning_content[0]: only text parts"),
        ("content", 5, "messages[1].content must be a string, a list of text parts or null"),
    ],
)
def test_a_bad_message_field_is_named_by_its_path(field, value, needle):
    msgs = MSGS + [{"role": "assistant", "content": "x", field: value}, {"role": "user", "content": "y"}]
    assert needle in error_of(post("/v1/chat/completions", json=chat(messages=msgs, max_tokens=2)))["message"]


@pytest.mark.parametrize(
    "message,needle",
    [
        # fields the template would have dropped without a word
        ({"role": "user", "content": "y", "tool_calls": []}, None),  # empty: nothing dropped
        (
            {"role": "user", "content": "y", "tool_calls": [{"function": {"name": "f"}}]},
            "messages[1].tool_calls belongs on 'assistant' messages, not on role 'user'",
        ),
        (
            {"role": "system", "content": "y", "reasoning_content": "r"},
            "messages[1].reasoning_content belongs on 'assistant' messages, not on role 'system'",
        ),
        (
            {"role": "user", "content": "y", "tool_call_id": "c1"},
            "messages[1].tool_call_id belongs on 'tool' messages, not on role 'user'",
        ),
        # an id that is not a string: str() made {"x": 1} the id "{'x': 1}"
        (
            {"role": "tool", "content": "5", "tool_call_id": {"x": 1}},
            "messages[1].tool_call_id must be a string, got dict",
        ),
        ({"role": "tool", "content": "5", "name": 3}, "messages[1].name must be a string, got int"),
    ],
)
def test_a_message_field_its_role_cannot_carry_is_refused(message, needle):
    r = post("/v1/chat/completions", json=chat(messages=MSGS + [message], max_tokens=2))
    if needle is None:
        assert r.status_code == 200, r.text
    else:
        assert needle in error_of(r)["message"]


def test_a_model_is_retrieved_by_its_id_or_alias():
    """`client.models.retrieve` (GET /v1/models/{id}); the default id is a path, slashes and all."""
    s = served()
    assert s.client().models.retrieve(s.model).id == s.model
    r = httpx.get(f"{s.url}/v1/models/{s.state.config.aliases[0]}")
    assert r.status_code == 200 and r.json()["id"] == s.model
    assert error_of(httpx.get(f"{s.url}/v1/models/nosuch"), 404)["code"] == "model_not_found"


def test_serve_passes_its_engine_sizes(monkeypatch):
    """`exactrl serve --max-num-seqs N --kv-budget-tokens T`: the engine it builds has them."""
    import uvicorn

    from exactrl.cli import main
    from exactrl.server import app as server_app

    built = []
    monkeypatch.setattr(server_app, "create_app", lambda state: built.append(state))
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    assert (
        main(["serve", "--model", str(model_dir()), "--port", "0", "--max-num-seqs", "3", "--kv-budget-tokens", "512"])
        == 0
    )
    engine = built[0].engine
    assert engine.scheduler.max_num_seqs == 3
    assert (
        engine.pool.num_pages * engine.model.block_size >= 512 > (engine.pool.num_pages - 2) * engine.model.block_size
    )


def test_a_small_kv_budget_is_the_context_limit_clients_are_told_and_it_is_named():
    """`--kv-budget-tokens` below the model's context: /v1/models reports the smaller limit, and a prompt
    over it is refused naming the flag, not the model (whose context is 512 here)."""
    state = build_state(str(model_dir()), kv_budget_tokens=64)  # two pages of 32
    thread = ServerThread(create_app(state)).start()
    try:
        card = httpx.get(f"{thread.url}/v1/models", timeout=60).json()["data"][0]
        assert card["max_model_len"] == 64 < state.engine.max_model_len == 512
        err = error_of(post("/v1/completions", thread.url, json={"model": card["id"], "prompt": [5] * 100}))
        assert err["code"] == "context_length_exceeded"
        assert err["message"].startswith(
            "This model's maximum context length is 64 tokens (this server's KV "
            "cache: exactrl serve --kv-budget-tokens), but the prompt has 100 tokens"
        )
        long = " ".join(["hello world"] * 60)
        err = error_of(
            post(
                "/v1/chat/completions",
                thread.url,
                json={"model": card["id"], "messages": [{"role": "user", "content": long}]},
            )
        )
        assert "64 tokens (this server's KV cache: exactrl serve --kv-budget-tokens)" in err["message"]
    finally:
        thread.stop()
    tie = build_state(str(model_dir()), kv_budget_tokens=512)  # the KV cache holds the whole context: no hint
    with pytest.raises(Exception) as e:
        tie.resolve_max_tokens(None, 600, "prompt")
    assert "maximum context length is 512 tokens, but" in e.value.message and "KV cache" not in e.value.message


def test_a_streamed_event_is_one_line_for_every_line_splitter():
    """The model may generate U+0085, U+2028 or U+2029; JSON leaves them raw, and str.splitlines (httpx's
    aiter_lines) ends a line there: an event cut inside its text (seen in the concurrency fuzz)."""
    from exactrl.server.generation import sse

    text = "a\x85b\u2028c\u2029d é😀\n\r\x1c"
    event = sse({"choices": [{"text": text}]})
    assert event.endswith("\n\n") and len(event.splitlines()) == 2 and event.splitlines()[1] == ""
    assert json.loads(event.splitlines()[0].removeprefix("data: ")) == {"choices": [{"text": text}]}
    assert "é😀" in event  # other text stays as it is
