"""Causal attention over a paged KV store: the exact kernel computes each query row alone, in one order fixed
by the row's own position, so a row's bits never depend on the batch; `fast` is SDPA.

Every forward — a trainer batch (padded or packed), a full or chunked prefill,
a decode step — is described the same way: a flat list of N query tokens, each
with the sequence it belongs to and its absolute position, and a block table
mapping each sequence's key blocks to pages of the KV store. Keys and values of
the new tokens are written into the pages first; attention then reads pages.

Exact kernel (docs/design.md §4.2), in C (`native/exact.c`). Each query
row (token, head) is computed on its own, start to end, by one thread, over
the keys 0..pos of its sequence, in fp32:

    s_t = (scale·q)·k_t   (head dim summed in 8 fixed lanes, then a fixed tree)
    m   = max_t s_t       (a max is exact in any order)
    o   = Σ_t exp(s_t − m)·v_t / Σ_t exp(s_t − m)   (t ascending, running sums)

Nothing in that order depends on the other rows of the call, on page
placement, on the chunking of a prompt or on the thread count, so decode
against a cache, chunked prefill and a trainer's whole-sequence forward give
the same bits. Masked keys are simply never visited (they contribute exact
nothing). A sliding window of W keys (Mistral, Qwen's sliding layers) starts
a row's keys at max(0, pos - W + 1), transformers' (pos - W, pos]: a function
of the row's own position, so the order stays fixed past the window too.
A soft cap c > 0 (Gemma 2) replaces each score by c·tanh(s_t / c) before the
max (elementwise: the order stays the row's own); `fast` then computes the
scores with plain products, as SDPA has no cap.
The loop is one C function per backend (exactrl/kernels/native): the same
rule expressed in torch ops needs many tiny products per decode step, whose
dispatch costs more than the arithmetic (docs/performance.md has the figures).

Legend: N tokens, H query heads, Hk kv heads, D head dim, S sequences,
J blocks per sequence, P pages, B keys per block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from exactrl.kernels import native


@dataclass
class TokenLayout:
    """Where each token of a forward sits; shared by every layer."""

    seq_N: torch.Tensor  # int64, row of `block_table_SJ` the token belongs to
    pos_N: torch.Tensor  # int64, absolute position of the token in its sequence
    block_table_SJ: torch.Tensor  # int64, page id of key block j of sequence s (-1 unused)
    _kv_rows: dict = field(default_factory=dict, repr=False, compare=False)  # (Hk, B) -> (kv_rows, max)

    def kv_rows(self, num_kv_heads: int, block_size: int) -> torch.Tensor:
        """[N * Hk] row of each new (token, kv head) in a page store [P, Hk, B, D] viewed as [P*Hk*B, D].

        Computed once per forward and shared by every layer.
        """
        return self._rows(num_kv_heads, block_size)[0]

    def _rows(self, num_kv_heads: int, block_size: int) -> tuple[torch.Tensor, int]:
        """(`kv_rows`, their largest, -1 if none)."""
        key = (num_kv_heads, block_size)
        if key not in self._kv_rows:
            page_N = self.block_table_SJ[self.seq_N, self.pos_N // block_size]
            if not bool((page_N >= 0).all()):
                raise ValueError("a token has no page in the block table")
            head_NH = torch.arange(num_kv_heads)[None, :]
            rows_NH = (page_N[:, None] * num_kv_heads + head_NH) * block_size + (self.pos_N % block_size)[:, None]
            rows = rows_NH.reshape(-1)
            self._kv_rows[key] = (rows, int(rows.max()) if rows.numel() else -1)
        return self._kv_rows[key]


@dataclass
class ExactPlan:
    """What the exact kernel needs of a layout, checked once per forward and shared by every layer."""

    layout: TokenLayout
    block_size: int
    max_page: int  # highest page any query row reads: must exist in the store


@dataclass
class FastPlan:
    """Per-sequence padded query matrix for SDPA."""

    tok_SQ: torch.Tensor  # token index, 0 where padded
    pos_SQ: torch.Tensor  # position, 0 where padded (a fully masked row would give NaN)
    block_table_SJ: torch.Tensor
    num_blocks: int
    valid_x: torch.Tensor  # flat indices of the valid (s, q) slots, in order


def plan_exact(layout: TokenLayout, block_size: int) -> ExactPlan:
    """Checks that every key a query row reads has a page (the kernel reads pages unchecked): one C pass,
    rather than a dozen torch ops whose dispatch would cost a decode step more than the check."""
    if len(layout.seq_N) == 0:
        return ExactPlan(layout, block_size, -1)
    _, max_page = native.check_layout(layout.seq_N, layout.pos_N, layout.block_table_SJ, block_size)
    return ExactPlan(layout, block_size, max_page)


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
    return FastPlan(
        tok_SQ,
        pos_SQ,
        layout.block_table_SJ,
        int(pos_N.max()) // block_size + 1,
        valid_SQ.reshape(-1).nonzero().squeeze(1),
    )


def write_kv(
    k_pages: torch.Tensor, v_pages: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, layout: TokenLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stores new keys/values at their pages and slots; pages are [P, Hk, B, D].

    Returns the stores to use from here on: in place for the engine's cache,
    out of place (differentiable) when the values require grad (trainer).
    """
    _, Hk, B, D = k_pages.shape
    rows_x, max_row = layout._rows(Hk, B)
    k_xD, v_xD = k_NHD.reshape(-1, D), v_NHD.reshape(-1, D)
    if k_NHD.requires_grad or v_NHD.requires_grad:
        return (
            k_pages.reshape(-1, D).index_copy(0, rows_x, k_xD).view(k_pages.shape),
            v_pages.reshape(-1, D).index_copy(0, rows_x, v_xD).view(v_pages.shape),
        )
    native.write_rows(k_pages.view(-1, D), rows_x, k_xD, max_row)  # the engine's store: contiguous, in place
    native.write_rows(v_pages.view(-1, D), rows_x, v_xD, max_row)
    return k_pages, v_pages


