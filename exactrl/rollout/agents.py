"""Agent rollouts: run async OpenAI-client environments against the server, train on their tokens.

    for each problem, G episodes -> env(base_url=<server>/sessions/<id>/v1, problem, seed)
        -> reward                                   (the environment's own score)
        -> GET /sessions/<id>/trajectories          (token IDs, loss masks, behaviour logprobs)
    -> group advantages -> TrainBatch -> train_step -> weights copied into the server's engine

The environment never handles tokens: the server recorded every turn of the
session (`exactrl.chat.trajectory`). A trajectory's `prompt_ids` is the first
prompt; its completion holds the generated tokens (loss mask 1, engine
logprobs) interleaved with template, tool and user tokens (mask 0, logprob
0.0). An episode with several branches (parallel calls, n > 1) gives several
trajectories, all with the episode's advantage.

Seeds: episode j of problem k at step s samples with seed
`derive_seed(run_seed, step, k, j) * TURN_SEEDS` (exactrl/seeds.py; turns add their
index, below TURN_SEEDS, so no two turns of a step share a seed), so a step's
episodes do not depend on how many run concurrently.

An episode whose environment raises (a server error, a conversation that
outgrew the context), returns a reward that is not a finite number, or runs
past `episode_timeout_s` takes its group out of the step, as a group needs
all G rewards for its baseline; the others train. `rollout/failed_episodes`
counts them; if every group failed the step fails with the first error.

Legend: P problems, G episodes per problem.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from exactrl.algo.advantages import compute_advantages
from exactrl.chat.trajectory import Trajectory
from exactrl.envs.base import Problem
from exactrl.envs.rewards import as_reward
from exactrl.seeds import derive_seed
from exactrl.train.trainer import TrainBatch

TURN_SEEDS = 1000  # seeds per episode: one per turn
EnvFn = Callable[..., Awaitable[Any]]  # async (base_url, problem, *, seed, **kwargs) -> reward or object with .reward


@dataclass
class AgentRollout:
    """One episode: its reward and the token-level trajectories the server recorded."""

    problem: Problem
    reward: float
    trajectories: list[Trajectory]
    episode: Any  # whatever the environment returned (transcript, counters)


async def run_episode(
    server_url: str, env: EnvFn, problem: Problem, seed: int, client: httpx.AsyncClient, **env_kwargs
) -> AgentRollout:
    """One episode in a fresh session; the session is deleted once its trajectories are read."""
    sid = uuid.uuid4().hex
    try:
        result = await env(f"{server_url}/sessions/{sid}/v1", problem, seed=seed, **env_kwargs)
        r = await client.get(f"{server_url}/sessions/{sid}/trajectories")
        if r.status_code not in (200, 404):  # 404: the environment made no request, so there are no tokens
            raise RuntimeError(f"the server answered {r.status_code} for the episode's trajectories: {r.text[:300]}")
        trajectories = [Trajectory(**t) for t in r.json()["trajectories"]] if r.status_code == 200 else []
    finally:
        try:
            await client.delete(f"{server_url}/sessions/{sid}")
        except httpx.TransportError:  # the server is gone: its sessions with it; keep the episode's own error
            pass
    return AgentRollout(problem, _reward(result), trajectories, result)


def _reward(result: Any) -> float:
    """The episode's reward (returned, or its .reward), by the one rule of exactrl/envs/rewards.py."""
    return as_reward(result.reward if hasattr(result, "reward") else result, "the environment's reward")


