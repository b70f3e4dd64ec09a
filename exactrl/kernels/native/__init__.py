"""Native (C) kernels: every output's order of roundings is fixed in the source, so the batch, the build's
vector width and (in the forward kernels) the thread count change speed, not bits. Compiled on first use
with the machine's C compiler, loaded with ctypes.

`exact.c`: attention, RMSNorm, RoPE. `gemm.c`: the fp32 exact linear (its
order of sums is in that file's header). `pointwise.c`: fp32 SwiGLU and its
gradient, the engine's token draw, the LM head's entropy and logit gradient,
each one pass over memory where torch takes several. `moe.c`: a
mixture-of-experts layer's routing and experts in one inference call. `fpmode.h`: every thread of a
parallel region computes in its caller's flush-to-zero / denormal mode.
`exp_f.h`: the kernels' own float32 exp (vectorisable, the same bits on every CPU).
`gemm.py` is the Python side of `gemm.c` (its packed weights and calls), `elementwise.py` of pointwise.c's
elementwise kernels, `moe.py` of `moe.c`; this package re-exports their functions.
`graph.c` (with `graph.py`): replays recorded kernel calls in one C loop (the engine's decode graphs).

Why C: the exact attention computes each query row on its own with a fixed
reduction order (`exact.c`). In torch ops that needs many tiny fixed-shape
products and masks, whose dispatch costs more than their arithmetic; one C
loop makes one pass over each row's keys. RMSNorm likewise: one call instead
of several torch ops, and no padding of small batches (docs/kernels.md).

How the library is compiled, cached and loaded: build.py.
"""

from __future__ import annotations

import torch

from exactrl.kernels.native.build import (  # noqa: F401 (the build's names, as the package's)
    BUILDS,
    FLAGS,
    HEADERS,
    SOURCES,
    KernelBuildError,
    _compiler,
    _library,
    _recording,
    library,
)

_DTYPES = (torch.float32, torch.bfloat16)  # what the C kernels read


def check_layout(seq_N: torch.Tensor, pos_N: torch.Tensor, table_SJ: torch.Tensor, block_size: int) -> tuple[int, int]:
    """(max position + 1, highest page read) of a token layout, or a ValueError naming what is wrong (exact.c)."""
    assert seq_N.dtype == pos_N.dtype == table_SJ.dtype == torch.int64 and seq_N.shape == pos_N.shape
    seq, pos, table = (t if t.is_contiguous() else t.contiguous() for t in (seq_N, pos_N, table_SJ))
    S, J = table.shape
    scratch = torch.empty(S + 2, dtype=torch.int64)
    err = library().exactrl_check_layout(
        seq.data_ptr(),
        pos.data_ptr(),
        seq.shape[0],
        table.data_ptr(),
        S,
        J,
        block_size,
        scratch.data_ptr(),
        scratch[S:].data_ptr(),
    )
    if err == 1:
        raise ValueError("token layout: positions must be >= 0 and sequences rows of the block table")
    if err == 2:
        raise ValueError("token layout: a key position has no page in the block table")
    max_len, max_page = scratch[S:].tolist()
    return max_len, max_page


