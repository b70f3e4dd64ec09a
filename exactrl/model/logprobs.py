"""The trainer path: per-token logprobs of whole sequences in one batched forward.

`sequence_logprobs` lays the sequences out `packed` (all tokens in one flat
list, each with its own positions) or `padded` (every sequence extended with
pad tokens to the longest one, as a [B, T] trainer batch would be); both go
through the same model forward with a scratch KV store, so autograd works and
the bits equal the engine's (DESIGN.md §1).

Legend: B sequences, T tokens, N flat tokens, V vocabulary.
"""
from __future__ import annotations

import torch

from exactrl.kernels import TokenLayout, sampling_logprobs
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


def validate_token_ids(token_ids: list[list[int]], vocab_size: int) -> None:
    if not token_ids:
        raise ValueError("token_ids is empty: pass at least one sequence")
    for k, seq in enumerate(token_ids):
        if len(seq) == 0:
            raise ValueError(f"token_ids[{k}] is empty")
        bad = [t for t in seq if not (0 <= int(t) < vocab_size)]
        if bad:
            raise ValueError(f"token_ids[{k}] holds id {bad[0]} outside the vocabulary [0, {vocab_size})")


def forward_hidden(model: CausalLM, token_ids: list[list[int]], layout: str = "packed",
                   pad_id: int = 0) -> tuple[torch.Tensor, list[int]]:
    """Final hidden states [N, D] of the flat batch and the offset of each sequence in it."""
    validate_token_ids(token_ids, model.config.vocab_size)
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


def forward_logits(model: CausalLM, token_ids: list[list[int]], layout: str = "packed",
                   pad_id: int = 0) -> list[torch.Tensor]:
    """fp32 logits [len_k, V] of every sequence (the trainer's forward)."""
    hidden, starts = forward_hidden(model, token_ids, layout, pad_id)
    logits = model.logits(hidden)
    return [logits[s: s + len(ids)] for s, ids in zip(starts, token_ids)]


def token_logprobs(model: CausalLM, token_ids: list[list[int]], temperature: float = 1.0, top_k: int = -1,
                   top_p: float = 1.0, layout: str = "packed", with_entropy: bool = False,
                   first: list[int] | None = None, entropy_grad: bool = True
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
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k == 0 or top_k < -1:
        raise ValueError(f"top_k must be -1 (off) or >= 1, got {top_k}")
    validate_token_ids(token_ids, model.config.vocab_size)
    first = [1] * len(token_ids) if first is None else list(first)
    if len(first) != len(token_ids):
        raise ValueError(f"first has {len(first)} entries for {len(token_ids)} sequences")
    for k, (f, s) in enumerate(zip(first, token_ids)):
        if not 1 <= f <= len(s):
            raise ValueError(f"first[{k}]={f} must be in [1, len(token_ids[{k}])={len(s)}]")
    hidden, starts = forward_hidden(model, token_ids, layout)
    sizes = [len(s) - f for s, f in zip(token_ids, first)]
    if sum(sizes) == 0:
        empty = [torch.zeros(0) for _ in token_ids]
        return empty, (empty if with_entropy else None)
    rows_N = torch.cat([torch.arange(st + f - 1, st + len(s) - 1) for st, f, s in zip(starts, first, token_ids)])
    targets = torch.tensor([t for s, f in zip(token_ids, first) for t in s[f:]], dtype=torch.int64)
    n = rows_N.shape[0]
    lp_NV = sampling_logprobs(model.logits(hidden[rows_N]), torch.full((n,), float(temperature)),
                              torch.full((n,), int(top_k)), torch.full((n,), float(top_p)))
    lp_N = lp_NV.gather(1, targets[:, None]).squeeze(1)
    ent = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            p_NV = lp_NV.exp()
            ent_N = -(p_NV * lp_NV.masked_fill(p_NV == 0, 0.0)).sum(-1)
        ent = list(torch.split(ent_N, sizes))
    return list(torch.split(lp_N, sizes)), ent


def sequence_logprobs(model: CausalLM, token_ids: list[list[int]], temperature: float = 1.0,
                      top_k: int = -1, top_p: float = 1.0, layout: str = "packed") -> list[torch.Tensor]:
    """lps[k][i-1] = log p(token_ids[k][i] | token_ids[k][:i]) under the sampling distribution.

    The distribution is `sampling_logprobs` of the logits: temperature, then
    top-k, then top-p, renormalised — the one the engine samples from.
    """
    return token_logprobs(model, token_ids, temperature, top_k, top_p, layout)[0]
