"""Advantage estimators and KL estimators against hand-computed values."""

import math

import pytest
import torch

from exactrl.algo.advantages import ADVANTAGES, compute_advantages, dr_grpo, grpo, reinforce_pp, rloo
from exactrl.algo.kl import kl_estimate

R = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]], dtype=torch.float64)
EPS = 1e-6


def test_grpo():
    std = math.sqrt(4 * 0.25 / 3)  # Bessel-corrected std of 1, 0, 0, 1
    a = 0.5 / (std + EPS)
    assert grpo(R).flatten().tolist() == pytest.approx([a, -a, -a, a] + [0.0] * 4, rel=1e-12)


def test_grpo_without_std_is_dr_grpo():
    expected = [[0.5, -0.5, -0.5, 0.5], [0.0] * 4]
    assert grpo(R, normalize_std=False).tolist() == expected
    assert dr_grpo(R).tolist() == expected


def test_rloo():
    # 1 − mean(0, 0, 1) = 2/3 ; 0 − mean(1, 0, 1) = −2/3
    assert rloo(R).flatten().tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3] + [0.0] * 4, rel=1e-12)


def test_reinforce_pp_global_whitening():
    xs = [1, 0, 0, 1, 2, 2, 2, 2]
    mean = sum(xs) / 8
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / 7)
    expected = [(x - mean) / (std + EPS) for x in xs]
    assert reinforce_pp(R).flatten().tolist() == pytest.approx(expected, rel=1e-12)


def test_reinforce_pp_baseline_centres_groups_then_whitens():
    centred = [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]
    std = math.sqrt(sum(c * c for c in centred) / 7)
    out = compute_advantages("reinforce_pp_baseline", R).flatten().tolist()
    assert out == pytest.approx([c / (std + EPS) for c in centred], rel=1e-12)


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_one_sample_groups_give_finite_advantages(name):
    out = compute_advantages(name, torch.tensor([[3.0], [5.0]]))
    assert torch.isfinite(out).all()
    if name == "reinforce_pp":  # the only estimator with no per-group baseline: ±1/√2 over the batch
        assert out.flatten().tolist() == pytest.approx([-1 / (math.sqrt(2) + EPS), 1 / (math.sqrt(2) + EPS)])
    else:
        assert out.tolist() == [[0.0], [0.0]]
    single = compute_advantages(name, torch.tensor([[3.0]]))
    assert single.tolist() == [[0.0]]


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_equal_rewards_give_exactly_zero(name, dtype):
    # 0.7 and 5.7 are not exact in binary: G copies of them averaged in the rewards' own dtype come
    # out an ulp off, and / (std 0 + eps) made that ulp an advantage of −0.32 (5.7) for the whole group
    for v in (0.1, 0.7, 5.7, 1 / 3):
        for G in (2, 3, 7, 16):
            rewards = torch.full((2, G), v, dtype=dtype)
            assert compute_advantages(name, rewards).tolist() == [[0.0] * G] * 2, (v, G)
    mixed = torch.tensor([[0.7] * 4, [1.0, 0.0, 0.0, 1.0]], dtype=dtype)  # the equal group alone is 0
    if name != "reinforce_pp":  # which whitens over the batch, so no group is on its own
        assert compute_advantages(name, mixed)[0].tolist() == [0.0] * 4


def test_registry_and_errors():
    assert set(ADVANTAGES) == {"grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"}
    assert compute_advantages("grpo", R, normalize_std=False).tolist()[0] == [0.5, -0.5, -0.5, 0.5]
    with pytest.raises(ValueError, match="valid"):
        compute_advantages("ppo", R)
    with pytest.raises(ValueError, match="normalize_std"):
        compute_advantages("rloo", R, normalize_std=True)
    with pytest.raises(ValueError, match="2-D"):
        grpo(torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match=r"prompt 1, sample 2"):
        grpo(torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, float("nan")]]))


# ---- KL estimators: p = (0.5, 0.25, 0.25), q = (0.25, 0.25, 0.5); the sample is the first outcome
P = [0.5, 0.25, 0.25]
Q = [0.25, 0.25, 0.5]


def test_kl_kinds_hand_computed():
    logp, logq = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    assert kl_estimate(logp, logq, "k1").item() == pytest.approx(math.log(2), rel=1e-6)
    assert kl_estimate(logp, logq, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2, rel=1e-6)
    assert kl_estimate(logp, logq, "k3").item() == pytest.approx(0.5 - math.log(0.5) - 1, rel=1e-6)


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_unbiased_kinds_have_expectation_kl(kind):
    logp = torch.tensor([[math.log(x) for x in P]], dtype=torch.float64)
    logq = torch.tensor([[math.log(x) for x in Q]], dtype=torch.float64)
    expectation = sum(p * k for p, k in zip(P, kl_estimate(logp, logq, kind)[0].tolist()))
    true_kl = sum(p * math.log(p / q) for p, q in zip(P, Q))
    assert expectation == pytest.approx(true_kl, rel=1e-12)