async def collect_agent_groups(
    server_url: str,
    env: EnvFn,
    problems: list[Problem],
    group_size: int,
    seed: int,
    step: int,
    env_kwargs: dict | None = None,
    max_concurrency: int = 32,
    episode_timeout_s: float | None = None,
    indices: list[int] | None = None,
) -> list[list[AgentRollout | BaseException]]:
    """G episodes per problem, at most `max_concurrency` at a time; groups_P_G[k][j] (the exception an
    episode raised, in its place). `env_kwargs` go to every `env` call (model name, sampling settings, ...).
    `indices`: each problem's index in the step's batch, for its seeds (default 0, 1, ...).

    `episode_timeout_s`: an episode still running after that many seconds is cancelled and fails with a
    TimeoutError in its place (its session deleted), so one hung environment does not hang the step; None
    waits for ever. Cancelling works at the environment's awaits: a tool that blocks the event loop
    synchronously cannot be cut short."""
    if episode_timeout_s is not None and (
        isinstance(episode_timeout_s, bool)
        or not isinstance(episode_timeout_s, (int, float))
        or not 0 < episode_timeout_s < float("inf")
    ):
        raise ValueError(f"episode_timeout_s must be a number of seconds > 0 or None, got {episode_timeout_s!r}")
    sem = asyncio.Semaphore(max_concurrency)
    async with httpx.AsyncClient(timeout=None) as client:

        async def one(k: int, j: int) -> AgentRollout:
            async with sem:
                episode_seed = derive_seed(seed, step, k if indices is None else indices[k], j) * TURN_SEEDS
                episode = run_episode(server_url, env, problems[k], episode_seed, client, **(env_kwargs or {}))
                if episode_timeout_s is None:
                    return await episode
                deadline = asyncio.get_running_loop().time() + episode_timeout_s
                try:  # wait_for raises asyncio.TimeoutError, which before Python 3.11 is not the builtin TimeoutError
                    return await asyncio.wait_for(episode, episode_timeout_s)
                except asyncio.TimeoutError:
                    if asyncio.get_running_loop().time() < deadline:  # the environment's own timeout: its message
                        raise
                    raise TimeoutError(
                        f"the episode of problem {k}, sample {j} ran longer than episode_timeout_s="
                        f"{episode_timeout_s} and was cancelled"
                    ) from None

        flat = await asyncio.gather(
            *(one(k, j) for k in range(len(problems)) for j in range(group_size)), return_exceptions=True
        )
    for x in flat:
        if isinstance(x, (KeyboardInterrupt, SystemExit, asyncio.CancelledError)):
            raise x
    return [list(flat[k * group_size : (k + 1) * group_size]) for k in range(len(problems))]


def complete_groups(groups_P_G: list[list]) -> tuple[list[list[AgentRollout]], int]:
    """The groups none of whose episodes failed, and how many episodes failed; every group failed: the first
    error, raised."""
    failed = [x for g in groups_P_G for x in g if isinstance(x, BaseException)]
    kept = [g for g in groups_P_G if not any(isinstance(x, BaseException) for x in g)]
    if not kept:
        raise RuntimeError(
            f"every group had an episode that failed ({len(failed)} episodes); the first error: "
            f"{type(failed[0]).__name__}: {failed[0]}"
        ) from failed[0]
    return kept, len(failed)


def agent_train_batch(
    groups_P_G: list[list[AgentRollout]], advantage: str = "grpo", advantage_kwargs: dict | None = None
) -> TrainBatch:
    """Group-relative advantages per episode, broadcast to each of its trajectories."""
    rewards_PG = torch.tensor([[r.reward for r in g] for g in groups_P_G], dtype=torch.float64)
    adv_PG = compute_advantages(advantage, rewards_PG, **(advantage_kwargs or {}))
    prompt_ids, completion_ids, behav, adv, mask = [], [], [], [], []
    for k, g in enumerate(groups_P_G):
        for j, r in enumerate(g):
            for t in r.trajectories:
                if not any(t.loss_mask):
                    continue
                prompt_ids.append(t.prompt_ids)
                completion_ids.append(t.completion_ids)
                behav.append(t.behav_logprobs)
                mask.append(t.loss_mask)
                adv.append(float(adv_PG[k, j]))
    if not prompt_ids:
        raise ValueError("no episode produced a trajectory with generated tokens: nothing to train on")
    return TrainBatch(
        prompt_ids=prompt_ids, completion_ids=completion_ids, behav_logprobs=behav, advantages=adv, loss_mask=mask
    )


