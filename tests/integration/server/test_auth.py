"""API keys (`exactrl serve --api-key`, EXACTRL_API_KEY): every route needs OpenAI's bearer token, a 401 in
OpenAI's error JSON otherwise; the official client and the external rollout backend send it."""

from __future__ import annotations

import argparse

import httpx
import openai
import pytest
from serving import model_dir

from exactrl.engine import SamplingParams
from exactrl.rollout.external import ExternalEngine, RolloutBackendSettings
from exactrl.server.app import ServerThread, access_of, build_state, create_app
from exactrl.server.guard import Access

KEYS = ("key-one", "key-two")
MSGS = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def keyed():
    state = build_state(str(model_dir()), kv_budget_tokens=1024, access=Access(api_keys=KEYS, weight_updates=True))
    with ServerThread(create_app(state)) as thread:
        yield thread.url, state


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def test_the_openai_client_with_a_key_is_served(keyed):
    url, state = keyed
    for key in KEYS:
        r = client(url, key).chat.completions.create(model=state.config.model_name, messages=MSGS, max_tokens=2)
        assert r.choices[0].message.content is not None
    assert [m.id for m in client(url, KEYS[0]).models.list()] == [state.config.model_name]


def test_the_openai_client_without_the_key_is_401(keyed):
    url, state = keyed
    for key in ("wrong", KEYS[0] + "x", KEYS[0][:-1]):
        with pytest.raises(openai.AuthenticationError) as e:
            client(url, key).chat.completions.create(model=state.config.model_name, messages=MSGS, max_tokens=2)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        assert KEYS[0] not in str(e.value.body)  # the answer names no key


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/health"),
        ("GET", "/metrics"),
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/responses"),
        ("POST", "/update_weights_from_disk"),
        ("GET", "/sessions/s/trajectories"),
        ("POST", "/sessions/s/v1/chat/completions"),
        ("POST", "/sessions/s/v1/responses"),
        ("DELETE", "/sessions/s"),
        ("GET", "/no/such/route"),
    ],
)
@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEYS[0]}"}, {"Authorization": KEYS[0]}],
)
def test_every_route_needs_the_key(keyed, method, path, headers):
    url, state = keyed
    r = httpx.request(method, url + path, headers=headers, json={"model_path": str(model_dir())}, timeout=60)
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"


def test_weight_updates_need_the_key_too(keyed):
    url, state = keyed
    version = state.engine.version
    body = {"model_path": str(model_dir())}
    assert httpx.post(url + "/update_weights_from_disk", json=body, timeout=60).status_code == 401
    assert state.engine.version == version
    r = httpx.post(
        url + "/update_weights_from_disk", json=body, timeout=60, headers={"Authorization": f"Bearer {KEYS[1]}"}
    )
    assert r.status_code == 200 and r.json()["version"] == version + 1


def test_the_external_rollout_backend_sends_the_key(keyed, monkeypatch):
    url, state = keyed
    tok = state.tokenizer
    prompt = tok.encode("hello")
    for key, env in ((KEYS[0], None), (None, f" {KEYS[1]} ,other")):
        if env is not None:
            monkeypatch.setenv("EXACTRL_API_KEY", env)
        s = RolloutBackendSettings(kind="openai", base_url=url, model=state.config.model_name, api_key=key)
        eng = ExternalEngine(s, stop_token_ids=tok.stop_token_ids)
        try:
            ((c,),) = eng.generate([prompt], SamplingParams(max_tokens=2, seed=0))
            assert c.token_ids
        finally:
            eng.close()
    assert "api_key" not in RolloutBackendSettings(kind="openai", base_url=url, model="m", api_key="k").model_dump()


def serve_args(*argv: str) -> argparse.Namespace:
    from exactrl.cli import build_parser

    return build_parser().parse_args(["serve", "--model", "m", *argv])


def test_keys_come_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.delenv("EXACTRL_API_KEY", raising=False)
    assert access_of(serve_args()).api_keys == ()
    assert access_of(serve_args("--api-key", "a", "--api-key", "b")).api_keys == ("a", "b")
    monkeypatch.setenv("EXACTRL_API_KEY", "x, y,,")
    assert access_of(serve_args()).api_keys == ("x", "y")
    assert access_of(serve_args("--api-key", "a")).api_keys == ("a",)  # the flag wins
    with pytest.raises(ValueError, match="API key"):
        access_of(serve_args("--api-key", " "))


def test_a_non_loopback_bind_without_a_key_warns(monkeypatch, caplog):
    """serve_main's start, with the model load and uvicorn replaced: only what it says is looked at."""
    import uvicorn
    from serving import served

    import exactrl.server.app as app_mod

    monkeypatch.delenv("EXACTRL_API_KEY", raising=False)
    monkeypatch.setattr(app_mod, "_check_listen", lambda host, port: None)
    monkeypatch.setattr(app_mod, "build_state", lambda *a, **kw: served().state)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: None)
    for argv, warned in (
        (["--host", "0.0.0.0"], True),
        (["--host", "0.0.0.0", "--api-key", "k"], False),
        (["--host", "127.0.0.1"], False),
    ):
        caplog.clear()
        with caplog.at_level("WARNING", logger="exactrl.server"):
            assert app_mod.serve_main(serve_args(*argv)) == 0
        assert any("without an API key" in r.message for r in caplog.records) == warned, argv
