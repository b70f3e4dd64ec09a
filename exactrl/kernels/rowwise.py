"""Per-row ops (RMSNorm, rotary embedding, the sampling distribution): a row's bits depend on that row
alone, never on the rows beside it.

A per-row reduction is invariant as long as each row is reduced by one code
path. The exact RMSNorm is a C loop that reduces every row alone in one fixed
order (native/exact.c): one call, where torch ops would take several per call
and need small batches padded. log_softmax is C too (native/pointwise.c): one
thread reduces each row in one fixed order. torch's log_softmax parallelises
over rows when there are at least as many rows as threads but may split a
single long row across threads when there are fewer, so its bits for a row
depend on the batch size; padding small batches to ROW_TILE rows would fix
that at up to 32x the work for a decode step of one sequence.

The sampling distribution is the one contract between engine and trainer
(docs/design.md §1): `log_softmax` of fp32 logits divided by the temperature, with
top-k and then top-p applied by VALUE cut-offs (ties at the cut-off are kept),
so the result never depends on how a sort orders equal values.

Legend: N rows, V vocabulary, D features.
"""

from __future__ import annotations

import torch

from exactrl.kernels import native


def rms_norm(x_ND: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """y = w · x / sqrt(mean(x²) + eps), reduced in fp32, returned in x's dtype (as HF does); plain torch ops.

    The `fast` kernel, and the expression whose autograd gives the exact kernel's gradient.
    """
    xf = x_ND.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return weight_D * (xf * torch.rsqrt(var + eps)).to(x_ND.dtype)


def exact_rms_norm(x_ND: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """The same RMSNorm with every row reduced in one fixed order (native/exact.c), whatever the batch."""
    if torch.is_grad_enabled() and (x_ND.requires_grad or weight_D.requires_grad):
        return _ExactRMSNorm.apply(x_ND, weight_D, eps)
    return native.rms_norm(x_ND, weight_D, eps)


class _ExactRMSNorm(torch.autograd.Function):
    """Exact forward values; the backward is the gradient of `rms_norm`: in C for fp32 (`exact.c`, one pass,
    where autograd's recompute makes several over [rows, D] temporaries), autograd of `rms_norm` recomputed
    from the inputs otherwise (bf16 rounds between its products).

    As for the linear layers and attention, only forward values carry the
    contract (docs/design.md §1); the gradient is that of the same function.
    """

    @staticmethod
    def forward(ctx, x_ND, weight_D, eps):  # type: ignore[override]
        ctx.save_for_backward(x_ND, weight_D)
        ctx.eps = eps
        return native.rms_norm(x_ND, weight_D, eps)

    @staticmethod
    def backward(ctx, g_ND):  # type: ignore[override]
        x_ND, weight_D = ctx.saved_tensors
        if x_ND.dtype == weight_D.dtype == torch.float32:
            dx, dw = native.rms_norm_backward(x_ND, weight_D, g_ND.float(), ctx.eps)
            return (dx if ctx.needs_input_grad[0] else None), (dw if ctx.needs_input_grad[1] else None), None
        return rms_norm_grad(x_ND, weight_D, ctx.eps, g_ND, ctx.needs_input_grad[:2]) + (None,)


def rms_norm_grad(x_ND, weight_D, eps: float, g_ND, needs) -> tuple:
    """(∂L/∂x, ∂L/∂w) of `rms_norm` by autograd of its torch expression, recomputed from the inputs (None
    where `needs` says no): the backward of every exact RMSNorm whose bits it need not match."""
    with torch.enable_grad():
        ins = [t.detach().requires_grad_(need) for t, need in zip((x_ND, weight_D), needs)]
        y = rms_norm(ins[0], ins[1], eps)
        got = iter(torch.autograd.grad(y, [t for t in ins if t.requires_grad], g_ND))
    return tuple(next(got) if t.requires_grad else None for t in ins)


def rotary_tables(
    head_dim: int,
    max_positions: int,
    theta: float,
    start: int = 0,
    inv_freq: torch.Tensor | None = None,
    attention_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_positions, head_dim] in fp32 of positions start, start + 1, ..., indexed by absolute position
    (after `start`). The model builds its table in fixed chunks of transformer.ROPE_CHUNK positions, each computed
    with the same shape, so two copies of a model hold the same bits however each grew. `inv_freq` [head_dim / 2]
    (default: theta's) and `attention_factor` (which scales cos and sin) come from a RoPE scaling
    (model/rope.py); the angles are position x inv_freq, as transformers computes them."""
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(start, start + max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * attention_factor, emb.sin() * attention_factor


def apply_rotary(x_NHD: torch.Tensor, cos_ND: torch.Tensor, sin_ND: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in x's dtype (elementwise, hence invariant)."""
    cos = cos_ND.to(x_NHD.dtype)[:, None, :]
    sin = sin_ND.to(x_NHD.dtype)[:, None, :]
    half = x_NHD.shape[-1] // 2
    rotated = torch.cat([-x_NHD[..., half:], x_NHD[..., :half]], dim=-1)
    return x_NHD * cos + rotated * sin


MIN_TEMPERATURE = 1e-5  # below it (but above 0) z / T can overflow fp32 to inf and the distribution to NaN
MAX_TEMPERATURE = torch.finfo(torch.float32).max  # T is an fp32 tensor: above it, inf (or a cast error)


def check_temperature(temperature) -> None:
    """The sampling temperatures the distribution is defined for: 0 (greedy) or in [MIN_TEMPERATURE,
    MAX_TEMPERATURE]."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a number, got {temperature!r}")
    if not (temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE):
        raise ValueError(
            f"temperature must be 0 (greedy) or a number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}] "
            f"(smaller ones overflow fp32 logits / T, larger ones are no fp32 number), got {temperature}"
        )


def sampling_logprobs(
    logits_NV: torch.Tensor,
    temperature_N: torch.Tensor,
    top_k_N: torch.Tensor,
    top_p_N: torch.Tensor,
    row_log_softmax=None,
    row_cumsum=None,
) -> torch.Tensor:
    """log of the distribution tokens are sampled from, per row: [N, V] fp32.

    p = softmax(z / T) restricted to {z >= k-th largest} (top_k > 0) and then to
    the smallest set of largest probabilities whose mass reaches top_p, then
    renormalised. T = 0 (greedy) reports log_softmax(z), i.e. T = 1.
    The two reductions over a row, `row_log_softmax` and `row_cumsum`, are the kernels' (a backend's
    own; by default the C log_softmax and torch's CPU cumsum, sequential per row).
    """
    row_log_softmax = log_softmax if row_log_softmax is None else row_log_softmax
    row_cumsum = (lambda x: torch.cumsum(x, dim=-1)) if row_cumsum is None else row_cumsum
    V = logits_NV.shape[1]
    z = logits_NV.float()
    dev = z.device
    temperature_N, top_k_N, top_p_N = temperature_N.to(dev), top_k_N.to(dev), top_p_N.to(dev)
    temp = torch.where(temperature_N > 0, temperature_N.float(), 1.0)
    if bool((temp != 1.0).any()):  # z / 1 == z exactly: skipping it saves a pass over [N, V]
        z = z / temp[:, None]
    top_k, top_p = top_k_N, top_p_N.float()
    need_k = bool(((top_k > 0) & (top_k < V)).any())
    need_p = bool((top_p < 1.0).any())
    if need_k or need_p:
        sorted_z, _ = torch.sort(z.detach(), dim=-1, descending=True)
        keep = torch.ones_like(z, dtype=torch.bool)
        if need_k:
            k = torch.where((top_k > 0) & (top_k < V), top_k, V)
            kth = sorted_z.gather(1, (k - 1)[:, None])
            keep &= z >= kth
            sorted_z = sorted_z.masked_fill(sorted_z < kth, float("-inf"))
        if need_p:
            probs = row_log_softmax(sorted_z).exp()  # per row in one order: torch.softmax could split a lone row
            mass_before = row_cumsum(probs) - probs
            # a row without top-p keeps every token, also where its fp32 mass reaches 1.0 before the tail
            n_keep = torch.where(top_p < 1.0, (mass_before < top_p[:, None]).sum(-1).clamp(min=1), V)
            cut = sorted_z.gather(1, (n_keep - 1)[:, None])
            keep &= z >= cut
        z = z.masked_fill(~keep, float("-inf"))
    return row_log_softmax(z)


def log_softmax(z_NV: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dimension of fp32 rows, each row reduced in one fixed order (pointwise.c,
    whose docstring has the formula); differentiable."""
    if torch.is_grad_enabled() and z_NV.requires_grad:
        return LogSoftmax.apply(z_NV, native.log_softmax)
    return native.log_softmax(z_NV)


def softmax(z_NV: torch.Tensor) -> torch.Tensor:
    """softmax over the last dimension of fp32 rows as exp(log_softmax(z)), with pointwise.c's exp (exp_f.h):
    C code (the routing in native/moe.c) can then compute the same bits, which torch's exp would not promise;
    differentiable."""
    lp = log_softmax(z_NV)
    if torch.is_grad_enabled() and lp.requires_grad:
        return _Exp.apply(lp)
    return native.exp(lp)


class _Exp(torch.autograd.Function):
    """exp with pointwise.c's forward; backward ∂L/∂x = g · exp(x)."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        y = native.exp(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        (y,) = ctx.saved_tensors
        return g * y


class LogSoftmax(torch.autograd.Function):
    """A backend's row log_softmax `fn` (the C one, a Triton one); backward ∂L/∂z_j = g_j − exp(lp_j) · Σ_i g_i
    (row-wise), as torch's."""

    @staticmethod
    def forward(ctx, z_NV, fn):  # type: ignore[override]
        lp = fn(z_NV)
        ctx.save_for_backward(lp)
        return lp

    @staticmethod
    def backward(ctx, g_NV):  # type: ignore[override]
        (lp,) = ctx.saved_tensors
        return g_NV - lp.exp() * g_NV.sum(-1, keepdim=True), None
