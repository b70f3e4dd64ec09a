"""Mismatch diagnostics and the public train/rollout logprob-diff keys, by hand."""

import math

import pytest
import torch

from exactrl.algo.diagnostics import logprob_diff_metrics, mismatch_metrics
from exactrl.algo.types import LossInputs

F64 = torch.float64
L = math.log
# ρ = π_old/μ: row 0 (2, 0.5), row 1 (1.5, pad), row 2 empty; padding holds garbage
LOG_RHO = torch.tensor([[L(2.0), L(0.5)], [L(1.5), 40.0], [float("nan"), 3.0]], dtype=F64)
MASK = torch.tensor([[1, 1], [1, 0], [0, 0]], dtype=F64)
BEHAV = torch.full((3, 2), -1.0, dtype=F64)
OLD = BEHAV + LOG_RHO


def test_raw_mismatch_metrics():
    m = mismatch_metrics(OLD, BEHAV, MASK)
    assert m["mismatch/k1"] == pytest.approx(-L(1.5) / 3, rel=1e-12)  # mean(log μ − log π_old)
    k3 = (2 - L(2) - 1) + (0.5 - L(0.5) - 1) + (1.5 - L(1.5) - 1)
    assert m["mismatch/k3"] == pytest.approx(k3 / 3, rel=1e-12)
    assert m["mismatch/log_ppl_diff"] == pytest.approx((0.0 + L(1.5)) / 2, rel=1e-12)
    assert m["mismatch/chi2_token"] == pytest.approx((4 + 0.25 + 2.25) / 3 - 1, rel=1e-12)
    assert m["mismatch/chi2_seq"] == pytest.approx(((2 * 0.5) ** 2 - 1 + 1.5**2 - 1) / 2, rel=1e-12)
    assert m["mismatch/ess"] == pytest.approx((2 + 0.5 + 1.5) ** 2 / (3 * (4 + 0.25 + 2.25)), rel=1e-12)
    assert (m["mismatch/is_weight_mean"], m["mismatch/is_weight_min"], m["mismatch/is_weight_max"]) == pytest.approx(
        (4 / 3, 0.5, 2.0), rel=1e-12
    )
    assert (m["mismatch/token_clip_frac"], m["mismatch/token_mask_frac"], m["mismatch/seq_mask_frac"]) == (
        0.0,
        0.0,
        0.0,
    )


def test_with_final_weights_and_mask():
    weights = torch.tensor([[1.8, 0.5], [1.5, 1.0], [1.0, 1.0]], dtype=F64)  # TIS at 1.8
    final = torch.tensor([[1, 1], [0, 0], [0, 0]], dtype=F64)  # row 1 rejected
    m = mismatch_metrics(OLD, BEHAV, MASK, weights_BT=weights, final_mask_BT=final)
    assert m["mismatch/token_clip_frac"] == pytest.approx(1 / 2)  # of the 2 kept tokens, 1 truncated
    assert m["mismatch/token_mask_frac"] == pytest.approx(1 / 3)
    assert m["mismatch/seq_mask_frac"] == pytest.approx(1 / 2)
    assert m["mismatch/ess"] == pytest.approx(2.3**2 / (2 * (1.8**2 + 0.25)), rel=1e-12)
    assert m["mismatch/is_weight_max"] == pytest.approx(1.8)
    assert m["mismatch/chi2_token"] == pytest.approx((4 + 0.25 + 2.25) / 3 - 1, rel=1e-12)  # raw, uncorrected


def test_on_policy_is_exactly_neutral():
    m = mismatch_metrics(BEHAV, BEHAV.clone(), MASK)
    assert m["mismatch/k1"] == 0.0 and m["mismatch/k3"] == 0.0 and m["mismatch/chi2_token"] == 0.0
    assert m["mismatch/chi2_seq"] == 0.0 and m["mismatch/ess"] == 1.0 and m["mismatch/is_weight_max"] == 1.0


def test_all_masked_is_neutral_and_finite():
    m = mismatch_metrics(OLD, BEHAV, torch.zeros(3, 2, dtype=F64))
    assert all(math.isfinite(v) for v in m.values())
    assert m["mismatch/k3"] == 0.0 and m["mismatch/ess"] == 1.0 and m["mismatch/seq_mask_frac"] == 0.0


