"""One optimizer step against a naive reference of the objective its config defines.

The formula modules are checked alone in test_formulas_reference.py; this checks how the step feeds them
and what it does with their outputs: rollouts -> (KL-in-reward and overlong shaping, mask_truncated) ->
group advantages -> micro-batches -> LossNorm -> loss, entropy and KL terms -> backward -> data-parallel
sum -> clip. `loop.train_on` (which calls `train_step`) runs on hand-made groups: ragged prompts and
completions, completions cut at max_tokens, an empty completion, a group of equal rewards, μ off the
trainer's π_old on some tokens. The reference does one forward per sequence alone
(`exactrl.sequence_logprobs`), writes the objective out in float64 from the config's documented meaning
(docs/design.md §8, aggregation.py's table, the loss docstrings, config.py), and differentiates it with
autograd. Every loss (ppo, gspo, cispo, reinforce, sapo, topr at sequence and token level) and every
advantage estimator (grpo with and without the std, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline)
is written out from its docstring.

The model runs in fp32 only (fp32 and bf16 are its dtypes) and the step's loss arithmetic is fp32, so the
gradients agree to fp32 rounding, not fp64: measured max |Δg| / max |g| per tensor ≈ 1e-7 to 1e-6; asserted
at 2e-5. The forward logprobs are bitwise those of the reference (the exactness contract), so the loss,
the fractions and the KL/entropy figures agree to fp32 rounding of their sums. Micro-batches of 1 and of
the whole batch give gradients equal to the same rounding, not bitwise (the accumulation reorders fp32
sums: max |Δg| / max |g| ≈ 3e-7 to 8e-7), and the same metrics bit for bit but `train/grad_norm`.

Conventions the reference follows (documented in aggregation.py / trainer.py, not changed here): the
denominators count the loss mask as sampled, fixed before the step, so a token a masking correction or the
trainer's top-k/top-p drops stays in `total_tokens` and in its sequence's n_b; a completion left out by
`overlong.mask_truncated` stays in `total_seqs` (the seq-mean modes average over every sequence, as TRL
does) but not in `total_tokens`; the clip fractions and `loss/ratio_mean` are means over the tokens the
loss keeps, and so are GSPO's sequence mean and TOPR's sequence ratio (a token a masking correction drops
is not in them); `train/grad_norm` is the norm before clipping, and the clip is torch's (max / (norm + 1e-6)).

Legend: B sequences, T tokens; P prompts, G samples per prompt.
"""

from __future__ import annotations

import math

import pytest
from step_reference import (  # noqa: F401 (models, ref_dir: fixtures)
    BASE,
    CONFIGS,
    F64,
    G_RTOL,
    GROUPS,
    MAX_TOKENS,
    _forward,
    _Keep,
    _whitened,
    advantages,
    assert_grads_close,
    components,
    grpo_advantages,
    kl_token,
    make_groups,
    models,
    ref_dir,
    reference,
    reference_rows,
    step_grads,
)

from exactrl.distributed import Ranks
from exactrl.rollout.groups import rollout_metrics, to_train_batch
from exactrl.train.config import load_config
from exactrl.train.loop import train_on
from exactrl.train.trainer import train_step


@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_step_is_the_gradient_of_the_configured_objective(models, name):
    model, ref_model = models
    cfg = load_config(None, BASE + CONFIGS[name])
    groups = make_groups(model, cfg.rollout.temperature)
    want, want_m = reference(model, ref_model, groups, cfg)
    got = {}
    for mbs in (1, 5, 64):  # 5: micro-batches of 5, 5, 2, cutting groups apart
        model.zero_grad(set_to_none=True)
        m = train_on(components(model, ref_model, cfg, mbs), 1, groups)
        got[mbs] = step_grads(model), m
        assert_grads_close(got[mbs][0], want)
        for k, v in want_m.items():
            assert m[k] == pytest.approx(v, rel=2e-6, abs=1e-7), (k, mbs)
    g64, m64 = got[64]
    for g, m in (got[1], got[5]):
        assert_grads_close(g, [x.to(F64) for x in g64], rtol=1e-5)  # micro-batching reorders fp32 sums only
        assert m.pop("train/grad_norm") == pytest.approx(m64["train/grad_norm"], rel=1e-5)
        assert m == {k: v for k, v in m64.items() if k != "train/grad_norm"}  # taken over the whole batch at once
    g1 = got[1][0]
    if cfg.optim.grad_clip < 1:  # the clip acted, and `train/grad_norm` is the norm before it
        assert want_m["train/grad_norm"] > cfg.optim.grad_clip
        assert math.sqrt(sum(float((g.double() ** 2).sum()) for g in g1)) == pytest.approx(
            cfg.optim.grad_clip, rel=1e-4
        )


