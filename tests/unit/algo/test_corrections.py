"""Corrections against hand-computed weights and masks; composition, config, errors."""

import math

import pytest
import torch

from exactrl.algo.corrections import (
    CORRECTIONS,
    OPSM,
    DecoupledIS,
    GeometricMeanRejection,
    KLRejection,
    SequenceMaskIS,
    SequenceTIS,
    TokenMaskIS,
    TokenTIS,
    apply_bypass,
    build_corrections,
    compose,
)
from exactrl.algo.losses import PPOClipLoss
from exactrl.algo.types import LossInputs, LossNorm

F64 = torch.float64
L = math.log
# ρ = π_old/μ: row 0 (3, 0.5, 1), row 1 (1.5, 1.5, pad), row 2 empty
LOG_RHO = torch.tensor([[L(3.0), L(0.5), 0.0], [L(1.5), L(1.5), 50.0], [9.0, 9.0, 9.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=F64)
BEHAV = torch.full((3, 3), -1.0, dtype=F64)
OLD = BEHAV + LOG_RHO


def call(c, adv=None, old=OLD, behav=BEHAV, mask=MASK):
    return c(old, behav, mask, adv)


def rows(x):
    return [pytest.approx(r, rel=1e-12) for r in x.tolist()]


def test_token_tis():
    w, m, metrics = call(TokenTIS(upper=2.0))
    assert w.tolist() == rows(torch.tensor([[2.0, 0.5, 1.0], [1.5, 1.5, 1.0], [1.0, 1.0, 1.0]]))
    assert torch.equal(m, MASK)
    assert metrics["correction/token_tis/clip_frac"] == pytest.approx(1 / 5)
    assert metrics["correction/token_tis/weight_mean"] == pytest.approx((2 + 0.5 + 1 + 1.5 + 1.5) / 5)
    w, _, _ = call(TokenTIS(lower=0.8, upper=2.0))
    assert w[0].tolist() == pytest.approx([2.0, 0.8, 1.0])


def test_decoupled_weight_is_raw_ratio_unless_truncated():
    w, m, _ = call(DecoupledIS())
    assert w[0].tolist() == pytest.approx([3.0, 0.5, 1.0], rel=1e-12) and torch.equal(m, MASK)
    w, _, _ = call(DecoupledIS(upper=2.0))
    assert w[0].tolist() == pytest.approx([2.0, 0.5, 1.0])


def test_sequence_tis():
    w, m, metrics = call(SequenceTIS(upper=2.0))
    # row 0: 3 · 0.5 · 1 = 1.5 ; row 1: 1.5² = 2.25 -> 2 ; weights are 1 on masked positions
    assert w.tolist() == rows(torch.tensor([[1.5, 1.5, 1.5], [2.0, 2.0, 1.0], [1.0, 1.0, 1.0]]))
    assert torch.equal(m, MASK)
    assert metrics["correction/sequence_tis/clip_frac"] == pytest.approx(1 / 2)


def test_token_mask_is():
    w, m, metrics = call(TokenMaskIS(upper=2.0))
    assert torch.equal(w, torch.ones(3, 3, dtype=F64))
    assert m.tolist() == [[0, 1, 1], [1, 1, 0], [0, 0, 0]]
    assert metrics["correction/token_mask_is/mask_frac"] == pytest.approx(1 / 5)
    _, m, _ = call(TokenMaskIS(lower=0.6, upper=2.0))
    assert m[0].tolist() == [0, 0, 1]


def test_sequence_mask_is():
    _, m, metrics = call(SequenceMaskIS(upper=2.0))
    assert m.tolist() == [[1, 1, 1], [0, 0, 0], [0, 0, 0]]
    assert metrics["correction/sequence_mask_is/seq_mask_frac"] == pytest.approx(1 / 2)
    assert metrics["correction/sequence_mask_is/mask_frac"] == pytest.approx(2 / 5)


def test_geometric_mean_rejection():
    # geometric means: row 0 1.5^(1/3) ≈ 1.145, row 1 1.5
    _, m, _ = call(GeometricMeanRejection(lower=0.9, upper=1.2))
    assert m.tolist() == [[1, 1, 1], [0, 0, 0], [0, 0, 0]]
    _, m, _ = call(GeometricMeanRejection(lower=0.9, upper=1.1))
    assert m.tolist() == [[0, 0, 0], [0, 0, 0], [0, 0, 0]]


def k3(rho):  # KL(μ‖π_old) sample estimate with samples from μ: ρ − log ρ − 1
    return rho - math.log(rho) - 1


def test_kl_rejection_token_and_sequence():
    # token k3: 0.901, 0.193, 0 | 0.095, 0.095
    _, m, metrics = call(KLRejection(threshold=0.15))
    assert m.tolist() == [[0, 0, 1], [1, 1, 0], [0, 0, 0]]
    assert metrics["correction/kl_rejection_token/kl_mean"] == pytest.approx(
        (k3(3) + k3(0.5) + 0 + 2 * k3(1.5)) / 5, rel=1e-12
    )
    _, m, _ = call(KLRejection(threshold=0.15, level="sequence"))  # means 0.365 | 0.095
    assert m.tolist() == [[0, 0, 0], [1, 1, 0], [0, 0, 0]]
    _, m, _ = call(KLRejection(threshold=0.15, kind="k1", level="sequence"))  # k1 means −0.135 | −0.405
    assert torch.equal(m, MASK)


def test_opsm_masks_only_negative_far_off_policy_sequences():
    log_rho = torch.tensor([[L(0.5), L(0.5)], [L(0.5), L(0.5)], [L(0.95), L(0.95)]], dtype=F64)
    behav = torch.full((3, 2), -2.0, dtype=F64)
    adv = torch.tensor([[-1.0] * 2, [1.0] * 2, [-1.0] * 2], dtype=F64)
    mask = torch.ones(3, 2, dtype=F64)
    # mean KL(μ‖π_old) per sequence: log 2 = 0.69, 0.69, −log 0.95 = 0.051
    _, m, metrics = OPSM(delta=0.1)(behav + log_rho, behav, mask, adv)
    assert m.tolist() == [[0, 0], [1, 1], [1, 1]]
    assert metrics["correction/opsm/seq_mask_frac"] == pytest.approx(1 / 3)
    _, m, _ = OPSM(delta=0.7)(behav + log_rho, behav, mask, adv)
    assert torch.equal(m, mask)
    with pytest.raises(ValueError, match="advantages_BT"):
        OPSM(0.1)(behav + log_rho, behav, mask)


def test_token_tis_and_decoupled_together_are_refused():
    with pytest.raises(ValueError, match="apply the ratio twice"):
        build_corrections([{"name": "token_tis"}, {"name": "decoupled"}])
    assert build_corrections([{"name": "token_tis"}, {"name": "token_mask_is"}]).weighs_token_ratios
    assert not build_corrections([{"name": "token_tis"}, {"name": "sequence_tis"}]).weighs_token_ratios
    assert not build_corrections([{"name": "token_mask_is"}]).weighs_token_ratios


def test_compose_multiplies_weights_ands_masks_in_any_order():
    a, b = TokenTIS(upper=2.0), SequenceMaskIS(upper=2.0)
    w1, m1, met1 = compose([a, b])(OLD, BEHAV, MASK)
    w2, m2, met2 = compose([b, a])(OLD, BEHAV, MASK)
    assert torch.equal(w1, w2) and torch.equal(m1, m2) and met1 == met2
    assert w1[0].tolist() == pytest.approx([2.0, 0.5, 1.0])
    assert m1.tolist() == [[1, 1, 1], [0, 0, 0], [0, 0, 0]]
    w, m, met = compose([])(OLD, BEHAV, MASK)
    assert torch.equal(w, torch.ones(3, 3, dtype=F64)) and torch.equal(m, MASK) and met == {}
    with pytest.raises(ValueError, match="duplicate"):
        compose([TokenTIS(), TokenTIS(upper=3.0)])


def test_build_corrections_from_config():
    c = build_corrections(
        [
            {"name": "token_tis", "upper": 2.0},
            {"name": "sequence_mask_is", "upper": 2.0},
            {"name": "opsm", "delta": 1.0},
        ]
    )
    adv = torch.ones(3, 3, dtype=F64)
    w, m, _ = c(OLD, BEHAV, MASK, adv)
    assert w[0].tolist() == pytest.approx([2.0, 0.5, 1.0]) and m[1].tolist() == [0, 0, 0]
    assert set(CORRECTIONS) == {
        "token_tis",
        "sequence_tis",
        "token_mask_is",
        "sequence_mask_is",
        "geometric_rejection",
        "kl_rejection",
        "opsm",
        "decoupled",
    }


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"name": "bypass"}, "algorithm.bypass=true"),
        ({"upper": 2.0}, "'name'"),
        ({"name": "token_tis", "cap": 2.0}, "cap"),
        ({"name": "token_tis", "lower": 3.0, "upper": 2.0}, "lower < upper"),
        ({"name": "token_mask_is", "lower": None, "upper": None}, "at least one"),
        (
            {"name": "kl_rejection", "threshold": 0.1, "kind": "k9"},
            r"corrections\[0\] \('kl_rejection'\): KLRejection kind .*'k9'",
        ),
        ({"name": "kl_rejection", "threshold": 0.1, "level": "batch"}, "level"),
        ({"name": "geometric_rejection", "lower": 0.9}, "upper"),
    ],
)
def test_build_corrections_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        build_corrections([spec])