def attention(
    q_NHD: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    seq_N: torch.Tensor,
    pos_N: torch.Tensor,
    table_SJ: torch.Tensor,
    scale: float,
    with_lse: bool = False,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of every query row over its sequence's keys 0..pos, or with a sliding `window` > 0
    the keys pos - window + 1..pos, each score capped to softcap * tanh(score / softcap) where `softcap` > 0
    (exact.c): [N, H, D] fp32, and
    with `with_lse` also each row's log-sum-exp of its scaled scores, m + log(sum_t exp(s_t - m)), [N, H]
    (what a flash backward needs). The layout must have passed `check_layout` (the kernel reads pages
    unchecked)."""
    N, H, D = q_NHD.shape
    P, Hk, B, Dk = k_pages.shape
    assert Dk == D and H % Hk == 0 and v_pages.shape == k_pages.shape
    assert q_NHD.dtype == k_pages.dtype == v_pages.dtype and q_NHD.dtype in (torch.float32, torch.bfloat16)
    assert seq_N.dtype == pos_N.dtype == table_SJ.dtype == torch.int64
    q, k, v = q_NHD.contiguous(), k_pages.contiguous(), v_pages.contiguous()
    seq, pos, table = seq_N.contiguous(), pos_N.contiguous(), table_SJ.contiguous()
    out = torch.empty(N, H, D, dtype=torch.float32)
    lse = torch.empty(N, H, dtype=torch.float32) if with_lse else None
    if N:
        failed = library().exactrl_attention(
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            int(q.dtype == torch.bfloat16),
            seq.data_ptr(),
            pos.data_ptr(),
            table.data_ptr(),
            N,
            H,
            Hk,
            D,
            B,
            table.shape[1],
            window,
            scale,
            softcap,
            out.data_ptr(),
            None if lse is None else lse.data_ptr(),
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("exact attention could not allocate its per-thread scratch memory")
    return (out, lse) if with_lse else out


def attention_backward(
    q_NHD: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    o_NHD: torch.Tensor,
    lse_NH: torch.Tensor,
    g_NHD: torch.Tensor,
    seq_N: torch.Tensor,
    pos_N: torch.Tensor,
    table_SJ: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradient of `attention` (exact.c, `exactrl_attention_backward`), all fp32: dq [N, H, D] and each
    sequence's key and value gradients [S, Hk, J * B, D] (key t of sequence s at t, zero past its last
    position), for the caller to sum into the pages. The layout must have passed `check_layout` (the kernel
    reads pages unchecked), as the forward's did."""
    N, H, D = q_NHD.shape
    P, Hk, B, Dk = k_pages.shape
    S, J = table_SJ.shape
    assert Dk == D and H % Hk == 0 and v_pages.shape == k_pages.shape
    ts = [t.contiguous() for t in (q_NHD, k_pages, v_pages, o_NHD, lse_NH, g_NHD)]
    assert all(t.dtype == torch.float32 for t in ts), [t.dtype for t in ts]
    seq, pos, table = seq_N.contiguous(), pos_N.contiguous(), table_SJ.contiguous()
    assert seq.dtype == pos.dtype == table.dtype == torch.int64
    dq = torch.empty(N, H, D, dtype=torch.float32)
    dk, dv = torch.zeros(2, S, Hk, J * B, D, dtype=torch.float32)  # zero past each sequence's last position
    if N:
        failed = library().exactrl_attention_backward(
            *(t.data_ptr() for t in ts),
            seq.data_ptr(),
            pos.data_ptr(),
            table.data_ptr(),
            N,
            S,
            H,
            Hk,
            D,
            B,
            J,
            window,
            scale,
            softcap,
            dq.data_ptr(),
            dk.data_ptr(),
            dv.data_ptr(),
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("the exact attention backward could not allocate its scratch memory")
    return dq, dk, dv


def rms_norm(x: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, each row in one fixed order (exact.c), in x's dtype.

    Lean on purpose: a decode step calls it several times per layer (Qwen3 also normalises q and k), each call
    on little work, so the Python around the kernel is kept short.
    """
    D = x.shape[-1]
    assert x.dtype in _DTYPES and weight_D.dtype == x.dtype and weight_D.shape[0] == D and weight_D.is_contiguous()
    x = x if x.is_contiguous() else x.contiguous()
    out = torch.empty_like(x)
    rows = x.numel() // D if D else 0
    if rows:
        library().exactrl_rms_norm(
            x.data_ptr(),
            weight_D.data_ptr(),
            x.dtype == torch.bfloat16,
            rows,
            D,
            eps,
            out.data_ptr(),
            torch.get_num_threads(),
        )
    return out


def rms_norm_backward(
    x: torch.Tensor, weight_D: torch.Tensor, g: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) of the fp32 RMSNorm for the output gradient g (exact.c has the formula), dx shaped as x."""
    D = x.shape[-1]
    assert x.dtype == weight_D.dtype == g.dtype == torch.float32 and g.shape == x.shape and weight_D.shape == (D,)
    x, g, w = (t if t.is_contiguous() else t.contiguous() for t in (x, g, weight_D))
    threads = torch.get_num_threads()
    dx, dw_TD = torch.empty_like(x), torch.zeros(threads, D)
    rows = x.numel() // D if D else 0
    if rows:
        library().exactrl_rms_norm_backward(
            x.data_ptr(), w.data_ptr(), g.data_ptr(), rows, D, eps, dx.data_ptr(), dw_TD.data_ptr(), threads
        )
    return dx, dw_TD.sum(0)


def rotary(x_NHD: torch.Tensor, cos_ND: torch.Tensor, sin_ND: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE with the same roundings, hence the same bits, as `rowwise.apply_rotary`'s torch ops.
    The tables may be column slices of wider ones (Gemma 3's [global | local]): read in place, not copied."""
    N, H, D = x_NHD.shape
    assert x_NHD.dtype in _DTYPES and cos_ND.shape == sin_ND.shape == (N, D) and D % 2 == 0
    # tables in fp32 or already in x's dtype (a bf16 model's buffers): rounding them to x's dtype is the same
    c, s = cos_ND.float(), sin_ND.float()
    if not (c.stride() == s.stride() and c.stride(1) == 1 and c.stride(0) >= D):
        c, s = c.contiguous(), s.contiguous()
    x = x_NHD if x_NHD.is_contiguous() else x_NHD.contiguous()
    out = torch.empty_like(x)
    if N:
        library().exactrl_rotary(
            x.data_ptr(), c.data_ptr(), s.data_ptr(), x.dtype == torch.bfloat16, N, H, D, out.data_ptr(), c.stride(0)
        )
    return out


def write_rows(dst_RD: torch.Tensor, rows_N: torch.Tensor, src_ND: torch.Tensor, max_row: int) -> None:
    """dst_RD[rows_N] = src_ND in place (a KV store's new rows), one C loop: at a decode step's few rows
    index_copy_'s dispatch costs more than the copy. `max_row` is the largest of rows_N (checked against dst_RD
    once here)."""
    R, D = dst_RD.shape
    assert dst_RD.is_contiguous() and src_ND.dtype == dst_RD.dtype and rows_N.dtype == torch.int64
    assert src_ND.shape == (rows_N.shape[0], D), (src_ND.shape, rows_N.shape, D)
    if max_row >= R:
        raise ValueError(f"token layout: KV row {max_row} is beyond the store's {R} rows")
    src = src_ND if src_ND.is_contiguous() else src_ND.contiguous()
    rows = rows_N if rows_N.is_contiguous() else rows_N.contiguous()
    if rows.shape[0]:
        library().exactrl_write_rows(
            src.data_ptr(), rows.data_ptr(), rows.shape[0], D * src.element_size(), dst_RD.data_ptr()
        )


def _f32(*ts: torch.Tensor) -> list[torch.Tensor]:
    assert all(t.dtype == torch.float32 for t in ts), [t.dtype for t in ts]
    return [t if t.is_contiguous() else t.contiguous() for t in ts]


def log_softmax(z_RV: torch.Tensor, build: str = "") -> torch.Tensor:
    """log_softmax of each row, float32, one fixed order per row whatever the other rows (pointwise.c)."""
    R, V = z_RV.shape
    (z,) = _f32(z_RV)
    out = torch.empty_like(z)
    if R and V:
        library(build).exactrl_log_softmax(z.data_ptr(), R, V, out.data_ptr(), torch.get_num_threads())
    return out


def draw(
    lp_RV: torch.Tensor, block: int, uniform_R: torch.Tensor, greedy_R: torch.Tensor, build: str = ""
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [R] int64, its logprob [R]) of each row: inverse CDF at uniform_R (float64) in blocks of
    `block` tokens, or the first argmax where greedy_R (bool) is set (pointwise.c, exactrl_draw). A row with
    nothing to draw (NaN, or no mass: every entry -inf) gets token -1 and a NaN logprob."""
    return _draw("exactrl_draw", lp_RV, block, uniform_R, greedy_R, build)


def _draw(
    name: str, lp_RV: torch.Tensor, block: int, uniform_R: torch.Tensor, greedy_R: torch.Tensor, build: str
) -> tuple[torch.Tensor, torch.Tensor]:
    R, V = lp_RV.shape
    (lp,) = _f32(lp_RV)
    u = uniform_R.to(torch.float64).contiguous()
    greedy = greedy_R.to(torch.uint8).contiguous()
    assert u.shape == greedy.shape == (R,) and V > 0 and block > 0
    tok, tok_lp = torch.empty(R, dtype=torch.int64), torch.empty(R, dtype=torch.float32)
    threads = torch.get_num_threads()
    mass = torch.empty(threads * -(-V // block), dtype=torch.float64)
    if R:
        getattr(library(build), name)(
            lp.data_ptr(),
            R,
            V,
            block,
            u.data_ptr(),
            greedy.data_ptr(),
            tok.data_ptr(),
            tok_lp.data_ptr(),
            mass.data_ptr(),
            threads,
        )
    return tok, tok_lp


def sample(
    z_RV: torch.Tensor, block: int, uniform_R: torch.Tensor, greedy_R: torch.Tensor, build: str = ""
) -> tuple[torch.Tensor, torch.Tensor]:
    """`draw(log_softmax(z_RV), ...)` bit for bit, without writing the [R, V] log-probabilities
    (pointwise.c, exactrl_sample)."""
    return _draw("exactrl_sample", z_RV, block, uniform_R, greedy_R, build)


def entropy(lp_RV: torch.Tensor, build: str = "") -> torch.Tensor:
    """-sum_j p_j lp_j per row, p = exp(lp) (0 where p is 0), float32 (pointwise.c)."""
    R, V = lp_RV.shape
    (lp,) = _f32(lp_RV)
    out = torch.empty(R, dtype=torch.float32)
    if R:
        library(build).exactrl_entropy(lp.data_ptr(), R, V, out.data_ptr(), torch.get_num_threads())
    return out


def log_softmax_entropy(
    z_RV: torch.Tensor, inplace: bool = False, build: str = ""
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_softmax(z), entropy(log_softmax(z))) bit for bit, in one pass (pointwise.c); `inplace` writes the
    log-probabilities over z (which must be contiguous float32) and returns it."""
    R, V = z_RV.shape
    if inplace:
        assert z_RV.dtype == torch.float32 and z_RV.is_contiguous(), (z_RV.dtype, z_RV.stride())
        z, out = z_RV, z_RV
    else:
        (z,) = _f32(z_RV)
        out = torch.empty_like(z)
    ent = torch.empty(R, dtype=torch.float32)
    if R and V:
        library(build).exactrl_log_softmax_entropy(
            z.data_ptr(), R, V, out.data_ptr(), ent.data_ptr(), torch.get_num_threads()
        )
    return out, ent


def head_grad(
    lp_RV: torch.Tensor,
    g_lp_R: torch.Tensor,
    g_hit_R: torch.Tensor,
    tgt_R: torch.Tensor,
    g_ent_R: torch.Tensor | None,
    ent_R: torch.Tensor,
    temperature: float,
    build: str = "",
    inplace: bool = False,
) -> torch.Tensor:
    """Gradient of sum_r g_lp[r] lp[r, tgt[r]] + g_ent[r] H[r] with respect to the tempered logits
    (pointwise.c, exactrl_head_grad, has the formula): [R, V] float32; `inplace` writes it over lp (which
    must be contiguous float32) and returns that."""
    R, V = lp_RV.shape
    if inplace:
        assert lp_RV.dtype == torch.float32 and lp_RV.is_contiguous(), (lp_RV.dtype, lp_RV.stride())
    lp, g_lp, g_hit, ent = _f32(lp_RV, g_lp_R, g_hit_R, ent_R)
    tgt = tgt_R.contiguous()
    assert tgt.dtype == torch.int64 and g_lp.shape == g_hit.shape == tgt.shape == (R,)
    ge = None if g_ent_R is None else _f32(g_ent_R)[0]
    gz = lp if inplace else torch.empty(R, V, dtype=torch.float32)
    if R:
        library(build).exactrl_head_grad(
            lp.data_ptr(),
            R,
            V,
            g_lp.data_ptr(),
            g_hit.data_ptr(),
            tgt.data_ptr(),
            None if ge is None else ge.data_ptr(),
            ent.data_ptr(),
            float(temperature),
            gz.data_ptr(),
            torch.get_num_threads(),
        )
    return gz


# the Python sides of gemm.c, of pointwise.c's elementwise kernels and of moe.c (they need `library`, `_library`
# and `_f32` above)
from exactrl.kernels.native import elementwise as _e  # noqa: E402
from exactrl.kernels.native.gemm import PackedLinearWeight, linear, linears, packed_transpose  # noqa: E402,F401
from exactrl.kernels.native.moe import moe  # noqa: E402,F401

# the elementwise kernels as the package's own names (assigned, not imported: `scale` and `softcap` are also
# parameter names of `attention` above)
exp, add, scale, clamp, sigmoid_gate = _e.exp, _e.add, _e.scale, _e.clamp, _e.sigmoid_gate
swiglu, swiglu_backward, geglu, geglu_backward = _e.swiglu, _e.swiglu_backward, _e.geglu, _e.geglu_backward
softcap, softcap_backward = _e.softcap, _e.softcap_backward
