"""Causal attention over a paged KV store: fixed-block exact kernel and SDPA.

Every forward — a trainer batch (padded or packed), a full or chunked prefill,
a decode step — is described the same way: a flat list of N query tokens, each
with the sequence it belongs to and its absolute position, and a block table
mapping each sequence's key blocks to pages of the KV store. Keys and values of
the new tokens are written into the pages first; attention then reads pages.

Exact kernel (DESIGN.md §1 rule 2). Query rows are (token, head) pairs grouped
by (sequence, kv head) and cut into tiles of `QUERY_TILE` rows. Key blocks are
whole pages of `block_size` keys at absolute positions [jB, (j+1)B). For a
tile and every block j it can see, in fp32:

    s_j = q·k_jᵀ   (bmm of the fixed shape T×D×B, masked to -inf where key_pos > q_pos)
    m   = max over all visible scores (a max is exact in any order)
    p_j = exp(s_j - m);  l_j = Σ_b p_j;  pv_j = p_j·v_j   (bmm of the fixed shape T×B×D)
    l = l_0 + l_1 + …,  acc = pv_0 + pv_1 + …   (ascending j; a block the row
                                                  cannot see is skipped by `where`)
    o = acc / l

Every product has the same shape whatever the batch, and the only reductions
whose order could vary (over blocks) run in a fixed ascending order where an
unseen block is a bitwise no-op. So a row's result depends only on the keys it
may see, never on how many other rows, tokens or sequences share the call:
decode against a cache, chunked prefill and a whole-sequence trainer forward
give the same bits. Tiles are grouped by how many blocks they see and each
group computes only those (causal savings; the grouping changes work, never bits).

Legend: N tokens, H query heads, Hk kv heads, D head dim, S sequences,
J blocks per sequence, P pages, B keys per block, t tiles, T rows per tile.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

QUERY_TILE = 16  # query rows per tile; part of the exactness contract
MASK_CACHE_ELEMENTS = 1 << 24  # mask elements a plan keeps for its later layers (memory only, not bits)


@dataclass
class TokenLayout:
    """Where each token of a forward sits; shared by every layer."""

    seq_N: torch.Tensor  # int64, row of `block_table_SJ` the token belongs to
    pos_N: torch.Tensor  # int64, absolute position of the token in its sequence
    block_table_SJ: torch.Tensor  # int64, page id of key block j of sequence s (-1 unused)
    _kv_rows: dict = field(default_factory=dict, repr=False, compare=False)  # (Hk, B) -> kv_rows

    def kv_rows(self, num_kv_heads: int, block_size: int) -> torch.Tensor:
        """[N * Hk] row of each new (token, kv head) in a page store [P, Hk, B, D] viewed as [P*Hk*B, D].

        Computed once per forward and shared by every layer.
        """
        key = (num_kv_heads, block_size)
        if key not in self._kv_rows:
            page_N = self.block_table_SJ[self.seq_N, self.pos_N // block_size]
            if not bool((page_N >= 0).all()):
                raise ValueError("a token has no page in the block table")
            head_NH = torch.arange(num_kv_heads)[None, :]
            rows_NH = (page_N[:, None] * num_kv_heads + head_NH) * block_size + (self.pos_N % block_size)[:, None]
            self._kv_rows[key] = rows_NH.reshape(-1)
        return self._kv_rows[key]


@dataclass
class ExactPlan:
    """Query tiles of the exact kernel, computed once per forward and shared by every layer.

    Tiles are stored in the order they are computed: grouped by how many key
    blocks they see, so `chunks` are contiguous runs of them.
    """

    rows_x: torch.Tensor  # flat (token * H + head) row of q read by each tile row (x = t*T rows)
    pos_tT: torch.Tensor  # position of each row, -1 for padding rows
    real_tT1: torch.Tensor  # pos_tT >= 0, [t, T, 1]: zeroes the padding rows of q
    seq_t: torch.Tensor  # sequence of each tile
    kvh_t: torch.Tensor  # kv head of each tile
    chunks: list[tuple[int, int, int, int, int]]  # (first tile, end tile, blocks seen, blocks every real
    #                                                 row sees, real rows in its fullest tile)
    out_rows: torch.Tensor  # for each flat (token * H + head), its row in the chunks' outputs
    block_table_SJ: torch.Tensor
    layout: TokenLayout  # for the backward (`_ExactAttention`)
    block_size: int
    _fast: FastPlan | None = None  # built on the first backward, shared by every layer
    _inputs: dict = field(default_factory=dict)  # (chunk, Hk) -> `chunk_inputs`, shared by every layer
    _kept: int = 0  # mask elements in _inputs

    def fast(self) -> FastPlan:
        if self._fast is None:
            self._fast = plan_fast(self.layout, self.block_size)
        return self._fast

    def chunk_inputs(self, i: int, num_kv_heads: int) -> ChunkInputs:
        """Chunk i's `ChunkInputs`, kept for the next layers while the plan's masks stay under MASK_CACHE_ELEMENTS
        (a decode step's are tiny; a long trainer batch's would be gigabytes, kept through the backward)."""
        if (i, num_kv_heads) in self._inputs:
            return self._inputs[i, num_kv_heads]
        a, b, J, full, r = self.chunks[i]
        B = self.block_size
        pages_cJ = self.block_table_SJ[self.seq_t[a:b], :J].clamp(min=0)  # -1 (no page) only where masked
        pos_cr = self.pos_tT[a:b, :r]
        inputs = ChunkInputs(
            slabs_x=(pages_cJ * num_kv_heads + self.kvh_t[a:b, None]).reshape(-1),
            hidden_cJrB=torch.arange(J * B).view(1, J, 1, B) > pos_cr[:, None, :, None],
            seen_cJr=(torch.arange(J) * B)[None, :, None] <= pos_cr[:, None, :] if full < J else None)
        if self._kept + inputs.hidden_cJrB.numel() <= MASK_CACHE_ELEMENTS:
            self._inputs[i, num_kv_heads] = inputs
            self._kept += inputs.hidden_cJrB.numel()
        return inputs


@dataclass
class ChunkInputs:
    """What `_attend_chunk` needs of the layout for one chunk: the same for every layer, so computed once."""

    slabs_x: torch.Tensor  # row of the page store viewed as [P*Hk, B, D] for each (tile, block) x = c*J
    hidden_cJrB: torch.Tensor  # key position > query position: masked (the r real rows of each tile)
    seen_cJr: torch.Tensor | None  # block j is seen iff its first key is; None when every row sees every block


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
    order_t, runs = _chunks(pos_tT.amax(1).clamp(min=0) // block_size + 1, block_size)
    # blocks that every real row of a run sees need no where-guard (padding rows are discarded)
    minpos_t = torch.where(valid_tT, pos_tT, 1 << 62).amin(1)[order_t].tolist()
    # real rows are a prefix of every tile; a run's softmax works on its longest prefix only
    real_t = valid_tT.sum(1)[order_t].tolist()
    chunks = [(a, b, J, min(J, min(minpos_t[a:b]) // block_size + 1), max(real_t[a:b])) for a, b, J in runs]
    rows_tT = (tok_tT * num_heads + head_tT)[order_t]
    # the tiles' outputs hold only the first r rows of each tile of a chunk (`_attend_chunk`), chunk after chunk
    r_t = torch.repeat_interleave(torch.tensor([r for *_, r in chunks]), torch.tensor([b - a for a, b, *_ in chunks]))
    start_t = torch.cumsum(r_t, 0) - r_t
    out_tT = start_t[:, None] + torch.arange(QUERY_TILE)[None, :]
    valid_x = valid_tT[order_t].reshape(-1)
    out_rows = torch.empty(len(seq_N) * num_heads, dtype=torch.int64)
    out_rows[rows_tT.reshape(-1)[valid_x]] = out_tT.reshape(-1)[valid_x]
    pos_tT = pos_tT[order_t]
    return ExactPlan(rows_tT.reshape(-1), pos_tT, (pos_tT >= 0)[..., None], s_t[order_t], h_t[order_t], chunks,
                     out_rows, layout.block_table_SJ, layout, block_size)


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
    _, Hk, B, D = k_pages.shape
    rows_x = layout.kv_rows(Hk, B)
    k_xD, v_xD = k_NHD.reshape(-1, D), v_NHD.reshape(-1, D)
    if k_NHD.requires_grad or v_NHD.requires_grad:
        return (k_pages.reshape(-1, D).index_copy(0, rows_x, k_xD).view(k_pages.shape),
                v_pages.reshape(-1, D).index_copy(0, rows_x, v_xD).view(v_pages.shape))
    k_pages.view(-1, D).index_copy_(0, rows_x, k_xD)  # the engine's store: contiguous, written in place
    v_pages.view(-1, D).index_copy_(0, rows_x, v_xD)
    return k_pages, v_pages


CHUNK_ELEMENTS = 1 << 22  # score elements (tiles x blocks x T x B) computed at once; memory only, not bits


def _chunks(need_t: torch.Tensor, block_size: int) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """Orders the tiles by how many key blocks they see; runs of them under CHUNK_ELEMENTS.

    Each run computes exactly the blocks its tiles can see, so a causal prefill does
    not pay for the masked upper triangle. Computing fewer or more blocks for a tile
    cannot change its bits (unseen blocks are where-guarded no-ops): the grouping
    changes work and memory only.
    """
    order = torch.argsort(need_t, stable=True)
    values, counts = torch.unique_consecutive(need_t[order], return_counts=True)
    runs, start = [], 0
    for J, n in zip(values.tolist(), counts.tolist()):
        step = max(1, CHUNK_ELEMENTS // (J * QUERY_TILE * block_size))
        runs += [(a, min(a + step, start + n), J) for a in range(start, start + n, step)]
        start += n
    return order, runs


def _attend_chunk(q_cTD, inputs: ChunkInputs, k_pages, v_pages, full: int, r: int) -> torch.Tensor:
    """Softmax attention of tiles over key blocks 0..J-1 (see the module docstring), in fp32: [c, r, D].

    Every real row sees blocks 0..full-1: those are summed without the where-guard.
    Real rows are the first `r` of every tile (a decode step: its token's query
    heads of one kv head, e.g. 3 of 16), and only they are returned. The two
    products keep the fixed T-row shape; everything between them is row-wise
    and runs on the r real rows only (so a row is reduced exactly as in a full tile).
    """
    c, T, D = q_cTD.shape
    J, B = inputs.hidden_cJrB.shape[1], k_pages.shape[2]
    # one contiguous B×D slab per (tile, block): index_select is a plain row copy, far cheaper
    # than two-tensor advanced indexing (a copy, so no bits are involved)
    k_xBD = k_pages.flatten(0, 1).index_select(0, inputs.slabs_x).float()
    v_xBD = v_pages.flatten(0, 1).index_select(0, inputs.slabs_x).float()
    # every (tile, block) product has the fixed shape (T x D)(D x B): the same GEMM whatever c, J
    q_xTD = q_cTD[:, None].expand(c, J, T, D).reshape(c * J, T, D)
    s_cJTB = torch.bmm(q_xTD, k_xBD.transpose(1, 2)).view(c, J, T, B)
    s_cJrB = s_cJTB[:, :, :r].masked_fill(inputs.hidden_cJrB, float("-inf")).contiguous()
    # the max only shifts the exponent (it is exact in any order); detaching it keeps the gradient exact
    m_cr = s_cJrB.detach().amax(dim=(1, 3))
    m_cr = torch.where(m_cr == float("-inf"), 0.0, m_cr)
    p_cJrB = torch.exp(s_cJrB - m_cr[:, None, :, None])
    l_cJr = p_cJrB.sum(-1)
    if r < T:  # back to the fixed T-row shape for the second product; padding rows are zero
        p_cJTB = p_cJrB.new_zeros(c, J, T, B)
        p_cJTB[:, :, :r] = p_cJrB
    else:
        p_cJTB = p_cJrB
    pv_cJrD = torch.bmm(p_cJTB.view(c * J, T, B), v_xBD).view(c, J, T, D)[:, :, :r]
    l_cr, acc_crD = l_cJr[:, 0], pv_cJrD[:, 0]
    seen_cJr = inputs.seen_cJr
    for j in range(1, J):  # ascending block order; an unseen block is skipped bitwise (where)
        if j < full:
            l_cr, acc_crD = l_cr + l_cJr[:, j], acc_crD + pv_cJrD[:, j]
        else:
            l_cr = torch.where(seen_cJr[:, j], l_cr + l_cJr[:, j], l_cr)
            acc_crD = torch.where(seen_cJr[:, j, :, None], acc_crD + pv_cJrD[:, j], acc_crD)
    return acc_crD / torch.where(l_cr > 0, l_cr, 1.0)[..., None]


def exact_attention(q_NHD: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: ExactPlan,
                    scale: float) -> torch.Tensor:
    if torch.is_grad_enabled() and (q_NHD.requires_grad or k_pages.requires_grad or v_pages.requires_grad):
        return _ExactAttention.apply(q_NHD, k_pages, v_pages, plan, scale)
    return _exact_attention(q_NHD, k_pages, v_pages, plan, scale)


def _exact_attention(q_NHD, k_pages, v_pages, plan: ExactPlan, scale: float) -> torch.Tensor:
    N, H, D = q_NHD.shape
    # padding rows read row 0 and are zeroed; gathers and scatters are copies, no bits involved
    q_tTD = q_NHD.reshape(N * H, D).index_select(0, plan.rows_x).view(-1, QUERY_TILE, D).float() * scale
    q_tTD = q_tTD * plan.real_tT1
    outs = []
    for i, (a, b, J, full, r) in enumerate(plan.chunks):
        inputs = plan.chunk_inputs(i, k_pages.shape[1])
        outs.append(_attend_chunk(q_tTD[a:b], inputs, k_pages, v_pages, full, r).view(-1, D))
    o_xD = torch.cat(outs) if len(outs) > 1 else outs[0]
    return o_xD.index_select(0, plan.out_rows).view(N, H, D).to(q_NHD.dtype)


class _ExactAttention(torch.autograd.Function):
    """Exact forward values; the backward is SDPA's (the same function, differentiated by its kernel).

    Only forward values must be batch-invariant (DESIGN.md §1), as for the
    linear layers' plain-matmul backward. Differentiating the tiled kernel with
    autograd kept every gathered K/V slab, score and probability tile for the
    backward (~350 MB per layer for 64 x 160 tokens at the 20M shape) and paid
    scatter-adds for the gathers; here nothing but the inputs is kept and the
    backward recomputes attention with SDPA under autograd, in fp32.
    """

    @staticmethod
    def forward(ctx, q_NHD, k_pages, v_pages, plan, scale):  # type: ignore[override]
        ctx.save_for_backward(q_NHD, k_pages, v_pages)
        ctx.plan, ctx.scale = plan, scale
        return _exact_attention(q_NHD, k_pages, v_pages, plan, scale)

    @staticmethod
    def backward(ctx, g_NHD):  # type: ignore[override]
        q_NHD, k_pages, v_pages = ctx.saved_tensors
        raw = (q_NHD, k_pages, v_pages)
        with torch.enable_grad():  # in fp32 whatever the model dtype, as the forward computes
            ins = [t.detach().float().requires_grad_(need) for t, need in zip(raw, ctx.needs_input_grad)]
            o = fast_attention(*ins, ctx.plan.fast(), ctx.scale)
            got = iter(torch.autograd.grad(o, [t for t in ins if t.requires_grad], g_NHD.float()))
        return tuple(next(got).to(r.dtype) if t.requires_grad else None for t, r in zip(ins, raw)) + (None, None)


def fast_attention(q_NHD: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: FastPlan,
                   scale: float) -> torch.Tensor:
    B = k_pages.shape[2]
    J = plan.num_blocks
    pages_SJ = plan.block_table_SJ[:, :J].clamp(min=0)
    S = pages_SJ.shape[0]

    def gather(pages):  # [S*J, Hk, B, D] -> [S, Hk, J*B, D]; index_select: a plain row copy (as in exact)
        x = pages.index_select(0, pages_SJ.reshape(-1))
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
