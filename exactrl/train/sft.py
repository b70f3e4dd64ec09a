"""Supervised fine-tuning: the loss on the assistant's tokens, packed sequences, and the step.

A step takes `data.batch_size` examples (train/sft_data.py) and lays consecutive ones end to end into
packed sequences of at most `data.max_tokens` tokens. A packed sequence is one forward through the trainer's
exact path (`token_logprobs`), where each example is a segment of its own (its own positions and KV pages:
model/logprobs.py `pack_layout`), so it attends only to itself and its logprobs are bitwise those it has
alone (the exact kernels are row-invariant, docs/design.md §4). Every pack's loss is divided by the
trained tokens of the whole step and back-propagated at once, so the step's gradient is its token mean
however it is packed (up to the rounding of the gradient sums, §10). Unlike padded trainers, the layout has
no padding to remove: packing bounds a forward's memory and the number of forwards, not wasted rows.

The command around the step (`exactrl sft`) is train/sft_run.py; the default job's warm start
(train/warmstart.py) runs the same step on its task's demonstrations.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, Field, model_validator

from exactrl.argcheck import PathText
from exactrl.model.logprobs import token_logprobs
from exactrl.model.settings import ModelSettings
from exactrl.model.transformer import CausalLM
from exactrl.train.master_weights import MasterWeights
from exactrl.train.settings import _STRICT
from exactrl.train.sft_data import Example


class SFTModelSettings(ModelSettings):
    path: PathText | None = None
    """The Hugging Face model directory to fine-tune (required; a family of docs/models.md)."""
    tokenizer: PathText | None = None
    """Tokenizer directory (with the chat template the data is rendered with); None uses `path`."""


class SFTDataSettings(BaseModel):
    model_config = _STRICT

    train_jsonl: PathText | None = None
    """The JSONL file to train on: chat records (`{"messages": [...]}`) or prompt/completion records
    (docs/training.md). Read and checked whole before the model loads; a bad line is named by file:line."""
    prompt_format: Literal["chat", "raw"] = "chat"
    """How a prompt/completion record of two strings becomes tokens: `chat`, one user turn and the
    assistant's reply through the tokenizer's chat template (the prompts RL sees); `raw`, the prompt's
    tokens, then the completion's and eos (a base model without a template)."""
    batch_size: int = Field(32, ge=1)
    """Examples per step; the loss is the mean over all their trained (assistant) tokens."""
    max_tokens: int = Field(4096, ge=2)
    """Token budget of one packed sequence (one forward and backward): consecutive examples of a step share
    one while their tokens fit, each attending only to itself. It bounds memory; the loss is the same
    however a step is packed (the gradient up to rounding). A record longer than this is refused."""
    shuffle: bool = True
    """Each epoch in its own seeded order; false walks the file in order every epoch."""


class SFTOptimSettings(BaseModel):
    model_config = _STRICT

    lr: float = Field(2e-5, gt=0)
    """AdamW learning rate (after `warmup_steps`)."""
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.99)
    """AdamW's (β1, β2), each in [0, 1)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW's decoupled weight decay."""
    grad_clip: float = Field(1.0, gt=0)
    """Max global gradient norm."""
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear learning-rate warm-up from 0."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "linear"
    """The learning rate after the warm-up, decaying towards `min_lr_ratio` x `lr` at `max_steps` (as
    `exactrl train`'s `optim.lr_schedule`, train/setup.py `scheduled_lr`)."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Where `linear` and `cosine` decay to, as a fraction of `lr`."""
    fp32_master_weights: bool = True
    """With `model.dtype: bfloat16`: AdamW steps fp32 copies of the weights (train/master_weights.py)."""


