"""One optimisation step on a batch of scored rollouts.

The batch holds, per sequence, prompt + completion token ids, the behaviour
logprobs μ the engine reported while sampling, and the sequence advantage.
The step runs the trainer forward micro-batch by micro-batch, of a number of
sequences or up to a number of tokens (`micro_batches`; gradients accumulate;
the loss denominator `LossNorm` is computed once over the whole batch so the
sum of micro-batch losses is the full-batch loss), then clips the
gradient norm and steps the optimizer: one optimizer step per batch.

π_old: with one optimizer step per batch the weights cannot change between
the proximal forward and the update, so π_old is the detached value of the
same forward that builds the graph (bitwise equal to a separate no-grad
forward, which the invariance tests check). `train/train_rollout_logprob_abs_diff`
compares exactly this π_old with μ.

Data parallel (exactrl/distributed): each rank runs its share of the
sequences; the denominators are still the whole batch's, so summing the
ranks' gradients gives the whole batch's gradient, and the metrics are
summed or gathered over ranks before they are reduced. With `distributed.strategy: fsdp`
(distributed/fsdp.py) the model is sharded and FSDP2 reduce-scatters each micro-batch's gradient in its
backward; every rank then runs as many micro-batches (`_zero_backward`).

Legend: B sequences, T completion tokens (padded), P prompts, G samples per prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from exactrl.algo.aggregation import aggregate, masked_mean
from exactrl.algo.corrections import apply_bypass
from exactrl.algo.diagnostics import logprob_diff_metrics, mismatch_metrics
from exactrl.algo.kl import kl_estimate
from exactrl.algo.types import LossInputs, LossNorm
from exactrl.distributed import Ranks
from exactrl.model.logprobs import token_logprobs
from exactrl.model.transformer import CausalLM
from exactrl.train.moe_terms import router_aux_term, routing_agreement_metric


@dataclass
class TrainBatch:
    """Rollouts ready for the trainer (one entry per sequence)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]  # may be empty (the engine stopped at once)
    behav_logprobs: list[list[float]]  # μ for each completion token
    advantages: list[float]  # sequence advantage, broadcast over its tokens
    loss_mask: list[list[int]] | None = None  # per completion token (None = all ones)
    generated_mask: list[list[int]] | None = None  # 1 where the engine sampled the token (None = loss_mask):
    # the tokens the mismatch metrics and the entropy are measured on, whether trained on or not
    ref_logprobs: list[torch.Tensor] | None = None  # filled by the trainer when KL is on
    token_advantages: list[list[float]] | None = None  # per completion token, added to the sequence advantage
    # (on-policy distillation's log π_t − log π_s; train/distill.py)
    teacher_prompt_ids: list[list[int]] | None = None  # the prompt each completion is scored after by its teacher
    teacher_keys: list[str] | None = None  # which teacher scores each sequence (train/distill.py)
    # mixture of experts: per sequence, the engine's experts of each completion token ([T][L][K] ids,
    # `Completion.experts`), or None; read by `mismatch/routing_agreement` (train/moe_terms.py)
    behav_experts: list | None = None

    def __post_init__(self):
        for name in ("prompt_ids", "completion_ids", "behav_logprobs"):
            if not isinstance(getattr(self, name), (list, tuple)):
                raise ValueError(
                    f"TrainBatch.{name} must be a list with one entry per sequence, got "
                    f"{type(getattr(self, name)).__name__}"
                )
        n = len(self.prompt_ids)
        lengths = {name: len(getattr(self, name)) for name in ("completion_ids", "behav_logprobs")}
        lengths["advantages"] = len(_numbers("advantages", self.advantages))
        if self.behav_experts is not None:
            lengths["behav_experts"] = len(self.behav_experts)
        if any(v != n for v in lengths.values()):
            raise ValueError(
                f"TrainBatch fields must all have one entry per sequence: prompt_ids has {n}, "
                + ", ".join(f"{k} {v}" for k, v in lengths.items())
            )
        if n == 0:
            raise ValueError("TrainBatch is empty: no sequence to train on")
        if self.token_advantages is not None:
            if len(self.token_advantages) != n:
                raise ValueError(
                    f"TrainBatch.token_advantages has {len(self.token_advantages)} entries for {n} sequences"
                )
            for k, (c, a) in enumerate(zip(self.completion_ids, self.token_advantages)):
                if len(_numbers(f"token_advantages[{k}]", a)) != len(c):
                    raise ValueError(f"TrainBatch.token_advantages[{k}] has {len(a)} values for {len(c)} tokens")
        for name in ("prompt_ids", "completion_ids"):
            _check_token_ids(name, getattr(self, name))
        behav = [_numbers(f"behav_logprobs[{k}]", lp, finite=False) for k, lp in enumerate(self.behav_logprobs)]
        for k, (c, lp) in enumerate(zip(self.completion_ids, behav)):
            if len(lp) != len(c):
                raise ValueError(f"sequence {k}: {len(c)} completion tokens but {len(lp)} behaviour logprobs")
        bad = next((k for k, p in enumerate(self.prompt_ids) if not len(p)), None)
        if bad is not None:
            raise ValueError(f"TrainBatch.prompt_ids[{bad}] is empty: a prompt needs at least one token")
        for name in ("loss_mask", "generated_mask"):  # checked before a step changes any weight
            mask = getattr(self, name)
            if mask is None:
                continue
            if len(mask) != n:
                raise ValueError(f"TrainBatch.{name} must have one entry per sequence, got {len(mask)} for {n}")
            for k, (c, m) in enumerate(zip(self.completion_ids, mask)):
                if len(m) != len(c) or any(x not in (0, 1) for x in m):
                    raise ValueError(
                        f"TrainBatch.{name}[{k}] must be 0/1 for each of its {len(c)} completion "
                        f"tokens, got {list(m)[:8]}{'...' if len(m) > 8 else ''}"
                    )
        if self.generated_mask is not None:
            loss = self.loss_mask or [[1] * len(c) for c in self.completion_ids]
            bad = next(
                (k for k, (g, m) in enumerate(zip(self.generated_mask, loss)) if any(gx < mx for gx, mx in zip(g, m))),
                None,
            )
            if bad is not None:
                raise ValueError(
                    f"TrainBatch.generated_mask[{bad}] is 0 where loss_mask is 1: every token trained on was sampled"
                )
        # μ is read where the engine sampled: a token it did not sample (a tool's output) may carry anything
        for k, lp in enumerate(behav):
            bad = ~torch.isfinite(lp)
            sampled = (self.generated_mask or self.loss_mask or [None] * n)[k]
            if sampled is not None:
                bad &= torch.tensor(sampled, dtype=torch.bool)
            if bool(bad.any()):
                t = int(bad.nonzero()[0])
                raise ValueError(
                    f"TrainBatch.behav_logprobs[{k}][{t}] is {self.behav_logprobs[k][t]!r}, not a finite "
                    f"(fp32) number, at a sampled token"
                )

    def __len__(self):
        return len(self.prompt_ids)


