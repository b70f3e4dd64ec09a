"""Off-policy corrections between the behaviour policy μ and the proximal π_old.

In exact synchronous training μ == π_old bitwise and none of this is needed.
When it is not (asynchronous rollouts, an external engine, another
precision), the per-token ratio ρ_t = π_old/μ measures how far off-policy a
token is; a correction turns it into a weight multiplier and/or a mask:

    correction(old_logprobs_BT, behav_logprobs_BT, mask_BT, advantages_BT=None)
        -> (weights_BT, mask_BT, metrics)

Weights are 1 at positions the input mask excludes; the returned mask is the
input mask AND the correction's own keep-mask. `compose` multiplies weights
and ANDs masks. Every correction computes its statistics on the ORIGINAL
mask, so a composition does not depend on the order written in the config.

Sources: truncated IS (TIS) and masked IS (MIS) at token and sequence level
from Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training", and verl's rollout-correction docs (geometric-mean
rejection, the decoupled and bypass modes); decoupled PPO from Hilton et al.
2022 ("Batch size-invariance for policy optimization"); off-policy sequence
masking (OPSM) from DeepSeek-V3.2 (2025).

Numerics: log-ratios in fp64 (a sequence sums thousands of them); every exp
is clamped (kl.exp_ratio: e^±20, so an exploding sequence ratio becomes a
large finite number, not inf, and inf·0 cannot turn into NaN). Bounds are
compared in log space, where no clamp is involved.

Two modes of using μ:
- decoupled: the loss ratio stays π_θ/π_old and `DecoupledIS` supplies the
  extra weight π_old/μ (optionally truncated);
- bypass: `apply_bypass` sets π_old := μ, so the loss ratio is π_θ/μ and no
  separate proximal forward is needed.

Legend: B sequences, T tokens.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from exactrl.algo.aggregation import masked_mean, masked_values, seq_mean, seq_sum
from exactrl.algo.kl import KL_ESTIMATORS, exp_ratio, kl_estimate
from exactrl.algo.types import LossInputs, check_finite, check_kwargs, check_mask, check_same_shape
from exactrl.argcheck import check_arg_types

Metrics = dict[str, float]


def _check_bounds(name: str, lower: float | None, upper: float | None, allow_none: bool = False) -> None:
    if lower is None and upper is None and not allow_none:
        raise ValueError(f"{name} needs at least one of lower/upper")
    if lower is not None and not lower >= 0:
        raise ValueError(f"{name}: lower must be >= 0 (a ratio bound), got {lower}")
    if upper is not None and not upper > 0:
        raise ValueError(f"{name}: upper must be > 0 (a ratio bound), got {upper}")
    if lower is not None and upper is not None and not lower < upper:
        raise ValueError(f"{name}: need lower < upper, got lower={lower}, upper={upper}")


def _inside(log_ratio: torch.Tensor, lower: float | None, upper: float | None) -> torch.Tensor:
    """lower <= exp(log_ratio) <= upper, decided in log space (bool)."""
    keep = torch.ones_like(log_ratio, dtype=torch.bool)
    if lower is not None and lower > 0:
        keep &= log_ratio >= math.log(lower)
    if upper is not None:
        keep &= log_ratio <= math.log(upper)
    return keep


def _truncate(ratio: torch.Tensor, lower: float | None, upper: float | None) -> torch.Tensor:
    return ratio if lower is None and upper is None else ratio.clamp(min=lower, max=upper)


def _seq_frac(flag_B: torch.Tensor, mask_BT: torch.Tensor) -> float:
    """Fraction of the non-empty sequences where flag_B holds."""
    has_B = mask_BT.sum(dim=1) > 0
    return float((flag_B & has_B).sum().item() / max(int(has_B.sum().item()), 1))


def _tok(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    return float(masked_mean(x_BT.to(torch.float64), mask_BT).item())


@dataclasses.dataclass
class CorrectionBatch:
    """What a correction sees: sanitised fp64 logprobs (0 where masked) and their log-ratio."""

    old_BT: torch.Tensor
    behav_BT: torch.Tensor
    mask_BT: torch.Tensor
    advantages_BT: torch.Tensor | None

    @property
    def log_ratio_BT(self) -> torch.Tensor:
        """log ρ = log π_old − log μ."""
        return self.old_BT - self.behav_BT


def _prepare(old_BT, behav_BT, mask_BT, advantages_BT) -> CorrectionBatch:
    check_mask("mask_BT", mask_BT)
    named = {"old_logprobs_BT": old_BT, "behav_logprobs_BT": behav_BT, "mask_BT": mask_BT}
    if advantages_BT is not None:
        named["advantages_BT"] = advantages_BT
    check_same_shape(named)
    for name, x in named.items():
        if name != "mask_BT":
            check_finite(name, x, mask_BT)

    def clean(x):
        return None if x is None else masked_values(x.detach().to(torch.float64), mask_BT)

    return CorrectionBatch(clean(old_BT), clean(behav_BT), mask_BT, clean(advantages_BT))


class Correction:
    """Base: validates, calls `compute`, applies the neutral-outside-mask rule, prefixes metrics."""

    key = "correction"
    weighs: str | None = None  # "token": its weights are (truncated) token ratios ρ_t; "sequence": one per sequence

    def __call__(self, old_logprobs_BT, behav_logprobs_BT, mask_BT, advantages_BT=None):
        b = _prepare(old_logprobs_BT, behav_logprobs_BT, mask_BT, advantages_BT)
        w_BT, keep_BT, metrics = self.compute(b)
        weights_BT = torch.ones_like(mask_BT) if w_BT is None else torch.where(mask_BT > 0, w_BT, 1.0).to(mask_BT.dtype)
        new_mask_BT = mask_BT if keep_BT is None else mask_BT * keep_BT.to(mask_BT.dtype)
        if keep_BT is not None:
            n = float(mask_BT.sum().item())
            metrics["mask_frac"] = (n - float(new_mask_BT.sum().item())) / max(n, 1.0)
            metrics["seq_mask_frac"] = _seq_frac(new_mask_BT.sum(dim=1) == 0, mask_BT)
        return weights_BT, new_mask_BT, {f"correction/{self.key}/{k}": v for k, v in metrics.items()}

    def compute(self, b: CorrectionBatch) -> tuple[torch.Tensor | None, torch.Tensor | None, Metrics]:
        raise NotImplementedError


class TokenTIS(Correction):
    """Token truncated IS (Yao et al.): w_t = clamp(π_old/μ, lower, upper); default upper C = 2."""

    key = "token_tis"
    weighs = "token"

    def __init__(self, lower: float | None = None, upper: float | None = 2.0):
        _check_bounds(type(self).__name__, lower, upper)
        self.lower, self.upper = lower, upper

    def compute(self, b):
        lr_BT = b.log_ratio_BT
        w_BT = _truncate(exp_ratio(lr_BT), self.lower, self.upper)
        clipped_BT = ~_inside(lr_BT, self.lower, self.upper)
        return w_BT, None, {"clip_frac": _tok(clipped_BT, b.mask_BT), "weight_mean": _tok(w_BT, b.mask_BT)}


class DecoupledIS(TokenTIS):
    """Decoupled PPO (Hilton et al. 2022): the loss clips π_θ/π_old and this supplies
    the behaviour correction w_t = π_old/μ, truncated only if bounds are given."""

    key = "decoupled"

    def __init__(self, lower: float | None = None, upper: float | None = None):
        _check_bounds(type(self).__name__, lower, upper, allow_none=True)
        self.lower, self.upper = lower, upper


class SequenceTIS(Correction):
    """Sequence truncated IS: w_i = clamp(Π_t π_old/μ, lower, upper) = clamp(exp Σ_t log ρ_t),
    broadcast over the sequence's tokens. Unbiased before truncation, but its
    variance grows exponentially with length."""

    key = "sequence_tis"
    weighs = "sequence"

    def __init__(self, lower: float | None = None, upper: float | None = 2.0):
        _check_bounds(type(self).__name__, lower, upper)
        self.lower, self.upper = lower, upper

    def compute(self, b):
        lr_B = seq_sum(b.log_ratio_BT, b.mask_BT)
        w_B = _truncate(exp_ratio(lr_B), self.lower, self.upper)
        has_B = b.mask_BT.sum(dim=1) > 0
        return (
            w_B[:, None].expand_as(b.mask_BT),
            None,
            {
                "clip_frac": _seq_frac(~_inside(lr_B, self.lower, self.upper), b.mask_BT),
                "weight_mean": float(w_B[has_B].mean().item()) if bool(has_B.any()) else 1.0,
            },
        )


class TokenMaskIS(Correction):
    """Token masked IS (MIS, Yao et al.): drop tokens whose π_old/μ is outside [lower, upper]."""

    key = "token_mask_is"

    def __init__(self, lower: float | None = None, upper: float | None = 2.0):
        _check_bounds(type(self).__name__, lower, upper)
        self.lower, self.upper = lower, upper

    def compute(self, b):
        return None, _inside(b.log_ratio_BT, self.lower, self.upper), {}


class SequenceMaskIS(TokenMaskIS):
    """Sequence masked IS: drop whole sequences whose Π_t π_old/μ is outside [lower, upper]."""

    key = "sequence_mask_is"

    def compute(self, b):
        keep_B = _inside(seq_sum(b.log_ratio_BT, b.mask_BT), self.lower, self.upper)
        return None, keep_B[:, None].expand_as(b.mask_BT), {}


class GeometricMeanRejection(Correction):
    """Reject sequences whose geometric-mean ratio exp(mean_t log ρ_t) is outside
    [lower, upper] (verl `geometric`): length-normalised, so long sequences are
    not rejected merely for being long. Typical bounds hug 1 (e.g. 0.999, 1.001)."""

    key = "geometric_rejection"

    def __init__(self, lower: float, upper: float):
        _check_bounds(type(self).__name__, lower, upper)
        self.lower, self.upper = lower, upper

    def compute(self, b):
        keep_B = _inside(seq_mean(b.log_ratio_BT, b.mask_BT), self.lower, self.upper)
        return None, keep_B[:, None].expand_as(b.mask_BT), {}


class KLRejection(Correction):
    """Reject tokens (level='token') or whole sequences (level='sequence', mean over
    the sequence's tokens) whose estimate of KL(μ‖π_old) exceeds `threshold`.
    Tokens were sampled from μ, so the estimator is kl_estimate(log μ, log π_old, kind)."""

    def __init__(self, threshold: float, kind: str = "k3", level: str = "token"):
        if level not in ("token", "sequence"):
            raise ValueError(f"KLRejection level must be 'token' or 'sequence', got {level!r}")
        if not threshold > 0:
            raise ValueError(f"KLRejection threshold must be > 0, got {threshold}")
        if kind not in KL_ESTIMATORS:
            raise ValueError(f"KLRejection kind must be one of {sorted(KL_ESTIMATORS)}, got {kind!r}")
        self.threshold, self.kind, self.level = threshold, kind, level
        self.key = f"kl_rejection_{level}"

    def compute(self, b):
        kl_BT = masked_values(kl_estimate(b.behav_BT, b.old_BT, self.kind), b.mask_BT)
        metrics = {"kl_mean": _tok(kl_BT, b.mask_BT)}  # the token mean (the sequence means, length-weighted)
        if self.level == "sequence":
            kl_BT = seq_mean(kl_BT, b.mask_BT)[:, None].expand_as(kl_BT)
        return None, kl_BT <= self.threshold, metrics


class OPSM(Correction):
    """Off-policy sequence masking (DeepSeek-V3.2): drop a sequence with negative
    advantage whose mean KL(μ‖π_old), (1/|y|) Σ_t (log μ − log π_old), exceeds δ.
    Negative samples far off-policy are the ones that destabilise training;
    positive ones are kept. Needs `advantages_BT`. The paper measures
    π_sampling against π_θ; π_old here is π_θ's value in this trainer."""

    key = "opsm"

    def __init__(self, delta: float):
        if not delta >= 0:
            raise ValueError(f"OPSM delta must be >= 0, got {delta}")
        self.delta = delta

    def compute(self, b):
        if b.advantages_BT is None:
            raise ValueError("OPSM needs advantages_BT: call corrections(old, behav, mask, advantages_BT)")
        kl_B = seq_mean(-b.log_ratio_BT, b.mask_BT)
        reject_BT = (b.advantages_BT < 0) & (kl_B[:, None] > self.delta)
        return None, ~reject_BT, {}


class Composed:
    """Corrections applied together: weights multiply, masks AND, metrics merge."""

    def __init__(self, corrections: Sequence[Correction]):
        keys = [c.key for c in corrections]
        if len(set(keys)) != len(keys):
            raise ValueError(f"duplicate corrections {keys}: each kind (and KL level) may appear once")
        if {"token_tis", "decoupled"} <= set(keys):
            raise ValueError(
                "corrections token_tis and decoupled both weigh each token by π_old/μ: together they "
                "would apply the ratio twice; keep one (decoupled takes bounds too)"
            )
        self.corrections = list(corrections)
        weighs = {c.weighs for c in self.corrections}
        # the applied weight is each token's own (truncated) ratio: a weight ≠ ρ_t marks a truncated token
        self.weighs_token_ratios = "token" in weighs and "sequence" not in weighs

    def __call__(self, old_logprobs_BT, behav_logprobs_BT, mask_BT, advantages_BT=None):
        check_mask("mask_BT", mask_BT)
        weights_BT, out_mask_BT, metrics = torch.ones_like(mask_BT), mask_BT, {}
        for c in self.corrections:
            w_BT, m_BT, cm = c(old_logprobs_BT, behav_logprobs_BT, mask_BT, advantages_BT)
            weights_BT, out_mask_BT = weights_BT * w_BT, out_mask_BT * m_BT
            metrics |= cm
        return weights_BT, out_mask_BT, metrics


def compose(corrections: Sequence[Correction]) -> Composed:
    return Composed(corrections)


CORRECTIONS: dict[str, type[Correction]] = {
    "token_tis": TokenTIS,
    "sequence_tis": SequenceTIS,
    "token_mask_is": TokenMaskIS,
    "sequence_mask_is": SequenceMaskIS,
    "geometric_rejection": GeometricMeanRejection,
    "kl_rejection": KLRejection,
    "opsm": OPSM,
    "decoupled": DecoupledIS,
}


def build_corrections(specs: Sequence[dict]) -> Composed:
    """Composed corrections from config: [{"name": "token_tis", "upper": 2.0}, ...]."""
    if not isinstance(specs, (list, tuple)):
        raise ValueError(f"corrections must be a list of dicts with a 'name' key, got {specs!r}")
    built = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict) or "name" not in spec:
            raise ValueError(f"corrections[{i}] must be a dict with a 'name' key, got {spec!r}")
        kwargs = {k: v for k, v in spec.items() if k != "name"}
        name = spec["name"]
        if not isinstance(name, str) or name not in CORRECTIONS:
            raise ValueError(
                f"unknown correction {name!r}; valid: {sorted(CORRECTIONS)} "
                "(bypass mode is algorithm.bypass=true, not a correction)"
            )
        check_kwargs(CORRECTIONS[name], kwargs, f"correction {name!r}")
        check_arg_types(CORRECTIONS[name], kwargs, f"correction {name!r}")
        try:
            built.append(CORRECTIONS[name](**kwargs))
        except ValueError as e:  # a bound out of range: say which entry of the list
            raise ValueError(f"corrections[{i}] ({name!r}): {e}") from None
    return compose(built)


def apply_bypass(inp: LossInputs) -> LossInputs:
    """Bypass mode: the loss ratio is taken against μ (π_old := μ). Cheaper (no
    proximal forward) and exact when μ == π_old; otherwise the loss's own clip
    is the only trust region against μ."""
    return dataclasses.replace(inp, old_logprobs_BT=inp.behav_logprobs_BT)
