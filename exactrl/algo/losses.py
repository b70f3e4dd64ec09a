"""Policy-gradient losses: one small class each, chosen by name from `LOSSES`.

Every loss maps `LossInputs` to a per-token loss ℓ_t, multiplies it by the
correction weight w_t (`inp.weights_BT`, ones when no correction is on) and
aggregates with the configured mode and the batch-wide `LossNorm`:

    loss = aggregate(w · ℓ, mask, agg_mode, norm)

so the DENOMINATOR of every loss below is the one of `agg_mode`
(aggregation.py): total_tokens for `token-mean`, total_seqs for the seq-mean
modes, constant·total_seqs for `constant-normalised`. The papers' own choices
are noted per class. The ratio r_t = π_θ/π_old is always against π_old (the
proximal policy); for ratios against μ use `corrections.apply_bypass`. The
trainer takes one optimizer step per batch and π_old as the detached value of
its own forward, so r_t = 1 in value (gradient ∇log π_θ) and the ratio clips
and their clip fractions only act with `bypass` (ratio against μ).

Masked positions are replaced by zeros before any arithmetic, so garbage in
padding never reaches the value or the gradient. Metrics are python floats,
means over the unmasked tokens of this micro-batch.

Legend: B sequences, T tokens.
"""

from __future__ import annotations

import torch

from exactrl.algo.aggregation import aggregate, masked_mean, masked_values, seq_mean, seq_sum
from exactrl.algo.kl import MAX_LOG_RATIO, exp_ratio, upcast
from exactrl.algo.types import LossInputs, LossNorm, check_kwargs
from exactrl.argcheck import check_arg_types

Metrics = dict[str, float]


def _mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    return float(masked_mean(x_BT.detach().to(torch.float64), mask_BT).item())


def _check_eps(**eps: float) -> None:
    for name, v in eps.items():
        if not 0.0 <= v:
            raise ValueError(f"{name} must be >= 0, got {v}")
    for name in ("eps_low", "eps_low_is"):
        if name in eps and eps[name] > 1.0:
            raise ValueError(f"{name}={eps[name]} > 1 would make the lower bound 1 - {name} negative")


class PolicyLoss:
    """Shared plumbing: sanitise masked positions, weight, aggregate."""

    def __call__(self, inp: LossInputs, agg_mode: str, norm: LossNorm) -> tuple[torch.Tensor, Metrics]:
        mask_BT = inp.mask_BT
        lp_BT = masked_values(upcast(inp.logprobs_BT), mask_BT)
        old_BT = masked_values(upcast(inp.old_logprobs_BT), mask_BT)
        adv_BT = masked_values(upcast(inp.advantages_BT), mask_BT)
        loss_BT, metrics = self.token_loss(lp_BT, old_BT, adv_BT, mask_BT)
        assert loss_BT.shape == lp_BT.shape, (loss_BT.shape, lp_BT.shape)
        loss = aggregate(
            loss_BT * upcast(inp.weights_BT), mask_BT, agg_mode, norm, lengths_B=inp.sampled_mask_BT.sum(dim=1)
        )
        metrics["loss/weight_mean"] = _mean(inp.weights_BT, mask_BT)
        return loss, metrics

    def token_loss(self, lp_BT, old_BT, adv_BT, mask_BT) -> tuple[torch.Tensor, Metrics]:
        raise NotImplementedError


class PPOClipLoss(PolicyLoss):
    """PPO clipped surrogate (Schulman et al. 2017), asymmetric ε (DAPO "clip-higher",
    Yu et al. 2025) and optional dual clip (Ye et al. 2020, "Mastering Complex
    Control in MOBA Games with Deep RL"):

        r_t = exp(log π_θ − log π_old)
        ℓ_t = max(−A r_t, −A clip(r_t, 1−ε_low, 1+ε_high))
        dual clip c > 1, for A < 0 only:  ℓ_t = min(ℓ_t, −c A)

    The dual clip bounds the loss of a negative-advantage token whose ratio
    has exploded (its gradient is then 0). Denominator: agg_mode (PPO/GRPO:
    seq-mean-token-mean; DAPO: token-mean).
    """

    def __init__(self, eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None):
        _check_eps(eps_low=eps_low, eps_high=eps_high)
        if dual_clip is not None and not dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1 (typically 3), got {dual_clip}")
        self.eps_low, self.eps_high, self.dual_clip = eps_low, eps_high, dual_clip

    def token_loss(self, lp_BT, old_BT, adv_BT, mask_BT):
        ratio_BT = exp_ratio(lp_BT - old_BT)
        clipped_BT = ratio_BT.clamp(1.0 - self.eps_low, 1.0 + self.eps_high)
        loss_BT = torch.maximum(-adv_BT * ratio_BT, -adv_BT * clipped_BT)
        r = ratio_BT.detach()
        metrics = {
            "loss/ratio_mean": _mean(r, mask_BT),
            "loss/clip_frac_low": _mean((adv_BT < 0) & (r < 1.0 - self.eps_low), mask_BT),
            "loss/clip_frac_high": _mean((adv_BT > 0) & (r > 1.0 + self.eps_high), mask_BT),
        }
        if self.dual_clip is not None:
            neg_BT = adv_BT < 0
            loss_BT = torch.where(neg_BT, torch.minimum(loss_BT, -self.dual_clip * adv_BT), loss_BT)
            metrics["loss/dual_clip_frac"] = _mean(neg_BT & (r > self.dual_clip), mask_BT)
        return loss_BT, metrics


