"""Triton kernels of the exact mode: one fixed reduction order per op, decided by the op's own shape.

Every kernel here obeys one rule (docs/design.md, "On GPU"): the order in
which an output element's reduction is summed is a function of the op's
shape parameters that do not vary with the batch (K and N for a linear, the
row length for a row-wise op, the head dim and page size for attention), never
of the number of rows, the grid, the tile an element lands in, or the GPU's
SM count. So:

- `linear`: one tile configuration per (N, K, dtype) (`linear_config`), no
  split-K, the row count passed unspecialised (`do_not_specialize`), so a
  row's K loop and every `tl.dot` it goes through are the same code whatever
  M is; rows past M are masked loads that touch no real row.
- row-wise ops (RMSNorm, log-softmax, entropy, cumulative sums, the draw):
  one program per row, the row walked in chunks of a fixed size, per-lane
  accumulators folded by one `tl.sum`/`tl.max` at the end.
- `attention`: see attention.py.

The same kernels run on CPU tensors under Triton's interpreter
(`TRITON_INTERPRET=1`), which is how the tests check them without a GPU.

Legend: M rows, N output features, K input features, V vocabulary, N_ tokens
in attention, H heads, Hk kv heads, G = H / Hk, D head dim, B keys per page.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Under the interpreter tl.dot is numpy's matmul, whose BLAS gives a row other bits at another place in the
# tile (and reads bf16 as raw integers): there every dot is an fp32 broadcast product summed over K in one
# order per element instead. On a GPU tl.dot's matrix instructions sum each element alike wherever it sits.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

ROW_CHUNK = 1024  # elements of a row handled per step of a row-wise kernel; part of the reduction order
LINEAR_BLOCK_M = 128  # rows per linear tile: never varied, so the per-row code is the same for any M
ATTN_BLOCK_M = 64  # query rows (tokens x heads of one kv head) per attention tile


# ------------------------------------------------------------------------------------------------- linear
def linear_config(n: int, k: int, dtype: torch.dtype) -> dict:
    """The linear's tile configuration: a function of the weight's shape and dtype only."""
    block_n = 128 if n >= 1024 else 64
    block_k = 32 if dtype == torch.float32 else 64
    return dict(
        BLOCK_M=LINEAR_BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=8,
        num_warps=8 if block_n == 128 else 4,
        num_stages=4 if dtype != torch.float32 else 3,
    )


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, INTERP: tl.constexpr):
    """acc + a·b with fp32 accumulation (see INTERPRETED)."""
    if INTERP:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n  # grouped order: which tile a program takes (never how a tile is computed)
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K in one ascending loop of fixed chunks: the order of every output
        kk = k0 + rk
        a = tl.load(
            x_ptr + rm[:, None].to(tl.int64) * stride_xm + kk[None, :],
            mask=(rm[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            w_ptr + rn[None, :].to(tl.int64) * stride_wn + kk[:, None],
            mask=(rn[None, :] < N) & (kk[:, None] < K),
            other=0.0,
        )
        acc = _dot(a, b, acc, IEEE, INTERP)
    tl.store(
        y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


def linear(x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """y = x Wᵀ in x's dtype, fp32 accumulation, every row's bits independent of the others."""
    m, k = x_MK.shape
    n = w_NK.shape[0]
    if x_MK.dtype != w_NK.dtype:
        raise ValueError(f"triton linear: input is {x_MK.dtype}, weight {w_NK.dtype}")
    x_MK = x_MK if x_MK.stride(1) == 1 else x_MK.contiguous()
    w_NK = w_NK if w_NK.stride(1) == 1 else w_NK.contiguous()
    y = torch.empty(m, n, dtype=x_MK.dtype, device=x_MK.device)
    if m == 0:
        return y
    cfg = linear_config(n, k, w_NK.dtype)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _linear_kernel[grid](
        x_MK,
        w_NK,
        y,
        m,
        n,
        k,
        x_MK.stride(0),
        w_NK.stride(0),
        y.stride(0),
        IEEE=x_MK.dtype == torch.float32,
        INTERP=INTERPRETED,
        **cfg,
    )
    return y


# ---------------------------------------------------------------------------------------------- row-wise
# A program takes ROWS rows (a function of the row length only) as a [ROWS, CHUNK] block: every row has the
# same place in the block's layout, so each row's lanes and their fold are the same code whatever its
# neighbours; rows past the end are masked.
def _row_block(length: int) -> tuple[int, int]:
    """(ROWS, CHUNK) of a row-wise kernel over rows of `length` elements."""
    chunk = min(ROW_CHUNK, triton.next_power_of_2(max(length, 1)))
    return max(1, 4096 // chunk), chunk


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, R, D, eps, ROWS: tl.constexpr, CHUNK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = r < R
    acc = tl.zeros((ROWS, CHUNK), dtype=tl.float32)
    for d0 in range(0, D, CHUNK):
        d = d0 + tl.arange(0, CHUNK)
        m = live[:, None] & (d[None, :] < D)
        x = tl.load(x_ptr + r[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=1) / D + eps)
    for d0 in range(0, D, CHUNK):
        d = d0 + tl.arange(0, CHUNK)
        m = live[:, None] & (d[None, :] < D)
        x = tl.load(x_ptr + r[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
        normed = (x * rstd[:, None]).to(y_ptr.dtype.element_ty).to(tl.float32)  # rounded to x's dtype, as HF
        tl.store(y_ptr + r[:, None] * D + d[None, :], (w[None, :] * normed).to(y_ptr.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, w_D: torch.Tensor, eps: float) -> torch.Tensor:
    """w · x / sqrt(mean(x²) + eps) over the last dimension, each row reduced alone in one order."""
    x_ND = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty_like(x_ND)
    n, d = x_ND.shape
    if n:
        rows, chunk = _row_block(d)
        _rms_norm_kernel[(triton.cdiv(n, rows),)](x_ND, w_D.contiguous(), y, n, d, float(eps), ROWS=rows, CHUNK=chunk)
    return y.view(x.shape)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, R, H, D, ROWS: tl.constexpr, HALF: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # row = (token, head)
    live = (r < R)[:, None]
    n = (r // H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    base = r[:, None] * D
    x1 = tl.load(x_ptr + base + d, mask=live, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + HALF + d, mask=live, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + n * D + d, mask=live, other=0.0)
    c2 = tl.load(cos_ptr + n * D + HALF + d, mask=live, other=0.0)
    s1 = tl.load(sin_ptr + n * D + d, mask=live, other=0.0)
    s2 = tl.load(sin_ptr + n * D + HALF + d, mask=live, other=0.0)
    tl.store(y_ptr + base + d, (x1 * c1 - x2 * s1).to(y_ptr.dtype.element_ty), mask=live)
    tl.store(y_ptr + base + HALF + d, (x2 * c2 + x1 * s2).to(y_ptr.dtype.element_ty), mask=live)


def rotary(x_NHD: torch.Tensor, cos_ND: torch.Tensor, sin_ND: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, each output one fp32 expression rounded once to x's dtype."""
    n, h, d = x_NHD.shape
    if d % 2 or d & (d - 1):
        raise ValueError(f"triton rotary: head_dim must be a power of two, got {d}")
    x = x_NHD.contiguous()
    y = torch.empty_like(x)
    if n:
        rows = max(1, 4096 // d)
        _rotary_kernel[(triton.cdiv(n * h, rows),)](
            x, cos_ND.float().contiguous(), sin_ND.float().contiguous(), y, n * h, h, d, ROWS=rows, HALF=d // 2
        )
    return y


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, y_ptr, numel, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(g_ptr + i, mask=i < numel, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + i, mask=i < numel, other=0.0).to(tl.float32)
    tl.store(y_ptr + i, (g / (1.0 + tl.exp(-g)) * u).to(y_ptr.dtype.element_ty), mask=i < numel)


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) · u, one fp32 expression per element, rounded once."""
    g, u = g.contiguous(), u.contiguous()
    y = torch.empty_like(g)
    if g.numel():
        _swiglu_kernel[(triton.cdiv(g.numel(), 4096),)](g, u, y, g.numel(), BLOCK=4096)
    return y


@triton.jit
def _tanh(x):
    """tanh as the native kernels' tanh_f (exp_f.h): a Taylor polynomial below |x| = 1/16, else
    sign(x)(1 - 2 / (exp(2|x|) + 1)) (exp: Triton's)."""
    a = tl.abs(x)
    x2 = x * x
    small = x + x * x2 * ((-17.0 / 315.0 * x2 + 2.0 / 15.0) * x2 - 1.0 / 3.0)
    big = 1.0 - 2.0 / (tl.exp(2.0 * a) + 1.0)
    return tl.where(a < 0.0625, small, tl.where(x < 0, -big, big))


@triton.jit
def _geglu_kernel(g_ptr, u_ptr, y_ptr, numel, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(g_ptr + i, mask=i < numel, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + i, mask=i < numel, other=0.0).to(tl.float32)
    t = _tanh(0.7978845608028654 * (g + 0.044715 * (g * g * g)))
    tl.store(y_ptr + i, (0.5 * g * (1.0 + t) * u).to(y_ptr.dtype.element_ty), mask=i < numel)


def geglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """gelu(g) · u (gelu's tanh approximation), one fp32 expression per element, rounded once."""
    g, u = g.contiguous(), u.contiguous()
    y = torch.empty_like(g)
    if g.numel():
        _geglu_kernel[(triton.cdiv(g.numel(), 4096),)](g, u, y, g.numel(), BLOCK=4096)
    return y


@triton.jit
def _softcap_kernel(x_ptr, y_ptr, numel, cap, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < numel, other=0.0).to(tl.float32)
    tl.store(y_ptr + i, (cap * _tanh(x / cap)).to(y_ptr.dtype.element_ty), mask=i < numel)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap · tanh(x / cap), one fp32 expression per element, rounded once."""
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel():
        _softcap_kernel[(triton.cdiv(x.numel(), 4096),)](x, y, x.numel(), float(cap), BLOCK=4096)
    return y


@triton.jit
def _log_softmax_kernel(
    z_ptr, lp_ptr, ent_ptr, R, V, WITH_ENTROPY: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr
):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = (r < R)[:, None]
    # pass 1: per-lane running max m and sum s of exp(z - m), folded once at the end
    m = tl.full((ROWS, CHUNK), float("-inf"), tl.float32)
    s = tl.zeros((ROWS, CHUNK), tl.float32)
    for v0 in range(0, V, CHUNK):
        v = (v0 + tl.arange(0, CHUNK))[None, :]
        z = tl.load(z_ptr + r[:, None] * V + v, mask=live & (v < V), other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, z)
        s = tl.where(m_new > float("-inf"), s * tl.exp(m - m_new) + tl.exp(z - m_new), s)
        m = m_new
    row_max = tl.max(m, axis=1)
    total = tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - row_max[:, None]), 0.0), axis=1)
    shift = (row_max + tl.log(total))[:, None]
    ent = tl.zeros((ROWS, CHUNK), tl.float32)
    for v0 in range(0, V, CHUNK):
        v = (v0 + tl.arange(0, CHUNK))[None, :]
        m2 = live & (v < V)
        lp = tl.load(z_ptr + r[:, None] * V + v, mask=m2, other=float("-inf")).to(tl.float32) - shift
        tl.store(lp_ptr + r[:, None] * V + v, lp, mask=m2)
        if WITH_ENTROPY:
            ent += tl.where(lp > float("-inf"), tl.exp(lp) * lp, 0.0)
    if WITH_ENTROPY:
        tl.store(ent_ptr + r, -tl.sum(ent, axis=1), mask=r < R)


def log_softmax(z_RV: torch.Tensor, with_entropy: bool = False):
    """fp32 log_softmax of each row (and its entropy -Σ p·lp with `with_entropy`)."""
    z = z_RV.float().contiguous()
    r, v = z.shape
    lp = torch.empty_like(z)
    ent = torch.empty(r, dtype=torch.float32, device=z.device)
    if r:
        rows, chunk = _row_block(v)
        _log_softmax_kernel[(triton.cdiv(r, rows),)](
            z, lp, ent, r, v, WITH_ENTROPY=with_entropy, ROWS=rows, CHUNK=chunk
        )
    return (lp, ent) if with_entropy else lp


@triton.jit
def _entropy_kernel(lp_ptr, ent_ptr, R, V, ROWS: tl.constexpr, CHUNK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = (r < R)[:, None]
    acc = tl.zeros((ROWS, CHUNK), tl.float32)
    for v0 in range(0, V, CHUNK):
        v = (v0 + tl.arange(0, CHUNK))[None, :]
        lp = tl.load(lp_ptr + r[:, None] * V + v, mask=live & (v < V), other=float("-inf"))
        acc += tl.where(lp > float("-inf"), tl.exp(lp) * lp, 0.0)
    tl.store(ent_ptr + r, -tl.sum(acc, axis=1), mask=r < R)


def entropy(lp_RV: torch.Tensor) -> torch.Tensor:
    """-Σ exp(lp)·lp of each row of fp32 logprobs."""
    lp = lp_RV.float().contiguous()
    r, v = lp.shape
    ent = torch.empty(r, dtype=torch.float32, device=lp.device)
    if r:
        rows, chunk = _row_block(v)
        _entropy_kernel[(triton.cdiv(r, rows),)](lp, ent, r, v, ROWS=rows, CHUNK=chunk)
    return ent


@triton.jit
def _cumsum_kernel(x_ptr, y_ptr, V, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one row a program: Triton 3.6 fails to compile a 2-D scan + sum
    carry = tl.zeros((1,), tl.float32)
    for v0 in range(0, V, CHUNK):
        v = v0 + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + row * V + v, mask=v < V, other=0.0)
        tl.store(y_ptr + row * V + v, tl.cumsum(x, axis=0) + carry, mask=v < V)
        carry += tl.sum(x, axis=0)


def cumsum(x_RV: torch.Tensor) -> torch.Tensor:
    """Running sums along each fp32 row (torch's CUDA scan may pick its algorithm by the number of rows)."""
    x = x_RV.float().contiguous()
    y = torch.empty_like(x)
    r, v = x.shape
    if r:
        _cumsum_kernel[(r,)](x, y, v, CHUNK=_row_block(v)[1])
    return y


@triton.jit
def _mix64(x):
    """splitmix64's finaliser on uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _draw_kernel(lp_ptr, key_ptr, greedy_ptr, tok_ptr, out_lp_ptr, V, CHUNK: tl.constexpr):
    """Gumbel-max draw: token = argmax_v lp_v + g_v, g_v = -log(-log u_v), u_v a hash of (row key, v).

    argmax(lp + Gumbel noise) is a draw from softmax(lp); the noise of a token is a function of the row's
    key and the token id alone, so the draw does not depend on the other rows. Ties go to the lowest id.
    Greedy rows take argmax lp. A row with a NaN, or with no finite logprob, gets token -1.
    """
    row = tl.program_id(0).to(tl.int64)
    key = tl.load(key_ptr + row).to(tl.uint64)
    greedy = tl.load(greedy_ptr + row) != 0
    best = tl.full((CHUNK,), float("-inf"), tl.float64)
    best_i = tl.full((CHUNK,), 2147483647, tl.int32)
    bad = tl.zeros((CHUNK,), tl.int32)
    for v0 in range(0, V, CHUNK):
        v = v0 + tl.arange(0, CHUNK)
        lp = tl.load(lp_ptr + row * V + v, mask=v < V, other=float("-inf"))
        bad = bad | (lp != lp).to(tl.int32)
        h = _mix64(key ^ _mix64(v.to(tl.uint64) + 0x9E3779B97F4A7C15))
        u = ((h >> 11).to(tl.float64) + 0.5) * 1.1102230246251565e-16  # in (0, 1)
        noise = tl.where(greedy, 0.0, -tl.log(-tl.log(u)))
        score = tl.where(lp > float("-inf"), lp.to(tl.float64) + noise, float("-inf"))
        take = score > best  # strictly: an earlier (lower) id keeps a tie
        best = tl.where(take, score, best)
        best_i = tl.where(take, v, best_i)
    top = tl.max(best, axis=0)
    tok = tl.min(tl.where(best == top, best_i, 2147483647), axis=0)
    ok = (tl.max(bad, axis=0) == 0) & (top > float("-inf"))
    tok = tl.where(ok, tok, -1)
    tl.store(tok_ptr + row, tok)
    tl.store(out_lp_ptr + row, tl.load(lp_ptr + row * V + tl.maximum(tok, 0)))


def draw(lp_RV: torch.Tensor, keys_R: torch.Tensor, greedy_R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [R] int64, its logprob [R] fp32) drawn from each row of fp32 logprobs (`_draw_kernel`)."""
    lp = lp_RV.float().contiguous()
    r, v = lp.shape
    tok = torch.empty(r, dtype=torch.int32, device=lp.device)
    out = torch.empty(r, dtype=torch.float32, device=lp.device)
    if r:
        _draw_kernel[(r,)](
            lp,
            keys_R.to(lp.device, torch.int64),
            greedy_R.to(lp.device, torch.int32),
            tok,
            out,
            v,
            CHUNK=min(ROW_CHUNK, triton.next_power_of_2(v)),
        )
    return tok.long(), out
