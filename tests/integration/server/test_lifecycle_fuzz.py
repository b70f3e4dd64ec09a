"""The server's weight and session lifecycle on its edge paths: updates refused by name with the old weights
serving on bitwise, updates landing while requests run or are queued (every token's version and logprob),
concurrent updates, and sessions whose requests meet an update.

Its own server (weights change here; the shared one of serving.py stays as it was built).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import torch
from conftest import make_hf_model
from serving import model_dir, trainer_logprobs

import exactrl
from exactrl.server.app import ServerThread, build_state, create_app
from exactrl.server.guard import Access


@pytest.fixture(scope="module")
def srv():
    state = build_state(str(model_dir()), kv_budget_tokens=4096, access=Access(weight_updates=True))
    with ServerThread(create_app(state)) as t:
        yield SimpleNamespace(url=t.url, state=state, model=state.config.model_name)


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """A checkpoint of the served model's configuration with other weights."""
    d = shutil.copytree(model_dir(), tmp_path_factory.mktemp("ckpt") / "other")
    cfg = json.loads((d / "config.json").read_text())
    make_hf_model(
        d,
        "qwen3",
        seed=1,
        vocab_size=cfg["vocab_size"],
        eos_token_id=cfg["eos_token_id"],
        pad_token_id=cfg.get("pad_token_id"),
    )
    return d


def update(srv, path) -> httpx.Response:
    return httpx.post(srv.url + "/update_weights_from_disk", json={"model_path": str(path)}, timeout=60)


def bits(state) -> dict:
    """The served weights' bits (torch.equal would call -0.0 and 0.0 equal)."""
    return {k: v.detach().view(torch.int32).clone() for k, v in state.engine.model.named_parameters()}


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def sample(srv) -> dict:
    body = {"model": srv.model, "prompt": "hello world", "max_tokens": 8, "ignore_eos": True, "seed": 5, "n": 2}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return [(c["generation_token_ids"], c["generation_log_probs"]) for c in r.json()["choices"]]


def refused(srv, path, *words) -> dict:
    """An update from `path` is a 400 naming model_path and `words`; the old weights serve on, bitwise."""
    before, version, answer = bits(srv.state), srv.state.engine.version, sample(srv)
    r = update(srv, path)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "model_path" and all(w in err["message"] for w in words), err
    assert srv.state.engine.version == version and same_bits(bits(srv.state), before)
    assert sample(srv) == answer  # bitwise the same tokens and logprobs
    return err


# ---------------------------------------------------------------- refused updates
@pytest.mark.parametrize(
    "change, words",
    [
        ({"rope_parameters": {"rope_theta": 30000.0, "rope_type": "default"}}, ["rope_theta is 30000.0 there"]),
        ({"rms_norm_eps": 0.5}, ["rms_norm_eps is 0.5 there"]),
        ({"max_position_embeddings": 64}, ["max_position_embeddings is 64 there, 512 here"]),
    ],
)
def test_a_checkpoint_of_another_configuration_is_refused_naming_the_key(srv, tmp_path, change, words):
    """Its weights have the served shapes, but loaded under the served configuration they would not be the
    checkpoint's model: the trainer holding it would compute other logprobs than the server samples with."""
    d = shutil.copytree(model_dir(), tmp_path / "cfg")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | change))
    refused(srv, d, "does not match the model served", *words)


def test_a_checkpoint_of_another_architecture_is_refused_naming_what_differs(srv, tmp_path):
    cfg = json.loads((model_dir() / "config.json").read_text())
    make_hf_model(tmp_path / "llama", "llama", vocab_size=cfg["vocab_size"])
    refused(srv, tmp_path / "llama", "model_type is 'llama' there, 'qwen3' here")


def test_a_model_path_the_filesystem_refuses_is_a_400_naming_it(srv, tmp_path):
    """An OSError (here a name too long for the filesystem) is a 400 naming it, not a 500 quoting the whole path."""
    err = refused(srv, tmp_path / ("a" * 300) / "b", "File name too long")
    assert len(err["message"]) < 1000


def test_an_empty_model_path_is_refused_not_read_as_the_servers_working_directory(srv, other, monkeypatch):
    """Path("") is ".": the server loaded whatever checkpoint its working directory held."""
    monkeypatch.chdir(other)
    refused(srv, "", "empty")


# ---------------------------------------------------------------- updates while requests run
class HeldEngine:
    """Holds the engine thread inside its step number `at` until `release()`; meanwhile the test queues
    commands (an update), which the engine applies after that step, before the next."""

    def __init__(self, state, monkeypatch, at: int):
        self.state, self.reached, self.go = state, threading.Event(), threading.Event()
        real, n = state.engine.step, [0]

        def step():
            n[0] += 1
            if n[0] == at:
                self.reached.set()
                assert self.go.wait(30)
            return real()

        monkeypatch.setattr(state.engine, "step", step)

    def release_after_update(self, srv, path) -> dict:
        """Posts an update while the engine is held, releases it once the update's command is queued."""
        assert self.reached.wait(30), "the request never reached the engine"
        got: dict = {}
        queued = self.state.loop._commands.qsize()
        t = threading.Thread(target=lambda: got.update(r=update(srv, path)))
        t.start()
        deadline = time.monotonic() + 30
        while self.state.loop._commands.qsize() == queued:  # the checkpoint is read off the engine thread first
            assert time.monotonic() < deadline
            time.sleep(0.005)
        self.go.set()
        t.join(60)
        return got["r"]


