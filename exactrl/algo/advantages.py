"""Outcome-reward advantage estimators: rewards_PG -> advantages_PG.

All estimators are critic-free and work on one scalar reward per sample;
the trainer broadcasts a sample's advantage over its tokens. Rows are
prompts (groups), columns the G samples of that prompt.

Standard deviations are Bessel-corrected (as in DeepSeekMath's GRPO and its
common implementations); a group or batch of one sample has std 0 and, since
its centred reward is also 0, advantage exactly 0 — never 0/0 = NaN.

A group (or, whitened over the batch, a batch) of equal rewards gets
advantage exactly 0: its centred rewards are set to 0, not computed. The
mean of G copies of 0.7 in float32 comes out one ulp off, and
(r − mean) / (0 + eps) would turn that ulp into an advantage of ~0.06 for
the whole group (5.7 gives −0.32). They compute in float64 (float32
rewards' means and stds are then exact to float32's precision) and return
float64.

Legend: P prompts, G samples per prompt.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from exactrl.algo.types import check_kwargs
from exactrl.argcheck import check_arg_types


def _check_rewards(rewards_PG: torch.Tensor) -> torch.Tensor:
    if not isinstance(rewards_PG, torch.Tensor) or rewards_PG.dim() != 2:
        raise ValueError(
            "rewards_PG must be a 2-D [P prompts, G samples] tensor, "
            f"got {getattr(rewards_PG, 'shape', type(rewards_PG))}"
        )
    if rewards_PG.numel() == 0:
        raise ValueError(f"rewards_PG is empty (shape {tuple(rewards_PG.shape)})")
    if not bool(torch.isfinite(rewards_PG).all()):
        p, g = (int(i) for i in (~torch.isfinite(rewards_PG)).nonzero()[0])
        raise ValueError(f"rewards_PG is non-finite at (prompt {p}, sample {g}): {rewards_PG[p, g].item()}")
    return rewards_PG.to(torch.float64)  # see the module docstring: equal rewards centre to exactly 0


def _std(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    """Bessel-corrected std; 0 when there is a single element (instead of NaN)."""
    n = x.numel() if dim is None else x.shape[dim]
    if n < 2:
        return torch.zeros_like(x.sum(dim=dim, keepdim=dim is not None))
    return x.std(dim=dim, correction=1, keepdim=dim is not None)


def _check_eps(eps: float) -> None:
    """eps keeps (r − mean) / (std + eps) finite for a group of equal rewards (std 0): it must be > 0."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a number > 0 (it keeps a group of equal rewards finite), got {eps!r}")


def _centre(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    """x − mean(x) along `dim` (None: the whole tensor); exactly 0 where the values are all equal."""
    keep = dim is not None
    mean, same = (
        (x.mean(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True) == x.amin(dim=dim, keepdim=True))
        if keep
        else (x.mean(), x.max() == x.min())
    )
    return torch.where(same, torch.zeros_like(x), x - mean)


def _whiten(x: torch.Tensor, eps: float) -> torch.Tensor:
    """(x − mean) / (std + eps) over the whole batch."""
    _check_eps(eps)
    return _centre(x, None) / (_std(x, None) + eps)


def grpo(rewards_PG: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): A_i = (r_i − mean_g r) / (std_g r + eps).

    With normalize_std=False this is Dr.GRPO's estimator; Dr.GRPO also takes the loss with
    `agg_mode: constant-normalised` (the run config's default is `token-mean`).
    """
    r = _check_rewards(rewards_PG)
    centred_PG = _centre(r, 1)
    _check_eps(eps)
    if not normalize_std:
        return centred_PG
    return centred_PG / (_std(r, 1) + eps)


def dr_grpo(rewards_PG: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO (Liu et al. 2025): A_i = r_i − mean_g r. Dividing by the group std
    over-weights questions that are almost always or never solved; Dr.GRPO drops it."""
    return grpo(rewards_PG, normalize_std=False)


def rloo(rewards_PG: torch.Tensor) -> torch.Tensor:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024): A_i = r_i − mean_{j≠i} r_j
    = G/(G−1) (r_i − mean_g r). A one-sample group has no baseline: A = 0."""
    r = _check_rewards(rewards_PG)
    G = r.shape[1]
    if G < 2:
        return torch.zeros_like(r)
    return _centre(r, 1) * (G / (G - 1))


def reinforce_pp(rewards_PG: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): no per-prompt baseline; the rewards are whitened over
    the whole batch, A = (r − mean_batch) / (std_batch + eps). Global rather than
    per-group statistics avoid GRPO's overfitting to easy prompts.

    Per-token KL-penalised returns are not modelled here: with the KL in the
    reward, the trainer subtracts it from `rewards_PG` first.
    """
    return _whiten(_check_rewards(rewards_PG), eps)


def reinforce_pp_baseline(rewards_PG: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++-baseline (Hu 2025): subtract the group mean (removes the
    prompt's difficulty), then whiten over the whole batch.

    Each group's centred rewards sum to 0, so their batch mean is 0 and the
    whitening only divides by the batch std: centring again would turn that
    mean's rounding error into a nonzero advantage for a group of equal rewards.
    """
    centred_PG = _centre(_check_rewards(rewards_PG), 1)
    _check_eps(eps)
    return centred_PG / (_std(centred_PG, None) + eps)


ADVANTAGES: dict[str, Callable[..., torch.Tensor]] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
}


# the estimators whose baseline is the sample's own group: with one sample per prompt every advantage is
# exactly 0 (and so are the loss and its gradient); reinforce_pp whitens over the whole batch instead
GROUP_BASELINE = frozenset({"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"})


def compute_advantages(name: str, rewards_PG: torch.Tensor, **kwargs) -> torch.Tensor:
    """advantages_PG from the estimator registered under `name`."""
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {sorted(ADVANTAGES)}")
    fn = ADVANTAGES[name]
    check_kwargs(fn, kwargs, f"advantage estimator {name!r}", positional=("rewards_PG",))
    check_arg_types(fn, kwargs, f"advantage estimator {name!r}")
    advantages_PG = fn(rewards_PG, **kwargs)
    assert advantages_PG.shape == rewards_PG.shape
    if not bool(torch.isfinite(advantages_PG).all()):  # finite rewards near float64's max overflow mean or std
        raise ValueError(
            f"rewards_PG up to {rewards_PG.abs().max().item():g} overflow the {name!r} advantages "
            f"(NaN or inf): scale the rewards down"
        )
    return advantages_PG
