"""Atomic checkpoints holding the complete training state.

Layout: RUN_DIR/checkpoints/step_000040/{model.safetensors, config.json,
optimizer.pt, state.json} plus RUN_DIR/checkpoints/latest (a one-line pointer).
state.json records the sha256 of each other file (`file_sha256`), checked on
resume (`verify_digests`): flipped bytes behind an intact header would load
and train from garbage weights without a word.
A checkpoint is written into a temporary directory, fsynced, renamed into
place, and only then does `latest` move (os.replace is atomic on POSIX): a
crash at any point leaves the previous checkpoint and pointer intact. Each
rename is fsynced before the next step (the directory too), old checkpoints
are pruned only after the pointer is on disk, and a pointer that names no
complete checkpoint falls back to the newest complete one (checkpoints past the
step being saved, a history the run left, are moved aside to abandoned_step_N
so neither pruning nor that fallback mistakes them for the newest). The model part is
a normal Hugging Face directory that `load_model` and transformers read; a LoRA
run's is its adapters alone, {adapter_model.safetensors, adapter_config.json}
in PEFT's format, which peft loads onto the base model (`exactrl export
--merge` writes the merged model).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from exactrl.model import load_model, save_model
from exactrl.model.lora_files import ADAPTER_CONFIG, is_adapter_dir, load_adapters, save_adapters
from exactrl.model.transformer import CausalLM

log = logging.getLogger("exactrl.checkpoint")


SHARDS_METADATA = ".metadata"  # torch.distributed.checkpoint's index: a checkpoint of FSDP shards has it
DIGESTS = "file_sha256"  # state.json's key: {file name: sha256 hex digest} of every other file of the checkpoint


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the message names the one that is intact and how to go on."""


def _fsync(path: Path) -> None:
    """fsync of a file or directory (a directory's: its entries, so a rename in it reaches the disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(path: Path, text: str) -> None:
    """Writes `path` whole or not at all, on disk when this returns: a temporary file, fsynced, renamed
    over it, and the directory fsynced (a crash or power cut leaves the old text or the new)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    _fsync(tmp)
    os.replace(tmp, path)
    _fsync(path.parent)


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir():
        _fsync(f)
    _fsync(path)


def _step_dirs(root: Path) -> list[Path]:
    """The checkpoint directories under root, oldest first (by step number: step_1000000 > step_999999)."""
    return sorted(
        (p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()), key=lambda p: int(p.name[5:])
    )