@pytest.mark.parametrize("stream", [False, True])
def test_tokens_sampled_across_an_update_carry_the_version_and_logprobs_of_their_weights(
    srv, other, monkeypatch, stream
):
    """A session's request (n=2) and a queued one run across an update: each token's recorded version is
    that of the weights that sampled it, and its logprob is the trainer's under those weights, bitwise."""
    old_model = exactrl.load_model(model_dir())
    v0 = srv.state.engine.version
    held = HeldEngine(srv.state, monkeypatch, at=4)
    body = {
        "model": srv.model,
        "prompt": "hello",
        "max_tokens": 40,
        "ignore_eos": True,
        "n": 2,
        "seed": 9,
        "stream": stream,
    }
    sid = f"across-{stream}"
    results = []
    clients = [
        threading.Thread(target=lambda p=p: results.append(httpx.post(srv.url + p, json=body, timeout=60)))
        for p in (f"/sessions/{sid}/v1/completions", f"/sessions/{sid}-queued/v1/completions")
    ]
    clients[0].start()
    assert held.reached.wait(30)
    clients[1].start()  # queued behind the held step
    while srv.state.loop._commands.empty():
        time.sleep(0.005)
    r = held.release_after_update(srv, other)
    assert r.status_code == 200 and r.json()["version"] == v0 + 1, r.text
    for c in clients:
        c.join(60)
    assert [x.status_code for x in results] == [200, 200]
    new_model = exactrl.load_model(other)
    for s in (sid, f"{sid}-queued"):
        trajs = httpx.get(f"{srv.url}/sessions/{s}/trajectories").json()["trajectories"]
        assert len(trajs) == 2
        for t in trajs:
            full, p = t["prompt_ids"] + t["completion_ids"], len(t["prompt_ids"])
            versions = t["versions"]
            assert set(versions) <= {v0, v0 + 1} and versions == sorted(versions) and versions[-1] == v0 + 1
            if s == sid:
                assert versions[0] == v0  # the first tokens were sampled before the update
            else:
                assert set(versions) == {v0 + 1}  # queued: nothing sampled before the update
            lps = {
                v0: trainer_logprobs(full, model=old_model)[p - 1 :],
                v0 + 1: trainer_logprobs(full, model=new_model)[p - 1 :],
            }
            assert t["behav_logprobs"] == [lps[v][i] for i, v in enumerate(versions)]  # bitwise
        assert httpx.delete(f"{srv.url}/sessions/{s}").json()["deleted"]
    assert update(srv, model_dir()).status_code == 200  # the served weights back, for the other tests


def test_top_logprobs_across_an_update_are_409_and_the_session_records_nothing(srv, other, monkeypatch):
    """The alternatives would come from other weights than the tokens: 409 weights_changed, no record of
    the turn in its session, the session given back, and the same request answered once sent again."""
    held = HeldEngine(srv.state, monkeypatch, at=3)
    body = {
        "model": srv.model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 12,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 3,
        "seed": 1,
    }
    got: dict = {}
    client = threading.Thread(
        target=lambda: got.update(
            r=httpx.post(srv.url + "/sessions/top-409/v1/chat/completions", json=body, timeout=60)
        )
    )
    client.start()
    v0 = srv.state.engine.version
    assert held.release_after_update(srv, other).status_code == 200
    client.join(60)
    assert got["r"].status_code == 409, got["r"].text
    err = got["r"].json()["error"]
    assert err["code"] == "weights_changed" and f"(version {v0})" in err["message"], err
    assert httpx.get(srv.url + "/sessions/top-409/trajectories").json()["trajectories"] == []
    assert srv.state.sessions["top-409"].busy == 0
    again = httpx.post(srv.url + "/sessions/top-409/v1/chat/completions", json=body, timeout=60)
    assert again.status_code == 200, again.text
    (t,) = httpx.get(srv.url + "/sessions/top-409/trajectories").json()["trajectories"]
    assert set(t["versions"]) - {-1} == {v0 + 1}
    httpx.delete(srv.url + "/sessions/top-409")
    assert update(srv, model_dir()).status_code == 200


