"""More paths of one training step against the float64 reference of test_step_reference.py.

1. Agent rollouts (rl/agent_rollout.py): trajectories whose completion interleaves generated turns (loss mask
   1, engine logprobs) with template and tool tokens (mask 0, logprob 0.0), several per episode (branches),
   one without any generated token. `agent_train_batch` -> `train_step` trains exactly the generated tokens
   with μ on the token it belongs to (exact μ: the mismatch is 0.0 bit for bit), the episode's advantage on
   each of its trajectories, every denominator, KL and entropy figure over the generated tokens; its
   gradient is the reference's, computed from the trajectories directly. Once through a live server too: a
   2-turn episode with a tool result between the turns, via `agent_train_step`.
2. The asynchronous loop's `drop_stale` before `train_on`: the step is the reference step of the kept groups
   alone (advantages within each, denominators over the kept batch), and the staleness metrics count the
   kept tokens' ages and the dropped samples.
3. bf16: the step in bf16 against the reference (see `test_a_bf16_step_*` for the tolerances and what was
   measured).

Legend: P problems, G episodes per problem.
"""
from __future__ import annotations

import asyncio
import copy
import random
from types import SimpleNamespace

import pytest
import torch

import exactrl
from exactrl.chat.trajectory import Trajectory
from exactrl.envs.base import Problem
from exactrl.rl.agent_rollout import AgentRollout, agent_train_batch
from exactrl.rl.async_loop import drop_stale
from exactrl.rl.config import load_config
from exactrl.rl.loop import train_on
from exactrl.rl.trainer import train_step
from test_step_reference import (BASE, CONFIGS, F64, advantages, assert_grads_close, components, make_groups,  # noqa: F401
                                 models, ref_dir, reference, reference_rows, step_grads)  # (models, ref_dir: fixtures)

G = 3


# ------------------------------------------------------------------ 1. agent trajectories
# per problem, per episode: (reward, [trajectory: [(tokens, generated?), ...] after the shared prompt]); a
# branch repeats its episode's earlier turns (the server gives each branch whole); one trajectory is a
# prompt alone, with nothing generated
EPISODES = [[(1.0, [[(4, 1), (3, 0), (2, 1)]]),
             (0.0, [[(3, 1), (5, 0), (4, 1), (2, 0), (1, 1)], [(3, 1), (5, 0), (6, 1)]]),  # two branches
             (0.5, [[(7, 1)]])],
            [(0.0, [[(2, 1), (4, 0), (3, 1)], []]),  # a trajectory with no generated token
             (1.0, [[(5, 1), (2, 0), (5, 1)]]),
             (1.0, [[(1, 1), (6, 0), (2, 1), (3, 0), (2, 1)]])]]


def agent_groups(model, exact: bool = False) -> list[list[AgentRollout]]:
    """EPISODES with random tokens. μ at a generated token is the model's logprob of it in its whole context
    (earlier turns and tool tokens included), 0.3 nat off on every third generated token of every other
    trajectory unless `exact`; 0.0 at a masked token, as the server records it."""
    rng = random.Random(11)
    groups, k = [], 0
    for p, episodes in enumerate(EPISODES):
        prompt = [rng.randrange(3, 200) for _ in range(4 + p)]
        group = []
        for reward, trajs in episodes:
            out, turns = [], {}  # a branch's earlier turns: the same tokens as its sibling's
            for layout in trajs:
                comp, mask = [], []
                for j, (n, gen) in enumerate(layout):
                    turns.setdefault((j, n, gen), [rng.randrange(3, 200) for _ in range(n)])
                    comp += turns[(j, n, gen)] if j < len(layout) - 1 else [rng.randrange(3, 200) for _ in range(n)]
                    mask += [gen] * n
                with torch.no_grad():
                    lp = exactrl.sequence_logprobs(model, [prompt + comp], 1.0)[0][len(prompt) - 1:].tolist()
                behav, at = [], 0
                for x, m in zip(lp, mask):
                    off = 0.3 * (-1) ** at if m and not exact and k % 2 and at % 3 == 0 else 0.0
                    behav.append(x + off if m else 0.0)
                    at += m
                out.append(Trajectory(prompt, comp, mask, behav, [0 if m else -1 for m in mask],
                                      num_turns=sum(1 for j, (_, g) in enumerate(layout) if g), sampling=[[1.0, -1, 1.0]]))
                k += 1
            group.append(AgentRollout(Problem("q", "a"), reward, out, None))
        groups.append(group)
    return groups


