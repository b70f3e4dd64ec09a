"""Randomized concurrency stress of the server: many clients at once against one server whose KV cache is
small enough that sequences are preempted and recomputed.

Each example is a schedule hypothesis draws (so a failure comes back with the same clients, though not the same
interleaving): streaming and JSON chat and completions, n > 1, seeded sampling under temperature / top_k /
top_p / stop strings, two-turn sessions that send the first turn's token fields back, clients that hang up
mid-stream or before a JSON answer, and invalid requests, all started within a fraction of a second. Then:
  1. every valid request got a well-formed answer (and every invalid one a 4xx naming the problem);
  2. every completion's logprobs equal `exactrl.sequence_logprobs` of prompt + completion bitwise, however
     its batch, preemptions and chunking went; a session's trajectory is those turns' exact tokens;
  3. a seeded request sent again alone returns the same tokens;
  4. once the clients are done the engine holds no request, running or waiting, its KV pages are all free,
     and no session is left busy;
  5. the server still answers.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import httpx
import pytest
from fuzzing import examples
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from serving import check_trajectory, model_dir, trainer_logprobs

from exactrl.server.app import ServerThread, build_state, create_app
from exactrl.server.guard import Access

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
KV_BUDGET = 160  # 5 pages of 32 tokens: two long generations at once preempt each other
WORDS = ["hello", "world", "what is 2+3?", "the quick brown fox", "go on", "é😀", "12*7"]


@dataclass
class Spec:
    """One client of a schedule."""

    kind: str  # "chat" | "completion" | "session" | "hangup" | "invalid"
    path: str
    body: dict
    delay: float  # seconds after the schedule starts
    hangup_after: int = -1  # hangup: SSE lines read before closing (-1: a JSON request given up on)
    session: bool = False  # hangup: under a session (which then records nothing)


@dataclass
class Outcome:
    spec: Spec
    choices: list[dict] = field(default_factory=list)  # token fields + finish_reason of each choice
    turns: list[dict] = field(default_factory=list)  # a session's assistant messages
    trajectories: list[dict] = field(default_factory=list)


@pytest.fixture(scope="module")
def server():
    # 32-token steps: prompts are prefilled in chunks, decodes share steps with them; 8 sequence slots:
    # requests of n = 3 queue for seats
    state = build_state(
        str(model_dir()),
        kv_budget_tokens=KV_BUDGET,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        access=Access(weight_updates=True),
    )
    thread = ServerThread(create_app(state)).start()
    yield SimpleNamespace(url=thread.url, state=state, model=state.config.model_name)
    thread.stop()


# ---------------------------------------------------------------- schedules
def _sampling(draw) -> dict:
    out = {"seed": draw(st.integers(0, 2**31)), "temperature": draw(st.sampled_from([0.0, 0.7, 1.0, 1.3]))}
    if draw(st.booleans()):
        out["top_k"] = draw(st.sampled_from([1, 5, 50, 512]))
    if draw(st.booleans()):
        out["top_p"] = draw(st.sampled_from([0.5, 0.9, 1.0]))
    if draw(st.integers(0, 3)) == 0:
        out["stop"] = draw(st.sampled_from(["e", [" ", "o"], "\n"]))
    if draw(st.booleans()):
        out["ignore_eos"] = True  # long generations: preemption
    return out


def _messages(draw) -> list[dict]:
    """A user turn of at most 3 words: a prompt of <= 40 tokens, which leaves room for 100 generated ones."""
    return [{"role": "user", "content": " ".join(draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=3)))}]


@st.composite
def specs(draw, model: str) -> Spec:
    kind = draw(st.sampled_from(["chat", "chat", "completion", "completion", "session", "hangup", "invalid", "reload"]))
    delay = draw(st.sampled_from([0.0, 0.0, 0.05, 0.2, 0.5]))
    stream = draw(st.booleans())
    base = {"model": model, "max_tokens": draw(st.integers(1, 100)), "n": draw(st.integers(1, 3))} | _sampling(draw)
    if kind == "completion" or kind == "hangup" and draw(st.booleans()):
        k = draw(st.integers(1, 2))
        prompts = [draw(st.lists(st.integers(0, 511), min_size=1, max_size=50)) for _ in range(k)]
        body = base | {"prompt": prompts[0] if k == 1 else prompts, "stream": stream}
        if not stream and draw(st.booleans()):
            body["logprobs"] = draw(st.integers(0, 2))
            body["echo"] = draw(st.booleans())
        spec = Spec(kind, COMPLETIONS, body, delay)
    else:
        body = base | {"messages": _messages(draw), "stream": stream}
        if not stream and draw(st.booleans()):
            body |= {"logprobs": True, "top_logprobs": draw(st.integers(0, 2))}
        spec = Spec(kind, CHAT, body, delay)
    if kind == "session":  # two turns: temperature only, as `check_trajectory` scores them
        spec.body = {k: v for k, v in spec.body.items() if k not in ("top_k", "top_p", "n", "top_logprobs")}
        spec.body["max_tokens"] = min(spec.body["max_tokens"], 40)
    elif kind == "hangup":
        spec.body = {k: v for k, v in spec.body.items() if k not in ("logprobs", "top_logprobs", "echo")}
        spec.body |= {"ignore_eos": True, "max_tokens": 100, "stream": draw(st.booleans())}
        spec.hangup_after = draw(st.integers(0, 6)) if spec.body["stream"] else -1
        spec.session = draw(st.booleans())
    elif kind == "invalid":
        bad = draw(
            st.sampled_from(
                [
                    ("top_k", 10**30),
                    ("n", 0),
                    ("n", 9),
                    ("temperature", 3),
                    ("model", "gpt-4"),
                    ("max_tokens", 10**6),
                    ("seed", 2**64),
                    ("stop", [""]),
                    ("logit_bias", {"5": 1.0}),
                    ("prompt", [512]),
                    ("prompt", [1] * 400),
                    ("messages", [{"role": "wizard", "content": "x"}]),
                ]
            )
        )
        if bad[0] == "prompt":
            spec.path, spec.body = COMPLETIONS, {k: v for k, v in spec.body.items() if k != "messages"}
        elif bad[0] == "messages":
            spec.path, spec.body = CHAT, {k: v for k, v in spec.body.items() if k != "prompt"}
        spec.body[bad[0]] = bad[1]
    return spec


def schedules(model: str, max_size: int):
    return st.lists(specs(model), min_size=4, max_size=max_size)


# ---------------------------------------------------------------- clients
def _token_fields(holder: dict, finish_reason) -> dict:
    """The token fields of a choice, checked; with its finish_reason."""
    gen, lps = holder["generation_token_ids"], holder["generation_log_probs"]
    assert holder["prompt_token_ids"] and all(type(t) is int for t in holder["prompt_token_ids"] + gen), holder
    assert len(gen) == len(lps) and all(math.isfinite(lp) and lp <= 0 for lp in lps), holder
    assert finish_reason in ("stop", "length", "tool_calls"), finish_reason
    return {k: holder[k] for k in ("prompt_token_ids", "generation_token_ids", "generation_log_probs")} | {
        "finish_reason": finish_reason
    }


def _json_choices(r: httpx.Response, path: str, expect: int) -> list[dict]:
    assert r.status_code == 200, r.text[:2000]
    body = r.json()
    choices = body["choices"]
    assert [c["index"] for c in choices] == list(range(expect)), choices
    out = []
    for c in choices:
        if path.endswith(CHAT):
            m = c["message"]
            o = _token_fields(m, c["finish_reason"]) | {
                "message": m,
                "text": (m.get("reasoning_content") or "", m["content"] or ""),
            }
            if c["logprobs"] is not None:
                o["logprobs"] = [e["logprob"] for e in c["logprobs"]["content"]]
        else:
            o = _token_fields(c, c["finish_reason"]) | {"text": c["text"]}
        out.append(o)
    assert body["usage"]["completion_tokens"] == sum(len(c["generation_token_ids"]) for c in out)
    return out


async def _stream_choices(r: httpx.Response, path: str, expect: int) -> list[dict]:
    assert r.status_code == 200, (await r.aread())[:2000]
    events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    done: dict[int, dict] = {}
    parts = [{"reasoning_content": "", "content": "", "text": "", "logprobs": []} for _ in range(expect)]
    for e in map(json.loads, events[:-1]):
        assert "error" not in e, e
        for c in e["choices"]:
            j = c["index"]
            assert j not in done, e  # nothing after a choice's closing chunk
            if path.endswith(CHAT):
                for k in ("content", "reasoning_content"):
                    parts[j][k] += c["delta"].get(k) or ""
                parts[j]["logprobs"] += [x["logprob"] for x in (c["logprobs"] or {}).get("content") or []]
            else:
                parts[j]["text"] += c["text"]
            if c["finish_reason"] is not None:
                done[j] = _token_fields(c["delta"] if path.endswith(CHAT) else c, c["finish_reason"])
    assert sorted(done) == list(range(expect)), sorted(done)
    out = []
    for o, p in zip((done[j] for j in range(expect)), parts):
        if path.endswith(CHAT):
            msg = {"role": "assistant", "content": p["content"]} | (
                {"reasoning_content": p["reasoning_content"]} if p["reasoning_content"] else {}
            )
            o |= {
                "message": msg | {k: o[k] for k in o if k != "finish_reason"},
                "text": (p["reasoning_content"], p["content"]),
            }
            if p["logprobs"]:
                o["logprobs"] = p["logprobs"]
        else:
            o["text"] = p["text"]
        out.append(o)
    return out


def expected_choices(spec: Spec) -> int:
    prompt = spec.body.get("prompt")
    k = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else 1
    return k * spec.body.get("n", 1)


async def request(client: httpx.AsyncClient, path: str, body: dict) -> list[dict]:
    if body.get("stream"):
        async with client.stream("POST", path, json=body) as r:
            return await _stream_choices(r, path, expected_choices(Spec("", path, body, 0)))
    return _json_choices(await client.post(path, json=body), path, expected_choices(Spec("", path, body, 0)))


def scores_alternatives(body: dict) -> bool:
    """Top logprobs or echo: scored after generation, a 409 if the weights changed since sampling."""
    return bool(
        body.get("top_logprobs") or body.get("echo") or type(body.get("logprobs")) is int and body["logprobs"] > 0
    )


async def run_client(client: httpx.AsyncClient, spec: Spec, sid: str, reloads: bool) -> Outcome:
    await asyncio.sleep(spec.delay)
    out = Outcome(spec)
    if spec.kind in ("chat", "completion") and reloads and scores_alternatives(spec.body):
        r = await client.post(spec.path, json=spec.body)
        if r.status_code == 409:  # the weights were reloaded (the same ones) between sampling and scoring
            assert r.json()["error"]["code"] == "weights_changed", r.text
        else:
            out.choices = _json_choices(r, spec.path, expected_choices(spec))
    elif spec.kind in ("chat", "completion"):
        out.choices = await request(client, spec.path, spec.body)
    elif spec.kind == "reload":  # the served weights again: every sequence is preempted and recomputed
        r = await client.post("/update_weights_from_disk", json={"model_path": str(model_dir())})
        assert r.status_code == 200 and r.json()["success"], r.text
    elif spec.kind == "session":
        messages = list(spec.body["messages"])
        for t in range(2):
            (c,) = await request(
                client, f"/sessions/{sid}{CHAT}", spec.body | {"messages": messages, "seed": spec.body["seed"] + t}
            )
            msg = {k: v for k, v in c.pop("message").items() if k != "finish_reason"}
            out.turns.append(c)
            messages = messages + [msg, {"role": "user", "content": "go on"}]
        r = await client.get(f"/sessions/{sid}/trajectories")
        assert r.status_code == 200, r.text
        out.trajectories = r.json()["trajectories"]
        assert (await client.delete(f"/sessions/{sid}")).json()["deleted"]
    elif spec.kind == "hangup":
        path = f"/sessions/{sid}{spec.path}" if spec.session else spec.path
        if spec.hangup_after >= 0:
            async with client.stream("POST", path, json=spec.body) as r:
                assert r.status_code == 200, (spec.body, (await r.aread())[:2000])
                lines = r.aiter_lines()
                for _ in range(spec.hangup_after):
                    await anext(lines)
        else:  # a JSON request given up on: the connection is closed under it (unless it was quicker)
            try:
                out.choices = _json_choices(
                    await client.post(path, json=spec.body, timeout=0.05 + spec.delay),
                    spec.path,
                    expected_choices(spec),
                )
            except httpx.TimeoutException:
                pass

    else:
        r = await client.post(spec.path, json=spec.body)
        assert 400 <= r.status_code < 500, (spec.body, r.status_code, r.text[:2000])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return out


async def run_schedule(url: str, schedule: list[Spec]) -> list[Outcome]:
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=64)) as client:
        reloads = any(s.kind == "reload" for s in schedule)
        async with asyncio.TaskGroup() as tg:  # the first failure cancels the other clients and is raised
            tasks = [tg.create_task(run_client(client, s, session_id(k), reloads)) for k, s in enumerate(schedule)]
    return [t.result() for t in tasks]


def session_id(k: int) -> str:
    return f"conc-{k}"


# ---------------------------------------------------------------- checks
def sampling_of(body: dict) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) the trainer scores with: T = 0 reports the T = 1 logprobs."""
    return (body.get("temperature") or 1.0, body.get("top_k", -1), body.get("top_p", 1.0))


