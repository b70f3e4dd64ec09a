"""How per-token values become one scalar, and with which denominator.

Every mode is a sum over the micro-batch divided by a constant taken from the
batch-wide `LossNorm`, so micro-batch results add up to the full-batch value
(gradient accumulation is exact). The per-sequence modes need each sequence
whole inside one micro-batch, which is how the trainer splits.

| mode                  | value                                   | denominator           |
|-----------------------|-----------------------------------------|-----------------------|
| `token-mean`          | Σ_b Σ_t m·v                             | total_tokens          |
| `seq-mean-token-mean` | Σ_b (Σ_t m·v / n_b)                     | total_seqs            |
| `seq-mean-token-sum`  | Σ_b Σ_t m·v                             | total_seqs            |
| `constant-normalised` | Σ_b Σ_t m·v                             | constant · total_seqs |

`token-mean` weighs long sequences more (DAPO's token-level loss);
`seq-mean-token-mean` is the original GRPO average, which Dr.GRPO (Liu et al.
2025, "Understanding R1-Zero-Like Training") shows biases towards long wrong
answers; `constant-normalised` is Dr.GRPO's fix (a fixed length, e.g.
max_tokens, instead of the sequence's own length). n_b is sequence b's
length as sampled (`lengths_B`; by default its unmasked tokens, Σ_t m).

The trainer's denominators count the batch's tokens and sequences as sampled
(its loss mask), fixed before the step: a token or sequence that a masking
correction (`token_mask_is`, `geometric_rejection`, ...) then removes adds 0
to the sum but stays in the denominator, as a clipped token does: in
`total_tokens`, and in its sequence's n_b (the trainer passes the lengths as
sampled). So masking
shrinks the step rather than re-weighting the tokens left, and the gradient
accumulation over micro-batches stays exact.

Masked positions are selected away with `torch.where`, never multiplied by 0,
so NaN/inf in padding cannot reach the value or the gradient. An empty
sequence contributes exactly 0.

Legend: B sequences, T tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from exactrl.algo.types import LossNorm, check_mask, check_same_shape


def masked_values(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """values where mask is 1, exact zeros elsewhere (and no gradient there)."""
    return torch.where(mask_BT > 0, values_BT, torch.zeros((), dtype=values_BT.dtype, device=values_BT.device))


def seq_sum(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """[B] masked sum over each sequence's tokens."""
    return masked_values(values_BT, mask_BT).sum(dim=1)


def seq_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """[B] masked mean over each sequence's tokens; 0 for an empty sequence."""
    count_B = mask_BT.sum(dim=1).to(values_BT.dtype)
    return seq_sum(values_BT, mask_BT) / count_B.clamp(min=1)


def masked_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Scalar mean over all unmasked tokens of this tensor; 0 when there are none (for metrics)."""
    count = mask_BT.sum().to(values_BT.dtype)
    return masked_values(values_BT, mask_BT).sum() / count.clamp(min=1)


def _token_mean(values_BT, mask_BT, norm: LossNorm, lengths_B=None) -> torch.Tensor:
    """Σ m·v / total_tokens."""
    return masked_values(values_BT, mask_BT).sum() / max(norm.total_tokens, 1)


def _seq_mean_token_mean(values_BT, mask_BT, norm: LossNorm, lengths_B=None) -> torch.Tensor:
    """Σ_b (Σ_t m·v / n_b) / total_seqs, n_b = lengths_B (default Σ_t m); 0 for an empty sequence."""
    n_B = (mask_BT.sum(dim=1) if lengths_B is None else lengths_B).to(values_BT.dtype).clamp(min=1)
    return (seq_sum(values_BT, mask_BT) / n_B).sum() / max(norm.total_seqs, 1)


def _seq_mean_token_sum(values_BT, mask_BT, norm: LossNorm, lengths_B=None) -> torch.Tensor:
    """Σ_b Σ_t m·v / total_seqs."""
    return masked_values(values_BT, mask_BT).sum() / max(norm.total_seqs, 1)


def _constant_normalised(values_BT, mask_BT, norm: LossNorm, lengths_B=None) -> torch.Tensor:
    """Σ m·v / (constant · total_seqs)  (Dr.GRPO)."""
    if norm.constant is None:
        raise ValueError("agg mode 'constant-normalised' needs LossNorm.constant (e.g. max_tokens); it is None")
    return masked_values(values_BT, mask_BT).sum() / (norm.constant * max(norm.total_seqs, 1))


AGG_MODES: dict[str, Callable[..., torch.Tensor]] = {  # (values_BT, mask_BT, norm, lengths_B) -> scalar
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "constant-normalised": _constant_normalised,
}


def aggregate(
    values_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str, norm: LossNorm, lengths_B: torch.Tensor | None = None
) -> torch.Tensor:
    """Scalar aggregate of the unmasked `values_BT` under `mode` (see the module table). `lengths_B`: each
    sequence's tokens as sampled, n_b of `seq-mean-token-mean` (None: Σ_t m); at least its unmasked ones."""
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; valid modes: {sorted(AGG_MODES)}")
    check_mask("mask_BT", mask_BT)
    check_same_shape({"values_BT": values_BT, "mask_BT": mask_BT})
    tokens, seqs = int(mask_BT.sum().item()), mask_BT.shape[0]
    if tokens > norm.total_tokens or seqs > norm.total_seqs:
        raise ValueError(
            f"this micro-batch has {tokens} tokens / {seqs} sequences but LossNorm counts "
            f"{norm.total_tokens} / {norm.total_seqs}: build LossNorm over the whole step batch"
        )
    if lengths_B is not None and (lengths_B.shape != (seqs,) or bool((lengths_B < mask_BT.sum(dim=1)).any())):
        raise ValueError(
            f"lengths_B must hold each of the {seqs} sequences' sampled tokens, at least its "
            f"unmasked ones: got {lengths_B.tolist()} for {mask_BT.sum(dim=1).tolist()} unmasked"
        )
    return AGG_MODES[mode](values_BT, mask_BT, norm, lengths_B)
