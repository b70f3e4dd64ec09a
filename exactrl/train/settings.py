"""The run config's sections that belong to the training loop (rollout, engine, algorithm, optimizer,
asynchronous training, the warm start); config.py assembles them with the model's, task's and rollout
backend's own sections into `RunConfig`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from exactrl.argcheck import PlainData
from exactrl.kernels.rowwise import check_temperature

_STRICT = ConfigDict(extra="forbid", use_attribute_docstrings=True, populate_by_name=True, allow_inf_nan=False)


class RolloutSettings(BaseModel):
    model_config = _STRICT

    prompts_per_step: int = Field(32, ge=1, le=10**6)
    """Prompts sampled per training step (at most 1e6, as the step's rollouts are held in memory at once)."""
    samples_per_prompt: int = Field(8, ge=1)
    """Group size G: completions per prompt (the engine shares their prefill)."""
    max_tokens: int = Field(8, ge=1)
    """Completion length limit."""
    ignore_eos: bool = False
    """Keep sampling past the model's end-of-sequence ids (vLLM's and the server's `ignore_eos`), so every
    completion, training rollouts and evaluations alike, is `max_tokens` long: long-rollout runs and
    benchmarks (docs/training.md "Long rollouts"). Stop ids a task names itself still stop."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature (0 = greedy, else >= 1e-5); the trainer's logprobs use the same one."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus cut-off in (0, 1] (1 = off); logprobs are those of the truncated, renormalised distribution."""
    top_k: int = -1
    """top-k cut-off (-1 = off); logprobs are those of the truncated, renormalised distribution."""
    filter_groups: bool = False
    """DAPO's dynamic sampling (Yu et al. 2025, §3.2): a group whose task rewards are all equal has zero
    advantage under a group baseline (not `reinforce_pp`'s batch one; the KL and overlong shaping come
    after the filter) and only dilutes the batch, so it is set aside and another batch of
    `prompts_per_step` prompts is sampled, up to `max_sampling_rounds` batches in a step, until
    `prompts_per_step` groups with differing rewards are found; a step that runs out of rounds fills up
    with the set-aside groups. Synchronous loop only."""
    max_sampling_rounds: int = Field(3, ge=1)
    """With `filter_groups`: the most batches sampled in one step (verl's `max_num_gen_batches`)."""

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or not -1 <= v < 2**63:  # the engine's rule (SamplingParams), checked before the run starts
            raise ValueError(f"must be -1 (off) or in [1, 2**63), got {v}")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        check_temperature(v)  # the engine's and the trainer's rule, checked before the run starts
        return v


class EngineSettings(BaseModel):
    model_config = _STRICT

    kv_budget_tokens: int = Field(65536, ge=1)
    """KV cache size in tokens, allocated once, in whole pages of 32; one sequence (a prompt and its
    rollout.max_tokens answer) must fit, and more run at once the larger it is."""
    max_num_seqs: int = Field(256, ge=1)
    """Most sequences decoded in one step."""
    max_num_batched_tokens: int = Field(4096, ge=1)
    """Per-step token budget shared by prefill chunks and decodes."""
    decode_graphs: bool = True
    """Replay recorded decode steps (exact fp32 native kernels; exact triton kernels of a dense model, as CUDA
    graphs; the same bits, less Python per step); false runs every step eagerly, as a model changed with ops a
    replay cannot repeat needs."""


class KLSettings(BaseModel):
    model_config = _STRICT

    coef: float = Field(0.0, ge=0.0)
    """Weight of KL(π_θ‖π_ref); 0 disables the reference model entirely."""
    kind: Literal["k1", "k2", "k3"] = "k3"
    """Schulman's estimator (algo/kl.py). In the loss, k1's expected gradient is 0, k2's is the reverse KL's,
    k3's the forward KL's; π_ref is taken at the sampling temperature without top-k/top-p."""
    where: Literal["loss", "reward"] = "loss"
    """`loss`: added to the loss per token; `reward`: subtracted from the sequence reward."""


class OverlongSettings(BaseModel):
    model_config = _STRICT

    mask_truncated: bool = False
    """Leave completions cut at `rollout.max_tokens` out of the loss (DAPO's overlong filtering; TRL's
    `mask_truncated_completions`): an unfinished answer teaches nothing either way. They still count in
    their group's advantage baseline and in the rollout metrics."""
    buffer_len: int = Field(0, ge=0)
    """DAPO's soft overlong punishment over the last `buffer_len` tokens before `rollout.max_tokens`
    (rollout/groups.py `overlong_penalty`); 0 = off."""
    penalty_factor: float = Field(1.0, ge=0.0)
    """Penalty at `rollout.max_tokens` tokens; it grows linearly from 0 across the buffer."""


class AlgorithmSettings(BaseModel):
    model_config = _STRICT

    advantage: str = "grpo"
    """grpo | dr_grpo | rloo | reinforce_pp | reinforce_pp_baseline."""
    advantage_kwargs: PlainData = Field(default_factory=dict)
    """e.g. {normalize_std: false} for GRPO without std normalisation."""
    loss: str = "ppo"
    """ppo | gspo | cispo | reinforce | sapo | topr."""
    loss_kwargs: PlainData = Field(default_factory=dict)
    """e.g. {eps_low: 0.2, eps_high: 0.28, dual_clip: 3.0} for PPO."""
    agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant-normalised"] = "token-mean"
    """How per-token losses become one number (algo/aggregation.py), over the step's whole batch: `token-mean`
    divides by its loss-mask tokens, `seq-mean-token-mean` averages each sequence over its own tokens and
    divides by its sequences, `seq-mean-token-sum` divides by its sequences, `constant-normalised` (Dr.GRPO)
    by rollout.max_tokens x its sequences."""
    kl: KLSettings = Field(default_factory=KLSettings)
    entropy_coef: float = 0.0
    """Entropy bonus weight (subtracted from the loss)."""
    corrections: list[PlainData] = Field(default_factory=list)
    """Off-policy corrections, each {name: ..., **kwargs}; empty for synchronous exact training."""
    overlong: OverlongSettings = Field(default_factory=OverlongSettings)
    """What a completion that hits the length limit gets: by default its task reward, like any other."""
    bypass: bool = False
    """Take the loss ratio against μ (the engine's logprobs) instead of π_old: π_θ/μ, no proximal policy."""


class OptimSettings(BaseModel):
    model_config = _STRICT

    lr: float = Field(5e-5, gt=0)
    """AdamW learning rate (after `warmup_steps`)."""
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.99)
    """AdamW's (β1, β2), each in [0, 1)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW's decoupled weight decay."""
    grad_clip: float = Field(1.0, gt=0)
    """Max global gradient norm."""
    router_aux_loss_coef: float = Field(0.0, ge=0)
    """Mixture-of-experts models: weight of the Switch-Transformer load-balancing loss added to the policy
    loss, E · Σ_i f_i · P_i over each micro-batch's tokens (transformers' `router_aux_loss_coef`; formula
    in `model/moe.py`), logged as `train/router_aux_loss`. 0 = off; above 0 on a dense model is refused."""
    micro_batch_size: int = Field(64, ge=1)
    """Sequences per forward/backward; gradients accumulate over the step's batch."""
    max_tokens_per_micro_batch: int | None = Field(None, ge=1)
    """Micro-batches by tokens instead of sequences: consecutive sequences while their prompt + completion
    tokens fit this budget (`micro_batch_size` then has no effect); a sequence longer than the budget is
    a micro-batch of its own. The loss denominators are the whole batch's either way (train/trainer.py
    `micro_batches`). null: `micro_batch_size` sequences per micro-batch."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute activations in the backward instead of keeping them (train/activation_ckpt.py): `full`
    checkpoints every decoder layer, `selective` every layer's MLP (its 3 x [tokens, intermediate]
    tensors). The same loss and gradients bit for bit, less peak memory, one more forward (`full`) or
    MLP forward (`selective`) per step. The engine never recomputes."""
    share_prompts: bool = True
    """Lay the prompt of a micro-batch's samples of one prompt out once in the trainer's forward (its
    whole KV pages; `model/logprobs.py` `pack_shared`): the same logprob bits, fewer rows to compute."""
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear learning-rate warm-up from 0 (0 = none)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """The learning rate after the warm-up: `constant`, or decaying from `lr` towards `min_lr_ratio` x
    `lr` at `max_steps` (train/setup.py `scheduled_lr`; as Hugging Face's schedulers, the last step's is
    still above it). A resume with another `max_steps` takes the new length's schedule from its next
    step on (the rate jumps to it)."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Where `linear` and `cosine` decay to, as a fraction of `lr` (verl's `min_lr_ratio`)."""
    fp32_master_weights: bool = True
    """With `model.dtype: bfloat16`: AdamW steps fp32 copies of the weights and rounds them into the bf16
    model after each step (train/master_weights.py; the engine and trainer still share the bf16 bits). false
    steps the bf16 weights themselves, where an update under half a bf16 spacing is lost (most of them
    at RL's learning rates). The default job's SFT warm start follows it too. No effect in float32."""
    shard_state: bool = False
    """Data-parallel runs (`--nproc N`): each rank keeps the AdamW moments of its share of the
    parameters only (ZeRO stage 1; 2x the parameters' memory split over the ranks). The weights are
    bitwise those of the unsharded run and checkpoints are the same; no effect in one process."""


