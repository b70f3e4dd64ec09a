"""The trainer's mixture-of-experts terms: `mismatch/routing_agreement` (the engine's experts against the
trainer's, per sampled token) and the optional load-balancing loss (`optim.router_aux_loss_coef`). Neither
changes a logprob: the first is a measurement before the update, the second a term added to the loss.
"""

from __future__ import annotations

import torch

from exactrl.model.moe import load_balancing_loss
from exactrl.model.routing import routing_counts, trainer_experts


def routing_agreement_metric(model, batch, idx: list[int], ranks) -> dict[str, float]:
    """{"mismatch/routing_agreement": share of sampled tokens whose experts match} over the batch (every
    rank's sequences), by `model/routing.py`'s rule, with the weights the rollout sampled under (before the
    step). Empty where the model is dense or the rollout recorded no experts (an external engine, agent
    rollouts): no figure is better than a made-up one. One extra forward of this rank's sequences, no
    gradient, no LM head."""
    experts = getattr(batch, "behav_experts", None)
    if model.config.moe is None or experts is None or any(experts[k] is None for k in idx):
        return {}
    mask = batch.generated_mask if batch.generated_mask is not None else batch.loss_mask
    trainer = trainer_experts(model, [batch.prompt_ids[k] for k in idx], [batch.completion_ids[k] for k in idx])
    agree, total = routing_counts([experts[k] for k in idx], trainer, None if mask is None else [mask[k] for k in idx])
    if ranks.world > 1:
        parts = ranks.gather((agree, total))
        agree, total = sum(a for a, _ in parts), sum(t for _, t in parts)
    return {"mismatch/routing_agreement": agree / total if total else 1.0}


def router_aux_term(model, coef: float, seqs: int, batch_seqs: int) -> torch.Tensor | None:
    """coef · (seqs / batch_seqs) · load_balancing_loss of the micro-batch's forward just run (its formula
    in `model/moe.py`), over every row of that forward: prompt and completion, as transformers counts every
    unpadded token (with `share_prompts`, a prompt shared by several samples is one set of rows). Weighted
    by the micro-batch's share of the step's sequences, so the step's term is coef x the sequence-weighted
    mean over micro-batches and ranks, whatever their number. None when coef is 0."""
    if not coef:
        return None
    if model.config.moe is None:
        raise ValueError(
            f"optim.router_aux_loss_coef={coef} needs a mixture-of-experts model; "
            f"{model.config.model_type} has no router (set it to 0)"
        )
    return coef * (seqs / batch_seqs) * load_balancing_loss(model)
