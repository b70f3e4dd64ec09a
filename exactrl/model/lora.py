"""LoRA adapters on the one model (Hu et al. 2021), run unmerged by the trainer and the engine alike.

A targeted projection computes

    y = W x + (B (A x)) · α/r          A: [r, in], B: [out, r]

with W x, A x and B(·) each through the model's kernels' linear, then the
scale, then the sum (`transformer.Linear.adapted`), in this order on every
path: the trainer's forward, the engine's prefill, its decode steps and their
recorded graphs. So in `exact` mode the engine's logprobs stay the trainer's
bit for bit (docs/design.md §5). The engine never merges B A into W: the
merged sum rounds differently from the unmerged one, and every step would
sync whole weight matrices again. Merging is for export only (`merge_lora`),
where a plain Hugging Face checkpoint is the point.

Only the adapters train: `add_lora` freezes every other parameter, a run's
optimizer takes the trainable ones, and `synced_weights` (what a run copies
to its engine after a step) is the adapters alone. `engine_copy` gives an
engine the frozen base weights by reference, so the base is held once.

Where this departs from PEFT: no dropout. PEFT's `lora_dropout` drops inputs
of A in the training forward only, which would make the trainer's π_θ another
function than the engine's sampling distribution μ at the step's start (the
ratio π_θ/π_old is then not 1 on-policy); `model.lora.dropout` > 0 is refused.
Initialisation is PEFT's: A uniform in ±1/√in (kaiming-uniform, a = √5), B = 0,
so the adapted model starts as the base model exactly. Parameter names follow
PEFT's (`model.layers.0.self_attn.q_proj.lora_A.weight`); lora_files.py
writes and reads PEFT's adapter format.
"""

from __future__ import annotations

import copy
import hashlib
import sys
from dataclasses import dataclass

import torch

from exactrl.model.transformer import CausalLM, Linear

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # PEFT's module names


@dataclass(frozen=True)
class LoRASpec:
    """The adapters a model carries (`CausalLM.lora`)."""

    rank: int  # r: the inner dimension of B A
    alpha: float  # α: the adapter's output is scaled by α/r
    targets: tuple[str, ...]  # the projections adapted in every layer (TARGETS' names)
    base: str | None  # the base model's directory, written as PEFT's base_model_name_or_path
    base_sha256: str  # the base weights' digest when the adapters were attached (`base_digest`)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def check_targets(targets) -> tuple[str, ...]:
    """The target names as a tuple, or a ValueError naming the valid ones."""
    if isinstance(targets, str) or not targets:
        raise ValueError(f"LoRA targets must be a non-empty list of projection names from {list(TARGETS)}")
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        raise ValueError(f"LoRA targets {bad} are not projections of the model; valid names: {list(TARGETS)}")
    if len(set(targets)) != len(targets):
        raise ValueError(f"LoRA targets name a projection twice: {list(targets)}")
    return tuple(targets)


def check_rank_alpha(rank, alpha) -> None:
    if type(rank) is not int or rank < 1:
        raise ValueError(f"LoRA rank must be an int >= 1, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < float("inf"):
        raise ValueError(f"LoRA alpha must be a number > 0, got {alpha!r}")


def adapted_linears(model: CausalLM, targets) -> dict[str, Linear]:
    """The model's projections named by `targets`, by module name (model.layers.I.self_attn.q_proj, ...)."""
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, Linear) and name.rsplit(".", 1)[-1] in targets and name.startswith("model.layers.")
    }


def base_digest(model: CausalLM) -> str:
    """sha256 over the names, dtypes, shapes and bytes of every parameter that is not an adapter's: a LoRA
    checkpoint records it, and loading its adapters onto another base is refused (`lora_files.load_adapters`)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        t = p.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()


def add_lora(
    model: CausalLM, rank: int, alpha: float, targets=TARGETS, seed: int = 0, base: str | None = None
) -> CausalLM:
    """Attaches LoRA adapters to `targets` in every layer and freezes every other parameter; returns `model`.

    A is drawn from its own generator seeded by `seed` (PEFT's init), B is zero. Adapters take the model's
    dtype and device. Attach them before an Engine is made over the model (its decode graphs list the
    parameters when it is created). `base`: the base model's directory, for the adapter files."""
    check_rank_alpha(rank, alpha)
    targets = check_targets(targets)
    if model.lora is not None:
        raise ValueError("the model already carries LoRA adapters")
    digest = base_digest(model)
    model.requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    for _, m in sorted(adapted_linears(model, targets).items()):  # a fixed order of draws: by name
        d_out, d_in = m.weight.shape
        m.lora_A = Linear(m.kernels, d_in, rank, False)
        m.lora_B = Linear(m.kernels, rank, d_out, False)
        with torch.no_grad():
            bound = 1.0 / d_in**0.5
            m.lora_A.weight.copy_(torch.rand(rank, d_in, generator=g, dtype=torch.float64) * (2 * bound) - bound)
            m.lora_B.weight.zero_()
        m.lora_A.to(m.weight.device, m.weight.dtype)
        m.lora_B.to(m.weight.device, m.weight.dtype)
        m.lora_scale = alpha / rank
    model.lora = LoRASpec(rank, float(alpha), targets, base, digest)
    return model


def adapter_weights(model: CausalLM) -> dict[str, torch.Tensor]:
    """The adapters' parameters by name (model.layers.0.self_attn.q_proj.lora_A.weight, ...); {} without LoRA."""
    return {n: p for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}


def synced_weights(model: CausalLM) -> dict[str, torch.Tensor]:
    """What a run copies to its engine after a step: a LoRA model's adapters (the base never changes), else
    the whole state dict."""
    sd = adapter_weights(model) if model.lora is not None else model.state_dict()
    fsdp = sys.modules.get("exactrl.distributed.fsdp")  # imported by a run that shards its model
    return fsdp.full_state(sd) if fsdp is not None and fsdp.is_sharded(model) else sd


def trainable_parameters(model: CausalLM) -> list[torch.nn.Parameter]:
    """The parameters an optimizer steps: a LoRA model's adapters, else every parameter."""
    return [p for p in model.parameters() if p.requires_grad]


def engine_copy(model: CausalLM) -> CausalLM:
    """A copy of the model for an engine, without gradients. A LoRA model's frozen base weights are shared,
    not copied (they never change: the engine holds the base once with the trainer); its adapters are copied."""
    shared = {id(p): p for p in model.parameters() if not p.requires_grad} if model.lora is not None else {}
    return copy.deepcopy(model, memo=shared).requires_grad_(False)


@torch.no_grad()
def merge_lora(model: CausalLM) -> CausalLM:
    """A copy of a LoRA model without adapters whose weights are W + (α/r) B A, summed in float64 and rounded
    once to the model's dtype: for export (a plain Hugging Face checkpoint), never for the engine (it computes
    other bits than the unmerged forward). The adapters are taken as they are now."""
    if model.lora is None:
        raise ValueError("the model carries no LoRA adapters to merge")
    merged = copy.deepcopy(model)
    for m in adapted_linears(merged, model.lora.targets).values():
        w = m.weight.double() + m.lora_scale * (m.lora_B.weight.double() @ m.lora_A.weight.double())
        m.weight.copy_(w.to(m.weight.dtype))
        m.lora_A = m.lora_B = None
        m.lora_scale = 0.0
    merged.lora = None
    return merged.requires_grad_(True)
