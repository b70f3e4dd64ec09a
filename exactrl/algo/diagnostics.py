"""How far off-policy a batch is, and what the corrections did about it.

`logprob_diff_metrics` is the exactness contract's headline number
(docs/design.md §3, slime's definition): per sequence, the mean over its tokens of
|lp_train − lp_rollout|, then the mean over the sequences that have at least
one token; `_max` is the maximum over all tokens. In exact synchronous
training both are exactly 0.0. Computed in fp64, so a nonzero fp32
difference can never round to zero.

`mismatch_metrics` describes the token ratio ρ_t = π_old/μ (samples from μ):

    mismatch/k1, k3        token means of Schulman's estimators of KL(μ‖π_old)
    mismatch/log_ppl_diff  mean over sequences of (−mean log μ) − (−mean log π_old)
    mismatch/chi2_token    E_t[ρ_t²] − 1          (χ²(π_old‖μ), token level)
    mismatch/chi2_seq      E_i[(Π_t ρ_t)²] − 1    (sequence level)
    mismatch/ess           (Σw)² / (n Σw²) ∈ (0, 1], normalised effective sample size
    mismatch/is_weight_*   mean / min / max of w
    mismatch/token_clip_frac   tokens whose applied weight differs from ρ_t (truncated), when the
                               weights are token ratios (token_tis, decoupled); else 0 (a masking
                               or sequence-level correction reports its own figures)
    mismatch/seq_clip_frac     non-empty sequences holding a token whose weight is truncated (token
                               ratios, as token_clip_frac); the trainer reports sequence TIS's own
                               clipped fraction here when it weighs the sequences
    mismatch/token_mask_frac   tokens the corrections removed
    mismatch/seq_mask_frac     non-empty sequences the corrections removed entirely
    mismatch/out_of_support_frac  sampled tokens the trainer's top-k/top-p cuts (π_old = 0, so ρ_t = 0
                               and |lp_train − lp_rollout| = ∞; only off-policy). The trainer leaves
                               them out of the loss and every figure above (trainer.py)

χ² and k1 are sample estimates over the batch's tokens, so they can be
slightly negative when the mismatch is tiny. Ratios go through kl.exp_ratio, so
a sequence whose Σ_t log ρ_t passes ±20 counts in chi2_seq as e^±40, not ∞. w is the applied
weight (`weights_BT`, e.g. from `corrections`) on the tokens
that survived (`final_mask_BT`), or ρ_t itself when no weights are given. The
χ² and KL figures always describe the raw, uncorrected mismatch. With no
tokens at all every figure takes its on-policy value (0, or 1 for ess and
weights).

Legend: B sequences, T tokens.
"""

from __future__ import annotations

import torch

from exactrl.algo.aggregation import masked_mean, masked_values, seq_mean, seq_sum
from exactrl.algo.kl import exp_ratio, kl_estimate
from exactrl.algo.types import check_finite, check_mask, check_same_shape


def _clean(named: dict[str, torch.Tensor], mask_BT: torch.Tensor) -> list[torch.Tensor]:
    """Validated fp64 copies with exact zeros at masked positions."""
    check_mask("mask_BT", mask_BT)
    check_same_shape({**named, "mask_BT": mask_BT})
    for name, x in named.items():
        check_finite(name, x, mask_BT)
    return [masked_values(x.detach().to(torch.float64), mask_BT) for x in named.values()]


def _mean_over_nonempty(values_B: torch.Tensor, mask_BT: torch.Tensor) -> float:
    has_B = mask_BT.sum(dim=1) > 0
    return float(values_B[has_B].mean().item()) if bool(has_B.any()) else 0.0


def logprob_diff_metrics(
    train_logprobs_BT: torch.Tensor, rollout_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor
) -> dict[str, float]:
    """The public train/rollout mismatch keys (slime's definition; 0.0 when no tokens)."""
    train, rollout = _clean(
        {"train_logprobs_BT": train_logprobs_BT, "rollout_logprobs_BT": rollout_logprobs_BT}, mask_BT
    )
    abs_BT = (train - rollout).abs()
    return {
        "train/train_rollout_logprob_abs_diff": _mean_over_nonempty(seq_mean(abs_BT, mask_BT), mask_BT),
        "train/train_rollout_logprob_abs_diff_max": float(abs_BT.max().item()) if abs_BT.numel() else 0.0,
    }


