"""The run directory: its name, the checks before a run writes it, its creation and its lock.

A run dir holds one run (`metrics.jsonl`, `checkpoints/`, `.lock`; RUN_MARKERS) and what it writes beside
them (RUN_WRITES). It is checked before anything expensive (a warm start, a model load), created only once
nothing else can fail, and locked for the run (`lock_run_dir`): two runs never write one dir.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from exactrl.train.checkpoint import latest_checkpoint
from exactrl.train.config import RunConfig
from exactrl.train.logger import run_logger


def check_run_dir(cfg: RunConfig, locked: bool = False) -> Path:
    """The run directory, checked but not created (build creates it once nothing else can fail); `locked`:
    this process holds its lock."""
    if cfg.run_dir is None:
        cfg.run_dir = default_run_dir()
    d = Path(cfg.run_dir)
    if d.exists() and not d.is_dir():
        raise ValueError(f"run_dir {d} is a file: choose another run_dir")
    clash = [f for f in RUN_WRITES if (d / f).exists()] if d.is_dir() else []
    if clash and not any((d / f).exists() for f in RUN_MARKERS):
        raise ValueError(
            f"run_dir {d} holds {clash[0]} but no exactrl run (a model directory?): a run would "
            f"overwrite it; choose a new or empty directory"
        )
    if not d.exists():
        check_creatable(d)
    if (d / "checkpoints").exists() and not (d / "checkpoints").is_dir():
        raise ValueError(f"run_dir {d}: checkpoints is a file, where the run keeps its checkpoint directories")
    if not locked and (d / ".lock").is_file():  # a live run first: no advice that taking its dir over would then refuse
        lock_run_dir(d, probe=True).close()
    ckpt = latest_checkpoint(d) if d.exists() else None
    if ckpt is not None and not cfg.resume:
        raise ValueError(
            f"run_dir {d} already holds checkpoints: pass --set resume=true to continue it, or choose another run_dir"
        )
    if ckpt is None and (d / "metrics.jsonl").exists() and not cfg.resume:
        # resume=true restarts it from step 0: it stopped before its first checkpoint, its rows are redone
        raise ValueError(
            f"run_dir {d} already holds a run (with no checkpoint yet): pass --set resume=true to "
            f"start it again from step 0, or choose another run_dir"
        )
    return d


RUN_MARKERS = (".lock", "metrics.jsonl", "checkpoints")  # a directory with one of them holds a run
# what else a run writes in its dir
RUN_WRITES = ("config.json", "report", "tensorboard", "samples.jsonl", "trackers.json", "wandb")


def check_creatable(d: Path) -> None:
    """A run dir that does not exist yet can be made: no dangling link on the way, and its nearest existing
    ancestor is a writable directory that takes a new one (a probe made and removed at once: /proc passes
    os.access for root and refuses every mkdir, which a run found only after its warm start)."""
    p = d
    while not p.exists():
        if p.is_symlink():
            raise ValueError(f"run_dir {d} cannot be created: {p} is a symbolic link to nothing")
        p = p.parent
    if not p.is_dir():
        raise ValueError(f"run_dir {d} cannot be created: {p} is not a directory")
    if not os.access(p, os.W_OK | os.X_OK):
        raise ValueError(f"run_dir {d} cannot be created: {p} is not writable")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".exactrl-probe-", dir=p))
    except OSError as e:
        raise ValueError(f"run_dir {d} cannot be created: a directory cannot be made in {p} ({e.strerror})") from None


def default_run_dir() -> str:
    """runs/<date>-<time>, with _2, _3, ... if runs started in the same second."""
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    d, n = base, 1
    while d.exists():
        n += 1
        d = base.with_name(f"{base.name}_{n}")
    return str(d)


def claim_run_dir(cfg: RunConfig, run_dir: Path, named: bool, ckpt: Path | None, start: int, logger=run_logger):
    """(run dir, whether this run created it, its lock, the logger): rank 0 creates the dir (a default name
    taken meanwhile moves to the next free one), locks it and checks it again under the lock. `logger`
    makes the logger from (cfg, run dir, start step)."""
    new_run_dir = make_dir(run_dir)
    while not (named or new_run_dir):  # another run took this default name meanwhile: the next free one
        cfg.run_dir = default_run_dir()
        run_dir = Path(cfg.run_dir)
        new_run_dir = make_dir(run_dir)
    run_lock = lock_run_dir(run_dir)
    try:  # the checks again, under the lock: a run that ended meanwhile may have written the dir
        check_run_dir(cfg, locked=True)
        if latest_checkpoint(run_dir) != ckpt:
            raise ValueError(
                f"run_dir {run_dir} got a new checkpoint while this run was starting (another run "
                f"wrote it): start again to resume from it, or choose another run_dir"
            )
        log = logger(cfg, run_dir, start)
    except BaseException:
        if new_run_dir:  # made and locked by this run, which wrote nothing in it yet: no empty run is left
            shutil.rmtree(run_dir, ignore_errors=True)
        run_lock.close()
        raise
    return run_dir, new_run_dir, run_lock, log


def lock_run_dir(d: Path, probe: bool = False):
    """An exclusive lock on d/.lock, held while the returned file is open (the OS drops it if the process
    dies): two runs never write one run dir. A ValueError if another run holds it. `probe`: a shared lock,
    only to ask whether a run holds it; the ranks of one run probe at the same moment, and two exclusive
    probes refused one of them as "in use"."""
    import fcntl

    try:
        f = open(d / ".lock", "a")
    except OSError as e:
        raise ValueError(f"run_dir {d}: cannot write its lock file ({e.strerror or e})") from None
    try:
        fcntl.flock(f, (fcntl.LOCK_SH if probe else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise ValueError(
            f"run_dir {d} is in use by another run: wait for it to end, or choose another run_dir"
        ) from None
    return f


def make_dir(d: Path) -> bool:
    """Creates d (and its parents); True if this call created it (atomic: of two runs, one gets True)."""
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        d.mkdir()
        return True
    except FileExistsError:
        if d.is_dir():
            return False
        raise ValueError(f"run_dir {d} cannot be created: a file or link is in the way") from None
    except OSError as e:
        raise ValueError(f"run_dir {d} cannot be created: {e.strerror or e}") from None