def test_mismatch_errors():
    with pytest.raises(ValueError, match=r"old_logprobs_BT.*\(row 0, col 1\)"):
        mismatch_metrics(torch.tensor([[0.0, float("nan")]]), torch.zeros(1, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match="final_mask_BT"):
        mismatch_metrics(OLD, BEHAV, MASK, final_mask_BT=torch.ones(3, 2, dtype=F64))


def test_logprob_diff_slime_definition():
    train = torch.tensor([[-1.0, -2.0], [-3.0, 0.0], [0.0, 0.0]], dtype=F64)
    rollout = torch.tensor([[-1.1, -2.3], [-2.5, 100.0], [float("nan"), 7.0]], dtype=F64)
    m = logprob_diff_metrics(train, rollout, MASK)
    assert set(m) == {"train/train_rollout_logprob_abs_diff", "train/train_rollout_logprob_abs_diff_max"}
    # per-sequence means 0.2 and 0.5 (the empty row does not count), then their mean
    assert m["train/train_rollout_logprob_abs_diff"] == pytest.approx((0.2 + 0.5) / 2, rel=1e-12)
    assert m["train/train_rollout_logprob_abs_diff_max"] == pytest.approx(0.5, rel=1e-12)
    assert all(type(v) is float for v in m.values())


def test_logprob_diff_is_exactly_zero_when_bitwise_equal_and_sees_one_ulp():
    x = torch.randn(4, 5, dtype=torch.float32)
    mask = torch.ones(4, 5)
    m = logprob_diff_metrics(x, x.clone(), mask)
    assert m["train/train_rollout_logprob_abs_diff"] == 0.0 and m["train/train_rollout_logprob_abs_diff_max"] == 0.0
    y = x.clone()
    y[2, 3] = torch.nextafter(y[2, 3], torch.tensor(math.inf))
    m = logprob_diff_metrics(x, y, mask)
    assert m["train/train_rollout_logprob_abs_diff"] > 0.0 and m["train/train_rollout_logprob_abs_diff_max"] > 0.0


def test_logprob_diff_all_masked_and_errors():
    m = logprob_diff_metrics(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    assert m == {"train/train_rollout_logprob_abs_diff": 0.0, "train/train_rollout_logprob_abs_diff_max": 0.0}
    with pytest.raises(ValueError, match=r"rollout_logprobs_BT.*\(row 1, col 0\)"):
        logprob_diff_metrics(torch.zeros(2, 1), torch.tensor([[0.0], [math.inf]]), torch.ones(2, 1))
    with pytest.raises(ValueError, match="shape"):
        logprob_diff_metrics(torch.zeros(2, 1), torch.zeros(2, 2), torch.ones(2, 1))


# ---- LossInputs validation (types.py)
def _inputs(**over):
    base = dict(
        logprobs_BT=torch.zeros(2, 2, requires_grad=True),
        old_logprobs_BT=torch.zeros(2, 2),
        behav_logprobs_BT=torch.zeros(2, 2),
        advantages_BT=torch.ones(2, 2),
        mask_BT=torch.ones(2, 2),
    )
    return LossInputs(**(base | over))


def test_loss_inputs_defaults_and_errors():
    assert torch.equal(_inputs().weights_BT, torch.ones(2, 2))
    with pytest.raises(ValueError, match="shape"):
        _inputs(advantages_BT=torch.ones(2, 3))
    with pytest.raises(ValueError, match="old_logprobs_BT requires grad"):
        _inputs(old_logprobs_BT=torch.zeros(2, 2, requires_grad=True))
    with pytest.raises(ValueError, match=r"LossInputs.logprobs_BT.*\(row 1, col 1\)"):
        _inputs(logprobs_BT=torch.tensor([[0.0, 0.0], [0.0, float("nan")]]))
    with pytest.raises(ValueError, match="0.0 and 1.0"):
        _inputs(mask_BT=torch.full((2, 2), 0.5))
    with pytest.raises(ValueError, match="float"):
        _inputs(mask_BT=torch.ones(2, 2, dtype=torch.bool))
    ok = _inputs(
        logprobs_BT=torch.tensor([[0.0, float("nan")], [0.0, 0.0]]), mask_BT=torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    )  # NaN in padding is fine
    assert ok.mask_BT.sum().item() == 3