def test_concurrent_updates_each_get_their_own_version_and_the_last_one_serves(srv, other, tmp_path):
    """Updates sent at once (some refused) are applied one at a time: distinct versions, one per loaded
    checkpoint, and the weights served are those of the highest version's checkpoint, bitwise."""
    ref = {}
    for name, path in (("base", model_dir()), ("other", other)):
        m = exactrl.load_model(path)
        ref[name] = {k: v.detach().view(torch.int32) for k, v in m.named_parameters()}
    missing = tmp_path / "missing"
    plan = ["base", "other", "missing", "other", "base", "missing", "other"]
    paths = {"base": model_dir(), "other": other, "missing": missing}
    v0, count0 = srv.state.engine.version, srv.state.counters["server/weight_updates"]
    answers: dict = {}
    threads = [
        threading.Thread(target=lambda k=k, n=n: answers.update({k: update(srv, paths[n])})) for k, n in enumerate(plan)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    ok = {k: r.json()["version"] for k, r in answers.items() if r.status_code == 200}
    assert sorted(k for k in answers if k not in ok) == [k for k, n in enumerate(plan) if n == "missing"]
    assert sorted(ok.values()) == list(range(v0 + 1, v0 + 1 + len(ok)))
    last = max(ok, key=ok.get)
    assert srv.state.engine.version == ok[last] and same_bits(bits(srv.state), ref[plan[last]])
    metrics = httpx.get(srv.url + "/metrics").json()
    assert metrics["server/weight_updates"] == count0 + len(ok) and metrics["engine/version"] == ok[last]
    assert update(srv, model_dir()).status_code == 200


# ---------------------------------------------------------------- sessions while a request builds its prompt
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_session_deleted_while_a_request_builds_its_prompt_stays_deleted(srv, monkeypatch, path):
    """The prompt is built off the event loop before the generation starts: a DELETE then drops the turn's
    record too (the request took its session when it started), as one during the generation does: the late
    record does not bring the deleted session back, holding that turn alone."""
    from exactrl.server import completions

    sid = "del-plan-chat" if "chat" in path else "del-plan-text"
    body = {"model": srv.model, "max_tokens": 3} | (
        {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hello"}
    )
    url = f"{srv.url}/sessions/{sid}{path}"
    assert httpx.post(url, json=body, timeout=60).status_code == 200  # the session exists, one turn in it
    building, go = threading.Event(), threading.Event()

    def held(real):
        def build(*a, **k):
            building.set()
            assert go.wait(30)
            return real(*a, **k)

        return build

    if "chat" in path:
        monkeypatch.setattr(srv.state.splicer, "build", held(srv.state.splicer.build))
    else:
        monkeypatch.setattr(completions, "_prompts", held(completions._prompts))
    got: dict = {}
    client = threading.Thread(target=lambda: got.update(r=httpx.post(url, json=body, timeout=60)))
    client.start()
    assert building.wait(30)
    assert httpx.delete(f"{srv.url}/sessions/{sid}").json()["deleted"]
    go.set()
    client.join(60)
    assert got["r"].status_code == 200, got["r"].text
    assert httpx.get(f"{srv.url}/sessions/{sid}/trajectories").status_code == 404
    assert sid not in srv.state.sessions


def test_a_request_the_engine_cannot_take_fails_alone_and_the_next_one_is_served(monkeypatch):
    state = build_state(str(model_dir()), kv_budget_tokens=4096, access=Access(weight_updates=True))
    with ServerThread(create_app(state)) as t:
        body = {"model": state.config.model_name, "prompt": "hello world", "max_tokens": 4}
        real = state.engine.add_request
        calls = []

        def once_broken(*a, **kw):  # not a ValueError (bad input) but a fault of the engine's own
            calls.append(1)
            if len(calls) == 1:
                raise TypeError("broken on purpose")
            return real(*a, **kw)

        monkeypatch.setattr(state.engine, "add_request", once_broken)
        r = httpx.post(t.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 500 and "could not take the request" in r.text and "broken on purpose" in r.text
        assert httpx.post(t.url + "/v1/completions", json=body, timeout=60).status_code == 200
        assert httpx.get(t.url + "/health", timeout=10).json() == {"status": "ok"}


def test_if_the_engine_thread_stops_requests_fail_instead_of_hanging_and_health_says_so(monkeypatch, other):
    state = build_state(str(model_dir()), kv_budget_tokens=4096, access=Access(weight_updates=True))
    with ServerThread(create_app(state)) as t:
        body = {"model": state.config.model_name, "prompt": "hello world", "max_tokens": 4}
        assert httpx.post(t.url + "/v1/completions", json=body, timeout=60).status_code == 200

        def broken():  # called by the thread after every step, outside any command's or step's guard
            raise KeyError("broken on purpose")

        monkeypatch.setattr(state.engine, "stats", broken)
        r = httpx.post(t.url + "/v1/completions", json=body, timeout=60)  # the request in flight when it stops
        assert r.status_code == 500 and "engine thread stopped" in r.text and "broken on purpose" in r.text, r.text
        later = httpx.post(t.url + "/v1/completions", json=body, timeout=60)  # fails at once, no hang
        assert later.status_code == 500 and "restart the server" in later.text
        assert update(SimpleNamespace(url=t.url), other).status_code >= 500  # a weight update does not hang
        h = httpx.get(t.url + "/health", timeout=10)
        assert h.status_code == 503 and "broken on purpose" in h.json()["error"]
