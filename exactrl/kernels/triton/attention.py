"""Triton attention of the exact mode over the paged KV cache (the rule of ops.py: the reduction order of an
output row depends only on the head dim and page size, never on the batch).

`attention_tiles` cuts the tokens into tiles of ATTN_BLOCK_M query rows that never straddle a sequence.

The order a row's keys are visited in (`_attention_kernel`): a tile walks its sequence's pages j = 0, 1, ...
up to the page of its last row's position, in ascending order, with an online softmax in fp32 (running max
m, sum l, accumulator acc). For a row, a page wholly past its own position is fully masked: scores -inf,
p = 0, alpha = exp(m - m) = 1, so l and acc are unchanged bit for bit. Every row therefore gets the bits of
the pages 0..pos//B alone, whatever tile it lands in, which tokens share it, and whether the call is a
whole-sequence forward, a prefill chunk or a decode step. Each score and each P·V sum is one tl.dot of a
fixed shape.

A sliding window (WINDOW > 0) masks keys t <= pos - WINDOW too, and the walk starts at the page of the
tile's lowest window start. A page wholly before a row's window start is a no-op for that row as well: while
its m is still -inf, alpha and p are taken against 0 instead of m_new (exp(-inf - -inf) would be NaN), so
alpha = p = 0 and l and acc stay +0 bit for bit; the row's first page in its window then starts the sums as
it would had the walk begun there. WINDOW is a compile-time constant (one kernel per window). SOFTCAP > 0
(Gemma 2) caps each score to SOFTCAP·tanh(s / SOFTCAP) before the mask: elementwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exactrl.kernels.triton.ops import ATTN_BLOCK_M, INTERPRETED, _dot, _tanh


# --------------------------------------------------------------------------------------------- attention
@triton.jit
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
    tile_first_ptr,
    tile_count_ptr,
    seq_ptr,
    pos_ptr,
    table_ptr,
    stride_table,
    scale,
    H,
    HK,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    G: tl.constexpr,
    TOK: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    B: tl.constexpr,
    BLOCK_M: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
):
    """One tile = up to TOK consecutive tokens of one sequence x the G query heads of one kv head; row r is
    (token first + r // G, head kvh·G + r % G). The order of its sums: the module docstring."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    first = tl.load(tile_first_ptr + tile).to(tl.int64)
    count = tl.load(tile_count_ptr + tile)
    r = tl.arange(0, BLOCK_M)
    t = r // G
    valid = (t < count) & (r < TOK * G)
    tok = first + tl.where(valid, t, 0)
    head = kvh * G + r % G
    seq = tl.load(seq_ptr + first)
    pos = tl.where(valid, tl.load(pos_ptr + tok, mask=valid, other=0), 0)
    d = tl.arange(0, BLOCK_D)
    q = tl.load(
        q_ptr + (tok[:, None] * H + head[:, None]) * D + d[None, :], mask=valid[:, None] & (d[None, :] < D), other=0.0
    )
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    b = tl.arange(0, B)
    last_page = tl.max(pos, axis=0) // B
    first_page = 0
    if WINDOW > 0:
        lo = tl.where(valid, tl.maximum(pos - WINDOW + 1, 0), 2**62)  # each row's first key
        first_page = tl.min(lo, axis=0) // B
    for j in range(first_page, last_page + 1):
        page = tl.load(table_ptr + seq * stride_table + j).to(tl.int64)
        kv_off = ((page * HK + kvh) * B + b[:, None]) * D + d[None, :]
        k = tl.load(k_ptr + kv_off, mask=d[None, :] < D, other=0.0)
        v = tl.load(v_ptr + kv_off, mask=d[None, :] < D, other=0.0)
        s = _dot(q, tl.trans(k), tl.zeros((BLOCK_M, B), tl.float32), IEEE, INTERP) * scale
        if SOFTCAP > 0:
            s = SOFTCAP * _tanh(s / SOFTCAP)
        key = (j * B + b)[None, :]
        seen = key <= pos[:, None]
        if WINDOW > 0:
            seen = seen & (key > pos[:, None] - WINDOW)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row no key reached yet: see the docstring
        alpha = tl.exp(m_i - m_ref)
        p = tl.exp(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE, INTERP)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(
        o_ptr + (tok[:, None] * H + head[:, None]) * D + d[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=valid[:, None] & (d[None, :] < D),
    )
    tl.store(lse_ptr + tok * H + head, m_i + tl.log(l_i), mask=valid)


def attention_tiles(seq_N: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first token, token count) of each attention tile: runs of consecutive tokens of one sequence, cut
    every ATTN_BLOCK_M // group tokens (on the layout's device, usually the CPU)."""
    n = seq_N.shape[0]
    tok_per_tile = max(1, ATTN_BLOCK_M // group)
    idx = torch.arange(n)
    new_run = torch.ones(n, dtype=torch.bool)
    new_run[1:] = seq_N[1:] != seq_N[:-1]
    run_start = torch.cummax(torch.where(new_run, idx, 0), 0).values
    starts = ((idx - run_start) % tok_per_tile == 0).nonzero().squeeze(1)
    ends = torch.cat([starts[1:], torch.tensor([n])])
    return starts, ends - starts


def attention(
    q_NHD: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    tiles,
    seq_N,
    pos_N,
    table_SJ,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [N, H, D] in q's dtype, log-sum-exp [N, H] fp32) of causal attention over the paged store
    [P, Hk, B, D]; `tiles` from `attention_tiles`, every tensor on q's device. `window` > 0: each row's last
    `window` keys only; `softcap` > 0: scores capped to softcap·tanh(s / softcap)."""
    n, h, d = q_NHD.shape
    _, hk, blk, _ = k_pages.shape
    group = h // hk
    q = q_NHD.contiguous()
    o = torch.empty_like(q)
    lse = torch.empty(n, h, dtype=torch.float32, device=q.device)
    first, count = tiles
    if n:
        _attention_kernel[(first.shape[0], hk)](
            q,
            k_pages,
            v_pages,
            o,
            lse,
            first,
            count,
            seq_N,
            pos_N,
            table_SJ,
            table_SJ.stride(0),
            float(scale),
            h,
            hk,
            WINDOW=int(window),
            SOFTCAP=float(softcap),
            G=group,
            TOK=max(1, ATTN_BLOCK_M // group),
            D=d,
            BLOCK_D=max(16, triton.next_power_of_2(d)),
            B=blk,
            BLOCK_M=ATTN_BLOCK_M,
            IEEE=q.dtype == torch.float32,
            INTERP=INTERPRETED,
            num_warps=4,
            num_stages=2,
        )
    return o, lse
