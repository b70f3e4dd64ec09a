"""The trainer path: per-token logprobs of whole sequences in one batched forward.

`sequence_logprobs` lays the sequences out `packed` (all tokens in one flat
list, each with its own positions) or `padded` (every sequence extended with
pad tokens to the longest one, as a [B, T] trainer batch would be); both go
through the same model forward with a scratch KV store, so autograd works and
the bits equal the engine's (docs/design.md §1).

Legend: B sequences, T tokens, N flat tokens, V vocabulary.
"""

from __future__ import annotations

import torch

from exactrl.kernels import TokenLayout
from exactrl.kernels.linear import PackedWeights, using_packed
from exactrl.kernels.rowwise import check_temperature
from exactrl.model.transformer import CausalLM


def pack_layout(lengths: list[int], block_size: int) -> tuple[TokenLayout, int]:
    """Layout of whole sequences laid end to end, and the number of scratch pages."""
    blocks = [-(-n // block_size) for n in lengths]
    J = max(blocks)
    table = torch.full((len(lengths), J), -1, dtype=torch.int64)
    nxt = 0
    for s, nb in enumerate(blocks):
        table[s, :nb] = torch.arange(nxt, nxt + nb)
        nxt += nb
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])
    return TokenLayout(seq, pos, table), nxt


