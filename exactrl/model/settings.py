"""Run-config section for the policy model."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from exactrl.argcheck import PathText
from exactrl.model.lora import TARGETS, check_targets


class LoRASettings(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    rank: int = Field(default=0, ge=0)
    """r, the adapters' inner dimension; 0 trains every weight (no LoRA). With r > 0 each targeted projection
    computes W x + (B (A x))·alpha/r unmerged in the trainer and the engine alike (bitwise equal), only A and
    B train and only they are synced to the engine; checkpoints hold them in PEFT's format."""
    alpha: float = Field(default=16.0, gt=0)
    """alpha: the adapters' output is scaled by alpha/rank (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Must be 0: dropout on the adapters' input would make the trainer's forward another function than the
    engine's sampling forward, so the step's logprobs would no longer start equal to the rollouts' (kept for
    PEFT's lora_dropout, which the checkpoints write as 0)."""
    targets: list[str] = Field(default_factory=lambda: list(TARGETS))
    """Projections adapted in every layer, by PEFT's names: q_proj, k_proj, v_proj, o_proj (attention),
    gate_proj, up_proj, down_proj (MLP)."""

    @field_validator("dropout")
    @classmethod
    def _dropout(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError(
                f"dropout={v}: LoRA dropout is not supported. It drops adapter inputs in the trainer's forward "
                f"only, so the trainer's logprobs would differ from the engine's that sampled the tokens "
                f"(train/train_rollout_logprob_abs_diff no longer 0); leave it at 0"
            )
        return v

    @field_validator("targets")
    @classmethod
    def _targets(cls, v: list[str]) -> list[str]:
        return list(check_targets(v))


class ModelSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    path: PathText | None = None
    """Hugging Face model directory (a family of docs/models.md: Qwen3, Qwen2, Llama, Mistral, Gemma, the
    mixtures of experts; RoPE scaling and sliding windows as the README's `load_model` paragraph lists);
    None builds (and caches) the default tiny model with a warm start."""
    tokenizer: PathText | None = None
    """Tokenizer directory; None uses `path` (or the default job's own tokenizer)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter and activation dtype for both trainer and engine. With `bfloat16` the logprobs and the
    loss are fp32 and the gradients bf16; the optimizer steps fp32 master copies of the weights
    (`optim.fp32_master_weights`), without which an update under half a bf16 spacing of its weight is
    lost (one AdamW step at lr 5e-5 left half of a tiny Qwen3's weights unchanged)."""
    kernels: Literal["exact", "fast"] = "exact"
    """`exact` makes train/rollout logprobs bitwise equal; `fast` shows the mismatch it removes."""
    device: str = "cpu"
    """Where the model, the engine and the trainer's forward and backward run: `cpu` or `cuda` (`cuda:N`).
    Per-token losses and advantages are computed on the host either way (they are small)."""
    backend: Literal["native", "triton"] | None = None
    """Kernel implementation: `native` (C, CPU only) or `triton` (CUDA; on CPU under Triton's interpreter,
    with TRITON_INTERPRET=1 set). None picks native on cpu and triton on cuda."""
    lora: LoRASettings = Field(default_factory=LoRASettings)
    """LoRA adapters (model/lora.py; docs/training.md "LoRA"): off unless `rank` > 0."""

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.fullmatch(r"cpu|cuda(:\d+)?", v):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {v!r}")
        return v