def agent_rollout_metrics(groups_P_G: list[list[AgentRollout]]) -> dict[str, float]:
    flat = [r for g in groups_P_G for r in g]
    trajs = [t for r in flat for t in r.trajectories]
    gen = [sum(t.loss_mask) for t in trajs]
    return {
        "rollout/reward_mean": sum(r.reward for r in flat) / len(flat),
        "rollout/accuracy": sum(r.reward >= 1.0 for r in flat) / len(flat),
        "rollout/trajectories_per_episode": len(trajs) / len(flat),
        "rollout/turns_mean": sum(t.num_turns for t in trajs) / max(len(trajs), 1),
        "rollout/generated_tokens_mean": sum(gen) / max(len(gen), 1),
        "rollout/masked_tokens_mean": sum(len(t.loss_mask) - g for t, g in zip(trajs, gen)) / max(len(trajs), 1),
        "rollout/zero_std_group_frac": sum(len({r.reward for r in g}) == 1 for g in groups_P_G) / len(groups_P_G),
    }


def sync_weights(server_state, model) -> int:
    """Copies the trainer's weights into the server's engine (bitwise), between engine steps."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return server_state.loop.call(lambda engine: engine.update_weights(sd)).result()


def agent_train_step(
    model,
    optimizer,
    loss_fn,
    settings,
    server_state,
    server_url: str,
    env: EnvFn,
    problems: list[Problem],
    group_size: int,
    seed: int,
    step: int,
    env_kwargs: dict | None = None,
    advantage: str = "grpo",
    advantage_kwargs: dict | None = None,
    episode_timeout_s: float | None = None,
    ref_model=None,
) -> dict[str, float]:
    """Collect episodes -> train on their trajectories -> sync the server's engine. Returns flat metrics.

    `settings.temperature/top_k/top_p` must be the ones the environment samples with, so that the
    trainer's π_old is the distribution the engine sampled from. `episode_timeout_s`: see
    `collect_agent_groups`. `ref_model`: the reference policy of `settings.kl_coef`'s KL term, which
    goes in the loss (the episodes' rewards are the environment's own: no KL in the reward).
    """
    from exactrl.train.trainer import train_step

    if settings.kl_coef and not settings.kl_in_loss:  # checked before any episode runs
        raise ValueError(
            "agent_train_step puts no KL in the reward (settings.kl_in_loss=False): the rewards are "
            "the environment's own; put the KL term in the loss (kl_in_loss=True)"
        )
    if settings.kl_coef and ref_model is None:
        raise ValueError(
            f"settings.kl_coef={settings.kl_coef} puts a KL term in the loss but there is no ref_model: "
            f"pass the reference policy (ref_model=...), or set kl_coef=0"
        )
    groups, failed = complete_groups(
        asyncio.run(
            collect_agent_groups(
                server_url, env, problems, group_size, seed, step, env_kwargs, episode_timeout_s=episode_timeout_s
            )
        )
    )
    want = [float(settings.temperature) or 1.0, settings.top_k, float(settings.top_p)]
    used = {tuple(x) for g in groups for r in g for t in r.trajectories for x in t.sampling}
    if used - {tuple(want)}:
        raise ValueError(
            f"episodes sampled with (temperature, top_k, top_p) {sorted(used)} but the trainer uses "
            f"{tuple(want)}: its logprobs would not be the behaviour distribution"
        )
    batch = agent_train_batch(groups, advantage, advantage_kwargs)
    metrics = train_step(model, optimizer, loss_fn, batch, settings, ref_model)
    metrics |= agent_rollout_metrics(groups) | {"rollout/failed_episodes": failed}
    metrics["engine/version"] = sync_weights(server_state, model)
    metrics["step"] = step
    return metrics
