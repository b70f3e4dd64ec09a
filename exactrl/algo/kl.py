"""Log-ratios between two policies, and Schulman's KL estimators.

With samples y ~ p and the log-ratio r = log q(y) − log p(y), three unbiased
or low-variance estimators of KL(p‖q) (J. Schulman, "Approximating KL
Divergence", 2020):

    k1 = −r            = log p − log q         unbiased, high variance, can be < 0
    k2 = ½ r²                                  biased, low variance, ≥ 0
    k3 = (e^r − 1) − r  (e^r = q/p)            unbiased, low variance, ≥ 0

Uses here: KL to a reference policy (p = π_θ, q = π_ref; in the loss or as a
reward penalty), and train/rollout mismatch diagnostics (p = μ, q = π_old,
since tokens were sampled from μ). "Unbiased" holds for samples from p; in
the asynchronous loop the tokens come from an older μ and are not
re-weighted.

π_θ here is the sampling distribution (temperature, then top-k/top-p), the
one the loss trains; π_ref is taken at the same temperature but never
truncated (as TRL and verl do): a token that π_ref's own top-k/top-p would
cut off has log π_ref = −inf, and every estimator would be +inf.

As a *loss*, the gradient of an estimator's sample value is not the
gradient of the KL it estimates (Tang & Munos 2025, "On a few pitfalls in KL
divergence gradient estimation for RL"): with y ~ π_θ,

    E[∇ k1] = 0                       (k1 in the loss only adds noise)
    E[∇ k2] = ∇ KL(π_θ‖π_ref)          (the reverse KL's gradient)
    E[∇ k3] = ∇ KL(π_ref‖π_θ)          (the forward KL's gradient)

k3 in the loss is the common choice (GRPO, DeepSeekMath); k2 is the one
whose gradient is the reverse KL's. As a reward penalty (REINFORCE on
−β·k) k1 is the usual choice.

Numerics shared by the losses and corrections:
- log-ratios are formed in at least fp32 (fp64 stays fp64): two bf16
  logprobs of −12.3 and −12.4 are each rounded to ~0.06, so their difference
  would be noise;
- every exp of a log-ratio goes through `exp_ratio`, which clamps the
  exponent to ±MAX_LOG_RATIO. A sequence log-ratio is a sum over thousands of
  tokens and easily passes 88, where fp32 exp overflows to inf; inf·0 is NaN,
  which would poison a whole step. e^20 ≈ 4.9e8 is far beyond any clip or
  truncation bound in use, so the clamp never changes a clipped result; it
  changes a result only where a ratio beyond e^±20 meets no bound (PPO's
  A < 0 side without a dual clip, its A > 0 side below e^−20, a TIS bound left
  open, the χ² and weight diagnostics), whose value then stops at the clamp
  and whose gradient is 0; on GSPO's A < 0 side the detached sequence ratio
  stops at e^20 and its gradient e^20·A·∇log π with it.

Legend: B sequences, T tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MAX_LOG_RATIO = 20.0


def upcast(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 at least (fp64 kept); differentiable."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def log_ratio(logp_BT: torch.Tensor, logq_BT: torch.Tensor) -> torch.Tensor:
    """log(p/q) = logp − logq in fp32 or wider."""
    return upcast(logp_BT) - upcast(logq_BT)


def exp_ratio(log_ratio_BT: torch.Tensor) -> torch.Tensor:
    """exp of a log-ratio with the exponent clamped to ±MAX_LOG_RATIO (see module doc)."""
    return torch.exp(log_ratio_BT.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def _k1(logp_BT: torch.Tensor, logq_BT: torch.Tensor) -> torch.Tensor:
    """logp − logq."""
    return log_ratio(logp_BT, logq_BT)


def _k2(logp_BT: torch.Tensor, logq_BT: torch.Tensor) -> torch.Tensor:
    """½ (logp − logq)²."""
    return 0.5 * log_ratio(logp_BT, logq_BT).square()


def _k3(logp_BT: torch.Tensor, logq_BT: torch.Tensor) -> torch.Tensor:
    """exp(r) − r − 1 with r = logq − logp, r clamped above at MAX_LOG_RATIO as a whole: clamping
    only the exp would leave −r − 1, whose gradient +1 on logp beyond the clamp has the wrong sign
    (it would push logp further below logq where it has already fallen e^20 times below)."""
    r_BT = log_ratio(logq_BT, logp_BT).clamp(max=MAX_LOG_RATIO)
    return exp_ratio(r_BT) - r_BT - 1.0


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_estimate(logp_BT: torch.Tensor, logq_BT: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(p‖q) from tokens sampled from p; differentiable.

    No masking here: aggregate the result with `aggregation.aggregate` (loss)
    or `aggregation.masked_mean` (metrics).
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; valid kinds: {sorted(KL_ESTIMATORS)}")
    if logp_BT.shape != logq_BT.shape:
        raise ValueError(f"kl_estimate: logp {tuple(logp_BT.shape)} and logq {tuple(logq_BT.shape)} differ in shape")
    return KL_ESTIMATORS[kind](logp_BT, logq_BT)


def kl_reward_penalty(
    behav_lps: list[torch.Tensor], ref_lps: list[torch.Tensor], kind: str, coef: float
) -> tuple[list[float], dict[str, float]]:
    """KL to the reference in the reward (`algorithm.kl.where: reward`): one penalty per sequence.

        penalty_i = β · Σ_t kl_t,   kl_t = kind-estimate of KL(π‖π_ref) at token t of sequence i

    from the behaviour logprobs μ (the tokens were sampled from μ; μ = π_old in exact mode), to be
    subtracted from the task reward before the group advantages (the KL-shaped reward of
    InstructGPT-style RLHF, Ouyang et al. 2022, summed over the completion). Returns the penalties
    and their metrics; nothing here is differentiated.
    """
    if len(behav_lps) != len(ref_lps):
        raise ValueError(f"kl_reward_penalty: {len(behav_lps)} behaviour sequences but {len(ref_lps)} reference ones")
    per_seq = [
        kl_estimate(b.double(), r.double(), kind).sum().item() if len(b) else 0.0 for b, r in zip(behav_lps, ref_lps)
    ]
    n = max(len(per_seq), 1)
    return [coef * k for k in per_seq], {
        "rollout/kl_ref_per_seq": sum(per_seq) / n,
        "rollout/kl_penalty_mean": coef * sum(per_seq) / n,
    }