@pytest.mark.parametrize("which, bad, where", [("old", float("nan"), (1, 0)), ("behav", -math.inf, (0, 2))])
def test_non_finite_logprobs_name_tensor_and_position(which, bad, where):
    old, behav = OLD.clone(), BEHAV.clone()
    (old if which == "old" else behav)[where] = bad
    name = "old_logprobs_BT" if which == "old" else "behav_logprobs_BT"
    with pytest.raises(ValueError, match=rf"{name}.*\(row {where[0]}, col {where[1]}\)"):
        TokenTIS()(old, behav, MASK)


def test_non_finite_in_padding_is_fine():
    old = OLD.clone()
    old[2, 1], old[1, 2] = float("nan"), math.inf
    w, m, _ = build_corrections([{"name": "sequence_tis"}, {"name": "kl_rejection", "threshold": 1.0}])(
        old, BEHAV, MASK
    )
    assert torch.isfinite(w).all() and torch.isfinite(m).all()


def test_huge_sequence_ratio_does_not_overflow():
    log_rho = torch.full((2, 200), 5.0)  # Σ = 1000: exp would be inf in fp32 and fp64
    log_rho[1] = -5.0
    behav, mask = torch.full((2, 200), -10.0), torch.ones(2, 200)
    w, m, _ = compose([SequenceTIS(upper=2.0), DecoupledIS()])(behav + log_rho, behav, mask)
    assert torch.isfinite(w).all()
    assert w[0, 0].item() == pytest.approx(2.0 * math.exp(5.0), rel=1e-6)
    assert w[1, 0].item() == pytest.approx(math.exp(-20.0) * math.exp(-5.0), rel=1e-5)
    _, m, _ = SequenceMaskIS(lower=0.5, upper=2.0)(behav + log_rho, behav, mask)
    assert m.sum().item() == 0.0


