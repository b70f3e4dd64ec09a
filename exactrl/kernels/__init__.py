"""The only place where reduction order is decided.

A model holds one `Kernels` object, chosen at load time (`kernels="exact"` or
`"fast"`), never a hidden global. `exact` makes every op batch-invariant
(DESIGN.md §1); `fast` uses plain torch ops (`F.linear`, SDPA) and shows the
train/rollout mismatch that exactness removes. A GPU backend would be a third
implementation of this same interface.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from exactrl.kernels import attention as _attn
from exactrl.kernels import native
from exactrl.kernels.attention import ExactPlan, FastPlan, TokenLayout, write_kv
from exactrl.kernels.linear import check_short_rows, exact_linear, exact_linears, fast_linear, fuses_linears
from exactrl.kernels.rowwise import apply_rotary, exact_rms_norm, rms_norm, rotary_tables, sampling_logprobs

KERNEL_MODES = ("exact", "fast")


@dataclass(frozen=True)
class Kernels:
    """One implementation of every op whose result could depend on the batch."""

    mode: str  # "exact" | "fast"

    def __post_init__(self):
        if self.mode not in KERNEL_MODES:
            raise ValueError(f"kernels must be one of {KERNEL_MODES}, got {self.mode!r}")
        if self.exact:  # compiled (or found in the cache) now: a missing compiler is named as the model loads
            native.library()

    @property
    def exact(self) -> bool:
        return self.mode == "exact"

    def linear(self, x, weight, bias=None):
        return exact_linear(x, weight, bias) if self.exact else fast_linear(x, weight, bias)

    def fuses_linears(self, x, weights, biases) -> bool:
        """Whether `linears` can compute these projections of one input in one call (exact kernels, the
        engine's packed weights, no biases, no autograd); else the caller applies them one by one."""
        return self.exact and fuses_linears(x, weights, biases)

    def linears(self, x, weights) -> list[torch.Tensor]:
        """[linear(x, w) for w in weights] in one product, bit for bit (`fuses_linears` must hold)."""
        return exact_linears(x, weights)

    def prepare(self, linear_weights) -> None:
        """One-off checks the exact linear would otherwise run at its first call of few rows (an engine's
        first small decode step, which would wait for them: 0.6 s at 20M, 1.8 s at 100M)."""
        if self.exact:
            for w in linear_weights:
                check_short_rows(w)

    def rms_norm(self, x, weight, eps: float):
        return exact_rms_norm(x, weight, eps) if self.exact else rms_norm(x, weight, eps)

    def rotary(self, x_NHD, cos_ND, sin_ND):
        """RoPE. Elementwise, so invariant either way; exact inference runs it as one C call whose bits
        equal the torch expression's (tested), which autograd needs when a gradient is wanted."""
        if not self.exact:
            return apply_rotary(x_NHD, cos_ND, sin_ND)
        if not (torch.is_grad_enabled() and x_NHD.requires_grad):
            return native.rotary(x_NHD, cos_ND, sin_ND)
        if x_NHD.dtype == torch.float32:
            return _Rotary.apply(x_NHD, cos_ND, sin_ND)
        return apply_rotary(x_NHD, cos_ND, sin_ND)

    def swiglu(self, gate, up):
        """silu(gate) * up, the MLP's activation. Elementwise, so invariant either way; exact runs fp32 as one
        C pass forward and one backward (native/pointwise.c; at [10240, 1024] 4.5 ms vs torch's 6.3 forward,
        6.1 vs ~40 backward); bf16 and `fast` keep torch's ops."""
        if not (self.exact and gate.dtype == up.dtype == torch.float32):
            return torch.nn.functional.silu(gate) * up
        if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
            return _SwiGLU.apply(gate, up)
        return native.swiglu(gate, up)

    def plan_attention(self, layout: TokenLayout, num_heads: int, num_kv_heads: int, block_size: int):
        if self.exact:
            return _attn.plan_exact(layout, block_size)
        return _attn.plan_fast(layout, block_size)

    def attention(self, q_NHD, k_pages, v_pages, plan, scale: float):
        if self.exact:
            assert isinstance(plan, ExactPlan)
            return _attn.exact_attention(q_NHD, k_pages, v_pages, plan, scale)
        assert isinstance(plan, FastPlan)
        return _attn.fast_attention(q_NHD, k_pages, v_pages, plan, scale)


class _SwiGLU(torch.autograd.Function):
    """silu(g) * u with pointwise.c's forward and its hand-written gradient (the formula is there)."""

    @staticmethod
    def forward(ctx, g, u):  # type: ignore[override]
        ctx.save_for_backward(g, u)
        return native.swiglu(g, u)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        g, u = ctx.saved_tensors
        dg, du = native.swiglu_backward(g, u, dy.float())
        return dg, du


class _Rotary(torch.autograd.Function):
    """RoPE as one C pass forward and one backward (torch's ops and their autograd took ~5 passes each way).

    Rotating each pair (x_d, x_d+D/2) by θ is orthogonal, so the gradient is the rotation by −θ:
    gx = rotary(g, cos, −sin). That reads sin_d for both halves of a pair, which `rotary_tables` makes
    equal (its angles are [f, f]); other tables are refused.
    """

    @staticmethod
    def forward(ctx, x_NHD, cos_ND, sin_ND):  # type: ignore[override]
        half = sin_ND.shape[-1] // 2
        if not torch.equal(sin_ND[:, :half], sin_ND[:, half:]):
            raise ValueError("rotary: the sin table's two halves differ (rotate-half RoPE repeats its angles)")
        ctx.save_for_backward(cos_ND, sin_ND)
        return native.rotary(x_NHD, cos_ND, sin_ND)

    @staticmethod
    def backward(ctx, g_NHD):  # type: ignore[override]
        cos_ND, sin_ND = ctx.saved_tensors
        return native.rotary(g_NHD.float(), cos_ND, -sin_ND), None, None


def get_kernels(mode: str) -> Kernels:
    return Kernels(mode)


__all__ = ["Kernels", "KERNEL_MODES", "TokenLayout", "get_kernels", "write_kv", "apply_rotary",
           "rotary_tables", "sampling_logprobs"]