def test_the_references_see_what_they_test(models):
    """The batch makes every feature above act: clipping, dual clip, cut tokens, masks, shaping."""
    model, ref_model = models
    m = train_on(
        components(model, ref_model, load_config(None, BASE + CONFIGS["seq-mean-token-mean ppo bypass dual clip"])),
        1,
        make_groups(model, 1.0),
    )
    assert m["loss/clip_frac_low"] > 0 and m["loss/clip_frac_high"] > 0 and m["loss/dual_clip_frac"] > 0
    m = train_on(
        components(model, ref_model, load_config(None, BASE + CONFIGS["top-k cuts sampled tokens, grad clip"])),
        1,
        make_groups(model, 0.9),
    )
    assert 0.1 < m["mismatch/out_of_support_frac"] < 0.9
    m = train_on(
        components(model, ref_model, load_config(None, BASE + CONFIGS["token-mean ppo with corrections"])),
        1,
        make_groups(model, 1.0),
    )
    assert m["correction/token_tis/clip_frac"] > 0 and 0 < m["correction/sequence_mask_is/mask_frac"] < 1
    m = train_on(
        components(
            model, ref_model, load_config(None, BASE + CONFIGS["kl k1 in the reward, overlong shaping and masking"])
        ),
        1,
        make_groups(model, 1.0),
    )
    assert m["rollout/overlong_penalised_frac"] > 0 and m["rollout/kl_ref_per_seq"] != 0
    m = train_on(
        components(
            model, ref_model, load_config(None, BASE + CONFIGS["seq-mean-token-mean kl k3 in the loss, entropy"])
        ),
        1,
        make_groups(model, 1.0),
    )
    assert 0 < m["correction/token_mask_is/mask_frac"] < 0.5
    m = train_on(
        components(model, ref_model, load_config(None, BASE + CONFIGS["sapo bypass, dr_grpo, seq-mean-token-mean"])),
        1,
        make_groups(model, 1.0),
    )
    assert m["loss/gate_mean"] < 0.99  # the gate is off 1 where π_θ ≠ μ
    # TOPR: sequence ratios 1 (clipped at 0.9), e^-0.3 and e^-0.6 (the mask drops the +0.3 tokens); token ratios
    # 1, e^±0.3
    for name in (
        "topr bypass, reinforce_pp, kl k1 in the reward, token_mask_is",
        "topr token level bypass, reinforce_pp_baseline, constant-normalised, token_tis",
    ):
        m = train_on(components(model, ref_model, load_config(None, BASE + CONFIGS[name])), 1, make_groups(model, 1.0))
        assert 0 < m["loss/clip_frac_high"] < 0.5
    # every estimator gives this batch other advantages (so each reference above checks its own)
    rewards, sizes = [r for _, g in GROUPS for _, _, r in g], [len(g) for _, g in GROUPS]
    adv = {
        name: advantages(rewards, sizes, name, {})
        for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
    }
    assert len({tuple(round(x, 6) for x in v) for v in adv.values()}) == len(adv)
    assert all(v[6:9] == [0.0] * 3 for k, v in adv.items() if k != "reinforce_pp")  # the equal-reward group


def test_rollout_metrics_are_those_of_the_task_rewards(models):
    model, _ = models
    groups = make_groups(model, 1.0)
    flat = [r for g in groups for r in g]
    lens = [len(r.completion_ids) for r in flat]
    rewards = [r.reward for r in flat]
    m = rollout_metrics(groups)
    assert m["rollout/reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert m["rollout/response_len_mean"] == pytest.approx(sum(lens) / len(lens))
    assert m["rollout/response_len_max"] == MAX_TOKENS
    assert m["rollout/truncated_frac"] == pytest.approx(3 / 12)
    assert m["rollout/zero_std_group_frac"] == pytest.approx(1 / 4)
    assert m["rollout/pass_at_group"] == pytest.approx(2 / 4)


class _SimulatedRanks(Ranks):
    """Rank r of W in one process: ranks W-1..1 run first and leave their local gradient and per-token
    tensors in `shared`; rank 0 then sums the gradients and gathers the tensors as the collectives would."""

    shared: dict

    def sum_grads(self, params):
        ps = [p for p in params if p.requires_grad]
        if self.rank:
            self.shared.setdefault("grads", {})[self.rank] = [None if p.grad is None else p.grad.clone() for p in ps]
            return
        for other in self.shared["grads"].values():
            for p, g in zip(ps, other):
                if g is not None:
                    p.grad = g.clone() if p.grad is None else p.grad + g

    def check_same(self, what, tensors, why):
        pass

    def gather(self, obj):
        if self.rank:
            self.shared.setdefault("whole", {})[self.rank] = obj
            raise _RankDone
        return [dict(obj)] + [self.shared["whole"][r] for r in range(1, self.world)]  # a copy, as pickling gives


class _RankDone(Exception):
    pass


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    "name", ["token-mean kl k1 in the loss, temperature", "seq-mean-token-mean mask_truncated, k3 in the loss"]
)
def test_data_parallel_shares_are_normalised_by_the_whole_batch(models, world, name):
    """Each rank's loss is divided by the whole batch's token and sequence counts, so the ranks' summed
    gradient is the one-process gradient (a rank's own count would scale its share up by ~W)."""
    model, ref_model = models
    cfg = load_config(None, BASE + CONFIGS[name])
    groups = make_groups(model, cfg.rollout.temperature)
    want, want_m = reference(model, ref_model, groups, cfg)
    a = cfg.algorithm
    batch = to_train_batch(groups, a.advantage, a.advantage_kwargs, a.overlong.mask_truncated)
    shared: dict = {}
    for rank in [*range(1, world), 0]:
        ranks = _SimulatedRanks(rank, world)
        object.__setattr__(ranks, "shared", shared)
        c = components(model, ref_model, cfg, micro_batch_size=2, ranks=ranks)
        model.zero_grad(set_to_none=True)
        try:
            m = train_step(
                model, c.policy.optimizer, c.policy.loss_fn, batch, c.policy.step_settings, c.policy.ref_model, ranks
            )
        except _RankDone:
            assert rank
            continue
    assert_grads_close(step_grads(model), want)
    for k, v in want_m.items():
        assert m[k] == pytest.approx(v, rel=2e-6, abs=1e-7), k
