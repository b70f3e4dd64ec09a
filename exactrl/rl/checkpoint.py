"""Atomic checkpoints holding the complete training state.

Layout: RUN_DIR/checkpoints/step_000040/{model.safetensors, config.json,
optimizer.pt, state.json} plus RUN_DIR/checkpoints/latest (a one-line pointer).
A checkpoint is written into a temporary directory, fsynced, renamed into
place, and only then does `latest` move (os.replace is atomic on POSIX): a
crash at any point leaves the previous checkpoint and pointer intact. The model
part is a normal Hugging Face directory that `load_model` and transformers read.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from exactrl.model import load_model, save_model
from exactrl.model.transformer import CausalLM


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: Path, step: int, model: CausalLM, optimizer: torch.optim.Optimizer,
                    state: dict[str, Any], keep: int) -> Path:
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tmp)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, **state}))
    _fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = root / ".latest.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, root / "latest")
    for old in sorted(p for p in root.glob("step_*") if p != final)[:-(keep - 1) or None]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    if not (path / "state.json").is_file():
        raise ValueError(f"checkpoint pointer {pointer} names {path}, which is incomplete")
    return path


def load_checkpoint(path: Path, dtype: str, kernels: str) -> tuple[CausalLM, dict, dict[str, Any]]:
    """(model, optimizer state dict, trainer state) of a checkpoint directory."""
    model = load_model(path, dtype=dtype, kernels=kernels)
    opt_state = torch.load(path / "optimizer.pt", weights_only=False)
    return model, opt_state, json.loads((path / "state.json").read_text())