def test_k3_nonnegative_zero_on_policy_and_finite_far_off():
    x = torch.tensor([[-1.0, -3.0]])
    assert kl_estimate(x, x, "k3").tolist() == [[0.0, 0.0]]
    far = kl_estimate(torch.tensor([[-1000.0]]), torch.tensor([[0.0]]), "k3")
    assert torch.isfinite(far).all() and far.item() > 0


def test_k3_gradient_never_pushes_logp_further_below_the_reference():
    # r = logq − logp; ∂k3/∂logp = 1 − e^r < 0 for r > 0. Beyond the clamp (r > 20) it is 0, not +1,
    # which clamping only the exp gave: the loss then pushed logp down where it was already far below
    for r in (1.0, 19.0, 21.0, 25.0, 500.0):
        logp = torch.tensor([[-30.0 - r]], requires_grad=True)
        kl_estimate(logp, torch.tensor([[-30.0]]), "k3").sum().backward()
        assert logp.grad.item() <= 0, (r, logp.grad.item())
        if r < 20:
            assert logp.grad.item() == pytest.approx(1 - math.exp(r), rel=1e-5)
    for r in (-5.0, -25.0):  # logp above the reference: the gradient 1 − e^r pulls it down, ~1 far off
        logp = torch.tensor([[-1.0]], requires_grad=True)
        kl_estimate(logp, torch.tensor([[-1.0 + r]]), "k3").sum().backward()
        assert logp.grad.item() == pytest.approx(1 - math.exp(r), rel=1e-5)


def test_kl_reward_penalty_refuses_lists_of_different_lengths():
    from exactrl.algo.kl import kl_reward_penalty

    with pytest.raises(ValueError, match="3 behaviour sequences but 2 reference"):  # zip dropped the third
        kl_reward_penalty([torch.tensor([-1.0])] * 3, [torch.tensor([-1.5])] * 2, "k1", 0.1)


def test_kl_is_differentiable_and_upcast():
    logp = torch.tensor([[-1.0]], dtype=torch.bfloat16, requires_grad=True)
    out = kl_estimate(logp, torch.tensor([[-2.0]], dtype=torch.bfloat16), "k2")
    out.sum().backward()
    assert out.dtype == torch.float32 and logp.grad.item() == pytest.approx(1.0)  # d ½(p−q)² = p − q


def test_kl_unknown_kind_and_shape():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="k3"):
        kl_estimate(x, x, "k4")
    with pytest.raises(ValueError, match="shape"):
        kl_estimate(x, torch.zeros(2, 1), "k1")


def test_kl_reward_penalty_hand_computed():
    """penalty_i = β Σ_t kl_t; k1 = logp − logq per token."""
    from exactrl.algo.kl import kl_reward_penalty

    behav = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5]), torch.tensor([])]
    ref = [torch.tensor([-1.5, -1.0]), torch.tensor([-0.5]), torch.tensor([])]
    pen, m = kl_reward_penalty(behav, ref, "k1", 0.1)
    assert pen == pytest.approx([0.1 * (0.5 - 1.0), 0.0, 0.0])
    assert m["rollout/kl_ref_per_seq"] == pytest.approx(-0.5 / 3)
    assert m["rollout/kl_penalty_mean"] == pytest.approx(0.1 * -0.5 / 3)
    pen3, _ = kl_reward_penalty(behav, ref, "k3", 1.0)  # k3 = e^{q−p} − (q−p) − 1 ≥ 0
    want = sum(math.exp(d) - d - 1 for d in (-0.5, 1.0))
    assert pen3 == pytest.approx([want, 0.0, 0.0])


def test_agent_batches_take_the_advantage_estimators_arguments():
    """`agent_train_batch(..., advantage_kwargs)` (and agent_train_step's): GRPO without the std division
    gives each trajectory its episode's reward minus the group mean."""
    from exactrl.chat.trajectory import Trajectory
    from exactrl.envs.base import Problem
    from exactrl.rollout.agents import AgentRollout, agent_train_batch

    def episode(reward: float) -> AgentRollout:
        t = Trajectory([1, 2], [3, 4], [1, 1], [-0.5, -0.5], [0, 0], 1, [[1.0, -1, 1.0]])
        return AgentRollout(Problem("1+1=", "2"), reward, [t], None)

    groups = [[episode(0.0), episode(2.0)]]
    plain = agent_train_batch(groups, "grpo", {"normalize_std": False}).advantages
    assert plain == [-1.0, 1.0]
    assert agent_train_batch(groups, "grpo").advantages != plain  # divided by the std (√2)


def test_reinforce_pp_baseline_keeps_an_equal_group_at_exactly_zero_beside_random_groups():
    """The group-centred rewards have batch mean 0 in exact arithmetic; centring them again only turned
    that mean's rounding error (~1e-17) into a nonzero advantage for a group of equal rewards (whose sign
    decides, e.g., OPSM's and TOPR's negative branch)."""
    rewards = torch.randn(3, 5, generator=torch.Generator().manual_seed(15), dtype=torch.float64)
    rewards[1] = 0.3
    assert compute_advantages("reinforce_pp_baseline", rewards)[1].tolist() == [0.0] * 5