def check_exact(choices: list[dict], body: dict, cache: dict) -> None:
    for c in choices:
        full = c["prompt_token_ids"] + c["generation_token_ids"]
        key = (tuple(full), sampling_of(body))
        if key not in cache:
            cache[key] = trainer_logprobs(full, *sampling_of(body))
        start = len(c["prompt_token_ids"])
        assert cache[key][start - 1 :] == c["generation_log_probs"], (body, c)  # bitwise
        if body.get("logprobs") is True:  # chat's logprobs.content, streamed or not: the same values
            assert c.get("logprobs", []) == c["generation_log_probs"], (body, c)


def check_session(out: Outcome) -> None:
    turns = [SimpleNamespace(**t) for t in out.turns]
    (t,) = out.trajectories
    check_trajectory(t, turns, out.spec.body.get("temperature") or 1.0)


def wait_idle(url: str, timeout: float = 30.0) -> dict:
    t0 = time.time()
    while True:
        m = httpx.get(url + "/metrics", timeout=10).json()
        if (
            m["engine/unfinished_requests"] == 0
            and m["engine/kv_pages_free"] == m["engine/kv_pages_total"]
            and m["engine/num_requests"] == m["engine/num_running"] == m["engine/num_waiting"] == 0
        ):
            return m
        assert time.time() - t0 < timeout, f"the engine did not go idle: {m}"
        time.sleep(0.05)