def test_apply_bypass_takes_the_ratio_against_mu():
    lp = torch.tensor([[-1.0, -2.0]], dtype=F64)
    old, behav = lp - 0.05, lp - L(1.5)  # π_θ/π_old ≈ 1.05 (unclipped) but π_θ/μ = 1.5 (clipped)
    inp = LossInputs(
        lp.clone().requires_grad_(True), old, behav, torch.ones(1, 2, dtype=F64), torch.ones(1, 2, dtype=F64)
    )
    bypass = apply_bypass(inp)
    assert torch.equal(bypass.old_logprobs_BT, behav) and torch.equal(inp.old_logprobs_BT, old)
    v, _ = PPOClipLoss(0.2, 0.2)(bypass, "token-mean", LossNorm(2, 1))
    assert v.item() == pytest.approx(-1.2)
    v, _ = PPOClipLoss(0.2, 0.2)(inp, "token-mean", LossNorm(2, 1))
    assert v.item() == pytest.approx(-math.exp(0.05))


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_everything_masked_is_neutral(name):
    kwargs = {
        "geometric_rejection": dict(lower=0.9, upper=1.1),
        "kl_rejection": dict(threshold=0.1),
        "opsm": dict(delta=0.1),
    }.get(name, {})
    mask = torch.zeros(2, 3, dtype=F64)
    old = torch.full((2, 3), float("nan"), dtype=F64)
    w, m, metrics = build_corrections([{"name": name, **kwargs}])(old, BEHAV[:2], mask, -torch.ones(2, 3))
    assert torch.equal(w, torch.ones(2, 3, dtype=F64)) and torch.equal(m, mask)
    assert all(math.isfinite(v) for v in metrics.values())
    assert all(v == 0.0 for k, v in metrics.items() if k.endswith("mask_frac") or k.endswith("clip_frac"))
