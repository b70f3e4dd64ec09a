"""The Host header on a loopback bind: only this machine's names (any port) and --allowed-hosts, so a page
whose domain re-resolves to 127.0.0.1 (DNS rebinding) is refused."""

from __future__ import annotations

import httpx
import pytest
from serving import model_dir
from test_auth import serve_args

from exactrl.server.app import ServerThread, access_of, build_state, create_app
from exactrl.server.guard import LOOPBACK_HOSTS, Access


@pytest.fixture(scope="module")
def checked():
    access = Access(allowed_hosts=LOOPBACK_HOSTS + ("trainer.internal",))
    state = build_state(str(model_dir()), kv_budget_tokens=1024, access=access)
    with ServerThread(create_app(state)) as thread:
        yield thread.url, state


@pytest.mark.parametrize(
    "host",
    [
        "localhost",
        "localhost:8000",
        "LOCALHOST:1",
        "127.0.0.1",
        "127.0.0.1:9",
        "[::1]",
        "[::1]:8000",
        "trainer.internal:80",
        "localhost.",
    ],
)
def test_this_machines_names_are_served(checked, host):
    url, _ = checked
    assert httpx.get(url + "/health", headers={"Host": host}, timeout=60).status_code == 200


@pytest.mark.parametrize(
    "host",
    [
        "evil.example",
        "evil.example:8000",
        "127.0.0.1.evil.example",
        "localhost.evil",
        "[::2]",
        "",
        "localhost:80:80",
        "10.0.0.1",
    ],
)
def test_other_names_are_400(checked, host):
    url, _ = checked
    for method, path in (("GET", "/health"), ("POST", "/v1/completions")):
        r = httpx.request(method, url + path, headers={"Host": host}, json={}, timeout=60)
        assert r.status_code == 400, (host, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_host" and "--allowed-hosts" in err["message"]


def test_the_bind_decides_the_check():
    assert access_of(serve_args()).allowed_hosts == LOOPBACK_HOSTS  # --host 127.0.0.1 by default
    assert access_of(
        serve_args("--host", "localhost", "--allowed-hosts", "a.b,C.d", "--allowed-hosts", "e")
    ).allowed_hosts == LOOPBACK_HOSTS + ("a.b", "c.d", "e")
    assert access_of(serve_args("--host", "::1")).allowed_hosts == LOOPBACK_HOSTS
    assert access_of(serve_args("--host", "0.0.0.0")).allowed_hosts is None  # any name reaches a public bind
    assert access_of(serve_args("--host", "0.0.0.0", "--allowed-hosts", "srv.lan")).allowed_hosts == ("srv.lan",)