def begin_checkpoint(run_dir: Path, step: int) -> Path:
    """The empty directory a checkpoint of `step` is written into before its rename, what a crash or a full
    disk left removed first. `save_checkpoint` calls it; a sharded one (distributed/fsdp.py), whose ranks
    write their shards into it before rank 0 calls `save_checkpoint(..., shards=True)`, first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        root.mkdir(parents=True)
        _fsync(root.parent)
    for stale in [*root.glob(".tmp_step_*"), *root.glob(".old_step_*")]:  # left by a crash or a full disk
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp_step_{step:06d}"
    tmp.mkdir()
    return tmp


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: CausalLM,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep: int,
    whole: tuple[dict, dict] | None = None,
    shards: bool = False,
) -> Path:
    """Writes the checkpoint of `step` (the model, the optimizer's state and the trainer's `state`) and prunes
    to `keep`. `whole`: (weights, optimizer state) to write instead of the model's and optimizer's own (a
    sharded model's, gathered); `shards`: the ranks wrote their shards into `begin_checkpoint`'s directory,
    which takes the place of the model and optimizer files."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}" if shards else begin_checkpoint(run_dir, step)
    try:
        if not shards:
            if model.lora is not None:  # the adapters alone, in PEFT's format: the base is model.path's, unchanged
                save_adapters(model, tmp)
            else:
                save_model(model, tmp, None if whole is None else whole[0])
            torch.save(optimizer.state_dict() if whole is None else whole[1], tmp / "optimizer.pt")
        digests = {f.name: _sha256(f) for f in sorted(tmp.iterdir())}  # read back: the bytes on disk
        (tmp / "state.json").write_text(json.dumps({"step": step, **state, DIGESTS: digests}))
        _fsync_dir(tmp)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # the previous checkpoint and pointer are untouched
        fix = _write_failure_fix(e)
        if fix is not None:
            kept = latest_checkpoint(run_dir)
            raise CheckpointWriteError(
                f"the checkpoint of step {step} could not be written to {root} ({e}); "
                f"{f'{kept.name} is intact' if kept else 'no earlier checkpoint is kept'}: {fix} "
                f"and resume"
            ) from e
        raise
    if final.exists():  # a complete step_N a crash left unnamed: renamed first, as pruning does, so one
        gone = root / f".old_{final.name}"  # cut short by a kill never looks like a checkpoint
        os.replace(final, gone)
        shutil.rmtree(gone, ignore_errors=True)
    os.replace(tmp, final)
    _fsync(root)  # the rename is on disk before the pointer names it
    replace_durably(root / "latest", final.name + "\n")  # on disk before an older checkpoint goes
    _set_aside_later_steps(root, step)
    # only complete ones count: an empty or half-copied step_ directory never pushes an intact one out
    for old in [p for p in _step_dirs(root) if p != final and (p / "state.json").is_file()][: -(keep - 1) or None]:
        gone = root / f".old_{old.name}"  # renamed first: one cut short never looks like a checkpoint
        try:
            os.replace(old, gone)
            shutil.rmtree(gone, ignore_errors=True)
        except OSError as e:  # the new checkpoint is safe: an old one left over stops no run
            log.warning("could not remove the old checkpoint %s (%s); it stays", old, e)
    return final


def _write_failure_fix(e: BaseException) -> str | None:
    """What to do about an error that writing a checkpoint's files raised, if the disk caused it; None if not.
    A full disk shows as an OSError, as torch's zip writer's RuntimeError (from inline_container.cc) or as
    safetensors' SafetensorError (its message holds the OS error: "No space left on device")."""
    if isinstance(e, SafetensorError):
        return "free disk space" if "No space left" in str(e) or "StorageFull" in str(e) else "fix that"
    if isinstance(e, OSError) or (isinstance(e, RuntimeError) and "inline_container" in str(e)):
        return "free disk space" if getattr(e, "errno", None) in (None, errno.ENOSPC) else "fix that"
    return None


def _set_aside_later_steps(root: Path, step: int) -> None:
    """Complete checkpoints past `step` belong to a history this run left: a crash after one's rename but
    before its pointer's (the run resumed from the one before), or a `latest` rewound by hand. Kept among
    the step_ directories they would count as the newest when pruning and, were the pointer lost, be
    resumed from. They are renamed to abandoned_step_N (nothing is deleted) and named in a warning."""
    for later in [p for p in _step_dirs(root) if int(p.name[5:]) > step and (p / "state.json").is_file()]:
        aside = root / f"abandoned_{later.name}"
        n = 1
        while aside.exists():
            aside, n = root / f"abandoned_{later.name}.{n}", n + 1
        try:
            os.replace(later, aside)
            log.warning("checkpoint %s is past the step this run saved (%d): moved to %s", later.name, step, aside.name)
        except OSError as e:
            log.warning(
                "checkpoint %s is past the step this run saved (%d) and could not be moved aside (%s)",
                later.name,
                step,
                e,
            )
    _fsync(root)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_digests(directory: Path) -> bool:
    """Checks every file `directory`'s state.json records a sha256 for (a checkpoint's `file_sha256`) against
    the bytes there. True if they all match; False if there is nothing to check (no state.json, or one
    without digests: a checkpoint written before they were kept, or a plain model directory); a ValueError
    naming the first file that differs or is missing."""
    directory = Path(directory)
    path = directory / "state.json"
    if not path.is_file():
        return False
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read ({type(e).__name__}: {e})") from None
    digests = state.get(DIGESTS) if isinstance(state, dict) else None
    if digests is None:
        return False
    if not (
        isinstance(digests, dict)
        and all(
            isinstance(k, str) and "/" not in k and k not in ("", ".", "..") and isinstance(v, str)
            for k, v in digests.items()
        )
    ):
        raise ValueError(f"{path} is damaged: its {DIGESTS} is not a mapping of file names to sha256 digests")
    for name, expected in digests.items():
        if not (directory / name).is_file():
            raise ValueError(f"{directory / name} is missing (state.json records its sha256)")
        if _sha256(directory / name) != expected:
            raise ValueError(
                f"{directory / name} is damaged: its sha256 differs from the one recorded when it "
                f"was written (state.json)"
            )
    return True


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `latest` names; if it names none that is complete (a crash between a checkpoint's
    rename and the pointer's, or a lost pointer), the newest complete one there is; None if none is."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / "latest"
    complete = [p for p in _step_dirs(root) if (p / "state.json").is_file()] if root.is_dir() else []
    named = pointer.read_text(errors="replace").strip() if pointer.is_file() else ""  # garbage names none
    return next((p for p in complete if p.name == named), complete[-1] if complete else None)


_NO_OTHER = "; no other checkpoint is there: restore its files from a copy, or start the run afresh"


def load_checkpoint(
    path: Path,
    dtype: str,
    kernels: str,
    note: Callable[[str], Any] = log.warning,
    device: str = "cpu",
    backend: str | None = None,
    base: CausalLM | None = None,
) -> tuple[CausalLM, dict | None, dict[str, Any]]:
    """(model, optimizer state dict, trainer state) of a checkpoint directory, its files checked against the
    digests state.json records (one written without them is loaded with a `note`); a ValueError naming the
    file that cannot be read or differs. The model is loaded on `device` with `backend` (`load_model`). A
    LoRA run's checkpoint holds adapters only: they are loaded onto `base` (the run's model with its adapters
    attached, `lora_files.load_adapters`), which is returned. A checkpoint of FSDP shards gives (`base`, None,
    trainer state): distributed/fsdp.py `load_sharded` reads the shards once the model is sharded."""
    older = [p.name for p in _step_dirs(path.parent) if p != path]
    hint = (
        f"; older checkpoints there: {', '.join(older)} (remove {path.name} to resume from the newest)" if older else ""
    )
    errors = (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError)
    try:
        state = json.loads((path / "state.json").read_text())
    except errors as e:
        raise ValueError(f"checkpoint {path} cannot be read ({type(e).__name__}: {e}){hint}") from None
    if not (
        isinstance(state, dict)
        and type(state.get("step")) is int
        and state["step"] >= 0
        and isinstance(state.get("prompts"), dict)
        and isinstance(state.get("config", {}), dict)
    ):
        raise ValueError(
            f"checkpoint {path}: state.json is damaged (it needs an object with an integer step >= 0, "
            f"the prompts' position and the run config){hint}"
        )
    if path.name[5:].isdigit() and state["step"] != int(path.name[5:]):  # a run would go on from the wrong step
        raise ValueError(
            f"checkpoint {path}: state.json is damaged (its step {state['step']} is not the "
            f"directory's {int(path.name[5:])}){hint}"
        )
    try:  # before loading: damaged bytes behind an intact header load, and the run trains on from garbage
        verified = verify_digests(path)
    except ValueError as e:
        raise ValueError(f"checkpoint {path} cannot be read ({e}){hint or _NO_OTHER}") from None
    if not verified:
        note(
            f"note: checkpoint {path.name} records no file digests (written by an earlier exactrl): its files "
            f"are loaded unchecked"
        )
    if is_adapter_dir(path) and (base is None or base.lora is None):
        raise ValueError(
            f"checkpoint {path} holds LoRA adapters ({ADAPTER_CONFIG}), not a whole model: resume it with the "
            f"model.lora settings it was saved with"
        )
    try:
        if (path / SHARDS_METADATA).is_file():  # FSDP shards (distributed/fsdp.py): the caller reads them
            state.pop(DIGESTS, None)
            return base, None, state
        if is_adapter_dir(path):
            model = load_adapters(base, path)
        else:
            model = load_model(path, dtype=dtype, kernels=kernels, device=device, backend=backend)
        opt_state = torch.load(path / "optimizer.pt", weights_only=False, map_location=model.device)
    except errors as e:
        raise ValueError(f"checkpoint {path} cannot be read ({type(e).__name__}: {e}){hint}") from None
    state.pop(DIGESTS, None)  # the trainer's state is what save_checkpoint was given
    return model, opt_state, state
