"""Run-config section for the policy model."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator

from exactrl.argcheck import PathText


class ModelSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    path: PathText | None = None
    """Hugging Face model directory (Qwen3, Qwen2, Llama or Mistral; RoPE scaling and sliding windows as the
    README's `load_model` paragraph lists); None builds (and caches) the default tiny model with a warm start."""
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

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.fullmatch(r"cpu|cuda(:\d+)?", v):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {v!r}")
        return v
