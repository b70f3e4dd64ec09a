"""Rollouts: prompts -> engine samples -> rewards -> advantages -> a TrainBatch.

Every prompt gets its own sampling seed derived from (run seed, step, prompt
index), so a step's samples do not depend on batch composition and a resumed
run regenerates exactly the samples the uninterrupted run would have.

Legend: P prompts, G samples per prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from exactrl.algo.advantages import compute_advantages
from exactrl.distributed import Ranks
from exactrl.envs.base import Problem
from exactrl.envs.prompts import prompt_ids
from exactrl.envs.rewards import as_reward
from exactrl.seeds import derive_seed
from exactrl.train.trainer import TrainBatch


@dataclass
class Rollout:
    """One sampled completion with its score."""

    problem: Problem
    prompt_ids: list[int]
    completion_ids: list[int]
    behav_logprobs: list[float]  # μ per completion token, from the engine
    versions: list[int]  # policy version that produced each token
    finish_reason: str  # "stop" | "length"
    text: str  # decoded completion (special tokens dropped)
    reward: float
    loss_mask: list[int] | None = None  # per completion token, 1 = sampled (an episode's interleaved template,
    # tool and user tokens are 0); None: every token was sampled
    behav_experts: list | None = None  # mixture of experts: the engine's experts per token (`Completion.experts`)


def sampling_seed(run_seed: int, step: int, k: int) -> int:
    """The sampling seed of prompt k at `step` (exactrl/seeds.py)."""
    return derive_seed(run_seed, step, k)


def generate_groups(
    engine,
    tokenizer,
    task,
    problems: list[Problem],
    rs,
    seed: int,
    step: int,
    greedy: bool = False,
    on_step=None,
    indices: list[int] | None = None,
) -> list[list[Rollout]]:
    """Samples `rs.samples_per_prompt` completions per problem (1 if greedy) and scores them.

    `on_step` is passed to `Engine.generate` (in-flight weight updates). `indices`: each problem's
    index in the step's batch, for its seed (default 0, 1, ...; a rank's share passes its own).
    """
    from exactrl.engine import SamplingParams
    from exactrl.envs.verifiers_env import VerifiersTask

    indices = list(range(len(problems))) if indices is None else indices
    if isinstance(task, VerifiersTask):  # its episodes call the model through a server over the engine
        if on_step is not None:
            raise ValueError("task.kind=verifiers runs its episodes through a server: no in-flight weight updates")
        return task.play(engine, tokenizer, problems, rs, seed, step, greedy, indices)
    prompts = [prompt_ids(tokenizer, task, p) for p in problems]
    params = [
        SamplingParams(
            temperature=0.0 if greedy else rs.temperature,
            top_p=rs.top_p,
            top_k=rs.top_k,
            max_tokens=rs.max_tokens,
            ignore_eos=rs.ignore_eos,
            n=1 if greedy else rs.samples_per_prompt,
            seed=sampling_seed(seed, step, k),
        )
        for k in indices
    ]
    outs = engine.generate(prompts, params) if on_step is None else engine.generate(prompts, params, on_step=on_step)
    groups = []
    for prob, ids, samples in zip(problems, prompts, outs):
        group = []
        for o in samples:
            text = tokenizer.decode(o.token_ids, skip_special_tokens=True)
            group.append(
                Rollout(
                    prob,
                    ids,
                    list(o.token_ids),
                    list(o.logprobs),
                    list(o.versions),
                    o.finish_reason,
                    text,
                    _reward(task, prob, text),
                    behav_experts=getattr(o, "experts", None),
                )
            )
        groups.append(group)
    return groups


def _reward(task, problem: Problem, text: str) -> float:
    """The task's reward of a completion, by the one rule of exactrl/envs/rewards.py."""
    return as_reward(
        task.reward(problem, text),
        f"task {getattr(task, 'name', type(task).__name__)!r}: reward() for the prompt {problem.prompt!r}",
    )


def sample_groups(
    engine,
    tokenizer,
    task,
    problems: list[Problem],
    rs,
    seed: int,
    step: int,
    ranks: Ranks,
    greedy: bool = False,
    offset: int = 0,
) -> list[list[Rollout]]:
    """`generate_groups` over this rank's share of the problems, gathered: every rank gets every group,
    in batch order (exactrl/distributed). One process: simply `generate_groups`. `offset`: the index of
    the first problem in the step (a step's later batches, `rollout.filter_groups`, seed on from there)."""
    mine = ranks.shard(len(problems))
    local = generate_groups(
        engine, tokenizer, task, [problems[k] for k in mine], rs, seed, step, greedy, indices=[offset + k for k in mine]
    )
    return ranks.gather_sharded(len(problems), local)


