"""A long-running server leaves nothing behind: a few hundred mixed requests, then every per-request structure
is back to idle.

The mix: JSON and streaming chat and completions, n > 1, stop strings, top logprobs and echo (scored on the
engine thread), clients that hang up mid-stream or before a JSON answer, requests refused with a 400,
sessions used for several turns (token fields sent back) then deleted or left to expire (a short
--session-ttl), and weight updates from disk in between and during. Afterwards:
  * the engine holds no request (running, waiting, unclaimed) and every KV page is free with refcount 0;
  * the engine loop's stream dict and command queue are empty;
  * no session is left (each was deleted or expired) and the server's caches stay within the vocabulary;
  * no object of a request's life (Generation, Choice, RequestStream, a session's stream, a chat job,
    Session, Record) is still alive, nor any asyncio task.
Structures, never RSS or time (`soak` drives longer runs that measure RSS too; none is a threshold here).
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from conftest import make_hf_model
from serving import model_dir

from exactrl.server.app import ServerThread, build_state, create_app
from exactrl.server.guard import Access

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
WORDS = ["hello", "world", "what is 2+3?", "the quick brown fox", "go on", "é😀", "12*7"]
SESSION_TTL = 0.5  # seconds: sessions left alone expire within the run
LIVE_TYPES = ("Generation", "Choice", "RequestStream", "SessionStream", "_ChatJob", "Session", "Record")


def build_server(tmp: Path, kv_budget_tokens: int = 1024) -> SimpleNamespace:
    """A server of its own (its weights change) and a second checkpoint of the same configuration."""
    other = shutil.copytree(model_dir(), tmp / "other")
    cfg = json.loads((other / "config.json").read_text())
    make_hf_model(
        other,
        "qwen3",
        seed=1,
        vocab_size=cfg["vocab_size"],
        eos_token_id=cfg["eos_token_id"],
        pad_token_id=cfg.get("pad_token_id"),
    )
    state = build_state(
        str(model_dir()),
        kv_budget_tokens=kv_budget_tokens,
        session_ttl_s=SESSION_TTL,
        access=Access(weight_updates=True),
    )
    thread = ServerThread(create_app(state)).start()
    return SimpleNamespace(
        url=thread.url,
        state=state,
        thread=thread,
        model=state.config.model_name,
        checkpoints=[str(model_dir()), str(other)],
    )


# ---------------------------------------------------------------- one client action each
def _sampling(rng: random.Random) -> dict:
    body = {"max_tokens": rng.randint(1, 12), "n": rng.choice([1, 1, 2, 3]), "seed": rng.randrange(1000)}
    if rng.random() < 0.5:
        body["temperature"] = rng.choice([0.0, 0.7, 1.3])
    if rng.random() < 0.3:
        body["stop"] = rng.sample(["e", "o", " ", "th", "1"], rng.randint(1, 2))
    if rng.random() < 0.2:
        body["ignore_eos"] = True
    return body


def _messages(rng: random.Random) -> list[dict]:
    return [{"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 4)))}]


async def _post(client: httpx.AsyncClient, path: str, body: dict, ok=(200,)) -> dict | str | None:
    """The JSON answer or the whole SSE text; asserts the status is one of `ok`."""
    if body.get("stream"):
        async with client.stream("POST", path, json=body) as r:
            text = (await r.aread()).decode()
            assert r.status_code in ok, text
            assert r.status_code != 200 or text.endswith("data: [DONE]\n\n") and '"error"' not in text, text
            return text if r.status_code == 200 else None
    r = await client.post(path, json=body)
    assert r.status_code in ok, r.text
    return r.json() if r.status_code == 200 else None


async def _chat(srv, client, rng):
    body = {"model": srv.model, "messages": _messages(rng), "stream": rng.random() < 0.5} | _sampling(rng)
    if not body["stream"] and rng.random() < 0.3:
        body |= {"logprobs": True, "top_logprobs": rng.randint(0, 3)}
    await _post(client, CHAT, body, ok=(200, 409))  # 409: the weights changed before the top logprobs


async def _completion(srv, client, rng):
    prompt = " ".join(rng.choices(WORDS, k=3)) if rng.random() < 0.7 else [rng.choice(WORDS), rng.choice(WORDS)]
    body = {"model": srv.model, "prompt": prompt, "stream": rng.random() < 0.5} | _sampling(rng)
    if not body["stream"] and rng.random() < 0.3:
        body |= {"logprobs": rng.randint(0, 2), "echo": rng.random() < 0.5}
    await _post(client, COMPLETIONS, body, ok=(200, 409))


async def _hangup(srv, client, rng):
    """A client that leaves mid-stream, or before a long JSON answer."""
    path = rng.choice([CHAT, COMPLETIONS])
    body = {"model": srv.model, "max_tokens": 100, "ignore_eos": True, "n": rng.choice([1, 2])} | (
        {"messages": _messages(rng)} if path == CHAT else {"prompt": rng.choice(WORDS)}
    )
    if rng.random() < 0.2:
        path = f"/sessions/hangup-{rng.randrange(10**9)}" + path
    if rng.random() < 0.6:
        async with client.stream("POST", path, json=body | {"stream": True}) as r:
            lines = r.aiter_lines()
            for _ in range(rng.randint(1, 4)):
                await anext(lines)
        return
    try:
        await client.post(path, json=body, timeout=rng.choice([0.02, 0.1]))
    except httpx.TimeoutException:
        pass


async def _bad(srv, client, rng):
    """A request refused with a 400 (before or after its session was taken)."""
    sid = f"/sessions/bad-{rng.randrange(10**9)}" if rng.random() < 0.3 else ""
    chat = {"model": srv.model, "messages": _messages(rng)}
    body, path = rng.choice(
        [
            (chat | {"max_tokens": 0}, CHAT),
            (chat | {"top_logprobs": 3, "stream": True, "logprobs": True}, CHAT),
            (chat | {"max_tokens": 10**6}, CHAT),
            (
                {
                    "model": srv.model,
                    "messages": [
                        {"role": "user", "content": "x"},
                        {
                            "role": "assistant",
                            "content": "y",
                            "prompt_token_ids": [1, 2],
                            "generation_token_ids": [3],
                            "generation_log_probs": [-1.0],
                        },
                        {"role": "user", "content": "z"},
                    ],
                },
                CHAT,
            ),
            ({"model": srv.model, "prompt": [10**7], "max_tokens": 2}, COMPLETIONS),
            ({"model": srv.model, "prompt": "hi", "logprobs": 1, "stream": True}, COMPLETIONS),
            ({"model": srv.model, "prompt": [], "max_tokens": 2}, COMPLETIONS),
        ]
    )
    r = await client.post(sid + path, json=body)
    assert r.status_code == 400, r.text


def _streamed_message(sse: str) -> dict:
    """The assistant message a streamed chat answer (n = 1) adds up to, token fields included."""
    deltas = [
        c["delta"] for line in sse.split("\n\n") if line.startswith("data: {") for c in json.loads(line[6:])["choices"]
    ]
    msg = {"role": "assistant", "content": "".join(d.get("content", "") for d in deltas)}
    if reasoning := "".join(d.get("reasoning_content", "") for d in deltas):
        msg["reasoning_content"] = reasoning
    if calls := [{k: v for k, v in tc.items() if k != "index"} for d in deltas for tc in d.get("tool_calls", [])]:
        msg["tool_calls"] = calls
    last = deltas[-1]
    return msg | {k: last[k] for k in ("prompt_token_ids", "generation_token_ids", "generation_log_probs")}


async def _session(srv, client, rng):
    """An agent episode: several turns sending the token fields back, then deleted or left to expire."""
    sid = f"s-{rng.randrange(10**12)}"
    msgs = _messages(rng)
    for turn in range(rng.randint(2, 5)):
        body = {"model": srv.model, "messages": msgs, "max_tokens": rng.randint(1, 8), "seed": turn}
        if rng.random() < 0.3:
            body["stream"] = True
        out = await _post(client, f"/sessions/{sid}" + CHAT, body)
        if body.get("stream"):  # the closing delta carries the token fields
            msg = _streamed_message(out)
        else:
            msg = {k: v for k, v in out["choices"][0]["message"].items() if v is not None}
        msgs = msgs + [msg] + _messages(rng)
    if rng.random() < 0.3:
        body = {"model": srv.model, "prompt": rng.choice(WORDS), "max_tokens": 3, "n": 2}
        await _post(client, f"/sessions/{sid}" + COMPLETIONS, body)
    r = await client.get(f"/sessions/{sid}/trajectories")
    assert r.status_code in (200, 404), r.text  # 404: it expired between two turns (a slow machine)
    if rng.random() < 0.6:
        assert (await client.delete(f"/sessions/{sid}")).status_code == 200


async def _update(srv, client, rng):
    r = await client.post("/update_weights_from_disk", json={"model_path": rng.choice(srv.checkpoints)})
    assert r.status_code == 200, r.text


ACTIONS = [(_chat, 5), (_completion, 4), (_hangup, 2), (_bad, 2), (_session, 2), (_update, 0.3)]


async def soak(srv, requests: int, seed: int, concurrency: int = 6) -> None:
    """`requests` client actions from `concurrency` clients at once."""
    rng = random.Random(seed)
    todo = rng.choices([a for a, _ in ACTIONS], weights=[w for _, w in ACTIONS], k=requests)
    seeds = [rng.randrange(2**32) for _ in todo]
    queue = list(zip(todo, seeds))

    async def worker(client):
        while queue:
            action, s = queue.pop()
            await action(srv, client, random.Random(s))

    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))


# ---------------------------------------------------------------- what must be back to idle
def wait_idle(srv, timeout: float = 10.0) -> None:
    """The engine holds no request, every session is given back, and the idle ones have expired."""
    st, t0 = srv.state, time.time()
    time.sleep(SESSION_TTL)
    while True:
        st._next_sweep = 0.0
        httpx.get(srv.url + "/metrics", timeout=10)  # a sweep of the idle sessions (on the server's loop)
        eng = st.engine
        if (
            not eng.has_unfinished()
            and not st.loop._streams
            and not st.sessions
            and eng.pool.num_free == eng.pool.num_pages
        ):
            return
        assert time.time() - t0 < timeout, (eng.stats(), len(st.loop._streams), st.sessions.keys())
        time.sleep(0.05)


def live_objects() -> dict[str, int]:
    gc.collect()
    names = {}
    for o in gc.get_objects():
        name = type(o).__name__
        if name in LIVE_TYPES and type(o).__module__.startswith("exactrl"):
            names[name] = names.get(name, 0) + 1
    return names


def pending_tasks() -> set[str]:
    """The coroutines of the asyncio tasks still running (the server's own: serving, its lifespan)."""
    gc.collect()
    return {t.get_coro().__qualname__ for t in gc.get_objects() if type(t) is asyncio.Task and not t.done()}


def check_idle(srv) -> None:
    wait_idle(srv)
    st, eng = srv.state, srv.state.engine
    assert not eng._requests and not eng._unclaimed
    assert not eng.scheduler.running and not eng.scheduler.waiting
    assert eng.pool.num_free == eng.pool.num_pages and not any(eng.pool._refs)
    assert not st.loop._streams and st.loop._commands.empty()
    assert st.loop.stats.unfinished_requests == 0 and st.loop.error is None
    assert not st.sessions
    vocab = eng.vocab_size
    assert len(st._token_str) <= vocab and len(st._token_bytes) <= vocab
    assert live_objects() == srv.objects  # (what earlier tests in this process left, e.g. in log records)
    assert pending_tasks() == srv.tasks


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = build_server(tmp_path_factory.mktemp("soak"))
    s.tasks = pending_tasks()  # before any request
    s.objects = live_objects()
    yield s
    s.thread.stop()


@pytest.mark.slow  # a soak: `make test-slow` (CI)
def test_mixed_requests_leave_the_server_idle(srv):
    asyncio.run(soak(srv, requests=40, seed=0))  # warm-up: caches, graphs, lazily built objects
    check_idle(srv)
    counters = len(srv.state.counters)
    asyncio.run(soak(srv, requests=300, seed=1))
    check_idle(srv)
    m = httpx.get(srv.url + "/metrics").json()
    assert m["server/sessions_expired"] > 0 and m["server/client_disconnects"] > 0 and m["engine/aborted"] > 0
    assert m["server/weight_updates"] > 0 and m.get("server/errors_400", 0) > 0
    assert len(srv.state.counters) <= counters + 10  # new kinds of events at most, never one key per request
    assert (
        httpx.post(
            srv.url + CHAT, json={"model": srv.model, "messages": _messages(random.Random(0)), "max_tokens": 2}
        ).status_code
        == 200
    )
