"""The Python side of pointwise.c's elementwise kernels (float32): exp, the residual add and LoRA's scale (what a
decode graph records for them), SwiGLU, GeGLU, logit soft-capping and their gradients, clamp, and the sigmoid
gate of Qwen2-MoE's shared expert. Re-exported by `exactrl.kernels.native`."""

from __future__ import annotations

import torch

from exactrl.kernels.native import _f32, library


def exp(x: torch.Tensor, build: str = "") -> torch.Tensor:
    """pointwise.c's float32 exp (the one its kernels use), elementwise: the exact router probabilities
    (`rowwise.softmax`), whose bits moe.c computes again."""
    (x,) = _f32(x)
    out = torch.empty_like(x)
    library(build).exactrl_exp(x.data_ptr(), x.numel(), out.data_ptr())
    return out


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b, float32, b of a's shape or of its last dimensions (broadcast over the rest): torch's bits
    (pointwise.c). What a recorded graph runs for a residual add or a bias."""
    assert b.dim() <= a.dim() and a.shape[a.dim() - b.dim() :] == b.shape, (a.shape, b.shape)
    a, b = _f32(a, b)
    out = torch.empty_like(a)
    if b.numel():
        library().exactrl_add(a.data_ptr(), b.data_ptr(), a.numel(), b.numel(), out.data_ptr())
    return out


def scale(x: torch.Tensor, s: float) -> torch.Tensor:
    """x * s, float32, s a number: torch's bits (pointwise.c). What a recorded graph runs for LoRA's α/r."""
    (x,) = _f32(x)
    out = torch.empty_like(x)
    if x.numel():
        library().exactrl_scale(x.data_ptr(), x.numel(), s, out.data_ptr())
    return out


def swiglu(g: torch.Tensor, u: torch.Tensor, build: str = "") -> torch.Tensor:
    """silu(g) * u, elementwise, float32 (pointwise.c)."""
    return _gated("exactrl_swiglu", g, u, build)


def swiglu_backward(
    g: torch.Tensor, u: torch.Tensor, dy: torch.Tensor, build: str = ""
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dg, du) of out = silu(g) * u for the output gradient dy (pointwise.c)."""
    return _gated_backward("exactrl_swiglu_backward", g, u, dy, build)


def geglu(g: torch.Tensor, u: torch.Tensor, build: str = "") -> torch.Tensor:
    """gelu(g) * u (gelu's tanh approximation), elementwise, float32 (pointwise.c)."""
    return _gated("exactrl_geglu", g, u, build)


def geglu_backward(
    g: torch.Tensor, u: torch.Tensor, dy: torch.Tensor, build: str = ""
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dg, du) of out = gelu(g) * u for the output gradient dy (pointwise.c)."""
    return _gated_backward("exactrl_geglu_backward", g, u, dy, build)


def _gated(fn: str, g: torch.Tensor, u: torch.Tensor, build: str) -> torch.Tensor:
    """act(g) * u through the C function `fn` (pointwise.c's gated activations share one signature)."""
    assert g.shape == u.shape, (g.shape, u.shape)
    g, u = _f32(g, u)
    out = torch.empty_like(g)
    getattr(library(build), fn)(g.data_ptr(), u.data_ptr(), g.numel(), out.data_ptr(), torch.get_num_threads())
    return out


def _gated_backward(
    fn: str, g: torch.Tensor, u: torch.Tensor, dy: torch.Tensor, build: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dg, du) of a gated activation through the C function `fn`."""
    assert g.shape == u.shape == dy.shape, (g.shape, u.shape, dy.shape)
    g, u, dy = _f32(g, u, dy)
    dg, du = torch.empty_like(g), torch.empty_like(g)
    getattr(library(build), fn)(
        g.data_ptr(), u.data_ptr(), dy.data_ptr(), g.numel(), dg.data_ptr(), du.data_ptr(), torch.get_num_threads()
    )
    return dg, du


def softcap(x: torch.Tensor, cap: float, build: str = "") -> torch.Tensor:
    """cap * tanh(x / cap), elementwise, float32 (pointwise.c)."""
    (x,) = _f32(x)
    out = torch.empty_like(x)
    if x.numel():
        library(build).exactrl_softcap(x.data_ptr(), x.numel(), float(cap), out.data_ptr(), torch.get_num_threads())
    return out


def clamp(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """x clamped to [lo, hi], float32, torch.clamp's bits (pointwise.c): a recorded graph's OLMoE clip_qkv."""
    (x,) = _f32(x)
    out = torch.empty_like(x)
    if x.numel():
        library().exactrl_clamp(x.data_ptr(), x.numel(), float(lo), float(hi), out.data_ptr())
    return out


def sigmoid_gate(g_R: torch.Tensor, y_RD: torch.Tensor) -> torch.Tensor:
    """y · sigmoid(g) with a gate per row, sigmoid(g) = 1 / (1 + exp(-g)) with the kernels' exp, float32
    (pointwise.c): g [R] or [R, 1], y [R, D]."""
    R, D = y_RD.shape
    assert g_R.numel() == R, (g_R.shape, y_RD.shape)
    g, y = _f32(g_R.reshape(R), y_RD)
    out = torch.empty_like(y)
    if R:
        library().exactrl_sigmoid_gate(g.data_ptr(), y.data_ptr(), R, D, out.data_ptr())
    return out


def softcap_backward(x: torch.Tensor, dy: torch.Tensor, cap: float, inplace: bool = False) -> torch.Tensor:
    """dx = dy (1 - tanh(x / cap)^2), the gradient of `softcap` at x; with `inplace`, written over dy."""
    assert x.shape == dy.shape, (x.shape, dy.shape)
    x, dy = _f32(x, dy)
    dx = dy if inplace else torch.empty_like(dy)
    if x.numel():
        library().exactrl_softcap_backward(
            x.data_ptr(), dy.data_ptr(), x.numel(), float(cap), dx.data_ptr(), torch.get_num_threads()
        )
    return dx