class GSPOLoss(PolicyLoss):
    """Group Sequence Policy Optimization, token form (GSPO-token; Zheng et al. 2025):

        s_i   = exp( (1/|y_i|) Σ_t (log π_θ − log π_old) )      (sequence ratio)
        s_i,t = sg[s_i] · π_θ(y_t) / sg[π_θ(y_t)]               (value s_i, grad s_i ∇log π_θ(y_t))
        ℓ_t   = max(−A_t s_i,t, −A_t clip(s_i,t, 1−ε_low, 1+ε_high))

    With a sequence advantage and `seq-mean-token-mean` this equals
    sequence-level GSPO (under `token-mean` the 1/|y_i| becomes
    1/total_tokens). The clip
    acts on the whole sequence, so ε is tiny (paper: 3e-4 / 4e-4).
    Denominator: agg_mode (paper: seq-mean-token-mean).
    """

    def __init__(self, eps_low: float = 3e-4, eps_high: float = 4e-4):
        _check_eps(eps_low=eps_low, eps_high=eps_high)
        self.eps_low, self.eps_high = eps_low, eps_high

    def token_loss(self, lp_BT, old_BT, adv_BT, mask_BT):
        seq_log_ratio_B = seq_mean(lp_BT - old_BT, mask_BT).detach()
        log_s_BT = seq_log_ratio_B.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)[:, None] + (lp_BT - lp_BT.detach())
        s_BT = torch.exp(log_s_BT)
        clipped_BT = s_BT.clamp(1.0 - self.eps_low, 1.0 + self.eps_high)
        loss_BT = torch.maximum(-adv_BT * s_BT, -adv_BT * clipped_BT)
        s = s_BT.detach()
        return loss_BT, {
            "loss/ratio_mean": _mean(s, mask_BT),
            "loss/clip_frac_low": _mean((adv_BT < 0) & (s < 1.0 - self.eps_low), mask_BT),
            "loss/clip_frac_high": _mean((adv_BT > 0) & (s > 1.0 + self.eps_high), mask_BT),
        }


class CISPOLoss(PolicyLoss):
    """Clipped IS-weight Policy Optimization (MiniMax-M1, 2025):

        r̂_t = sg[clip(r_t, 1−ε_low^IS, 1+ε_high^IS)]
        ℓ_t  = −r̂_t A log π_θ

    Unlike PPO no token loses its gradient; only the weight is bounded. The
    paper sets no lower bound (ε_low^IS large: here 1.0, i.e. bound 0) and
    tunes ε_high^IS. Denominator: agg_mode (paper: token-mean).
    """

    def __init__(self, eps_low_is: float = 1.0, eps_high_is: float = 0.28):
        _check_eps(eps_low_is=eps_low_is, eps_high_is=eps_high_is)
        self.eps_low_is, self.eps_high_is = eps_low_is, eps_high_is

    def token_loss(self, lp_BT, old_BT, adv_BT, mask_BT):
        r = exp_ratio(lp_BT - old_BT).detach()
        w_BT = r.clamp(1.0 - self.eps_low_is, 1.0 + self.eps_high_is)
        return -w_BT * adv_BT * lp_BT, {
            "loss/ratio_mean": _mean(r, mask_BT),
            "loss/clip_frac_low": _mean(r < 1.0 - self.eps_low_is, mask_BT),
            "loss/clip_frac_high": _mean(r > 1.0 + self.eps_high_is, mask_BT),
        }


