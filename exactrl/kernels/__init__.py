"""The only place where reduction order is decided.

A model holds one `Kernels` object, chosen at load time (`kernels="exact"` or
`"fast"`, and a backend), never a hidden global. `exact` makes every op
batch-invariant (docs/design.md §4); `fast` uses plain torch ops (`F.linear`, SDPA)
and shows the train/rollout mismatch that exactness removes.

Two backends implement this one interface: `native` (this class; C kernels,
CPU tensors) and `triton` (`kernels/triton`: Triton kernels on CUDA tensors,
or on CPU tensors under Triton's interpreter). The model, the engine and the
trainer call these methods and never ask which backend they have.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exactrl.kernels import attention as _attn
from exactrl.kernels import native
from exactrl.kernels import rowwise as _rowwise
from exactrl.kernels.attention import ExactPlan, FastPlan, TokenLayout, write_kv
from exactrl.kernels.linear import (
    check_short_rows,
    exact_experts,
    exact_linear,
    exact_linears,
    fast_linear,
    fuses_linears,
    input_grad,
    transposed_panels,
)
from exactrl.kernels.rowwise import apply_rotary, exact_rms_norm, rms_norm, rotary_tables, sampling_logprobs

KERNEL_MODES = ("exact", "fast")
BACKENDS = ("native", "triton")


@dataclass(frozen=True)
class Kernels:
    """One implementation of every op whose result could depend on the batch."""

    mode: str  # "exact" | "fast"
    backend = "native"  # the C kernels on CPU tensors

    def __post_init__(self):
        if self.mode not in KERNEL_MODES:
            raise ValueError(f"kernels must be one of {KERNEL_MODES}, got {self.mode!r}")
        if self.exact:  # compiled (or found in the cache) now: a missing compiler is named as the model loads
            native.library()

    def ensure_built(self) -> None:
        """Builds what the engine needs in either mode now (the KV cache is written by C code), so a missing
        compiler is named when an engine is created."""
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

    def fuses_experts(self, x, weights) -> bool:
        """Whether `experts` can run a mixture-of-experts layer's routed experts in one call: the engine's exact
        inference in fp32 (`fuses_linears` of every expert weight) on this backend's C kernels."""
        return self.backend == "native" and self.fuses_linears(x, weights, [None] * len(weights))

    def experts(self, x_ND, logits_NE, experts, k: int, normalise: bool):
        """(out, selected experts [N, k], their weights [N, k]) of a MoE layer's routed experts (`experts`: each
        one's (gate, up, down) weights), with the bits of model/moe.py's module path (`fuses_experts` must hold)."""
        return exact_experts(x_ND, logits_NE, experts, k, normalise)

    def prepare(self, linear_weights) -> None:
        """One-off checks the exact linear would otherwise run at its first call of few rows (an engine's
        first small decode step, which would then wait for them)."""
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
        C pass forward and one backward (native/pointwise.c), fewer passes over memory than torch's ops and
        their autograd; bf16 and `fast` keep torch's ops."""
        if not (self.exact and gate.dtype == up.dtype == torch.float32):
            return torch.nn.functional.silu(gate) * up
        if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
            return _SwiGLU.apply(gate, up)
        return native.swiglu(gate, up)

    def geglu(self, gate, up):
        """gelu(gate) * up with gelu's tanh approximation, Gemma's MLP activation. torch's CPU gelu is not
        batch-invariant: its vector body and its scalar tail compute tanh differently, and which elements fall
        in a tail depends on the tensor's size and the thread split. So exact runs it as one C pass each way
        in fp32 (native/pointwise.c), rounded once to the inputs' dtype; `fast` keeps torch's op."""
        if not self.exact:
            return torch.nn.functional.gelu(gate, approximate="tanh") * up
        if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
            return _GeGLU.apply(gate, up)
        return native.geglu(gate.float(), up.float()).to(gate.dtype)

    def softcap(self, z, cap: float):
        """cap * tanh(z / cap) of fp32 logits (Gemma 2's final logit soft-capping), elementwise in C for exact
        (torch's tanh has the vector-body / scalar-tail split that gelu has); differentiable."""
        if not self.exact:
            return torch.tanh(z / cap) * cap
        if torch.is_grad_enabled() and z.requires_grad:
            return _SoftCap.apply(z, cap)
        return native.softcap(z, cap)

    def clip(self, x, c: float):
        """x clamped to [-c, c] (OLMoE's clip_qkv). Elementwise, so invariant either way; exact fp32 inference
        runs it in C (torch.clamp's bits, tested), so a decode graph records it."""
        if self.exact and x.dtype == torch.float32 and not (torch.is_grad_enabled() and x.requires_grad):
            return native.clamp(x, -c, c)
        return x.clamp(-c, c)

    def sigmoid_gate(self, g_N1, y_ND):
        """sigmoid(g) · y with one gate per row (Qwen2-MoE's shared expert); exact fp32 in C with the kernels'
        exp, so a decode graph records it; differentiable."""
        if not (self.exact and g_N1.dtype == y_ND.dtype == torch.float32 and y_ND.dim() == 2):
            return torch.sigmoid(g_N1) * y_ND
        if torch.is_grad_enabled() and (g_N1.requires_grad or y_ND.requires_grad):
            return _SigmoidGate.apply(g_N1, y_ND)
        return native.sigmoid_gate(g_N1, y_ND)

    def softcap_grad(self, z, g, cap: float):
        """The gradient of `softcap` at z for the output gradient g: g (1 - tanh(z / cap)^2); may overwrite g."""
        return native.softcap_backward(z, g, cap, inplace=g.is_contiguous())

    def plan_attention(
        self,
        layout: TokenLayout,
        num_heads: int,
        num_kv_heads: int,
        block_size: int,
        device: torch.device | None = None,
    ):
        """What attention needs of a layout, checked once per forward (`device`: the model's; CPU here)."""
        if self.exact:
            return _attn.plan_exact(layout, block_size)
        return _attn.plan_fast(layout, block_size)

    def write_kv(self, k_pages, v_pages, k_NHD, v_NHD, layout: TokenLayout, plan):
        """Stores new keys/values at their pages and slots (`attention.write_kv`); returns the stores."""
        return write_kv(k_pages, v_pages, k_NHD, v_NHD, layout)

    def log_softmax(self, z_NV):
        """log_softmax of fp32 rows, each row reduced in one fixed order; differentiable."""
        return _rowwise.log_softmax(z_NV)

    def softmax(self, z_NV):
        """softmax of fp32 rows, exact: exp(log_softmax(z)) with the kernels' own exp, each row reduced in one
        fixed order (a MoE router's probabilities); differentiable."""
        return _rowwise.softmax(z_NV) if self.exact else torch.softmax(z_NV, dim=-1)

    def entropy(self, lp_NV):
        """-Σ exp(lp)·lp of each row of logprobs."""
        return native.entropy(lp_NV)

    def log_softmax_entropy(self, z_NV):
        """(log_softmax, entropy) of fp32 rows in one pass; may overwrite z_NV."""
        return native.log_softmax_entropy(z_NV, inplace=True)

    def sampling_logprobs(self, logits_NV, temperature_N, top_k_N, top_p_N):
        """`rowwise.sampling_logprobs` with this backend's row reductions."""
        return sampling_logprobs(logits_NV, temperature_N, top_k_N, top_p_N)

    def sample(self, logits_RV, rows):
        """(tokens [R], their logprobs [R]) drawn from each row's sampling distribution (`engine/sampling.py`)."""
        from exactrl.engine.sampling import sample

        return sample(logits_RV, rows)

    def head_grad(self, lp_cV, g_lp, g_hit, tgt, g_ent, ent, temp: float):
        """∂L/∂z of a logits chunk for the trainer's LM-head path (formula in `model/logprobs.py`)."""
        return native.head_grad(lp_cV, g_lp, g_hit, tgt, g_ent, ent, temp, inplace=lp_cV.is_contiguous())

    def head_input_grad(self, w_VD):
        """A function g -> g W for many chunks of one backward (W packed once where the backend packs)."""
        w_t = transposed_panels(w_VD.float())
        return lambda g: input_grad(g, w_t)

    def attention(self, q_NHD, k_pages, v_pages, plan, scale: float, window: int = 0, softcap: float = 0.0):
        """Causal attention over the paged store; `window` > 0: each row's last `window` keys only; `softcap`
        > 0: scores capped to softcap·tanh(s / softcap) (Gemma 2)."""
        if self.exact:
            assert isinstance(plan, ExactPlan)
            return _attn.exact_attention(q_NHD, k_pages, v_pages, plan, scale, window, softcap)
        assert isinstance(plan, FastPlan)
        return _attn.fast_attention(q_NHD, k_pages, v_pages, plan, scale, window, softcap)


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