def pack_shared(
    token_ids: list[list[int]], first: list[int], block_size: int
) -> tuple[TokenLayout, int, torch.Tensor, list[torch.Tensor]]:
    """`pack_layout` where sequences with the same prompt (`token_ids[k][:first[k]]`) lay its whole pages out once.

    GRPO's G samples of a prompt repeat the prompt G times; the keys and values of a
    prompt position depend on the prompt alone, so one copy serves them all. The
    first sequence of each prompt (its owner) is laid out whole; the others start
    after the prompt's full pages (`first // block_size` pages) and their block
    tables point at the owner's pages there, as the engine's forked samples share
    their prefill. Every query row still reads the same keys in the same order, so
    no logprob bit changes (tested); the body's forward and backward skip the
    repeated rows (G = 8, prompt 32 of 160 tokens: 17.5% fewer rows), and the
    gradients of a shared position arrive summed from the samples that read it
    (the same gradient up to rounding). Prefix Grouper (Liu et al. 2025,
    arXiv:2506.05433; verl's `use_prefix_grouper`) removes the same redundancy by
    splitting attention into prefix and suffix parts; here the paged layout does it.
    Returns (layout, pages, flat tokens, row_of) with row_of[k][p] the flat row of
    sequence k's position p.
    """
    owners: dict[tuple, int] = {}
    tables, seq, pos, tokens, row_of = [], [], [], [], []
    pages = rows = 0
    for k, (s, f) in enumerate(zip(token_ids, first)):
        shared_pages = f // block_size
        owner = owners.get(tuple(s[:f])) if shared_pages else None
        own_from = shared_pages * block_size if owner is not None else 0  # first position laid out here
        if shared_pages and owner is None:
            owners[tuple(s[:f])] = k
        own_pages = -(-len(s) // block_size) - (shared_pages if owner is not None else 0)
        tables.append(
            (tables[owner][:shared_pages] if owner is not None else []) + list(range(pages, pages + own_pages))
        )
        pages += own_pages
        n = len(s) - own_from
        mine = torch.arange(rows, rows + n)
        row_of.append(torch.cat([row_of[owner][:own_from], mine]) if owner is not None else mine)
        seq.append(torch.full((n,), k, dtype=torch.int64)), pos.append(torch.arange(own_from, len(s)))
        tokens.extend(s[own_from:])
        rows += n
    table = torch.full((len(token_ids), max(len(t) for t in tables)), -1, dtype=torch.int64)
    for k, t in enumerate(tables):
        table[k, : len(t)] = torch.tensor(t, dtype=torch.int64)
    layout = TokenLayout(torch.cat(seq), torch.cat(pos), table)
    return layout, pages, torch.tensor(tokens, dtype=torch.int64), row_of


def validate_token_ids(token_ids, vocab_size: int) -> list[list[int]]:
    """The sequences as lists of ints (a 2-D tensor or lists of tensors are accepted); ValueError otherwise."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 2:
            raise ValueError(
                f"token_ids as a tensor must be 2-D [sequences, tokens], got shape {tuple(token_ids.shape)}"
            )
        token_ids = token_ids.tolist()
    if not isinstance(token_ids, (list, tuple)):
        raise ValueError(f"token_ids must be a list of sequences (lists of token ids), got {type(token_ids).__name__}")
    if not token_ids:
        raise ValueError("token_ids is empty: pass at least one sequence")
    out = []
    for k, seq in enumerate(token_ids):
        if isinstance(seq, torch.Tensor):
            seq = seq.tolist()
        if not isinstance(seq, (list, tuple)):
            raise ValueError(f"token_ids[{k}] is {seq!r}, not a list of token ids (for one sequence pass [[...]])")
        if len(seq) == 0:
            raise ValueError(f"token_ids[{k}] is empty")
        not_int = [t for t in seq if isinstance(t, bool) or not isinstance(t, int)]
        if not_int:
            raise ValueError(f"token_ids[{k}] holds {not_int[0]!r}, not an int token id")
        bad = [t for t in seq if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token_ids[{k}] holds id {bad[0]} outside the vocabulary [0, {vocab_size})")
        out.append(list(seq))
    return out


def forward_hidden(
    model: CausalLM, token_ids: list[list[int]], layout: str = "packed", pad_id: int = 0
) -> tuple[torch.Tensor, list[int]]:
    """Final hidden states [N, D] of the flat batch and the offset of each sequence in it."""
    return _hidden(model, validate_token_ids(token_ids, model.config.vocab_size), layout, pad_id)


def _hidden(
    model: CausalLM, token_ids: list[list[int]], layout: str, pad_id: int = 0
) -> tuple[torch.Tensor, list[int]]:
    """`forward_hidden` of ids already validated (the trainer path checks them once, up front)."""
    if layout not in ("packed", "padded"):
        raise ValueError(f"layout must be 'packed' or 'padded', got {layout!r}")
    if layout == "padded":
        T = max(len(s) for s in token_ids)
        seqs = [list(s) + [pad_id] * (T - len(s)) for s in token_ids]
    else:
        seqs = token_ids
    lay, pages = pack_layout([len(s) for s in seqs], model.block_size)
    tokens = torch.tensor([t for s in seqs for t in s], dtype=torch.int64)
    hidden = model(tokens, lay, model.new_kv(pages))
    starts = [0]
    for s in seqs[:-1]:
        starts.append(starts[-1] + len(s))
    return hidden, starts


def forward_logits(
    model: CausalLM, token_ids: list[list[int]], layout: str = "packed", pad_id: int = 0
) -> list[torch.Tensor]:
    """fp32 logits [len_k, V] of every sequence (the trainer's forward)."""
    hidden, starts = forward_hidden(model, token_ids, layout, pad_id)
    logits = model.logits(hidden)
    return [logits[s : s + len(ids)] for s, ids in zip(starts, token_ids)]


def token_logprobs(
    model: CausalLM,
    token_ids: list[list[int]],
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    layout: str = "packed",
    with_entropy: bool = False,
    first: list[int] | None = None,
    entropy_grad: bool = True,
    share_prompts: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Per-token logprobs (and optionally the entropy of each sampling distribution).

    lps[k][j] = log p(token_ids[k][f_k + j] | token_ids[k][:f_k + j]) with f_k = first[k]
    (default 1: every token but the first). A trainer passes the prompt lengths as
    `first` so that only completion tokens are projected onto the vocabulary: the
    LM head and log-softmax over V dominate a small model's step, and the rows are
    selected from the hidden states BEFORE the projection (one gather, whose
    backward is one scatter, instead of a zero-filled [N, V] gradient per slice).
    Row selection cannot change bits: every op after it is row-wise.
    entropies[k][j] = H(p(· | token_ids[k][:f_k + j])) under the same truncated,
    tempered distribution, for the trainer's entropy bonus and metrics. With
    `entropy_grad=False` (no entropy bonus: a metric only) it is computed outside
    autograd, which spares the step three [N, V] tensors kept for the backward.
    `share_prompts` (packed layout only) lays each prompt `token_ids[k][:first[k]]`
    that several sequences start with out once (`pack_shared`): the same bits, fewer rows.
    """
    check_temperature(temperature)
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k == 0 or top_k < -1:
        raise ValueError(f"top_k must be -1 (off) or >= 1, got {top_k}")
    token_ids = validate_token_ids(token_ids, model.config.vocab_size)
    first = [1] * len(token_ids) if first is None else list(first)
    if len(first) != len(token_ids):
        raise ValueError(f"first has {len(first)} entries for {len(token_ids)} sequences")
    for k, (f, s) in enumerate(zip(first, token_ids)):
        if not 1 <= f <= len(s):
            raise ValueError(f"first[{k}]={f} must be in [1, len(token_ids[{k}])={len(s)}]")
    sizes = [len(s) - f for s, f in zip(token_ids, first)]
    if sum(sizes) == 0:
        empty = [torch.zeros(0) for _ in token_ids]
        return empty, (empty if with_entropy else None)
    if share_prompts and layout == "packed":
        lay, pages, tokens, row_of = pack_shared(token_ids, first, model.block_size)
        hidden = model(tokens, lay, model.new_kv(pages))
        rows_N = torch.cat([r[f - 1 : len(s) - 1] for r, f, s in zip(row_of, first, token_ids)])
    else:
        hidden, starts = _hidden(model, token_ids, layout)
        rows_N = torch.cat([torch.arange(st + f - 1, st + len(s) - 1) for st, f, s in zip(starts, first, token_ids)])
    targets = torch.tensor([t for s, f in zip(token_ids, first) for t in s[f:]], dtype=torch.int64)
    dist = (float(temperature), int(top_k), float(top_p))
    lp_N, ent_N = _head_logprobs(
        model,
        hidden[rows_N.to(hidden.device)],
        model.head_weight,
        targets.to(hidden.device),
        dist,
        with_entropy,
        with_entropy and entropy_grad and torch.is_grad_enabled(),
    )
    # per-token values come back to the host, where the losses are computed (a differentiable copy)
    lp_N, ent_N = lp_N.cpu(), (ent_N.cpu() if ent_N is not None else None)
    ent = list(torch.split(ent_N, sizes)) if with_entropy else None
    return list(torch.split(lp_N, sizes)), ent


def completion_log_probs(
    model: CausalLM, token_ids: list[list[int]], first: list[int], temperature: float = 1.0
) -> list[torch.Tensor]:
    """log p(· | token_ids[k][:f_k + j]) over the whole vocabulary, [len_k − f_k, V] fp32 per sequence, at the
    positions `token_logprobs(..., first=first)` scores (autograd flows to the model). For losses over the
    vocabulary (distillation's forward KL and JSD); holds an [N, V] tensor, so a step calls it per micro-batch."""
    check_temperature(temperature)
    token_ids = validate_token_ids(token_ids, model.config.vocab_size)
    if len(first) != len(token_ids) or any(not 1 <= f <= len(s) for f, s in zip(first, token_ids)):
        raise ValueError(f"first must give each of the {len(token_ids)} sequences a start in [1, its length]")
    hidden, starts = _hidden(model, token_ids, "packed")
    rows_N = torch.cat([torch.arange(st + f - 1, st + len(s) - 1) for st, f, s in zip(starts, first, token_ids)])
    logits_NV = model.logits(hidden[rows_N.to(hidden.device)]) / temperature
    lp_NV = torch.log_softmax(logits_NV, dim=-1).cpu()
    return list(torch.split(lp_NV, [len(s) - f for s, f in zip(token_ids, first)]))


HEAD_CHUNK_ROWS = 256  # rows projected onto the vocabulary at once; memory and speed only (no exact-mode bit)


class _HeadLogprobs(torch.autograd.Function):
    """LM head + sampling distribution + target gather, in row chunks, with a hand-written backward.

    Forward, per chunk of HEAD_CHUNK_ROWS rows: lp = sampling_logprobs(h W^T),
    lp_t = lp[target], and H = -Σ p·lp with p = exp(lp). The chunks keep the
    [chunk, V] temporaries in cache and let the allocator reuse them, where
    unchunked autograd made half a dozen fresh [N, V] tensors per step (8192 x
    16k fp32 is 537 MB each; their page faults alone cost seconds on a CPU).
    For the backward the forward keeps each chunk's lp ([N, V] in all), as
    log_softmax's autograd would, or, with `model.head_recompute` (set by
    activation checkpointing), nothing of size V: the backward runs the chunk's
    forward again (`_chunk_logprobs`, the same call on the same rows), so the
    recomputed lp is bitwise the kept one and so is every gradient (tested).

    Backward, with z' = z / T the tempered logits (T = 1 for greedy) and the
    top-k/top-p cut-offs constant (as autograd treats them):
        ∂lp_t/∂z'_j = 1[j = t] − p_j          (no 1[j = t] when t itself was cut off)
        ∂H/∂z'_j    = −p_j (lp_j + H)          (0 where p_j = 0)
    through a logit soft cap (Gemma 2, z = c·tanh(z_raw / c)) times 1 − tanh(z_raw / c)², the chunk's
    z_raw computed again, then ∂/∂h = ∂z·W (the native linear over Wᵀ, `input_grad`) and ∂/∂W = ∂zᵀ·h
    (torch's matmul): only forward values must be batch-invariant. Chunking changes no forward bit: the exact
    projection is row-invariant and every op after it row-wise (tested against
    the unchunked path).
    """

    @staticmethod
    def forward(ctx, h_ND, w_VD, tgt_N, model, dist, with_entropy, entropy_grad, backward):  # type: ignore[override]
        cap = model.config.logit_softcap
        lps, ents, keep = [], [], []
        packed = PackedWeights()  # the head weight packed once for all chunks (it cannot change inside a call)
        recompute = backward and model.head_recompute
        for a in range(0, h_ND.shape[0], HEAD_CHUNK_ROWS):
            h_cD = h_ND[a : a + HEAD_CHUNK_ROWS]
            lp_cV, ent_c = _chunk_logprobs(model.kernels, packed, h_cD, w_VD, dist, with_entropy, cap)
            if with_entropy:
                ents.append(ent_c)
            lps.append(lp_cV.gather(1, tgt_N[a : a + HEAD_CHUNK_ROWS, None]).squeeze(1))
            if backward and not recompute:  # under no_grad (reference model, behaviour recompute) nothing is kept
                keep.append(lp_cV)
        lp_N = torch.cat(lps)
        ent_N = torch.cat(ents) if with_entropy else h_ND.new_zeros(0, dtype=torch.float32)
        ctx.save_for_backward(h_ND, w_VD, tgt_N, lp_N, ent_N)
        ctx.chunks, ctx.temp, ctx.entropy_grad = keep, (dist[0] if dist[0] > 0 else 1.0), entropy_grad
        ctx.kernels, ctx.rows, ctx.cap = model.kernels, HEAD_CHUNK_ROWS, cap
        ctx.recompute = (dist, with_entropy, cap) if recompute else None  # what `_chunk_logprobs` takes again
        if not entropy_grad:
            ctx.mark_non_differentiable(ent_N)
        return lp_N, ent_N

    @staticmethod
    def backward(ctx, g_lp_N, g_ent_N):  # type: ignore[override]
        h_ND, w_VD, tgt_N, lp_N, ent_N = ctx.saved_tensors
        gh_ND = torch.empty_like(h_ND) if ctx.needs_input_grad[0] else None
        gw_VD = torch.zeros_like(w_VD, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        g_lp_N = g_lp_N.float()
        g_hit_N = g_lp_N * torch.isfinite(lp_N)  # a cut-off target's own logit is a constant (-inf)
        g_ent_N = g_ent_N.float() if ctx.entropy_grad and g_ent_N is not None else None
        kern, rows, packed = ctx.kernels, ctx.rows, PackedWeights()
        times_w = kern.head_input_grad(w_VD) if gh_ND is not None else None  # W packed once for every chunk
        for c, a in enumerate(range(0, h_ND.shape[0], rows)):
            sl = slice(a, a + rows)
            if ctx.recompute is None:
                lp_cV, ctx.chunks[c] = ctx.chunks[c], None
            else:  # the forward's call on the same rows: the same bits
                lp_cV = _chunk_logprobs(kern, packed, h_ND[sl], w_VD, *ctx.recompute)[0]
            # the formula above, one pass, over the chunk's own memory (this backward is its last reader)
            gz_cV = kern.head_grad(
                lp_cV, g_lp_N[sl], g_hit_N[sl], tgt_N[sl], None if g_ent_N is None else g_ent_N[sl], ent_N[sl], ctx.temp
            )
            del lp_cV
            if ctx.cap is not None:  # through the cap: ∂z/∂z_raw = 1 - tanh(z_raw / c)², z_raw recomputed
                with using_packed(packed):
                    gz_cV = kern.softcap_grad(kern.linear(h_ND[sl], w_VD).float(), gz_cV, ctx.cap)
            if gh_ND is not None:
                gh_ND[sl] = times_w(gz_cV).to(h_ND.dtype)
            if gw_VD is not None:  # accumulated in place: a [V, D] product and sum per chunk took 1.7x as long
                gw_VD.addmm_(gz_cV.t(), h_ND[sl].float())
        ctx.chunks = None
        return gh_ND, (gw_VD.to(w_VD.dtype) if gw_VD is not None else None), None, None, None, None, None, None


def _plain(dist: tuple[float, int, float], V: int) -> bool:
    """Whether `sampling_logprobs` under `dist` = (temperature, top_k, top_p) is log_softmax itself."""
    temp, top_k, top_p = dist
    return temp in (0, 1) and not 0 < top_k < V and top_p >= 1


def _chunk_logprobs(kern, packed: PackedWeights, h_cD, w_VD, dist, with_entropy: bool, cap: float | None):
    """(lp [c, V], entropy [c] or None) of one chunk of head rows: the forward's path and its recomputation's.
    `cap`: Gemma 2's final logit soft cap, z = c·tanh(z / c) as `model.logits`, or None."""
    temp, top_k, top_p = dist
    n = h_cD.shape[0]
    with using_packed(packed):
        z_cV = kern.linear(h_cD, w_VD).float().contiguous()
    if cap is not None:
        z_cV = kern.softcap(z_cV, cap)
    if _plain(dist, w_VD.shape[0]) and with_entropy:  # one pass, over the logits' own memory: the bits below
        return kern.log_softmax_entropy(z_cV)
    lp_cV = kern.sampling_logprobs(z_cV, torch.full((n,), temp), torch.full((n,), top_k), torch.full((n,), top_p))
    return lp_cV, (kern.entropy(lp_cV) if with_entropy else None)


def _head_logprobs(model, h_ND, w_VD, tgt_N, dist, with_entropy: bool, entropy_grad: bool):
    """(logprobs [N], entropies [N] or None) through `_HeadLogprobs` (see there)."""
    backward = torch.is_grad_enabled() and (h_ND.requires_grad or w_VD.requires_grad)
    lp_N, ent_N = _HeadLogprobs.apply(h_ND, w_VD, tgt_N, model, dist, with_entropy, entropy_grad, backward)
    return lp_N, (ent_N if with_entropy else None)


def sequence_logprobs(
    model: CausalLM,
    token_ids: list[list[int]],
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    layout: str = "packed",
) -> list[torch.Tensor]:
    """lps[k][i-1] = log p(token_ids[k][i] | token_ids[k][:i]) under the sampling distribution.

    The distribution is `sampling_logprobs` of the logits: temperature, then
    top-k, then top-p, renormalised — the one the engine samples from.
    """
    return token_logprobs(model, token_ids, temperature, top_k, top_p, layout)[0]