def _check_token_ids(name: str, rows) -> None:
    """Each row a list (or tuple) of int token ids: the vocabulary range is checked by train_step."""
    for k, ids in enumerate(rows):
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"TrainBatch.{name}[{k}] must be a list of token ids, got {type(ids).__name__}")
        bad = next((j for j, t in enumerate(ids) if isinstance(t, bool) or not isinstance(t, int)), None)
        if bad is not None:
            raise ValueError(f"TrainBatch.{name}[{k}] holds {ids[bad]!r}, not an int token id")


def _numbers(name: str, values, finite: bool = True) -> torch.Tensor:
    """`values` as the trainer reads them (fp32, 1-D), each finite unless `finite` is False: a NaN or an
    overflow named by its index here, not as a row of a micro-batch (or a NaN gradient) inside the step."""
    try:
        v = torch.as_tensor(values, dtype=torch.float32)
    except (TypeError, ValueError, OverflowError, RuntimeError):
        v = None
    if v is None or v.dim() != 1:
        raise ValueError(f"TrainBatch.{name} must be a list of numbers, got {str(values)[:80]}")
    bad = (~torch.isfinite(v)).nonzero()
    if finite and len(bad):
        k = int(bad[0])
        raise ValueError(f"TrainBatch.{name}[{k}] is {values[k]!r}, not a finite (fp32) number")
    return v


