"""Fuzzed agent rollouts: environments that raise, return junk rewards, stall or use tools badly.

A small HTTP server stands in for exactrl's (it serves the trajectories each episode's environment
registered under its session id), so `collect_agent_groups` runs as in training. Whatever the episodes do:
the batch is not lost to one bad episode, each failure is kept in its place and counted, and the training
data carries loss only on generated tokens.
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch
from fastapi import FastAPI, HTTPException
from fuzzing import examples
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from exactrl.envs.base import Problem
from exactrl.envs.tool_use import calculate
from exactrl.rollout.agents import agent_train_batch, collect_agent_groups, complete_groups
from exactrl.server.app import ServerThread

REGISTERED: dict[str, list[dict]] = {}  # session id -> its trajectories


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/sessions/{sid}/trajectories")
    async def trajectories(sid: str):
        if sid not in REGISTERED or REGISTERED[sid] == "broken":
            raise HTTPException(404 if sid not in REGISTERED else 500, "the server broke")
        return {"trajectories": REGISTERED[sid]}

    @app.delete("/sessions/{sid}")
    async def drop(sid: str):
        return {"deleted": REGISTERED.pop(sid, None) is not None}

    return app


@pytest.fixture(scope="module")
def url():
    with ServerThread(_app()) as srv:
        yield srv.url


def _trajectory(turns: int, tool_out: str) -> dict:
    """A branch as the server records it: generated tokens (mask 1) between prompt and tool tokens (mask 0)."""
    completion, mask = [], []
    for k in range(turns):
        completion += [10 + k, 11, 2]
        mask += [1, 1, 1]
        tool = [20 + ord(c) % 50 for c in tool_out[:64]]  # a huge tool output, as the template would hold it
        completion += tool
        mask += [0] * len(tool)
    lps = [-0.5 if m else 0.0 for m in mask]
    return dict(
        prompt_ids=[1, 5, 6],
        completion_ids=completion,
        loss_mask=mask,
        behav_logprobs=lps,
        versions=[0 if m else -1 for m in mask],
        num_turns=turns,
        sampling=[[1.0, -1, 1.0]],
    )


TOOLS = st.sampled_from(["ok", "raise", "none", "number", "huge", "bad_args"])
OUTCOMES = st.one_of(st.floats(0, 1), st.sampled_from(["raise", "nan", "inf", "none", "str", "no_request", "stall"]))


def _tool(kind: str) -> str:
    """What an environment makes of a tool: its result, or an error text when the tool misbehaves."""
    try:
        out = {
            "ok": lambda: calculate("2+3"),
            "raise": lambda: 1 // 0,
            "none": lambda: None,
            "number": lambda: 5,
            "huge": lambda: "9" * 100_000,
            "bad_args": lambda: calculate({"e": 1}),
        }[kind]()
    except ZeroDivisionError as e:
        return f"error: {type(e).__name__}"
    return out if isinstance(out, str) else f"error: the tool returned {type(out).__name__}"


async def _play(base_url: str, outcome, tools: list[str]):
    """One episode: registers its branch (tool results included) unless it made no request, then ends as
    `outcome` says: a reward, an exception, or a reward that is not a number."""
    sid = base_url.split("/sessions/")[1].split("/")[0]
    if outcome == "stall":
        await asyncio.sleep(0.05)  # a slow tool: the other episodes go on meanwhile
    if outcome != "no_request":
        REGISTERED[sid] = [_trajectory(len(tools) + 1, "".join(_tool(t) for t in tools))]
    if outcome == "raise":
        raise ConnectionError("the model server went away")
    return {"nan": math.nan, "inf": math.inf, "none": None, "str": "1.0", "no_request": 0.0, "stall": 0.5}.get(
        outcome, outcome
    )


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    episodes=st.lists(
        st.lists(st.tuples(OUTCOMES, st.lists(TOOLS, max_size=2)), min_size=2, max_size=2), min_size=1, max_size=3
    )
)
@example(episodes=[[("no_request", []), ("no_request", [])]])  # a kept group with no trajectory at all
def test_bad_episodes_leave_the_batch_standing_and_only_generated_tokens_carry_loss(url, episodes):
    problems = [Problem(prompt=f"p{k}", answer="5") for k in range(len(episodes))]
    calls = {}  # problem -> episodes started: episode j of the plan is the j-th call (any order is fine)

    async def env(base_url, problem, *, seed):
        k = int(problem.prompt[1:])
        j = calls[k] = calls.get(k, -1) + 1
        return await _play(base_url, *episodes[k][j])

    groups = asyncio.run(collect_agent_groups(url, env, problems, 2, seed=0, step=0, max_concurrency=3))
    assert not REGISTERED  # every session was deleted, failed ones included
    bad = {"raise", "nan", "inf", "none", "str"}
    for k, g in enumerate(groups):
        fails = sum(isinstance(x, BaseException) for x in g)
        assert fails == sum(o in bad for o, _ in episodes[k])
        for x in g:
            if isinstance(x, ValueError):
                assert "reward must be a finite number" in str(x)
            elif isinstance(x, BaseException):
                assert isinstance(x, ConnectionError)
    n_failed = sum(o in bad for g in episodes for o, _ in g)
    if all(any(o in bad for o, _ in g) for g in episodes):
        with pytest.raises(RuntimeError, match=f"every group had an episode that failed \\({n_failed} episodes\\)"):
            complete_groups(groups)
        return
    kept, failed = complete_groups(groups)
    assert failed == n_failed and len(kept) == sum(not any(o in bad for o, _ in g) for g in episodes)
    trajs = [t for g in kept for r in g for t in r.trajectories]
    if not any(any(t.loss_mask) for t in trajs):  # the kept episodes made no request: nothing to train on
        with pytest.raises(ValueError, match="no episode produced a trajectory with generated tokens"):
            agent_train_batch(kept)
        return
    batch = agent_train_batch(kept)
    assert batch.loss_mask == [t.loss_mask for t in trajs if any(t.loss_mask)]
    for c, m, lp in zip(batch.completion_ids, batch.loss_mask, batch.behav_logprobs):
        assert all((x == 1) == (tok < 20) for tok, x in zip(c, m))  # generated ids are < 20 in _trajectory
        assert all((x == 0) == (p == 0.0) for x, p in zip(m, lp))


@pytest.mark.parametrize(
    "reward, shown",
    [
        (math.nan, "nan"),
        (math.inf, "inf"),
        (None, "None"),
        ("1.0", "'1.0'"),
        (torch.tensor([1.0, 0.0]), "tensor"),
        (np.array([True, False]), "array"),
        pytest.param(10**400, "1000", id="int_beyond_float"),
    ],
)
def test_a_reward_that_is_not_a_finite_number_fails_its_episode_only(url, reward, shown):
    """A reward that is not one finite real number (NaN, inf, None, a string "1.0", an array or tensor of
    several values, an int beyond every float) fails its own episode, naming it; the step's other groups go
    on (NaN or inf in the advantages would fail every group: "scale the rewards down")."""

    async def env(base_url, problem, *, seed):
        return reward if problem.prompt == "bad" else 1.0 if seed % 2 else 0.0

    groups = asyncio.run(collect_agent_groups(url, env, [Problem("bad", "1"), Problem("good", "1")], 2, 0, 0))
    assert all(
        isinstance(x, ValueError) and "reward must be a finite number" in str(x) and shown in str(x) for x in groups[0]
    )
    kept, failed = complete_groups(groups)
    assert failed == 2 and len(kept) == 1 and [r.problem.prompt for r in kept[0]] == ["good", "good"]


def test_an_episode_whose_trajectories_the_server_cannot_give_fails_instead_of_training_on_nothing(url):
    """Any answer but 200 for an episode's trajectories fails the episode: it does not go on with no
    trajectories, its tokens lost and its reward still in the group's baseline. A 404 (the environment made
    no request) means no tokens."""

    async def env(base_url, problem, *, seed):
        REGISTERED[base_url.split("/sessions/")[1].split("/")[0]] = "broken"
        return 1.0

    groups = asyncio.run(collect_agent_groups(url, env, [Problem("p", "1")], 2, 0, 0))
    assert all(
        isinstance(x, RuntimeError) and "answered 500 for the episode's trajectories" in str(x) for x in groups[0]
    )
    assert not REGISTERED


@pytest.mark.parametrize(
    "reward", [np.float32(0.5), torch.tensor(0.5), torch.tensor([0.5]), 1, 0.5, True, np.False_, torch.tensor([True])]
)
def test_a_reward_of_any_real_number_type_is_taken(url, reward):
    async def env(base_url, problem, *, seed):
        return reward

    groups = asyncio.run(collect_agent_groups(url, env, [Problem("good", "1")], 2, 0, 0))
    assert [r.reward for r in groups[0]] == [float(reward.item() if hasattr(reward, "item") else reward)] * 2


def test_a_hung_episode_fails_alone_after_episode_timeout_s_and_its_session_is_deleted(url):
    """episode_timeout_s bounds an episode: an environment that never returns fails its own episodes, their
    sessions are deleted, and the rest of the step goes on instead of hanging."""
    sids = []

    async def env(base_url, problem, *, seed):
        sid = base_url.split("/sessions/")[1].split("/")[0]
        REGISTERED[sid] = [_trajectory(1, "ok")]
        sids.append(sid)
        if problem.prompt == "hang":
            await asyncio.Event().wait()  # never set
        return 1.0

    groups = asyncio.run(
        collect_agent_groups(url, env, [Problem("hang", "1"), Problem("good", "1")], 2, 0, 0, episode_timeout_s=0.5)
    )  # a hang: pytest-timeout fails it
    assert all(
        isinstance(x, TimeoutError) and "problem 0, sample" in str(x) and "episode_timeout_s=0.5" in str(x)
        for x in groups[0]
    )
    assert [r.reward for r in groups[1]] == [1.0, 1.0]
    assert len(sids) == 4 and not set(sids) & set(REGISTERED)  # every session deleted, the cancelled ones too


@pytest.mark.parametrize("episode_timeout_s", [None, 60])
def test_an_environments_own_timeout_error_keeps_its_message(url, episode_timeout_s):
    """A TimeoutError the environment raises itself (a judge's own deadline) keeps its message: it is not
    reported as the episode running past episode_timeout_s, with or without an episode_timeout_s."""

    async def env(base_url, problem, *, seed):
        raise TimeoutError("the judge took too long")

    groups = asyncio.run(
        collect_agent_groups(url, env, [Problem("p", "1")], 2, 0, 0, episode_timeout_s=episode_timeout_s)
    )
    assert [str(x) for x in groups[0]] == ["the judge took too long"] * 2


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, True, "5"])
def test_a_bad_episode_timeout_is_refused(url, bad):
    async def env(base_url, problem, *, seed):
        return 1.0

    with pytest.raises(ValueError, match="episode_timeout_s must be a number of seconds > 0 or None"):
        asyncio.run(collect_agent_groups(url, env, [Problem("good", "1")], 2, 0, 0, episode_timeout_s=bad))