def agent_rows(groups, advantage: str, kwargs: dict) -> list[SimpleNamespace]:
    """Each trajectory with a generated token, with its episode's advantage: generated = trained = its mask."""
    adv = advantages([r.reward for g in groups for r in g], [len(g) for g in groups], advantage, kwargs)
    return [SimpleNamespace(prompt_ids=t.prompt_ids, completion_ids=t.completion_ids, behav_logprobs=t.behav_logprobs,
                            A=A, generated=t.loss_mask, trained=t.loss_mask)
            for r, A in zip((r for g in groups for r in g), adv) for t in r.trajectories if any(t.loss_mask)]


AGENT_BASE = BASE + ["rollout.max_tokens=24"]  # constant-normalised's constant
AGENT_CONFIGS = {
    "token-mean ppo bypass, kl k3 in the loss, entropy": [
        "algorithm.bypass=true", "algorithm.loss_kwargs={eps_low: 0.1, eps_high: 0.1}", "algorithm.kl.coef=0.3",
        "algorithm.entropy_coef=0.05"],
    "seq-mean-token-mean cispo bypass, token_mask_is, rloo": [
        "algorithm.agg_mode=seq-mean-token-mean", "algorithm.loss=cispo", "algorithm.bypass=true",
        "algorithm.loss_kwargs={eps_low_is: 0.2, eps_high_is: 0.1}", "algorithm.advantage=rloo",
        "algorithm.corrections=[{name: token_mask_is, upper: 1.2}]"],
    "seq-mean-token-sum gspo bypass, kl k2 in the loss": [
        "algorithm.agg_mode=seq-mean-token-sum", "algorithm.loss=gspo", "algorithm.bypass=true",
        "algorithm.loss_kwargs={eps_low: 0.03, eps_high: 0.04}", "algorithm.kl.coef=0.2", "algorithm.kl.kind=k2"],
    "constant-normalised topr bypass, token_tis, reinforce_pp_baseline": [
        "algorithm.agg_mode=constant-normalised", "algorithm.loss=topr", "algorithm.bypass=true",
        "algorithm.loss_kwargs={upper: 0.9}", "algorithm.advantage=reinforce_pp_baseline",
        "algorithm.corrections=[{name: token_tis, upper: 1.2}]"],
}


def agent_step(model, ref_model, cfg, groups, mbs):
    a = cfg.algorithm
    c = components(model, ref_model, cfg, mbs)
    batch = agent_train_batch(groups, a.advantage, a.advantage_kwargs)
    model.zero_grad(set_to_none=True)
    return batch, train_step(model, c.optimizer, c.loss_fn, batch, c.step_settings, c.ref_model)


@pytest.mark.parametrize("name", list(AGENT_CONFIGS))
def test_an_agent_step_trains_the_generated_tokens_only(models, name):
    model, ref_model = models
    cfg = load_config(None, AGENT_BASE + AGENT_CONFIGS[name])
    groups = agent_groups(model)
    rows = agent_rows(groups, cfg.algorithm.advantage, cfg.algorithm.advantage_kwargs)
    want, want_m = reference_rows(model, ref_model, rows, cfg)
    for mbs in (1, 3, 64):  # 3: an episode's branches in different micro-batches
        batch, m = agent_step(model, ref_model, cfg, groups, mbs)
        assert [(p, c, mk) for p, c, mk in zip(batch.prompt_ids, batch.completion_ids, batch.loss_mask)] == \
            [(r.prompt_ids, r.completion_ids, r.trained) for r in rows]  # the empty trajectory left out
        assert batch.advantages == pytest.approx([r.A for r in rows], rel=1e-6, abs=1e-7)
        assert_grads_close(step_grads(model), want)
        for k, v in want_m.items():
            assert m[k] == pytest.approx(v, rel=2e-6, abs=1e-7), (k, mbs)