@dataclass
class StepSettings:
    """What the step needs from the run config (kept flat for the hot path)."""

    temperature: float
    top_k: int
    top_p: float
    micro_batch_size: int
    agg_mode: str
    agg_constant: float | None
    grad_clip: float
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    kl_in_loss: bool = True
    corrections: object | None = None  # callable(old, behav, mask, advantages) -> (weights, mask, metrics)
    bypass: bool = False  # loss ratio against μ instead of π_old (corrections.apply_bypass)
    share_prompts: bool = True  # a micro-batch's repeated prompts are laid out once (logprobs.pack_shared)
    max_tokens_per_micro_batch: int | None = None  # micro-batches by tokens (micro_batches); None: by micro_batch_size
    router_aux_loss_coef: float = 0.0  # the load-balancing loss's weight (train/moe_terms.py), 0 = off
    fsdp: bool = False  # the model is sharded over the ranks (distributed/fsdp.py): FSDP2 sums the gradients
    distill: object | None = None  # a Distiller (train/distill.py) whose `vocab_term` enters the loss, coef ×
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if type(self.micro_batch_size) is not int or self.micro_batch_size < 1:
            raise ValueError(f"StepSettings.micro_batch_size must be an int >= 1, got {self.micro_batch_size!r}")
        budget = self.max_tokens_per_micro_batch
        if budget is not None and (type(budget) is not int or budget < 1):
            raise ValueError(f"StepSettings.max_tokens_per_micro_batch must be None or an int >= 1, got {budget!r}")


def micro_batches(order: list[int], lengths: list[int], s: StepSettings) -> list[list[int]]:
    """The step's sequences `order` (batch indices, in this order) split into micro-batches.

    By count: `micro_batch_size` sequences each. By tokens (`max_tokens_per_micro_batch`): consecutive
    sequences while their prompt + completion tokens (`lengths`, the forward's rows before prompt sharing)
    fit the budget; a sequence longer than the budget alone is a micro-batch of its own. The order is kept
    (a GRPO group stays together for `share_prompts`), and each sequence is whole in one micro-batch, as the
    per-sequence aggregation modes need; the loss denominators are the whole batch's either way.
    """
    if s.max_tokens_per_micro_batch is None:
        return [order[a : a + s.micro_batch_size] for a in range(0, len(order), s.micro_batch_size)]
    out, used = [], 0
    for k in order:
        if not out or used + lengths[k] > s.max_tokens_per_micro_batch:
            out.append([])
            used = 0
        out[-1].append(k)
        used += lengths[k]
    return out


def _pad(rows: list[torch.Tensor], T: int) -> torch.Tensor:
    out = torch.zeros(len(rows), T, dtype=torch.float32)
    for k, r in enumerate(rows):
        out[k, : len(r)] = r
    return out


