"""The `triton` backend: the `Kernels` interface over Triton kernels (CUDA tensors, or CPU under the interpreter),
with the native backend's contract: in `exact` no forward value depends on the batch.

`exact` runs every op whose bits could depend on the batch through a kernel
of `ops.py`, whose reduction order is fixed by the op's own shape (docs/design.md
§4.4). `fast` is plain torch: cuBLAS through `F.linear`, SDPA, torch's
log_softmax: the mismatch exactness removes. The draw is `ops.draw` in both
modes (it decides which token, not what its logprob is).

Only forward values carry the contract, so every backward here is plain torch:
the linear's two products, the gradient of the torch RMSNorm expression, and
attention recomputed through SDPA under autograd.

`ops` is imported on first use: Triton reads TRITON_INTERPRET when a kernel is
defined, so the environment must say which it is before then (`check_backend`).

Legend: N tokens, H heads, Hk kv heads, D head dim, B keys per page, R rows, V vocabulary.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from exactrl.kernels import Kernels
from exactrl.kernels import attention as _attn
from exactrl.kernels import rowwise as _rowwise
from exactrl.kernels.attention import FastPlan, TokenLayout


def check_backend(device: torch.device) -> None:
    """Raises ValueError naming what is missing for the triton backend on `device`."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "backend='triton' on device='cpu' runs Triton's interpreter, which needs "
            "TRITON_INTERPRET=1 in the environment before the process starts (or use backend='native')"
        )
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise ValueError(f"backend='triton' needs the triton package ({e}): pip install triton") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"backend='triton' runs on 'cuda' or 'cpu' tensors, got device {device}")


def _ops():
    from exactrl.kernels.triton import ops

    return ops


def _attention_ops():
    from exactrl.kernels.triton import attention

    return attention


@dataclass
class TritonPlan:
    """A forward's layout on the model's device, checked once and shared by every layer."""

    layout: TokenLayout  # as built, on the host
    seq_N: torch.Tensor
    pos_N: torch.Tensor
    table_SJ: torch.Tensor
    max_page: int  # highest page any query row reads
    group: int  # query heads per kv head
    block_size: int
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None  # exact: (first token, count) per attention tile
    _fast: FastPlan | None = field(default=None, repr=False)  # SDPA's plan: fast mode, exact's backward
    _kv_rows: dict = field(default_factory=dict, repr=False)

    def kv_rows(self, num_kv_heads: int) -> torch.Tensor:
        """[N * Hk] row of each new (token, kv head) in a page store viewed as [P*Hk*B, D], on the device."""
        if num_kv_heads not in self._kv_rows:
            self._kv_rows[num_kv_heads] = self.layout.kv_rows(num_kv_heads, self.block_size).to(self.seq_N.device)
        return self._kv_rows[num_kv_heads]

    def fast(self) -> FastPlan:
        if self._fast is None:
            p = _attn.plan_fast(self.layout, self.block_size)
            dev = self.seq_N.device
            self._fast = replace(
                p,
                tok_SQ=p.tok_SQ.to(dev),
                pos_SQ=p.pos_SQ.to(dev),
                block_table_SJ=p.block_table_SJ.to(dev),
                valid_x=p.valid_x.to(dev),
            )
        return self._fast


def _check_layout(layout: TokenLayout, block_size: int) -> int:
    """Every key a query row reads has a page (the kernel reads pages unchecked); returns the highest page."""
    seq, pos, table = layout.seq_N, layout.pos_N, layout.block_table_SJ
    last_N = pos // block_size
    if bool((last_N >= table.shape[1]).any()):
        raise ValueError("a token has no page in the block table")
    rows = table[seq]
    need = torch.arange(table.shape[1])[None, :] <= last_N[:, None]
    if bool(((rows < 0) & need).any()):
        raise ValueError("a token has no page in the block table")
    return int(torch.where(need, rows, -1).max())


