"""The distillation objectives (exactrl/algo/distill.py) against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from exactrl.algo.distill import forward_kl, generalized_jsd, reverse_kl_advantages, teacher_top_k, vocab_divergence

F64 = torch.float64
P_T = [0.5, 0.25, 0.125, 0.125]  # teacher
P_S = [0.25, 0.25, 0.25, 0.25]  # student


def logs(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64).log()


def test_reverse_kl_advantage_is_teacher_minus_student_on_the_sampled_token():
    t = torch.tensor([-0.5, -2.0, -0.1], dtype=F64)
    s = torch.tensor([-1.0, -1.0, -0.1], dtype=F64)
    assert reverse_kl_advantages(t, s).tolist() == [0.5, -1.0, 0.0]


def test_reverse_kl_advantage_refuses_a_token_the_teacher_never_samples():
    with pytest.raises(ValueError, match="infinite"):
        reverse_kl_advantages(torch.tensor([-math.inf]), torch.tensor([-1.0]))


def test_forward_kl_by_hand():
    # KL(p_t || p_s) = Σ p_t log(p_t / p_s) = .5 log 2 + .25 log 1 + 2 · .125 log .5 = log(2) / 4
    assert forward_kl(logs(P_S), logs(P_T)).item() == pytest.approx(math.log(2) / 4, abs=1e-12)


def test_forward_kl_skips_tokens_the_teacher_gives_no_mass():
    t = logs([1.0, 0.0])  # log 0 = -inf
    s = logs([0.5, 0.5])
    assert forward_kl(s, t).item() == pytest.approx(math.log(2))


def test_jsd_by_hand_and_its_symmetric_case():
    beta = 0.3
    m = [beta * a + (1 - beta) * b for a, b in zip(P_T, P_S)]
    kl_t = sum(a * math.log(a / c) for a, c in zip(P_T, m))
    kl_s = sum(b * math.log(b / c) for b, c in zip(P_S, m))
    got = generalized_jsd(logs(P_S), logs(P_T), beta).item()
    assert got == pytest.approx(beta * kl_t + (1 - beta) * kl_s, abs=1e-12)
    # β = 1/2 is the symmetric Jensen-Shannon divergence
    assert generalized_jsd(logs(P_S), logs(P_T), 0.5).item() == pytest.approx(
        generalized_jsd(logs(P_T), logs(P_S), 0.5).item(), abs=1e-12
    )


def test_every_divergence_of_a_distribution_with_itself_is_zero():
    p = logs(P_T, P_S)
    assert torch.allclose(forward_kl(p, p), torch.zeros(2, dtype=F64), atol=1e-15)
    assert torch.allclose(generalized_jsd(p, p, 0.7), torch.zeros(2, dtype=F64), atol=1e-15)


def test_jsd_beta_must_be_inside_zero_one():
    with pytest.raises(ValueError, match="beta must be in"):
        generalized_jsd(logs(P_S), logs(P_T), 1.0)


def test_top_k_keeps_the_teachers_most_likely_tokens_renormalised():
    t = logs([0.1, 0.4, 0.3, 0.2])
    s = logs([0.4, 0.1, 0.2, 0.3])
    s2, t2 = teacher_top_k(s, t, 2)  # the teacher's tokens 1 and 2
    assert torch.allclose(t2.exp(), torch.tensor([[0.4 / 0.7, 0.3 / 0.7]], dtype=F64))
    assert torch.allclose(s2.exp(), torch.tensor([[0.1 / 0.3, 0.2 / 0.3]], dtype=F64))
    d = vocab_divergence(s, t, "forward_kl", top_k=2).item()
    assert d == pytest.approx((0.4 / 0.7) * math.log(0.4 / 0.7 / (1 / 3)) + (0.3 / 0.7) * math.log(0.3 / 0.7 / (2 / 3)))


def test_top_k_breaks_ties_by_the_lower_token_id():
    t = logs([0.25, 0.25, 0.25, 0.25])
    s = logs([0.1, 0.2, 0.3, 0.4])
    s2, _ = teacher_top_k(s, t, 2)
    assert torch.allclose(s2.exp(), torch.tensor([[1 / 3, 2 / 3]], dtype=F64))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="k must be an int in"):
        teacher_top_k(logs(P_S), logs(P_T), 5)
    with pytest.raises(ValueError, match="kind must be"):
        vocab_divergence(logs(P_S), logs(P_T), "reverse_kl")
    with pytest.raises(ValueError, match="differ in shape"):
        forward_kl(logs(P_S), logs([0.5, 0.5]))