def _mask(rows: list[list[int]] | None, batch: TrainBatch, idx: list[int], T: int) -> torch.Tensor:
    """[B, T] float 0/1 of the sequences idx (rows None: every completion token)."""
    mask_BT = torch.zeros(len(idx), T)
    for r, k in enumerate(idx):
        m = rows[k] if rows is not None else [1] * len(batch.completion_ids[k])
        mask_BT[r, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return mask_BT


def micro_batch_inputs(model, batch: TrainBatch, idx: list[int], s: StepSettings, T: int):
    seqs = [list(batch.prompt_ids[k]) + list(batch.completion_ids[k]) for k in idx]
    plens = [len(batch.prompt_ids[k]) for k in idx]
    lps, ents = token_logprobs(
        model,
        seqs,
        s.temperature,
        s.top_k,
        s.top_p,
        with_entropy=True,
        first=plens,
        entropy_grad=bool(s.entropy_coef),
        share_prompts=s.share_prompts,
    )
    logp_BT, ent_BT = _pad(lps, T), _pad(ents, T)
    mask_BT = _mask(batch.loss_mask, batch, idx, T)
    gen_BT = mask_BT if batch.generated_mask is None else _mask(batch.generated_mask, batch, idx, T)
    behav_BT = _pad([torch.tensor(batch.behav_logprobs[k], dtype=torch.float32) for k in idx], T)
    behav_BT = torch.where(gen_BT > 0, behav_BT, 0.0)  # μ of a token not sampled is never read (TrainBatch)
    adv_BT = torch.tensor([batch.advantages[k] for k in idx], dtype=torch.float32)[:, None].expand(-1, T)
    if batch.token_advantages is not None:
        adv_BT = adv_BT + _pad([torch.tensor(batch.token_advantages[k], dtype=torch.float32) for k in idx], T)
    adv_BT = adv_BT * (mask_BT > 0)
    return logp_BT, ent_BT, mask_BT, gen_BT, behav_BT, adv_BT


def _check_step_inputs(model, batch: TrainBatch, s: StepSettings, ref_model, ranks: Ranks) -> None:
    """What train_step refuses before any micro-batch runs: token ids outside the vocabulary (naming the
    sequence), a KL term without a reference model, fewer sequences than ranks."""
    vocab = model.config.vocab_size  # checked before any micro-batch runs, naming the sequence
    for name in ("prompt_ids", "completion_ids"):
        bad = next(((k, t) for k, ids in enumerate(getattr(batch, name)) for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(
                f"TrainBatch.{name}[{bad[0]}] holds token id {bad[1]}, outside the vocabulary [0, {vocab})"
            )
    if s.kl_coef and s.kl_in_loss and ref_model is None:  # the term would be left out, silently
        raise ValueError(
            f"StepSettings.kl_coef={s.kl_coef} puts a KL term in the loss but there is no ref_model: "
            f"pass the reference policy (ref_model=...), or set kl_coef=0"
        )
    if len(batch) < ranks.world:
        raise ValueError(
            f"a batch of {len(batch)} sequences cannot be shared by {ranks.world} ranks: raise "
            f"rollout.prompts_per_step or rollout.samples_per_prompt, or run fewer ranks"
        )


def train_step(
    model: CausalLM,
    optimizer: torch.optim.Optimizer,
    loss_fn,
    batch: TrainBatch,
    s: StepSettings,
    ref_model: CausalLM | None = None,
    ranks: Ranks = Ranks(),
) -> dict[str, float]:
    """Forward/backward over micro-batches (this rank's share of the batch), clip, step. Returns flat metrics."""
    _check_step_inputs(model, batch, s, ref_model, ranks)
    T = max(1, max(len(c) for c in batch.completion_ids))
    n_tokens = sum(sum(m) for m in batch.loss_mask) if batch.loss_mask else sum(len(c) for c in batch.completion_ids)
    norm = LossNorm(total_tokens=max(int(n_tokens), 1), total_seqs=len(batch), constant=s.agg_constant)
    kept = {k: [] for k in ("old", "behav", "loss_mask", "live", "gen", "adv", "final", "ent", "kl", "distill")}
    moe_metrics = routing_agreement_metric(model, batch, ranks.shard(len(batch)), ranks)  # before any update
    aux_sum = torch.zeros(())
    optimizer.zero_grad(set_to_none=True)
    lengths = [len(p) + len(c) for p, c in zip(batch.prompt_ids, batch.completion_ids)]
    parts = micro_batches(ranks.shard(len(batch)), lengths, s)
    if s.fsdp:  # every rank runs as many forwards and backwards (FSDP2's collectives), or none at all
        n = max(ranks.gather(len(parts))) if any(batch.completion_ids) else 0
        parts = parts[:n] + [[]] * (n - len(parts))
    for idx in parts:
        if not idx:  # another rank's extra micro-batch (fsdp)
            _zero_backward(model, batch, s)
            continue
        logp_BT, ent_BT, sampled_BT, gen_BT, behav_BT, adv_BT = micro_batch_inputs(model, batch, idx, s, T)
        old_BT = logp_BT.detach()
        # a sampled token the trainer's top-k/top-p cuts (π_old = 0, only off-policy: μ ≠ π_old) has no
        # gradient and no finite ratio: it leaves the loss as a correction's mask would, and is counted
        live_BT = sampled_BT * torch.isfinite(old_BT)
        weights_BT, mask_BT = torch.ones_like(old_BT), live_BT
        if s.corrections is not None:
            weights_BT, mask_BT, _ = s.corrections(old_BT, behav_BT, live_BT, adv_BT)
        inp = LossInputs(
            logprobs_BT=logp_BT,
            old_logprobs_BT=old_BT,
            behav_logprobs_BT=behav_BT,
            advantages_BT=adv_BT,
            mask_BT=mask_BT,
            weights_BT=weights_BT,
            sampled_mask_BT=sampled_BT,
        )
        if s.bypass:
            inp = apply_bypass(inp)
        kl_BT = None
        if ref_model is not None and s.kl_coef and s.kl_in_loss:
            ref_BT = _ref_logprobs(ref_model, batch, idx, s, T)
            # a cut token's −inf would make k2's gradient NaN through the mask: it is the reference there (KL 0)
            kl_BT = kl_estimate(torch.where(live_BT > 0, logp_BT, ref_BT), ref_BT, s.kl_kind)
            kept["kl"].append(kl_BT.detach())
        d_BT = None
        if s.distill is not None:
            d_BT = s.distill.vocab_term(model, batch, idx, T)
            kept["distill"].append(d_BT.detach())
        loss = _regularised(loss_fn(inp, s.agg_mode, norm)[0], ent_BT, kl_BT, mask_BT, sampled_BT, s, norm, d_BT)
        aux = router_aux_term(model, s.router_aux_loss_coef, len(idx), len(batch))  # of this micro-batch's forward
        if aux is not None:
            loss, aux_sum = loss + aux, aux_sum + aux.detach()
        _backward(loss, logp_BT, model, batch, s)
        for k, t in zip(
            kept, (old_BT, behav_BT, sampled_BT, live_BT, gen_BT, adv_BT, mask_BT.detach(), ent_BT.detach())
        ):
            kept[k].append(t)
    grad_norm = _clip_and_step(model, optimizer, s, ranks)
    whole = {k: torch.cat(v) if v else None for k, v in kept.items()}
    if ranks.world > 1:  # every rank's per-token tensors, in batch order: the metrics of one process
        parts = ranks.gather(whole)
        rows = torch.tensor([k for r in range(ranks.world) for k in range(r, len(batch), ranks.world)])
        for k, v in whole.items():
            if v is not None:
                whole[k] = torch.empty(len(batch), *v.shape[1:], dtype=v.dtype)
                whole[k][rows] = torch.cat([p[k] for p in parts])
    if s.router_aux_loss_coef:  # coef x the load-balancing loss, summed over micro-batches and ranks
        moe_metrics["train/router_aux_loss"] = float(sum(ranks.gather(float(aux_sum))))
    return _batch_metrics(whole, loss_fn, s, norm) | moe_metrics | {"train/grad_norm": float(grad_norm)}


def _backward(loss: torch.Tensor, logp_BT: torch.Tensor, model, batch: TrainBatch, s: StepSettings) -> None:
    """loss.backward(); without a graph (a micro-batch of empty completions has no token to learn from)
    nothing, or under FSDP a backward of zero gradients, whose collectives the other ranks' meet."""
    if loss.requires_grad:
        loss.backward()
    elif s.fsdp and logp_BT.requires_grad:  # the forward ran: its backward's collectives too
        (torch.where(torch.isfinite(logp_BT), logp_BT, 0.0).sum() * 0.0).backward()
    elif s.fsdp:  # no completion token: token_logprobs ran no forward
        _zero_backward(model, batch, s)


def _clip_and_step(model, optimizer, s: StepSettings, ranks: Ranks) -> torch.Tensor:
    """Sums the gradients over ranks (`ddp`; FSDP2 reduce-scattered them in each backward), clips their global
    norm, steps the optimizer, checks that the ranks hold the same weights (`ddp`); returns the norm."""
    if not s.fsdp:
        ranks.sum_grads(model.parameters())
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
    if s.fsdp:  # the norm over every rank's shards, a replicated DTensor
        from exactrl.distributed.fsdp import full

        grad_norm = full(grad_norm)
    if not torch.isfinite(grad_norm):
        raise FloatingPointError(f"gradient norm is {grad_norm.item()}: refusing to step (check lr / data)")
    optimizer.step()
    if not s.fsdp:  # sharded weights differ by rank; gathering them gives every rank the same bits
        ranks.check_same(
            "weights after the optimizer step",
            model.parameters(),
            "the data-parallel step did not give every rank the same result",
        )
    return grad_norm


def _zero_backward(model, batch: TrainBatch, s: StepSettings) -> None:
    """A forward and backward whose gradient is zero everywhere: the first prompt and one token of it again,
    its logprob times 0 (untruncated, so finite). A sharded rank without tokens in a micro-batch runs it so
    that its all-gathers and reduce-scatters meet the other ranks'; adding zeros changes no gradient."""
    prompt = list(batch.prompt_ids[0])
    lps, _ = token_logprobs(model, [prompt + prompt[-1:]], s.temperature, first=[len(prompt)])
    (lps[0].sum() * 0.0).backward()


def _regularised(loss, ent_BT, kl_BT, mask_BT, sampled_BT, s: StepSettings, norm: LossNorm, d_BT=None):
    """loss − entropy_coef·agg(H) + kl_coef·agg(KL) + distill.coef·agg(D) (the KL and distillation terms only
    when given), aggregated as the loss is; seq-mean-token-mean's n_b counts the sampled tokens (a masked
    one stays in it)."""
    lengths_B = sampled_BT.sum(dim=1)
    if s.entropy_coef:
        loss = loss - s.entropy_coef * aggregate(ent_BT, mask_BT, s.agg_mode, norm, lengths_B)
    if kl_BT is not None:
        loss = loss + s.kl_coef * aggregate(kl_BT, mask_BT, s.agg_mode, norm, lengths_B)
    if d_BT is not None:
        loss = loss + s.distill.s.coef * aggregate(d_BT, mask_BT, s.agg_mode, norm, lengths_B)
    return loss


def _batch_metrics(t: dict, loss_fn, s: StepSettings, norm: LossNorm) -> dict[str, float]:
    """The step's metrics over the whole batch at once, so that no figure depends on micro_batch_size or
    on the number of ranks: the corrections and the loss (`train/loss` with its entropy and KL terms)
    are evaluated again on the detached tensors (π_θ = π_old, as in the step)."""
    old, behav, final, live = t["old"], t["behav"], t["final"], t["live"]
    # tokens the trainer's top-k/top-p cut (π_old = 0) have an infinite mismatch: counted, not averaged
    cut = t["gen"] * ~torch.isfinite(old)
    gen = t["gen"] - cut
    # over the tokens as sampled, before any mask drops some: a mask never hides the mismatch it acts on
    metrics = logprob_diff_metrics(old, behav, gen)
    metrics["mismatch/out_of_support_frac"] = float(cut.sum() / t["gen"].sum().clamp(min=1))
    weights, cm = torch.ones_like(old), {}
    if s.corrections is not None:
        weights, _, cm = s.corrections(old, behav, live, t["adv"])
    # what the corrections removed, not what the rollout kept out of the loss (overlong.mask_truncated)
    kept = final + (gen - live)
    metrics |= mismatch_metrics(
        old,
        behav,
        gen,
        weights_BT=weights if s.corrections else None,
        final_mask_BT=kept,
        weights_are_token_ratios=getattr(s.corrections, "weighs_token_ratios", False),
        weighted_mask_BT=final if s.corrections else None,
    )  # ρ itself: every token
    if "correction/sequence_tis/clip_frac" in cm:  # its weights are the sequences': it counts their clipping
        metrics["mismatch/seq_clip_frac"] = cm["correction/sequence_tis/clip_frac"]
    inp = LossInputs(
        logprobs_BT=old,
        old_logprobs_BT=old,
        behav_logprobs_BT=behav,
        advantages_BT=t["adv"],
        mask_BT=final,
        weights_BT=weights,
        sampled_mask_BT=t["loss_mask"],
    )
    loss, lm = loss_fn(apply_bypass(inp) if s.bypass else inp, s.agg_mode, norm)
    loss = _regularised(loss, t["ent"], t["kl"], final, t["loss_mask"], s, norm, t["distill"])  # each if in the loss
    metrics |= cm | lm | {"train/loss": float(loss)}
    metrics["train/entropy"] = float(masked_mean(t["ent"].double(), t["gen"]))  # the policy's, on what it sampled
    if t["kl"] is not None:  # the estimator's token mean over the trained tokens, whatever agg_mode
        metrics["train/kl_ref"] = float(masked_mean(t["kl"].double(), final))
    if t["distill"] is not None:
        metrics[f"distill/{s.distill.s.kind}"] = float(masked_mean(t["distill"].double(), final))
    return metrics


def _ref_logprobs(ref_model, batch, idx, s: StepSettings, T: int) -> torch.Tensor:
    """log π_ref of the sampled tokens at the sampling temperature, never truncated (`kl.py`: π_ref must
    cover every token the policy samples, or the KL is infinite)."""
    seqs = [list(batch.prompt_ids[k]) + list(batch.completion_ids[k]) for k in idx]
    with torch.no_grad():
        lps, _ = token_logprobs(
            ref_model,
            seqs,
            s.temperature,
            -1,
            1.0,
            first=[len(batch.prompt_ids[k]) for k in idx],
            share_prompts=s.share_prompts,
        )
    return _pad(lps, T)