class AsyncSettings(BaseModel):
    model_config = _STRICT

    enabled: bool = False
    """Generate the next batches on a second thread while the trainer trains (train/async_loop.py)."""
    max_staleness: int = Field(1, ge=0)
    """Largest policy-version lag of a trained token; the rollout thread runs at most this many steps
    ahead. 0 reproduces the synchronous loop bit for bit. Above 0, a resumed run's first batches are
    fresher than the uninterrupted run's (the batches sampled ahead are not saved): it goes on from the
    trained data position, not bit for bit."""
    inflight_updates: bool = False
    """Apply new weights between engine steps, inside a batch (tokens of one sequence may then come
    from several versions, each recorded)."""
    recompute_behaviour: bool = True
    """Keep the weights of the versions in the staleness window and recompute μ with them
    (`async/behaviour_recompute_abs_diff_max`: 0.0 in exact mode). Costs one forward per version."""


class SFTSettings(BaseModel):
    model_config = _STRICT

    steps: int = Field(300, ge=0)
    """Supervised warm-start steps for the default job's model (cached by config hash)."""
    batch_size: int = Field(64, ge=1)
    """Demonstrations per SFT step."""
    lr: float = Field(1e-3, gt=0)
    """SFT learning rate (AdamW)."""
    echo_frac: float = Field(0.55, ge=0.0, le=1.0)
    """Fraction of demonstrations that restate the question before the answer ("3+9=12"). The reward
    takes the first integer, so an echo scores 0: the warm-started model knows the sums but often
    answers in the wrong form, and GRPO has to find the form that is rewarded (RL sharpens what
    the model can already do, as in RL from verifiable rewards on a pretrained model)."""


class DistributedSettings(BaseModel):
    model_config = _STRICT

    strategy: Literal["ddp", "fsdp"] = "ddp"
    """How `--nproc N` ranks hold the model (exactrl/distributed): `ddp` replicates the weights, gradients
    and (unless `optim.shard_state`) AdamW's state on every rank; `fsdp` shards all three over the ranks
    with torch's FSDP2 (`fully_shard`; exactrl/distributed/fsdp.py), gathering the whole weights bitwise
    for each rank's engine. Weights agree with `ddp`'s up to rounding (docs/distributed.md). No effect in
    one process."""
    checkpoint: Literal["sharded", "full"] = "full"
    """With `strategy: fsdp`: `full` gathers the weights and optimizer state into the one-process format
    (resumable under either strategy, at any number of ranks); `sharded` writes each rank's shards with
    torch.distributed.checkpoint (less memory and time on rank 0; resumes at the same number of ranks)."""
