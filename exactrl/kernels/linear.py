"""Linear layers: the row-tiled exact matmul and the plain fast one.

Why tiles: on CPU, `x[:M] @ W` picks a different GEMM kernel (and so a
different reduction order over K) depending on M — in fp32 the first row of the
product already changes its last bits between M <= 3 and M >= 4 (measured with
torch 2.13). The exact kernel therefore pads the rows to a multiple of a fixed
tile `ROW_TILE` and runs ONE batched matmul over `(n_tiles, ROW_TILE, K)` with
the weight broadcast along the batch (stride 0). Every output element is then
produced by the same small GEMM whatever the number of rows, the row's
neighbours, or its place in the tile; the tests sweep these.

Column blocks: a weight with more than SPLIT_ABOVE output features (the
vocabulary projection) is multiplied in blocks of COL_BLOCK columns, each
block by one batched matmul over all the tiles. Otherwise every 32-row tile
streams the whole weight (25 MB for a 16k x 384 LM head) from memory; a block
stays in cache while the tiles pass. Measured on this CPU at 2 threads, 8192
rows x 384 -> 16384: 93 GFLOP/s unsplit, 127 split, plain mm 146. The split
is decided by the weight's shape alone, so it is the same for every call.

Tile size: 32 rows. At training sizes 16-row tiles cost up to 1.9x plain
matmul for K=1024 (the weight is re-packed per tile), 32-row tiles ~1.1x; a
decode batch of 32 is one tile either way (measured on this CPU, fp32).

bf16: one native bf16 `mm` per 32-row tile, in a Python loop. Every call has
the same shape (ROW_TILE x K times K x N), so oneDNN runs the same kernel for
every tile; it accumulates in fp32 and rounds to bf16 once. Native bf16 `bmm`
is 4-8x slower than this on this CPU (it does not reach oneDNN's bf16 path),
and the fp32 `bmm` of upcast operands 1.7-8x slower (measured with torch
2.13, 2 threads: 32x384 -> 1024 at 187 vs 24 GFLOP/s, 4096 rows at 225-242
vs 133-139). In fp32 the loop is slower than the one batched matmul (102-111
vs 128-146 GFLOP/s at 4096 rows), so fp32 keeps the `bmm`.

Backward: only the forward values must be batch-invariant. The gradients use
plain matmuls (a custom autograd function), which avoids materialising the
(n_tiles, K, N) gradient that autograd of the broadcast weight would create.

Legend: M rows, K input features, N output features, P padded rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_TILE = 32  # rows per tile; part of the exactness contract — never vary it per call
COL_BLOCK = 512  # output columns per GEMM when a weight has more than SPLIT_ABOVE of them
SPLIT_ABOVE = 4096  # (a rule on the weight's shape only, so it never varies with the rows)


def pad_rows(x_MK: torch.Tensor, tile: int = ROW_TILE) -> torch.Tensor:
    """Zero-pads the rows of a 2-D tensor up to a (non-zero) multiple of `tile`."""
    m = x_MK.shape[0]
    p = max(-(-m // tile), 1) * tile
    if p == m:
        return x_MK
    return F.pad(x_MK, (0, 0, 0, p - m))


def _tile_loop_matmul(x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """bf16: one native `mm` per 32-row tile, so every call has the same shape (P rows in P/32 calls)."""
    x_PK = pad_rows(x_MK)
    y_PN = torch.empty(x_PK.shape[0], w_NK.shape[0], dtype=x_MK.dtype)
    w_KN = w_NK.t()
    for i in range(0, x_PK.shape[0], ROW_TILE):
        torch.mm(x_PK[i:i + ROW_TILE], w_KN, out=y_PN[i:i + ROW_TILE])
    return y_PN[:x_MK.shape[0]]


def _tiled_matmul(x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    if x_MK.dtype == torch.bfloat16 and w_NK.dtype == torch.bfloat16:
        return _tile_loop_matmul(x_MK, w_NK)
    m, k = x_MK.shape
    n = w_NK.shape[0]
    out_dtype = x_MK.dtype
    x_tTK = pad_rows(x_MK.float()).view(-1, ROW_TILE, k)
    n_tiles = x_tTK.shape[0]
    w_KN = w_NK.float().t()
    if n <= SPLIT_ABOVE:
        y_tTN = torch.bmm(x_tTK, w_KN.unsqueeze(0).expand(n_tiles, k, n))
    else:  # column blocks: a block of the weight stays in cache while every tile passes through it
        y_tTN = torch.empty(n_tiles, ROW_TILE, n)
        for c in range(0, n, COL_BLOCK):
            w_Kc = w_KN[:, c:c + COL_BLOCK]
            y_tTN[:, :, c:c + COL_BLOCK] = torch.bmm(x_tTK, w_Kc.unsqueeze(0).expand(n_tiles, k, w_Kc.shape[1]))
    return y_tTN.view(n_tiles * ROW_TILE, n)[:m].to(out_dtype)


class _ExactLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_NK):  # type: ignore[override]
        ctx.save_for_backward(x_MK, w_NK)
        return _tiled_matmul(x_MK, w_NK)

    @staticmethod
    def backward(ctx, g_MN):  # type: ignore[override]
        x_MK, w_NK = ctx.saved_tensors
        gx = (g_MN @ w_NK) if ctx.needs_input_grad[0] else None
        gw = (g_MN.t() @ x_MK) if ctx.needs_input_grad[1] else None
        return gx, gw


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b with a batch-invariant row-tiled matmul (see module docstring)."""
    lead = x.shape[:-1]
    x_MK = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        y = _ExactLinear.apply(x_MK, weight)
    else:  # inference (the engine): no autograd node to build
        y = _tiled_matmul(x_MK, weight)
    if bias is not None:
        y = y + bias  # elementwise: invariant by construction
    return y.view(*lead, weight.shape[0])


def fast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain `F.linear`: the kernel torch picks depends on the number of rows."""
    return F.linear(x, weight, bias)
