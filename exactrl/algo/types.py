"""What a policy loss consumes, the batch-wide denominator, and input checks.

Three log-probabilities meet in a loss (docs/design.md §8): μ (behaviour, reported
by the engine while sampling), π_old (proximal, recomputed by the trainer at
the start of the step) and π_θ (current, carries the graph). In exact
synchronous training μ == π_old bitwise; the corrections in `corrections.py`
exist for the cases where it is not.

`LossNorm` is computed ONCE over the whole step batch (all micro-batches, all
data-parallel ranks) and handed to every micro-batch, so that every
aggregation mode becomes a plain sum divided by a batch-wide constant: the
micro-batch losses then add up to the full-batch loss and gradient
accumulation is exact, whatever the micro-batch split.

The checks live here so every module fails the same way: `ValueError` naming
the tensor and, for non-finite values, the first bad (row, col).

Legend: B sequences, T tokens.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch


@dataclass
class LossInputs:
    """Per-token inputs of one micro-batch, all [B, T] on the same device."""

    logprobs_BT: torch.Tensor
    """log π_θ of the sampled tokens: the current policy, carries autograd."""
    old_logprobs_BT: torch.Tensor
    """log π_old: the proximal policy, recomputed by the trainer (detached)."""
    behav_logprobs_BT: torch.Tensor
    """log μ: the behaviour policy, as reported by the engine (detached)."""
    advantages_BT: torch.Tensor
    """Float advantages; a sequence advantage is broadcast over its tokens."""
    mask_BT: torch.Tensor
    """Float 0/1 loss mask: 1 = this token is trained on (padding, prompts, tool output = 0)."""
    weights_BT: torch.Tensor | None = None
    """Per-token importance weight from the corrections (detached); None means ones."""
    sampled_mask_BT: torch.Tensor | None = None
    """The loss mask as sampled, before a correction removed tokens (None: mask_BT). Its per-sequence
    counts are `seq-mean-token-mean`'s lengths, so a masked token stays in its sequence's denominator."""

    def __post_init__(self):
        check_mask("mask_BT", self.mask_BT)
        if self.weights_BT is None:
            self.weights_BT = torch.ones_like(self.mask_BT)
        if self.sampled_mask_BT is None:
            self.sampled_mask_BT = self.mask_BT
        check_mask("sampled_mask_BT", self.sampled_mask_BT)
        named = self._named()
        check_same_shape(named)
        for name, x in named.items():
            if not x.is_floating_point():
                raise ValueError(f"LossInputs.{name} must be a floating tensor, got {x.dtype}")
            if name != "logprobs_BT" and x.requires_grad:
                raise ValueError(
                    f"LossInputs.{name} requires grad: pass it .detach()ed; only logprobs_BT (π_θ) may carry the graph"
                )
            if name not in ("mask_BT", "sampled_mask_BT"):
                check_finite(f"LossInputs.{name}", x, self.mask_BT)
        if bool((self.mask_BT > self.sampled_mask_BT).any()):
            raise ValueError(
                "LossInputs.mask_BT keeps a token that sampled_mask_BT does not: a correction "
                "may only remove sampled tokens"
            )

    def _named(self) -> dict[str, torch.Tensor]:
        return {
            "logprobs_BT": self.logprobs_BT,
            "old_logprobs_BT": self.old_logprobs_BT,
            "behav_logprobs_BT": self.behav_logprobs_BT,
            "advantages_BT": self.advantages_BT,
            "mask_BT": self.mask_BT,
            "weights_BT": self.weights_BT,
            "sampled_mask_BT": self.sampled_mask_BT,
        }


@dataclass(frozen=True)
class LossNorm:
    """Denominators of the aggregation modes, counted over the WHOLE step batch."""

    total_tokens: int
    """Unmasked tokens in the step batch (denominator of `token-mean`)."""
    total_seqs: int
    """Sequences in the step batch, empty ones included (denominator of the seq-mean modes)."""
    constant: float | None = None
    """Dr.GRPO's fixed per-sequence length (e.g. max_tokens) for `constant-normalised`."""

    def __post_init__(self):
        for name in ("total_tokens", "total_seqs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"LossNorm.{name} must be a non-negative int, got {v!r}")
        if self.constant is not None and not self.constant > 0:
            raise ValueError(f"LossNorm.constant must be > 0 (e.g. max_tokens) or None, got {self.constant!r}")

    @classmethod
    def from_masks(cls, masks_BT: Iterable[torch.Tensor], constant: float | None = None) -> LossNorm:
        """Counts over every micro-batch mask of the step (they may differ in T).

        Every row counts as a sequence, even an empty one, so that a sequence's
        weight in the step does not depend on how its neighbours were masked.
        With several data-parallel ranks, all-reduce the two counts first.
        """
        tokens, seqs = 0, 0
        for m in masks_BT:
            check_mask("mask_BT", m)
            tokens += int(m.sum().item())
            seqs += m.shape[0]
        return cls(total_tokens=tokens, total_seqs=seqs, constant=constant)

    @classmethod
    def from_mask(cls, mask_BT: torch.Tensor, constant: float | None = None) -> LossNorm:
        return cls.from_masks([mask_BT], constant)


def check_mask(name: str, mask_BT: torch.Tensor) -> None:
    """A loss mask is a 2-D float tensor of zeros and ones."""
    if not isinstance(mask_BT, torch.Tensor) or mask_BT.dim() != 2:
        raise ValueError(f"{name} must be a 2-D [B, T] tensor, got {getattr(mask_BT, 'shape', type(mask_BT))}")
    if not mask_BT.is_floating_point():
        raise ValueError(f"{name} must be a float 0/1 tensor, got {mask_BT.dtype}: convert it with .float()")
    if not bool(((mask_BT == 0) | (mask_BT == 1)).all()):
        raise ValueError(f"{name} must contain only 0.0 and 1.0")


def check_same_shape(named: dict[str, torch.Tensor]) -> None:
    """All tensors are 2-D with one shape; the message lists every shape."""
    shapes = {k: tuple(v.shape) for k, v in named.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 2:
        raise ValueError(f"expected [B, T] tensors of one shape, got {shapes}")


def check_finite(name: str, x_BT: torch.Tensor, mask_BT: torch.Tensor) -> None:
    """Raises on NaN/±inf at an unmasked position (padding may hold anything)."""
    bad_BT = ~torch.isfinite(x_BT) & (mask_BT > 0)
    if bool(bad_BT.any()):
        row, col = (int(i) for i in bad_BT.nonzero()[0])
        raise ValueError(
            f"{name} is non-finite ({x_BT[row, col].item()}) at unmasked (row {row}, col {col}); "
            f"{int(bad_BT.sum())} such tokens in total: fix the producer or mask them out"
        )


def check_kwargs(factory: Callable, kwargs: dict, what: str, positional: tuple[str, ...] = ()) -> None:
    """Rejects config keys the factory does not accept, and required ones that are missing.

    `positional` names the arguments the caller passes itself (not from config).
    """
    params = {n: p for n, p in inspect.signature(factory).parameters.items() if n not in positional}
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise ValueError(f"{what} got unknown arguments {unknown}; accepted: {sorted(params)}")
    missing = [
        n
        for n, p in params.items()
        if p.default is inspect.Parameter.empty
        and n not in kwargs
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    if missing:
        raise ValueError(f"{what} needs arguments {missing}")