@dataclass(frozen=True)
class TritonKernels(Kernels):
    """`Kernels` on Triton (exact) or plain torch (fast), for tensors on one device."""

    backend = "triton"

    def __post_init__(self):
        if self.mode not in ("exact", "fast"):
            raise ValueError(f"kernels must be one of ('exact', 'fast'), got {self.mode!r}")

    def ensure_built(self) -> None:
        """Nothing to build ahead: each kernel compiles at its first call."""

    def prepare(self, linear_weights) -> None:
        """Nothing to check ahead: a linear's configuration is a function of its shape."""

    def fuses_linears(self, x, weights, biases) -> bool:
        return False

    def linear(self, x, weight, bias=None):
        if not self.exact:
            return F.linear(x, weight, bias)
        lead = x.shape[:-1]
        y = _Linear.apply(x.reshape(-1, x.shape[-1]), weight)
        if bias is not None:
            y = y + bias  # elementwise: invariant by construction
        return y.view(*lead, weight.shape[0])

    def rms_norm(self, x, weight, eps: float):
        if not self.exact:
            return _rowwise.rms_norm(x, weight, eps)
        return _RMSNorm.apply(x, weight, eps)

    def rotary(self, x_NHD, cos_ND, sin_ND):
        if not self.exact:
            return _rowwise.apply_rotary(x_NHD, cos_ND, sin_ND)
        return _Rotary.apply(x_NHD, cos_ND, sin_ND)

    def swiglu(self, gate, up):
        if not self.exact:
            return F.silu(gate) * up
        return _SwiGLU.apply(gate, up)

    def geglu(self, gate, up):
        if not self.exact:
            return F.gelu(gate, approximate="tanh") * up
        return _GeGLU.apply(gate, up)

    def softcap(self, z, cap: float):
        if not self.exact:
            return torch.tanh(z / cap) * cap
        return _SoftCap.apply(z, cap)

    def clip(self, x, c: float):
        return x.clamp(-c, c)

    def sigmoid_gate(self, g_N1, y_ND):
        return torch.sigmoid(g_N1) * y_ND  # elementwise with one gate per row: CUDA's bits are a row's own

    def softcap_grad(self, z, g, cap: float):
        t = torch.tanh(z.float() / cap)
        return g * (1 - t * t)

    def plan_attention(
        self,
        layout: TokenLayout,
        num_heads: int,
        num_kv_heads: int,
        block_size: int,
        device: torch.device | None = None,
    ):
        dev = torch.device("cpu") if device is None else device
        max_page = _check_layout(layout, block_size) if len(layout.seq_N) else -1
        plan = TritonPlan(
            layout,
            layout.seq_N.to(dev),
            layout.pos_N.to(dev),
            layout.block_table_SJ.to(dev),
            max_page,
            num_heads // num_kv_heads,
            block_size,
        )
        if self.exact and len(layout.seq_N):
            first, count = _attention_ops().attention_tiles(layout.seq_N, plan.group)
            plan.tiles = (first.to(dev), count.to(dev))
        return plan

    def write_kv(self, k_pages, v_pages, k_NHD, v_NHD, layout: TokenLayout, plan):
        _, Hk, B, D = k_pages.shape
        rows = plan.kv_rows(Hk)
        k_xD, v_xD = k_NHD.reshape(-1, D), v_NHD.reshape(-1, D)
        if k_NHD.requires_grad or v_NHD.requires_grad:  # the trainer's scratch store: out of place
            return (
                k_pages.reshape(-1, D).index_copy(0, rows, k_xD).view(k_pages.shape),
                v_pages.reshape(-1, D).index_copy(0, rows, v_xD).view(v_pages.shape),
            )
        k_pages.view(-1, D).index_copy_(0, rows, k_xD)
        v_pages.view(-1, D).index_copy_(0, rows, v_xD)
        return k_pages, v_pages

    def attention(self, q_NHD, k_pages, v_pages, plan, scale: float, window: int = 0, softcap: float = 0.0):
        if plan.max_page >= k_pages.shape[0]:
            raise ValueError(f"token layout: page {plan.max_page} is beyond the KV store's {k_pages.shape[0]} pages")
        if not self.exact:
            return _attn.fast_attention(q_NHD, k_pages, v_pages, plan.fast(), scale, window, softcap)
        return _Attention.apply(q_NHD, k_pages, v_pages, plan, scale, window, softcap)

    def log_softmax(self, z_NV):
        if not self.exact:
            return torch.log_softmax(z_NV.float(), dim=-1)
        return _rowwise.LogSoftmax.apply(z_NV, _ops().log_softmax)

    def softmax(self, z_NV):
        if not self.exact:
            return torch.softmax(z_NV.float(), dim=-1)
        return self.log_softmax(z_NV).exp()  # CUDA's exp: one function for every element

    def entropy(self, lp_NV):
        if not self.exact:
            return -torch.where(lp_NV > float("-inf"), lp_NV.exp() * lp_NV, 0.0).sum(-1)
        return _ops().entropy(lp_NV)

    def log_softmax_entropy(self, z_NV):
        if not self.exact:
            lp = self.log_softmax(z_NV)
            return lp, self.entropy(lp)
        return _ops().log_softmax(z_NV, with_entropy=True)

    def sampling_logprobs(self, logits_NV, temperature_N, top_k_N, top_p_N):
        cumsum = _ops().cumsum if self.exact else (lambda x: torch.cumsum(x, dim=-1))
        return _rowwise.sampling_logprobs(
            logits_NV, temperature_N, top_k_N, top_p_N, row_log_softmax=self.log_softmax, row_cumsum=cumsum
        )

    def sample(self, logits_RV, rows):
        from exactrl.engine.sampling import row_logprobs

        lp_RV = row_logprobs(logits_RV, rows, self)
        keys = torch.tensor([int(u * 2.0**53) for u in rows.uniform], dtype=torch.int64)  # the draw's 53 bits
        greedy = torch.tensor([t == 0 for t in rows.temperature], dtype=torch.int32)
        return _ops().draw(lp_RV, keys, greedy)

    def head_grad(self, lp_cV, g_lp, g_hit, tgt, g_ent, ent, temp: float):
        """∂L/∂z = (g_hit·1[j = t] − g_lp·p_j − g_ent·p_j·(lp_j + H)) / T, p = exp(lp) (0 where lp = −inf)."""
        p = lp_cV.exp()
        gz = -g_lp[:, None] * p
        if g_ent is not None:
            gz -= g_ent[:, None] * torch.where(p > 0, p * (lp_cV + ent[:, None]), 0.0)
        gz.scatter_add_(1, tgt[:, None], g_hit[:, None])
        return gz / temp if temp != 1.0 else gz

    def head_input_grad(self, w_VD):
        w_f = w_VD.float()
        return lambda g: g @ w_f


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_NK):  # type: ignore[override]
        ctx.save_for_backward(x_MK, w_NK)
        return _ops().linear(x_MK, w_NK)

    @staticmethod
    def backward(ctx, g_MN):  # type: ignore[override]
        x_MK, w_NK = ctx.saved_tensors
        gx = g_MN @ w_NK if ctx.needs_input_grad[0] else None
        gw = g_MN.t() @ x_MK if ctx.needs_input_grad[1] else None
        return gx, gw


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.eps = eps
        return _ops().rms_norm(x, w, eps)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, w = ctx.saved_tensors
        return _rowwise.rms_norm_grad(x, w, ctx.eps, g, ctx.needs_input_grad[:2]) + (None,)