class SFTConfig(BaseModel):
    """`exactrl sft`'s config: a model directory, a JSONL file, and the run's files as `exactrl train` keeps them."""

    model_config = _STRICT

    max_steps: int = Field(100, ge=1)
    """SFT steps to run."""
    seed: int = Field(0, ge=-(2**63), lt=2**63)
    """Seeds the data order."""
    run_dir: PathText | None = None
    """Output directory; None creates runs/<timestamp>."""
    resume: bool = False
    """Continue from the latest checkpoint in run_dir (required if run_dir has checkpoints)."""
    save_every: int = Field(50, ge=1)
    """Checkpoint every this many steps, and at the last."""
    keep_checkpoints: int = Field(2, ge=1)
    """Newest checkpoints kept in run_dir/checkpoints (older ones are pruned)."""
    progress: bool = True
    """A live progress bar on a terminal; a plain line a step to a pipe; false: one line of JSON a step."""
    tensorboard: bool = True
    """Also write the metrics as TensorBoard events in run_dir."""
    model: SFTModelSettings = Field(default_factory=SFTModelSettings)
    data: SFTDataSettings = Field(default_factory=SFTDataSettings)
    optim: SFTOptimSettings = Field(default_factory=SFTOptimSettings)

    @model_validator(mode="after")
    def _required(self) -> SFTConfig:
        if self.model.path is None:
            raise ValueError("model.path is not set: exactrl sft fine-tunes a Hugging Face model directory")
        if self.data.train_jsonl is None:
            raise ValueError("data.train_jsonl is not set: the JSONL file of chat or prompt/completion records")
        if self.resume and self.run_dir is None:
            raise ValueError(
                "resume=true needs run_dir: the directory of the run to continue (--set run_dir=runs/<its name>)"
            )
        return self


def sft_loss(lps: list[torch.Tensor], masks: list[torch.Tensor], denominator: int) -> tuple[torch.Tensor, dict]:
    """Masked negative log-likelihood of one packed sequence:

        L = −(1/N) Σ_k Σ_t m_kt · log π_θ(x_kt | x_k,<t)

    over its examples k and their positions t, with m the loss mask (the assistant's tokens) and N =
    `denominator` the trained tokens of the whole step, so the packs' losses add up to the step's token
    mean however the step is packed. `lps[k]` and `masks[k]` cover the same positions of example k."""
    lp_N, m_N = torch.cat(lps), torch.cat(masks)
    loss = -lp_N.masked_fill(~m_N, 0.0).sum() / denominator  # a masked -inf must not make 0 · -inf = nan
    return loss, {"train/loss": float(loss.detach())}


def pack(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of consecutive examples grouped while their tokens fit `budget` (each fits alone)."""
    packs: list[list[int]] = []
    used = budget
    for i, n in enumerate(lengths):
        assert n <= budget, f"an example of {n} tokens exceeds the pack budget {budget}"
        if used + n > budget:
            packs.append([])
            used = 0
        packs[-1].append(i)
        used += n
    return packs


def example_logprobs(model: CausalLM, examples: list[Example]) -> list[torch.Tensor]:
    """Logprobs of each example's tokens from its first trained one on, in one forward (one packed sequence)."""
    lps, _ = token_logprobs(model, [e.tokens for e in examples], first=[e.first for e in examples])
    return lps


def sft_step(
    model: CausalLM, optimizer: torch.optim.Optimizer, examples: list[Example], max_tokens: int, grad_clip: float
) -> dict[str, float]:
    """One optimizer step on `examples`, packed into sequences of at most `max_tokens` tokens; its metrics."""
    n_loss = sum(sum(e.loss_mask) for e in examples)
    packs = pack([len(e.tokens) for e in examples], max_tokens)
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for idx in packs:
        part = [examples[i] for i in idx]
        masks = [torch.tensor(e.loss_mask[e.first :]) for e in part]
        loss, m = sft_loss(example_logprobs(model, part), masks, n_loss)
        loss.backward()
        total += m["train/loss"]
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if not (math.isfinite(total) and torch.isfinite(grad_norm)):
        raise FloatingPointError(
            f"loss {total}, gradient norm {grad_norm.item()}: refusing to step (check optim.lr and the data)"
        )
    optimizer.step()
    return {
        "train/loss": total,
        "train/tokens": n_loss,
        "train/seq_tokens": sum(len(e.tokens) for e in examples),
        "train/packs": len(packs),
        "train/grad_norm": float(grad_norm),
    }


def make_optimizer(model: CausalLM, o: SFTOptimSettings) -> torch.optim.Optimizer:
    """AdamW over the model's parameters; over fp32 master copies for a bf16 model (`o.fp32_master_weights`)."""
    adamw = lambda params: torch.optim.AdamW(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
    low_precision = next(model.parameters()).dtype != torch.float32
    if low_precision and o.fp32_master_weights:
        return MasterWeights(model.parameters(), adamw)
    return adamw(model.parameters())