def overlong_penalty(length: int, max_tokens: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), L = max_tokens, L_b = buffer_len:

        0                              |y| <= L - L_b
        factor · (L - L_b - |y|) / L_b   L - L_b < |y| <= L      (reaches -factor at |y| = L)

    A completion never exceeds L here (the engine stops it), so DAPO's third case (-1 past L) cannot occur.
    """
    if buffer_len == 0 or length <= max_tokens - buffer_len:
        return 0.0
    return factor * (max_tokens - buffer_len - length) / buffer_len


def overlong_shaped(
    groups: list[list[Rollout]], max_tokens: int, buffer_len: int, factor: float
) -> tuple[list[list[Rollout]], dict[str, float]]:
    """The groups with the soft overlong penalty added to each reward; like the KL shaping, the task
    reward stays in the rollout metrics and the shaped one only drives the advantages."""
    pen = [[overlong_penalty(len(r.completion_ids), max_tokens, buffer_len, factor) for r in g] for g in groups]
    flat = [x for g in pen for x in g]
    shaped = [[replace(r, reward=r.reward + x) for r, x in zip(g, p)] for g, p in zip(groups, pen)]
    return shaped, {
        "rollout/overlong_penalty_mean": sum(flat) / len(flat),
        "rollout/overlong_penalised_frac": sum(x < 0 for x in flat) / len(flat),
    }


def to_train_batch(
    groups: list[list[Rollout]], advantage: str, advantage_kwargs: dict, mask_truncated: bool = False
) -> TrainBatch:
    """Advantages over each group's rewards. `mask_truncated`: a completion cut at the length limit gets a
    loss mask of zeros (it still counts in its group's baseline)."""
    rewards_PG = torch.tensor([[r.reward for r in g] for g in groups], dtype=torch.float64)
    adv_PG = compute_advantages(advantage, rewards_PG, **advantage_kwargs)
    flat = [r for g in groups for r in g]
    sampled = [r.loss_mask or [1] * len(r.completion_ids) for r in flat]
    masked = mask_truncated or any(r.loss_mask is not None for r in flat)
    keep = [int(not mask_truncated or r.finish_reason != "length") for r in flat]
    return TrainBatch(
        prompt_ids=[r.prompt_ids for r in flat],
        completion_ids=[r.completion_ids for r in flat],
        behav_logprobs=[r.behav_logprobs for r in flat],
        advantages=adv_PG.reshape(-1).tolist(),
        # the cut completions were still sampled: measured, not trained on
        loss_mask=[[m * k for m in s] for s, k in zip(sampled, keep)] if masked else None,
        generated_mask=sampled if masked else None,
        behav_experts=[r.behav_experts for r in flat] if any(r.behav_experts for r in flat) else None,
    )


def rollout_metrics(groups: list[list[Rollout]]) -> dict[str, float]:
    flat = [r for g in groups for r in g]
    rewards = torch.tensor([r.reward for r in flat])
    lens = torch.tensor([len(r.completion_ids) for r in flat], dtype=torch.float32)
    solved = sum(any(r.reward >= 1.0 for r in g) for g in groups)
    uniform = sum(len({r.reward for r in g}) == 1 for g in groups)
    return {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/reward_std": rewards.std().item() if len(flat) > 1 else 0.0,
        "rollout/accuracy": (rewards >= 1.0).float().mean().item(),
        "rollout/response_len_mean": lens.mean().item(),
        "rollout/response_len_max": lens.max().item(),
        "rollout/truncated_frac": sum(r.finish_reason == "length" for r in flat) / len(flat),
        "rollout/pass_at_group": solved / len(groups),
        "rollout/zero_std_group_frac": uniform / len(groups),
    }


def evaluate(
    engine, tokenizer, task, problems: list[Problem], rs, seed: int, ranks: Ranks = Ranks()
) -> tuple[dict[str, float], list[list[Rollout]]]:
    """Greedy accuracy on held-out problems (shared out over the ranks of a distributed run), and the
    groups it scored (one greedy completion per problem)."""
    groups = sample_groups(engine, tokenizer, task, problems, rs, seed, -1, ranks, greedy=True)
    return {"eval/accuracy": sum(g[0].reward >= 1.0 for g in groups) / max(len(groups), 1)}, groups
