"""`mismatch/routing_agreement`: the experts a mixture-of-experts trainer forward selects for each sampled
token, against those the engine selected when it sampled the token. With exact kernels a token's routing is
a function of its own hidden state (`model/moe.py`), so the two agree on every token; with `fast` kernels
the router logits, and so near-ties, may round differently in the two forwards.

A sampled token t of a sequence was drawn from the logits of the row at position len(prompt) - 1 + t; its
routing is the experts each MoE layer selected at that row (the engine's `Completion.experts`).
"""

from __future__ import annotations

import torch

from exactrl.model.logprobs import forward_hidden
from exactrl.model.moe import selected_experts


def trainer_experts(model, prompts: list[list[int]], completions: list[list[int]]) -> list[torch.Tensor] | None:
    """Per sequence, [len(completion), L, K] experts the trainer's forward of prompt + completion selects at
    the row each completion token is predicted from (None for a dense model). One packed forward, no
    gradient, no LM head."""
    seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
    with torch.no_grad():
        _, starts = forward_hidden(model, seqs)
    picked = selected_experts(model)
    if picked is None:
        return None
    picked = picked.cpu()
    return [picked[s + len(p) - 1 : s + len(p) - 1 + len(c)] for s, p, c in zip(starts, prompts, completions)]


def routing_agreement(rollout: list, trainer: list[torch.Tensor], mask: list[list[int]] | None = None) -> float:
    """Share of tokens whose selected experts match between rollout and trainer, over the tokens `mask`
    keeps (all if None):

        agree_t = 1 if for every MoE layer l: set(rollout_t,l) == set(trainer_t,l), else 0
        routing_agreement = Σ_t agree_t / #tokens        (1.0 where there is no token)

    `rollout[k]`: sequence k's engine experts, [T_k][L][K] ids (or a tensor); `trainer[k]`: [T_k, L, K]."""
    agree, total = routing_counts(rollout, trainer, mask)
    return agree / total if total else 1.0


def routing_counts(rollout: list, trainer: list[torch.Tensor], mask: list[list[int]] | None = None) -> tuple[int, int]:
    """(Σ_t agree_t, #tokens) of `routing_agreement`: counts, which ranks and micro-batches add up."""
    agree = total = 0
    for k, (r, t) in enumerate(zip(rollout, trainer)):
        r = torch.as_tensor(r, dtype=torch.int64) if len(r) else t[:0]
        if r.shape != t.shape:
            raise ValueError(f"sequence {k}: rollout experts have shape {tuple(r.shape)}, trainer's {tuple(t.shape)}")
        same = (r.sort(-1).values == t.sort(-1).values).all(-1).all(-1)  # [T]
        keep = torch.ones_like(same) if mask is None else torch.tensor(mask[k], dtype=torch.bool)
        agree += int((same & keep).sum())
        total += int(keep.sum())
    return agree, total