def _weight_stats(w_BT: torch.Tensor, keep_BT: torch.Tensor) -> dict[str, float]:
    """ess and is_weight_* of w over the kept tokens."""
    w = w_BT[keep_BT > 0]
    if w.numel() == 0:
        return {
            "mismatch/ess": 1.0,
            "mismatch/is_weight_mean": 1.0,
            "mismatch/is_weight_min": 1.0,
            "mismatch/is_weight_max": 1.0,
        }
    sq = float(w.square().sum().item())
    ess = float(w.sum().item()) ** 2 / (w.numel() * sq) if sq > 0 else 0.0
    return {
        "mismatch/ess": ess,
        "mismatch/is_weight_mean": float(w.mean().item()),
        "mismatch/is_weight_min": float(w.min().item()),
        "mismatch/is_weight_max": float(w.max().item()),
    }


def _differs(w, ratio):
    """|w − ρ| beyond fp32 rounding of the applied weight: a truncated weight."""
    return (w - ratio).abs() > 1e-6 * ratio.clamp(min=1.0)


def _correction_fracs(ratio_BT, weights_BT, mask_BT, final_BT, weighted_BT, token_ratios: bool) -> dict[str, float]:
    n = max(float(mask_BT.sum().item()), 1.0)
    clipped = seq_clip = 0.0
    if weights_BT is not None and token_ratios:
        differs_BT = _differs(weights_BT, ratio_BT) & (weighted_BT > 0)
        clipped = float(masked_mean(differs_BT.to(torch.float64), weighted_BT).item())
        weighed_B = weighted_BT.sum(dim=1) > 0
        seq_clip = float(differs_BT.any(dim=1).sum().item()) / max(int(weighed_B.sum().item()), 1)
    has_B = mask_BT.sum(dim=1) > 0
    removed_B = has_B & (final_BT.sum(dim=1) == 0)
    return {
        "mismatch/token_clip_frac": clipped,
        "mismatch/seq_clip_frac": seq_clip,
        "mismatch/token_mask_frac": 1.0 - float(final_BT.sum().item()) / n if mask_BT.sum() > 0 else 0.0,
        "mismatch/seq_mask_frac": float(removed_B.sum().item()) / max(int(has_B.sum().item()), 1),
    }


def mismatch_metrics(
    old_logprobs_BT: torch.Tensor,
    behav_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    weights_BT: torch.Tensor | None = None,
    final_mask_BT: torch.Tensor | None = None,
    weights_are_token_ratios: bool = True,
    weighted_mask_BT: torch.Tensor | None = None,
) -> dict[str, float]:
    """Flat `mismatch/...` metrics (see the module docstring for each key). `weights_are_token_ratios`:
    whether `weights_BT` are the tokens' own (truncated) ratios, which token_clip_frac compares with ρ_t.
    `weighted_mask_BT`: the tokens the weights were computed for, over which ess, is_weight_* and
    token_clip_frac are taken (default `final_mask_BT`; a trainer that keeps tokens out of the loss
    before the corrections run, as overlong.mask_truncated does, passes those the corrections saw)."""
    old_BT, behav_BT = _clean({"old_logprobs_BT": old_logprobs_BT, "behav_logprobs_BT": behav_logprobs_BT}, mask_BT)
    final_BT = mask_BT if final_mask_BT is None else final_mask_BT
    check_mask("final_mask_BT", final_BT)
    if bool(((final_BT > 0) & (mask_BT == 0)).any()):
        raise ValueError("final_mask_BT keeps tokens that mask_BT excludes: pass the mask the corrections returned")
    if weights_BT is not None:
        (weights_BT,) = _clean({"weights_BT": weights_BT}, mask_BT)
    lr_BT = old_BT - behav_BT
    ratio_BT = masked_values(exp_ratio(lr_BT), mask_BT)
    seq_ratio_B = exp_ratio(seq_sum(lr_BT, mask_BT))
    metrics = {
        "mismatch/k1": float(masked_mean(-lr_BT, mask_BT).item()),
        "mismatch/k3": float(masked_mean(kl_estimate(behav_BT, old_BT, "k3"), mask_BT).item()),
        "mismatch/log_ppl_diff": _mean_over_nonempty(seq_mean(lr_BT, mask_BT), mask_BT),
        "mismatch/chi2_token": float(masked_mean(ratio_BT.square(), mask_BT).item()) - 1.0
        if mask_BT.sum() > 0
        else 0.0,
        "mismatch/chi2_seq": _mean_over_nonempty(seq_ratio_B.square() - 1.0, mask_BT),
    }
    weighted_BT = final_BT if weighted_mask_BT is None else weighted_mask_BT
    if bool(((weighted_BT > 0) & (final_BT == 0)).any()):
        raise ValueError("weighted_mask_BT keeps tokens that final_mask_BT excludes")
    metrics |= _weight_stats(ratio_BT if weights_BT is None else weights_BT, weighted_BT)
    metrics |= _correction_fracs(ratio_BT, weights_BT, mask_BT, final_BT, weighted_BT, weights_are_token_ratios)
    return metrics