class _GeGLU(torch.autograd.Function):
    """gelu(g) * u with pointwise.c's forward and its hand-written gradient (the formula is there); fp32 inside,
    results in the inputs' dtypes."""

    @staticmethod
    def forward(ctx, g, u):  # type: ignore[override]
        ctx.save_for_backward(g, u)
        return native.geglu(g.float(), u.float()).to(g.dtype)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        g, u = ctx.saved_tensors
        dg, du = native.geglu_backward(g.float(), u.float(), dy.float())
        return dg.to(g.dtype), du.to(u.dtype)


class _SoftCap(torch.autograd.Function):
    """cap * tanh(z / cap) with pointwise.c's forward and gradient (formula in `native.softcap_backward`)."""

    @staticmethod
    def forward(ctx, z, cap):  # type: ignore[override]
        ctx.save_for_backward(z)
        ctx.cap = cap
        return native.softcap(z, cap)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        (z,) = ctx.saved_tensors
        return native.softcap_backward(z, g.float(), ctx.cap), None


class _SigmoidGate(torch.autograd.Function):
    """out = s · y, s = sigmoid(g) per row, forward in C; backward dy = s · dout, dg = s (1 - s) Σ_d dout · y."""

    @staticmethod
    def forward(ctx, g_N1, y_ND):  # type: ignore[override]
        ctx.save_for_backward(g_N1, y_ND)
        return native.sigmoid_gate(g_N1, y_ND)

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        g, y = ctx.saved_tensors
        s = 1.0 / (1.0 + native.exp(-g))
        dg = (dout * y).sum(-1, keepdim=True) * s * (1.0 - s)
        return dg.view(g.shape), dout * s


class _Rotary(torch.autograd.Function):
    """RoPE as one C pass forward and one backward (torch's ops and their autograd take ~5 passes each way).

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


def get_kernels(mode: str, backend: str = "native") -> Kernels:
    """The kernels of `mode` ("exact" | "fast") on `backend` ("native" | "triton")."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton":
        from exactrl.kernels.triton import TritonKernels

        return TritonKernels(mode)
    return Kernels(mode)


__all__ = [
    "Kernels",
    "KERNEL_MODES",
    "BACKENDS",
    "TokenLayout",
    "get_kernels",
    "write_kv",
    "apply_rotary",
    "rotary_tables",
    "sampling_logprobs",
]
