"""Aggregation modes against hand-computed sums, the micro-batch property, empty input."""

import math

import pytest
import torch

from exactrl.algo.aggregation import AGG_MODES, aggregate
from exactrl.algo.types import LossNorm

NAN = float("nan")
# row 0: three tokens 1, 2, 3; row 1: one token 4 (5 is masked); row 2: empty, garbage in padding
VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0], [NAN, math.inf, 7.0]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
NORM = LossNorm(total_tokens=4, total_seqs=3, constant=5.0)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),  # 2.5
        ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + 4 / 1 + 0) / 3),  # 2.0
        ("seq-mean-token-sum", ((1 + 2 + 3) + 4 + 0) / 3),  # 10/3
        ("constant-normalised", (1 + 2 + 3 + 4) / (5.0 * 3)),  # 2/3
    ],
)
def test_modes_hand_computed(mode, expected):
    out = aggregate(VALUES, MASK, mode, NORM)
    assert out.item() == pytest.approx(expected, rel=1e-12)


def test_seq_mean_token_mean_divides_by_the_lengths_as_sampled():
    """A token a correction removed (row 1's second, masked now but sampled) stays in its sequence's
    denominator; the other modes take their denominators from LossNorm and do not change."""
    lengths = torch.tensor([3.0, 2.0, 0.0], dtype=torch.float64)
    out = aggregate(VALUES, MASK, "seq-mean-token-mean", NORM, lengths)
    assert out.item() == pytest.approx(((1 + 2 + 3) / 3 + 4 / 2 + 0) / 3, rel=1e-12)  # 4/3, not 2.0
    for mode in ("token-mean", "seq-mean-token-sum", "constant-normalised"):
        assert aggregate(VALUES, MASK, mode, NORM, lengths).item() == aggregate(VALUES, MASK, mode, NORM).item()
    with pytest.raises(ValueError, match="lengths_B"):  # fewer than the unmasked tokens
        aggregate(VALUES, MASK, "seq-mean-token-mean", NORM, torch.tensor([3.0, 0.0, 0.0]))


def test_mode_names_are_the_contract():
    assert set(AGG_MODES) == {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant-normalised"}


def test_unknown_mode_lists_valid_modes():
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        aggregate(VALUES, MASK, "mean", NORM)


def test_constant_mode_needs_constant():
    with pytest.raises(ValueError, match="constant"):
        aggregate(VALUES, MASK, "constant-normalised", LossNorm(4, 3, None))


def test_norm_smaller_than_micro_batch_is_rejected():
    with pytest.raises(ValueError, match="whole step batch"):
        aggregate(VALUES, MASK, "token-mean", LossNorm(total_tokens=2, total_seqs=3))


@pytest.mark.parametrize("mode", sorted(AGG_MODES))
def test_micro_batches_sum_to_full_batch(mode):
    g = torch.Generator().manual_seed(0)
    B, T = 8, 6
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.tensor([6, 0, 3, 1, 5, 2, 6, 4])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    norm = LossNorm.from_mask(mask, constant=6.0)
    whole = aggregate(values, mask, mode, norm)
    halves = aggregate(values[:3], mask[:3], mode, norm) + aggregate(values[3:], mask[3:], mode, norm)
    assert halves.item() == pytest.approx(whole.item(), rel=1e-12, abs=1e-15)
    # and a local norm would NOT give the same sum (the property is not vacuous)
    local = aggregate(values[:3], mask[:3], mode, LossNorm.from_mask(mask[:3], 6.0)) + aggregate(
        values[3:], mask[3:], mode, LossNorm.from_mask(mask[3:], 6.0)
    )
    assert local.item() != pytest.approx(whole.item(), rel=1e-6)


@pytest.mark.parametrize("mode", sorted(AGG_MODES))
def test_everything_masked_gives_zero_and_zero_grad(mode):
    values = torch.tensor([[NAN, 1.0], [math.inf, 2.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, 2, dtype=torch.float64)
    out = aggregate(values, mask, mode, LossNorm.from_mask(mask, constant=3.0))
    out.backward()
    assert out.item() == 0.0
    assert torch.equal(values.grad, torch.zeros(2, 2, dtype=torch.float64))


def test_garbage_in_padding_does_not_reach_the_gradient():
    values = VALUES.clone().requires_grad_(True)
    aggregate(values, MASK, "token-mean", NORM).backward()
    assert torch.equal(values.grad, MASK / 4)


def test_from_masks_counts_tokens_and_all_rows():
    norm = LossNorm.from_masks([MASK, torch.ones(2, 5, dtype=torch.float64)], constant=2.0)
    assert (norm.total_tokens, norm.total_seqs, norm.constant) == (4 + 10, 3 + 2, 2.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(total_tokens=-1, total_seqs=1),
        dict(total_tokens=1.5, total_seqs=1),
        dict(total_tokens=1, total_seqs=1, constant=0.0),
    ],
)
def test_bad_norm(kwargs):
    with pytest.raises(ValueError, match="LossNorm"):
        LossNorm(**kwargs)


def test_bool_mask_rejected():
    with pytest.raises(ValueError, match="float"):
        aggregate(VALUES, MASK.bool(), "token-mean", NORM)