def exact_attention(
    q_NHD: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    plan: ExactPlan,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """`window` > 0: each query row attends to its last `window` keys (itself included), else to all;
    `softcap` > 0: scores capped to softcap·tanh(s / softcap)."""
    if torch.is_grad_enabled() and (q_NHD.requires_grad or k_pages.requires_grad or v_pages.requires_grad):
        return _ExactAttention.apply(q_NHD, k_pages, v_pages, plan, scale, window, softcap)
    return _exact_attention(q_NHD, k_pages, v_pages, plan, scale, window=window, softcap=softcap)


def _exact_attention(
    q_NHD, k_pages, v_pages, plan: ExactPlan, scale: float, with_lse: bool = False, window: int = 0, softcap=0.0
):
    """Output in q's dtype; with `with_lse`, (fp32 output, fp32 log-sum-exp [N, H]) for the backward."""
    if plan.max_page >= k_pages.shape[0]:
        raise ValueError(f"token layout: page {plan.max_page} is beyond the KV store's {k_pages.shape[0]} pages")
    lay = plan.layout
    # values only (`_ExactAttention` supplies the gradient): the C kernel fills a new tensor autograd never sees
    table = lay.block_table_SJ
    out = native.attention(q_NHD, k_pages, v_pages, lay.seq_N, lay.pos_N, table, scale, with_lse, window, softcap)
    return out if with_lse else out.to(q_NHD.dtype)


class _ExactAttention(torch.autograd.Function):
    """Exact forward values; the backward is exact.c's flash-attention backward, fed this forward's own
    output O and per-row log-sum-exp L of the scaled scores (P = exp(S - L)), so attention is not run again.

    Only forward values must be batch-invariant (docs/design.md §10), as for the
    linear layers' plain-matmul backward; the backward's values are
    deterministic (one thread per sequence and kv head, rows in call order).
    Each sequence's key and value gradients come back per key position and go
    to their pages with index_add (pages that sequences share: summed, in
    one order). It is used rather than SDPA's CPU flash backward (a private
    aten op, which would need per-sequence query slots and a mask): on the
    trainer's shapes it is at least as fast, and faster on some CPUs
    (docs/performance.md).
    """

    @staticmethod
    def forward(ctx, q_NHD, k_pages, v_pages, plan, scale, window, softcap):  # type: ignore[override]
        o, lse = _exact_attention(q_NHD, k_pages, v_pages, plan, scale, with_lse=True, window=window, softcap=softcap)
        ctx.save_for_backward(q_NHD, k_pages, v_pages, o, lse)
        ctx.plan, ctx.scale, ctx.window, ctx.softcap = plan, scale, window, softcap
        return o.to(q_NHD.dtype)

    @staticmethod
    def backward(ctx, g_NHD):  # type: ignore[override]
        q_NHD, k_pages, v_pages, o_NHD, lse_NH = ctx.saved_tensors
        lay = ctx.plan.layout
        P, Hk, B, D = k_pages.shape
        J = int(lay.pos_N.max()) // B + 1 if len(lay.pos_N) else 0  # the blocks any row reads
        table_SJ = lay.block_table_SJ[:, :J].contiguous()
        S = table_SJ.shape[0]
        gq, gk_S, gv_S = native.attention_backward(
            q_NHD.detach().float(),
            k_pages.detach().float(),
            v_pages.detach().float(),
            o_NHD,
            lse_NH,
            g_NHD.float(),
            lay.seq_N,
            lay.pos_N,
            table_SJ,
            ctx.scale,
            ctx.window,
            ctx.softcap,
        )
        pages_x = table_SJ.clamp(min=0).reshape(-1)  # an unused block (-1): its keys' gradients are zero

        def to_pages(gp):  # [S, Hk, J*B, D] -> [P, Hk, B, D], summed where sequences share a page
            x = gp.view(S, Hk, J, B, D).permute(0, 2, 1, 3, 4).reshape(S * J, Hk, B, D)
            return torch.zeros(P, Hk, B, D).index_add_(0, pages_x, x)

        need = ctx.needs_input_grad
        return (
            gq.to(q_NHD.dtype) if need[0] else None,
            to_pages(gk_S).to(k_pages.dtype) if need[1] else None,
            to_pages(gv_S).to(v_pages.dtype) if need[2] else None,
            None,
            None,
            None,
            None,
        )


def fast_attention(
    q_NHD: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    plan: FastPlan,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    B = k_pages.shape[2]
    J = plan.num_blocks
    pages_SJ = plan.block_table_SJ[:, :J].clamp(min=0)
    S = pages_SJ.shape[0]

    def gather(pages):  # [S*J, Hk, B, D] -> [S, Hk, J*B, D]; index_select: a plain row copy (as in exact)
        x = pages.index_select(0, pages_SJ.reshape(-1))
        Hk, D = x.shape[1], x.shape[3]
        return x.view(S, J, Hk, B, D).permute(0, 2, 1, 3, 4).reshape(S, Hk, J * B, D)

    k, v = gather(k_pages), gather(v_pages)
    Q, (_, H, D) = plan.tok_SQ.shape[1], q_NHD.shape
    # row copies by index_select / index_copy: their backwards are index_add / index_select, where
    # advanced indexing's is an accumulating index_put, far slower at a training step's sizes
    q = q_NHD.index_select(0, plan.tok_SQ.reshape(-1)).view(S, Q, H, D).transpose(1, 2)  # [S, H, Q, D]
    key_K = torch.arange(J * B, device=q_NHD.device)[None, None, :]
    mask = key_K <= plan.pos_SQ[:, :, None]
    if window > 0:  # transformers' sliding window: keys in (pos - window, pos]
        mask &= key_K > plan.pos_SQ[:, :, None] - window
    if softcap > 0:  # SDPA has no cap: transformers' eager attention, scores capped then masked
        G = H // k.shape[1]
        k, v = k.to(q.dtype).repeat_interleave(G, 1), v.to(q.dtype).repeat_interleave(G, 1)
        s = torch.tanh(q @ k.transpose(-1, -2) * scale / softcap) * softcap
        s = s.masked_fill(~mask[:, None], float("-inf"))
        o = torch.softmax(s.float(), dim=-1).to(q.dtype) @ v
    else:
        o = F.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask[:, None], scale=scale, enable_gqa=True
        )
    o_xHD = o.transpose(1, 2).reshape(S * Q, H, D)  # [S * Q, H, D]
    return torch.zeros_like(q_NHD).index_copy(
        0, plan.tok_SQ.reshape(-1)[plan.valid_x], o_xHD.index_select(0, plan.valid_x)
    )