def check_idle(server) -> dict:
    m = wait_idle(server.url)
    eng = server.state.engine
    assert eng.pool.num_free == eng.pool.num_pages and not eng.has_unfinished()
    assert not eng.scheduler.running and not eng.scheduler.waiting
    assert all(s.busy == 0 for s in server.state.sessions.values()), server.state.sessions
    return m


def replay_alone(url: str, model: str, outcomes: list[Outcome], rng: random.Random, k: int) -> None:
    """A few seeded requests sent again, one at a time and streamed if they were not (or not if they were):
    the same tokens and text as in the crowd."""
    done = [o for o in outcomes if o.choices]
    for o in rng.sample(done, min(k, len(done))):
        body = o.spec.body | {"stream": not o.spec.body["stream"]}
        if body["stream"]:  # alternatives are not streamed
            body = {k: v for k, v in body.items() if k not in ("top_logprobs", "echo")}
            body = {k: v for k, v in body.items() if not (k == "logprobs" and o.spec.path == COMPLETIONS)}
        again = asyncio.run(_one(url, Spec(o.spec.kind, o.spec.path, body, 0)))
        for a, c in zip(again, o.choices, strict=True):
            assert a["generation_token_ids"] == c["generation_token_ids"], (body, a, c)
            assert a["generation_log_probs"] == c["generation_log_probs"], (body, a, c)
            if not o.spec.body.get("echo"):
                assert a["text"] == c["text"], (body, a, c)
    r = httpx.post(
        url + CHAT, timeout=60, json={"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert r.status_code == 200, r.text


async def _one(url: str, spec: Spec) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return await request(client, spec.path, spec.body)


def run_and_check(server, schedule: list[Spec], cache: dict) -> None:
    outcomes = asyncio.run(run_schedule(server.url, schedule))
    check_idle(server)
    for k, o in enumerate(outcomes):
        if o.spec.kind == "hangup" and o.spec.session:  # recorded only if it was answered (the hang-up came late)
            r = httpx.get(f"{server.url}/sessions/{session_id(k)}/trajectories", timeout=60)
            assert r.status_code == 200, r.text
            # (identical choices, or one a prefix of another, are one trajectory)
            assert len(r.json()["trajectories"]) <= expected_choices(o.spec), r.text[:2000]
            if o.choices:
                assert r.json()["trajectories"], r.text
            assert httpx.delete(f"{server.url}/sessions/{session_id(k)}", timeout=60).json()["deleted"]
    for o in outcomes:
        if o.choices:
            check_exact(o.choices, o.spec.body, cache)
        if o.turns:
            check_session(o)
    replay_alone(server.url, server.model, outcomes, random.Random(len(schedule)), 2)  # (the first may be invalid)
    check_idle(server)


# no shrinking: each example is a whole crowd of requests (minutes to shrink); the failing schedule is printed
SCHEDULES = settings(
    max_examples=examples(15),
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def test_concurrent_clients_are_exact_and_leave_nothing_behind(server):
    before = wait_idle(server.url)
    cache: dict = {}

    @SCHEDULES
    @given(schedule=schedules(server.model, 12))
    def run(schedule):
        run_and_check(server, schedule, cache)

    run()
    after = wait_idle(server.url)
    assert after["engine/num_preemptions"] > before["engine/num_preemptions"]  # the KV budget was contended


@pytest.mark.slow
def test_concurrent_clients_many_schedules(server):
    cache: dict = {}

    @settings(SCHEDULES, max_examples=examples(40))
    @given(schedule=schedules(server.model, 24))
    def run(schedule):
        run_and_check(server, schedule, cache)

    run()
