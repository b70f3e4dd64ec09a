"""What one request may cost: its body (413 past --max-body-mb), its text (refused before it is tokenized when
it cannot fit the context), the event loop (tokenizing runs in a worker thread), a connection's time to send
its request head (closed past --header-timeout)."""

from __future__ import annotations

import socket
import threading

import httpx
import openai
import pytest
from serving import model_dir, served
from test_auth import serve_args

from exactrl.server.app import ServerThread, access_of, build_state, create_app
from exactrl.server.guard import Access

LIMIT = 64 << 10
MSGS = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def limited():
    state = build_state(str(model_dir()), kv_budget_tokens=1024, access=Access(max_body_bytes=LIMIT))
    with ServerThread(create_app(state), header_timeout_s=1.0) as thread:
        yield thread.url, state


def test_the_default_limit_is_8_mb():
    assert Access().max_body_bytes == access_of(serve_args()).max_body_bytes == 8 << 20
    assert access_of(serve_args("--max-body-mb", "0.5")).max_body_bytes == 1 << 19


def test_a_body_past_the_limit_is_413(limited):
    url, state = limited
    big = [{"role": "user", "content": "x" * LIMIT}]
    r = httpx.post(url + "/v1/chat/completions", json={"model": state.config.model_name, "messages": big}, timeout=60)
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and "--max-body-mb" in err["message"]
    with pytest.raises(openai.APIStatusError) as e:  # through the official client
        openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).chat.completions.create(
            model=state.config.model_name, messages=big, max_tokens=1
        )
    assert e.value.status_code == 413
    # without a Content-Length (chunked): refused as the chunks pass the limit
    chunks = (b'{"model": "m", "prompt": "' + b"y" * 8192 if i == 0 else b"y" * 8192 for i in range(2 * LIMIT // 8192))
    r = httpx.post(url + "/v1/completions", content=chunks, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    # under the limit: served
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"model": state.config.model_name, "messages": MSGS, "max_tokens": 1},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert state.metrics()["server/errors_413"] == 3


@pytest.fixture
def encoded(monkeypatch):
    """The texts the served tokenizer is asked to encode."""
    cls = type(served().state.tokenizer)  # a frozen dataclass: its method is replaced
    texts, encode = [], cls.encode

    def spy(self, text):
        texts.append(text)
        return encode(self, text)

    monkeypatch.setattr(cls, "encode", spy)
    return texts


def test_text_that_cannot_fit_the_context_is_refused_before_it_is_tokenized(encoded):
    s = served()
    st = s.state
    big = "the quick brown fox " * (st.context_limit * st.splicer.max_token_chars // 20 + 1)
    post = lambda path, body: httpx.post(s.url + path, json={"model": s.model} | body, timeout=60)
    for path, body, start in (
        ("/v1/completions", {"prompt": big}, "This model's maximum context length is"),
        ("/v1/completions", {"prompt": ["hi", big]}, "prompt[1]: This model's maximum"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": big}]},
            "This model's maximum context length is",
        ),
    ):
        r = post(path, body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["message"].startswith(start), err
        assert "at least" in err["message"]
    assert not any(len(t) >= len(big) for t in encoded)  # never tokenized
    # the bound is one: a text's tokens are never fewer than it says
    for text in (big[:5000], "hello world " * 300, "é" * 2000, "\n\n  \t" * 500, "<|im_end|>" * 50):
        assert st.splicer.min_tokens(text, 0) <= len(st.tokenizer.hf.encode(text, add_special_tokens=False))


def test_tokenizing_does_not_hold_the_event_loop(monkeypatch):
    """While one request's text is being tokenized (held here), the server answers others."""
    s = served()
    cls = type(s.state.tokenizer)
    entered, release, encode = threading.Event(), threading.Event(), cls.encode

    def held(self, text):
        if text.startswith("HOLD"):
            entered.set()
            assert release.wait(60)
        return encode(self, text)

    monkeypatch.setattr(cls, "encode", held)
    answers = []
    t = threading.Thread(
        target=lambda: answers.append(
            httpx.post(
                s.url + "/v1/completions", json={"model": s.model, "prompt": "HOLD hello", "max_tokens": 1}, timeout=60
            )
        )
    )
    t.start()
    try:
        assert entered.wait(60)
        assert httpx.get(s.url + "/health", timeout=30).status_code == 200
        r = s.client().chat.completions.create(model=s.model, messages=MSGS, max_tokens=1)
        assert r.choices[0].message.generation_token_ids
    finally:
        release.set()
        t.join(60)
    assert answers[0].status_code == 200


def test_a_connection_that_does_not_finish_its_request_head_is_closed(limited):
    url, _ = limited
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:  # 30 s: a hang guard
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
        assert sock.recv(1024) == b""  # closed by the server (a timeout here: never closed)
    with socket.create_connection((host, int(port)), timeout=30) as sock:  # nothing sent at all
        assert sock.recv(1024) == b""
    with socket.create_connection((host, int(port)), timeout=30) as sock:  # a whole head is answered
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert sock.recv(1024).startswith(b"HTTP/1.1 200")
