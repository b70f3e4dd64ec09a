"""Fully sharded data parallel (`distributed.strategy: fsdp`): torch's FSDP2 (`fully_shard`) over gloo.

Invariant: every rank's engine samples with the whole weights, gathered
bitwise. FSDP2 shards each parameter along dim 0 (rank r holds rows
[r·⌈R/W⌉, (r+1)·⌈R/W⌉), the last shards padded); gathering is the
concatenation of those rows, no arithmetic, so the gathered tensor is the
bits the owner ranks hold, and every rank receives the same ones. So
`train/train_rollout_logprob_abs_diff` stays 0.0 on every rank as in `ddp`.

A step under FSDP2 (train/trainer.py): each decoder layer and the root
(embeddings, final norm, head) is one FSDP unit; a unit's forward all-gathers
its parameters and frees them after (the root keeps its own until the
backward), its backward all-gathers them again and reduce-scatters the
gradient: rank r receives the SUM over ranks of its rows' gradients (the
losses are normalised by the whole batch, as in `ddp`; gloo has no
pre-scaled sum, so the sum is forced and the divide factor is 1). Every
collective must be entered by every rank in the same order, so every rank
runs the same number of forwards and backwards (`trainer.train_step` pads
with zero-weight micro-batches). Then AdamW steps each rank's shard: its
moments are DTensors of the same shape, so parameters, gradients and
optimizer state are all split over the ranks.

Against `ddp`: the gradient is summed over ranks per micro-batch here and
per step there, and the gradient norm is a sum of per-shard squares; the
weights agree up to rounding (docs/distributed.md states the measured
difference and tests/integration/distributed/test_fsdp.py its bound).

Checkpoints (`distributed.checkpoint`): `full` gathers the weights and
AdamW's state into the one-process format (train/checkpoint.py), which
resumes under `ddp` or `fsdp` at any number of ranks; `sharded` writes each
rank's shards with torch.distributed.checkpoint (DCP) into the checkpoint
directory, which resumes bitwise at the same number of ranks.

Legend: W ranks, R a parameter's rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from exactrl.distributed import Ranks

DCP_METADATA = ".metadata"  # the file DCP writes last into a sharded checkpoint: its presence marks one
ADAMW_STATE = ("exp_avg", "exp_avg_sq")  # AdamW's per-element moments (its `step` is one scalar)


def shard_model(model: torch.nn.Module, ranks: Ranks) -> torch.nn.Module:
    """Applies `fully_shard` to every decoder layer and then to the whole model (in place; returns it)."""
    mesh = init_device_mesh("cpu", (ranks.world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # the sum over ranks: the loss is the whole batch's already
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo refuses PREMUL_SUM and AVG)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def full(t: Any) -> Any:
    """A DTensor's whole tensor (an all-gather: every rank must call it), anything else as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state(obj: Any) -> Any:
    """`obj` (nested dicts and lists, e.g. a state dict) with every DTensor gathered whole: a collective."""
    if isinstance(obj, dict):
        return {k: full_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(full_state(v) for v in obj)
    return full(obj)


def local_numel(params) -> tuple[int, int]:
    """(elements of the parameters this rank holds, elements of the whole parameters)."""
    mine = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
    return mine, sum(p.numel() for p in params)


def _adamw(optimizer) -> torch.optim.Optimizer:
    """The AdamW whose state holds the moments: the inner one of fp32 master weights (train/master_weights.py)."""
    return getattr(optimizer, "inner", optimizer)


@torch.no_grad()
def load_full_optimizer_state(optimizer, state: dict) -> None:
    """Loads a whole (one-process format) optimizer state into an optimizer over sharded parameters: each
    moment and master weight is cut to this rank's rows (`distribute_tensor` without communication: every
    rank holds the whole state and keeps its own part)."""
    params = [p for g in _adamw(optimizer).param_groups for p in g["params"]]

    def cut(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return distribute_tensor(t.to(like.dtype), like.device_mesh, like.placements, src_data_rank=None)

    masters = "master" in state and "inner" in state
    inner = state["inner"] if masters else state
    moments = {
        i: {**s, **{name: cut(s[name], params[int(i)]) for name in ADAMW_STATE}} for i, s in inner["state"].items()
    }
    inner = {**inner, "state": moments}
    if masters:
        optimizer.load_state_dict({"inner": inner, "master": [cut(m, p) for m, p in zip(state["master"], params)]})
    else:
        optimizer.load_state_dict(inner)


def dcp_state(model: torch.nn.Module, optimizer) -> dict[str, torch.Tensor]:
    """The flat dict DCP saves: `model.<name>` (each rank's shard), `optim.<i>.<exp_avg|exp_avg_sq|step>`
    for the i-th stepped parameter, and `master.<i>` with fp32 master weights. Plain names, so a loader
    builds its own template from them."""
    out: dict[str, torch.Tensor] = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, s in _adamw(optimizer).state_dict()["state"].items():
        out |= {f"optim.{i}.{k}": v for k, v in s.items()}
    if _adamw(optimizer) is not optimizer:
        out |= {f"master.{i}": m for i, m in enumerate(optimizer.master)}
    return out


def save_sharded(directory: Path, model: torch.nn.Module, optimizer) -> None:
    """Every rank writes its shards into `directory` (DCP; a collective: rank 0 writes the metadata last)."""
    dcp.save(dcp_state(model, optimizer), checkpoint_id=str(directory))


@torch.no_grad()
def load_sharded(directory: Path, model: torch.nn.Module, optimizer) -> None:
    """Fills the sharded model and its optimizer from a sharded checkpoint (DCP reads each rank's rows). The
    optimizer's state template has the parameters' own shards for each moment the checkpoint holds."""
    keys = set(dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata)
    params = [p for g in _adamw(optimizer).param_groups for p in g["params"]]
    template: dict[str, torch.Tensor] = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, p in enumerate(params):
        if f"optim.{i}.step" in keys:
            template[f"optim.{i}.step"] = torch.zeros((), dtype=torch.float32)
            template |= {f"optim.{i}.{k}": torch.zeros_like(p) for k in ADAMW_STATE}
    masters = _adamw(optimizer) is not optimizer
    if masters:
        template |= {f"master.{i}": torch.zeros_like(m) for i, m in enumerate(optimizer.master)}
    missing = sorted(set(template) - keys)
    if missing:
        raise ValueError(
            f"sharded checkpoint {directory} does not fit this model and optimizer: it lacks {missing[:3]} "
            f"(and {max(0, len(missing) - 3)} more)"
        )
    dcp.load(template, checkpoint_id=str(directory))
    model.load_state_dict({k[6:]: v for k, v in template.items() if k.startswith("model.")})
    inner = _adamw(optimizer).state_dict()
    inner["state"] = {
        i: {k: template[f"optim.{i}.{k}"] for k in ("step", *ADAMW_STATE)}
        for i in range(len(params))
        if f"optim.{i}.step" in template
    }
    if masters:
        optimizer.load_state_dict({"inner": inner, "master": [template[f"master.{i}"] for i in range(len(params))]})
    else:
        optimizer.load_state_dict(inner)