class _Rotary(torch.autograd.Function):
    """The rotation's gradient is the rotation by −θ (the tables' two halves repeat their angles)."""

    @staticmethod
    def forward(ctx, x, cos, sin):  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        return _ops().rotary(x, cos, sin)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return _ops().rotary(g.contiguous(), cos, -sin), None, None


class _SwiGLU(torch.autograd.Function):
    """y = silu(g)·u; ∂y/∂u = silu(g), ∂y/∂g = u·σ(g)·(1 + g·(1 − σ(g)))."""

    @staticmethod
    def forward(ctx, g, u):  # type: ignore[override]
        ctx.save_for_backward(g, u)
        return _ops().swiglu(g, u)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        g, u = ctx.saved_tensors
        gf, uf, dyf = g.float(), u.float(), dy.float()
        sig = torch.sigmoid(gf)
        dg = dyf * uf * sig * (1 + gf * (1 - sig))
        du = dyf * gf * sig
        return dg.to(g.dtype), du.to(u.dtype)


class _GeGLU(torch.autograd.Function):
    """gelu(g) · u (`ops.geglu`); its gradient in torch ops (elementwise, deterministic)."""

    @staticmethod
    def forward(ctx, g, u):  # type: ignore[override]
        ctx.save_for_backward(g, u)
        return _ops().geglu(g, u)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        g, u = ctx.saved_tensors
        gf, uf, dyf = g.float(), u.float(), dy.float()
        c, k = 0.7978845608028654, 0.044715
        t = torch.tanh(c * (gf + k * gf**3))
        dg = dyf * uf * (0.5 * (1 + t) + 0.5 * gf * (1 - t * t) * c * (1 + 3 * k * gf * gf))
        du = dyf * 0.5 * gf * (1 + t)
        return dg.to(g.dtype), du.to(u.dtype)


class _SoftCap(torch.autograd.Function):
    """cap · tanh(z / cap) (`ops.softcap`); gradient g (1 - tanh(z / cap)^2) in torch ops."""

    @staticmethod
    def forward(ctx, z, cap):  # type: ignore[override]
        ctx.save_for_backward(z)
        ctx.cap = cap
        return _ops().softcap(z, cap)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        (z,) = ctx.saved_tensors
        t = torch.tanh(z.float() / ctx.cap)
        return (g.float() * (1 - t * t)).to(z.dtype), None


class _Attention(torch.autograd.Function):
    """Exact forward values (`attention.attention`); the gradient is SDPA's, recomputed from the inputs."""

    @staticmethod
    def forward(ctx, q_NHD, k_pages, v_pages, plan: TritonPlan, scale, window, softcap):  # type: ignore[override]
        ctx.save_for_backward(q_NHD, k_pages, v_pages)
        ctx.plan, ctx.scale, ctx.window, ctx.softcap = plan, scale, window, softcap
        o, _ = _attention_ops().attention(
            q_NHD, k_pages, v_pages, plan.tiles, plan.seq_N, plan.pos_N, plan.table_SJ, scale, window, softcap
        )
        return o

    @staticmethod
    def backward(ctx, g_NHD):  # type: ignore[override]
        saved = ctx.saved_tensors
        with torch.enable_grad():
            ins = [t.detach().requires_grad_(True) for t in saved]
            o = _attn.fast_attention(ins[0], ins[1], ins[2], ctx.plan.fast(), ctx.scale, ctx.window, ctx.softcap)
            grads = torch.autograd.grad(o, ins, g_NHD)
        need = ctx.needs_input_grad
        return tuple(gr if need[i] else None for i, gr in enumerate(grads)) + (None, None, None, None)
