"""Causal attention over a paged KV store: fixed-block exact kernel and SDPA.

Every forward — a trainer batch (padded or packed), a full or chunked prefill,
a decode step — is described the same way: a flat list of N query tokens, each
with the sequence it belongs to and its absolute position, and a block table
mapping each sequence's key blocks to pages of the KV store. Keys and values of
the new tokens are written into the pages first; attention then reads pages.

Exact kernel (DESIGN.md §1 rule 2). Query rows are (token, head) pairs grouped
by (sequence, kv head) and cut into tiles of `QUERY_TILE` rows. Key blocks are
whole pages of `block_size` keys at absolute positions [jB, (j+1)B). For each
block j in ascending order, every tile that can see it does, in fp32:

    s = q·kᵀ (bmm of fixed shape T×D×B),  masked to -inf where key_pos > q_pos
    m' = max(m, max_b s);  p = exp(s - m');  a = exp(m - m')
    l' = a·l + Σ_b p;      acc' = a·acc + p·v  (bmm of fixed shape T×B×D)

A block that is fully masked for a row gives a = 1, p = 0: a bitwise no-op. So
a row's result depends only on the keys it may see, never on how many other
rows, tokens or sequences share the call — decode against a cache, chunked
prefill and a whole-sequence trainer forward give the same bits. Tiles that
cannot see block j (all their positions < jB) are skipped, which is the same
no-op done cheaper (causal savings for long sequences).

Legend: N tokens, H query heads, Hk kv heads, D head dim, S sequences,
J blocks per sequence, P pages, B keys per block, t tiles, T rows per tile.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

QUERY_TILE = 16  # query rows per tile; part of the exactness contract


@dataclass
class TokenLayout:
    """Where each token of a forward sits; shared by every layer."""

    seq_N: torch.Tensor  # int64, row of `block_table_SJ` the token belongs to
    pos_N: torch.Tensor  # int64, absolute position of the token in its sequence
    block_table_SJ: torch.Tensor  # int64, page id of key block j of sequence s (-1 unused)


@dataclass
class ExactPlan:
    """Query tiles of the exact kernel, computed once per forward."""

    tok_tT: torch.Tensor  # token index of each tile row (0 for padding rows)
    head_tT: torch.Tensor  # query head of each tile row
    pos_tT: torch.Tensor  # position of each row, -1 for padding rows
    valid_tT: torch.Tensor  # bool, real row
    seq_t: torch.Tensor  # sequence of each tile
    kvh_t: torch.Tensor  # kv head of each tile
    maxpos_t: torch.Tensor  # largest position in the tile
    block_table_SJ: torch.Tensor
    num_blocks: int  # blocks the longest query can see


@dataclass
class FastPlan:
    """Per-sequence padded query matrix for SDPA."""

    tok_SQ: torch.Tensor  # token index, 0 where padded
    valid_SQ: torch.Tensor
    pos_SQ: torch.Tensor  # position, 0 where padded (a fully masked row would give NaN)
    block_table_SJ: torch.Tensor
    num_blocks: int


def plan_exact(layout: TokenLayout, num_heads: int, num_kv_heads: int, block_size: int) -> ExactPlan:
    seq_N, pos_N = layout.seq_N, layout.pos_N
    S = layout.block_table_SJ.shape[0]
    g = num_heads // num_kv_heads
    order_N = torch.argsort(seq_N * (int(pos_N.max()) + 1) + pos_N)
    counts_S = torch.bincount(seq_N, minlength=S)
    offset_S = torch.cumsum(counts_S, 0) - counts_S
    rows_G = (counts_S * g).repeat_interleave(num_kv_heads)  # G = S*Hk groups
    tiles_G = -(-rows_G // QUERY_TILE)
    group_t = torch.repeat_interleave(torch.arange(len(tiles_G)), tiles_G)
    start_G = torch.cumsum(tiles_G, 0) - tiles_G
    local_t = torch.arange(len(group_t)) - start_G[group_t]
    s_t, h_t = group_t // num_kv_heads, group_t % num_kv_heads
    i_tT = local_t[:, None] * QUERY_TILE + torch.arange(QUERY_TILE)[None, :]
    valid_tT = i_tT < (counts_S[s_t] * g)[:, None]
    sorted_idx = (offset_S[s_t][:, None] + i_tT // g).clamp(max=len(order_N) - 1)
    tok_tT = torch.where(valid_tT, order_N[sorted_idx], 0)
    head_tT = h_t[:, None] * g + i_tT % g
    pos_tT = torch.where(valid_tT, pos_N[tok_tT], -1)
    maxpos_t = pos_tT.amax(1)
    return ExactPlan(tok_tT, head_tT, pos_tT, valid_tT, s_t, h_t, maxpos_t,
                     layout.block_table_SJ, int(pos_N.max()) // block_size + 1)


def plan_fast(layout: TokenLayout, block_size: int) -> FastPlan:
    seq_N, pos_N = layout.seq_N, layout.pos_N
    S = layout.block_table_SJ.shape[0]
    order_N = torch.argsort(seq_N * (int(pos_N.max()) + 1) + pos_N)
    counts_S = torch.bincount(seq_N, minlength=S)
    offset_S = torch.cumsum(counts_S, 0) - counts_S
    q = int(counts_S.max())
    i_SQ = torch.arange(q)[None, :].expand(S, q)
    valid_SQ = i_SQ < counts_S[:, None]
    tok_SQ = torch.where(valid_SQ, order_N[(offset_S[:, None] + i_SQ).clamp(max=len(order_N) - 1)], 0)
    pos_SQ = torch.where(valid_SQ, pos_N[tok_SQ], 0)
    return FastPlan(tok_SQ, valid_SQ, pos_SQ, layout.block_table_SJ, int(pos_N.max()) // block_size + 1)


def write_kv(k_pages: torch.Tensor, v_pages: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor,
             layout: TokenLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Stores new keys/values at their pages and slots; pages are [P, Hk, B, D].

    Returns the stores to use from here on: in place for the engine's cache,
    out of place (differentiable) when the values require grad (trainer).
    """
    B = k_pages.shape[2]
    page_N = layout.block_table_SJ[layout.seq_N, layout.pos_N // B]
    assert bool((page_N >= 0).all()), "a token has no page in the block table"
    slot_N = layout.pos_N % B
    Hk = k_pages.shape[1]
    idx = (page_N[:, None].expand(-1, Hk), torch.arange(Hk)[None, :].expand(len(page_N), -1), slot_N[:, None].expand(-1, Hk))
    if k_NHD.requires_grad or v_NHD.requires_grad:
        return k_pages.index_put(idx, k_NHD), v_pages.index_put(idx, v_NHD)
    k_pages.index_put_(idx, k_NHD)
    v_pages.index_put_(idx, v_NHD)
    return k_pages, v_pages


GATHER_ALL_LIMIT = 4096  # tiles x blocks up to which all key blocks are gathered in one op (decode)


def _fold_block(q_aTD, k_aBD, v_aBD, pos_aT, m_aT, l_aT, acc_aTD, j: int):
    """One online-softmax step of the given tiles over key block j (see module docstring).

    Rows that see no key of the block keep their state exactly (`torch.where`),
    so folding a block into a tile that cannot see it is a bitwise no-op.
    """
    B = k_aBD.shape[1]
    visible = (j * B + torch.arange(B))[None, None, :] <= pos_aT[:, :, None]
    s_aTB = torch.bmm(q_aTD, k_aBD.transpose(1, 2)).masked_fill(~visible, float("-inf"))
    # the running max only shifts the exponent; detaching it leaves the gradient exact
    m_new = torch.maximum(m_aT, s_aTB.detach().amax(-1))
    m_use = torch.where(m_new == float("-inf"), 0.0, m_new)
    p_aTB = torch.exp(s_aTB - m_use[..., None])
    a_aT = torch.exp(m_aT - m_use)
    seen = visible.any(-1)
    l_new = torch.where(seen, l_aT * a_aT + p_aTB.sum(-1), l_aT)
    acc_new = torch.where(seen[..., None], acc_aTD * a_aT[..., None] + torch.bmm(p_aTB, v_aBD), acc_aTD)
    return m_new, l_new, acc_new


def exact_attention(q_NHD: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: ExactPlan,
                    scale: float) -> torch.Tensor:
    B, J = k_pages.shape[2], plan.num_blocks
    q_tTD = (q_NHD[plan.tok_tT, plan.head_tT].float() * scale) * plan.valid_tT[..., None]
    t, T, D = q_tTD.shape
    m_tT = torch.full((t, T), float("-inf"))
    l_tT = torch.zeros(t, T)
    acc_tTD = torch.zeros(t, T, D)
    pages_tJ = plan.block_table_SJ[plan.seq_t, :J].clamp(min=0)  # -1 (no page) only where fully masked
    gather_all = t * J <= GATHER_ALL_LIMIT
    if gather_all:  # decode-sized: one gather for every block instead of two per block
        k_all = k_pages[pages_tJ, plan.kvh_t[:, None]].float()
        v_all = v_pages[pages_tJ, plan.kvh_t[:, None]].float()
    for j in range(J):
        act = torch.nonzero(plan.maxpos_t >= j * B).squeeze(1)
        # few tiles see block j (long prefill, causal): fold only those; otherwise fold all,
        # which the where-guard in _fold_block makes bitwise identical
        idx = act if 2 * len(act) < t else slice(None)
        if gather_all:
            k_aBD, v_aBD = k_all[idx, j], v_all[idx, j]
        else:
            k_aBD = k_pages[pages_tJ[idx, j], plan.kvh_t[idx]].float()
            v_aBD = v_pages[pages_tJ[idx, j], plan.kvh_t[idx]].float()
        new = _fold_block(q_tTD[idx], k_aBD, v_aBD, plan.pos_tT[idx], m_tT[idx], l_tT[idx], acc_tTD[idx], j)
        if isinstance(idx, slice):
            m_tT, l_tT, acc_tTD = new
        else:
            m_tT, l_tT, acc_tTD = (x.index_copy(0, idx, n) for x, n in zip((m_tT, l_tT, acc_tTD), new))
    o_tTD = acc_tTD / torch.where(l_tT > 0, l_tT, 1.0)[..., None]
    out = torch.zeros(q_NHD.shape, dtype=o_tTD.dtype)
    v = plan.valid_tT
    out = out.index_put((plan.tok_tT[v], plan.head_tT[v]), o_tTD[v])
    return out.to(q_NHD.dtype)


def fast_attention(q_NHD: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: FastPlan,
                   scale: float) -> torch.Tensor:
    B = k_pages.shape[2]
    J = plan.num_blocks
    pages_SJ = plan.block_table_SJ[:, :J].clamp(min=0)
    S = pages_SJ.shape[0]

    def gather(pages):  # [S*J, Hk, B, D] -> [S, Hk, J*B, D]
        x = pages[pages_SJ.reshape(-1)]
        Hk, D = x.shape[1], x.shape[3]
        return x.view(S, J, Hk, B, D).permute(0, 2, 1, 3, 4).reshape(S, Hk, J * B, D)

    k, v = gather(k_pages), gather(v_pages)
    q = q_NHD[plan.tok_SQ].transpose(1, 2)  # [S, H, Q, D]
    mask = torch.arange(J * B)[None, None, :] <= plan.pos_SQ[:, :, None]
    o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask[:, None],
                                       scale=scale, enable_gqa=True)
    o = o.transpose(1, 2)  # [S, Q, H, D]
    out = torch.zeros_like(q_NHD)
    return out.index_put((plan.tok_SQ[plan.valid_SQ],), o[plan.valid_SQ])