class ReinforceLoss(PolicyLoss):
    """Plain REINFORCE (Williams 1992): ℓ_t = −A log π_θ. No ratio, no clip:
    on-policy by assumption, or made so by correction weights.
    Denominator: agg_mode."""

    def token_loss(self, lp_BT, old_BT, adv_BT, mask_BT):
        return -adv_BT * lp_BT, {"loss/ratio_mean": _mean(exp_ratio(lp_BT - old_BT), mask_BT)}


class SAPOLoss(PolicyLoss):
    """Soft Adaptive Policy Optimization (Gao et al. 2025, Qwen): a sigmoid gate
    in place of the hard clip,

        f(r) = (4/τ) σ(τ (r − 1)),   τ = τ_pos if A > 0 else τ_neg
        ℓ_t  = −f(r_t) A

    ∇ℓ_t = −4 σ(1−σ) r_t A ∇log π_θ: weight 1 on-policy, decaying smoothly as
    r leaves 1 (faster for negatives: τ_neg > τ_pos). Denominator: agg_mode
    (paper: seq-mean-token-mean).
    """

    def __init__(self, tau_pos: float = 1.0, tau_neg: float = 1.05):
        if not (tau_pos > 0 and tau_neg > 0):
            raise ValueError(f"SAPO temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
        self.tau_pos, self.tau_neg = tau_pos, tau_neg

    def token_loss(self, lp_BT, old_BT, adv_BT, mask_BT):
        ratio_BT = exp_ratio(lp_BT - old_BT)
        tau_BT = torch.full_like(ratio_BT, self.tau_neg).masked_fill(adv_BT > 0, self.tau_pos)
        sig_BT = torch.sigmoid(tau_BT * (ratio_BT - 1.0))
        s = sig_BT.detach()
        return -(4.0 / tau_BT) * sig_BT * adv_BT, {
            "loss/ratio_mean": _mean(ratio_BT, mask_BT),
            "loss/gate_mean": _mean(4.0 * s * (1.0 - s), mask_BT),
        }


class TOPRLoss(PolicyLoss):
    """Tapered Off-Policy REINFORCE (Le Roux et al. 2025):

        A ≥ 0:  ℓ_t = −A log π_θ                       (plain SFT-like push up)
        A < 0:  ℓ_t = −sg[clip(ρ, 0, upper)] A log π_θ  (truncated IS push down)

    ρ is the trajectory ratio π_θ(y)/π_old(y) = exp(Σ_t log-ratio) (paper);
    `level="token"` uses per-token ratios instead. Truncating negatives only
    keeps the push-down bounded without slowing learning from successes.
    Denominator: agg_mode.
    """

    def __init__(self, upper: float = 1.0, level: str = "sequence"):
        if level not in ("sequence", "token"):
            raise ValueError(f"TOPR level must be 'sequence' or 'token', got {level!r}")
        if not upper > 0:
            raise ValueError(f"TOPR upper must be > 0, got {upper}")
        self.upper, self.level = upper, level

    def token_loss(self, lp_BT, old_BT, adv_BT, mask_BT):
        log_ratio_BT = (lp_BT - old_BT).detach()
        if self.level == "sequence":
            log_ratio_BT = seq_sum(log_ratio_BT, mask_BT)[:, None].expand_as(lp_BT)
        rho_BT = exp_ratio(log_ratio_BT)
        neg_BT = adv_BT < 0
        w_BT = torch.where(neg_BT, rho_BT.clamp(0.0, self.upper), torch.ones_like(rho_BT))
        return -w_BT * adv_BT * lp_BT, {
            "loss/ratio_mean": _mean(rho_BT, mask_BT),
            "loss/clip_frac_high": _mean(neg_BT & (rho_BT > self.upper), mask_BT),
        }


LOSSES: dict[str, type[PolicyLoss]] = {
    "ppo": PPOClipLoss,
    "gspo": GSPOLoss,
    "cispo": CISPOLoss,
    "reinforce": ReinforceLoss,
    "sapo": SAPOLoss,
    "topr": TOPRLoss,
}


def build_loss(name: str, **kwargs) -> PolicyLoss:
    """The loss registered under `name`, built from config kwargs."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; valid losses: {sorted(LOSSES)}")
    check_kwargs(LOSSES[name], kwargs, f"loss {name!r}")
    check_arg_types(LOSSES[name], kwargs, f"loss {name!r}")
    try:
        return LOSSES[name](**kwargs)
    except ValueError as e:  # a value out of range (eps_low=1.5): say which loss
        raise ValueError(f"loss {name!r}: {e}") from None