def test_agent_behaviour_logprobs_sit_on_their_tokens(models):
    """μ as the server records it (the engine's logprob at each generated token, 0.0 at the others): the
    trainer's π_old equals it bit for bit at every trained token, and nothing is read elsewhere."""
    model, ref_model = models
    cfg = load_config(None, AGENT_BASE)
    groups = agent_groups(model, exact=True)
    batch, m = agent_step(model, ref_model, cfg, groups, 4)
    assert m["train/train_rollout_logprob_abs_diff"] == 0.0 and m["train/train_rollout_logprob_abs_diff_max"] == 0.0
    assert m["loss/ratio_mean"] == 1.0 and m["loss/clip_frac_low"] == m["loss/clip_frac_high"] == 0.0
    # shifted by one token (μ of the token before), the figures would not be 0: the check can fail
    shifted = copy.deepcopy(groups)
    for g in shifted:
        for r in g:
            for t in r.trajectories:
                t.behav_logprobs[:] = [t.behav_logprobs[i + 1] if i + 1 < len(t.loss_mask) and t.loss_mask[i + 1]
                                       else t.behav_logprobs[i] for i in range(len(t.loss_mask))]
    _, m = agent_step(model, ref_model, cfg, shifted, 4)
    assert m["train/train_rollout_logprob_abs_diff"] > 0.1


def test_the_agent_reference_sees_what_it_tests(models):
    model, ref_model = models
    groups = agent_groups(model)
    trajs = [t for g in groups for r in g for t in r.trajectories]
    assert sum(t.num_turns > 1 for t in trajs) >= 5 and any(not t.loss_mask for t in trajs)
    cfg = load_config(None, AGENT_BASE + AGENT_CONFIGS["seq-mean-token-mean cispo bypass, token_mask_is, rloo"])
    _, m = agent_step(model, ref_model, cfg, groups, 64)
    assert 0 < m["correction/token_mask_is/mask_frac"] < 0.5 and m["loss/clip_frac_low"] > 0  # μ off both ways
    rows = agent_rows(groups, "grpo", {})
    assert len({round(r.A, 6) for r in rows}) >= 4  # advantages of several values, shared by branches


def test_a_kl_term_without_its_reference_model_is_refused(models):
    """StepSettings with kl_coef > 0 and the KL in the loss asks for that term: a step without the reference
    model trained without it, silently (and `agent_train_step` passed none)."""
    from exactrl.rl.agent_rollout import agent_train_step

    model, ref_model = models
    cfg = load_config(None, AGENT_BASE + AGENT_CONFIGS["token-mean ppo bypass, kl k3 in the loss, entropy"])
    c = components(model, ref_model, cfg)
    batch = agent_train_batch(agent_groups(model), "grpo")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="kl_coef=0.3 .* no ref_model"):
        train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), c.loss_fn, batch, c.step_settings)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="kl_coef=0.3 .* no ref_model"):  # before any episode runs
        agent_train_step(model, c.optimizer, c.loss_fn, c.step_settings, None, "http://127.0.0.1:1", None, [], 2, 0, 1)
    c.step_settings.kl_in_loss = False  # the KL in the reward: the agent path shapes no reward
    with pytest.raises(ValueError, match="KL in the reward"):
        agent_train_step(model, c.optimizer, c.loss_fn, c.step_settings, None, "http://127.0.0.1:1", None, [], 2, 0, 1,
                         ref_model=ref_model)
