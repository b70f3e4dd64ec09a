"""On-policy distillation objectives: the student samples, the teacher scores (docs/design.md §8).

Notation: s = the student π_s, t = the teacher π_t, y_t the token the student sampled at position t,
p_s(·), p_t(·) the two next-token distributions there.

reverse_kl (Thinking Machines' on-policy distillation; Agarwal et al. 2024, GKD): a per-token advantage on
the sampled token,

    A_t = log π_t(y_t) − log π_s(y_t)          (−1 × the sampled estimate of KL(π_s ‖ π_t) at t)

which a policy-gradient loss turns into a descent on the reverse KL. It needs only the teacher's logprob of
each sampled token, so the teacher can be a server.

forward_kl and jsd are losses over the vocabulary at every sampled position:

    forward_kl_t = Σ_v p_t(v) (log p_t(v) − log p_s(v))                             = KL(p_t ‖ p_s)
    jsd_t(β)     = β KL(p_t ‖ m) + (1 − β) KL(p_s ‖ m),   m = β p_t + (1 − β) p_s,   0 < β < 1

(the generalised Jensen-Shannon divergence of GKD; β = 0.5 is the symmetric JSD). With `top_k` both
distributions are restricted to the teacher's k most likely tokens and renormalised there.

Every function here takes log-probabilities and returns per-token values; the trainer aggregates them
as it does any per-token loss. Legend: N positions, V vocabulary, K kept tokens.
"""

from __future__ import annotations

import torch


def reverse_kl_advantages(teacher_lp: torch.Tensor, student_lp: torch.Tensor) -> torch.Tensor:
    """A_t = log π_t(y_t) − log π_s(y_t), elementwise (any shape; both finite)."""
    _check_same(teacher_lp, student_lp)
    if not (torch.isfinite(teacher_lp).all() and torch.isfinite(student_lp).all()):
        raise ValueError(
            "reverse_kl_advantages: logprobs must be finite (a teacher that gives a sampled token 0 "
            "probability makes the reverse KL infinite)"
        )
    return teacher_lp - student_lp


def forward_kl(student_NV: torch.Tensor, teacher_NV: torch.Tensor) -> torch.Tensor:
    """KL(p_t ‖ p_s) per position [N] from log-probabilities [N, V]; 0·log 0 = 0 for tokens the teacher
    gives no mass."""
    _check_same(student_NV, teacher_NV)
    p_t = teacher_NV.exp()
    return torch.where(p_t > 0, p_t * (teacher_NV - student_NV), 0.0).sum(dim=-1)


def generalized_jsd(student_NV: torch.Tensor, teacher_NV: torch.Tensor, beta: float) -> torch.Tensor:
    """β KL(p_t ‖ m) + (1 − β) KL(p_s ‖ m), m = β p_t + (1 − β) p_s, per position [N]."""
    _check_same(student_NV, teacher_NV)
    if not 0 < beta < 1:
        raise ValueError(f"generalized_jsd: beta must be in (0, 1), got {beta!r}")
    b = torch.tensor(beta, dtype=student_NV.dtype)
    log_m = torch.logsumexp(torch.stack([teacher_NV + b.log(), student_NV + (1 - b).log()]), dim=0)
    p_t, p_s = teacher_NV.exp(), student_NV.exp()
    kl_t = torch.where(p_t > 0, p_t * (teacher_NV - log_m), 0.0).sum(dim=-1)
    kl_s = torch.where(p_s > 0, p_s * (student_NV - log_m), 0.0).sum(dim=-1)
    return beta * kl_t + (1 - beta) * kl_s


def teacher_top_k(student_NV: torch.Tensor, teacher_NV: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both distributions on the teacher's k most likely tokens of each position, renormalised there:
    ([N, K] student, [N, K] teacher) log-probabilities. Ties are broken by token id (lowest first)."""
    _check_same(student_NV, teacher_NV)
    V = teacher_NV.shape[-1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= V:
        raise ValueError(f"teacher_top_k: k must be an int in [1, {V}], got {k!r}")
    # a stable sort on the negated values: equal probabilities keep ascending token order
    ids_NK = torch.sort(-teacher_NV.detach(), dim=-1, stable=True).indices[..., :k]
    s, t = student_NV.gather(-1, ids_NK), teacher_NV.gather(-1, ids_NK)
    return s - torch.logsumexp(s, dim=-1, keepdim=True), t - torch.logsumexp(t, dim=-1, keepdim=True)


def vocab_divergence(
    student_NV: torch.Tensor, teacher_NV: torch.Tensor, kind: str, beta: float = 0.5, top_k: int | None = None
) -> torch.Tensor:
    """The per-position divergence of `kind` (`forward_kl` | `jsd`), over the vocabulary or the teacher's top-k."""
    if top_k is not None:
        student_NV, teacher_NV = teacher_top_k(student_NV, teacher_NV, top_k)
    if kind == "forward_kl":
        return forward_kl(student_NV, teacher_NV)
    if kind == "jsd":
        return generalized_jsd(student_NV, teacher_NV, beta)
    raise ValueError(f"vocab_divergence: kind must be 'forward_kl' or 'jsd', got {kind!r}")


def _check_same(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"student and teacher values differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
