"""Data-parallel training over torch.distributed (gloo on CPU): one process per rank, many machines.

    exactrl train --nproc 2 [CONFIG] [--set ...]          N processes on this machine
    torchrun --nnodes 2 --nproc-per-node 1 ... -m exactrl train [CONFIG] [--set ...]
                                                          across machines (RANK, WORLD_SIZE, MASTER_ADDR, ...)

Every rank holds the whole model, its own engine and the same optimizer. A
step (train/loop.py):

    prompts: every rank takes the same batch; rank r samples the prompts
             k = r, r + W, r + 2W, ...  (seeds depend on k only: the tokens
             are those one process would sample)
    gather:  every rank receives every group (all_gather of the rollouts),
             so rewards, advantages and rollout metrics are the whole batch's
    train:   rank r runs forward/backward over its share of the sequences
             (same stride), with the loss normalised by the WHOLE batch's
             token and sequence counts; gradients are summed over ranks
             (one all_reduce), then every rank clips and steps alike
    check:   a fingerprint of the new weights is compared across ranks; ranks
             that diverge stop the run (they must hold the same bits for
             every engine's μ to be the trainer's π_old)
    async:   (async_loop.py) each rank's rollout thread samples its share;
             the trainer thread gathers the shares, so collectives run on
             one thread only
    rank 0:  evaluation is sharded like rollouts; rank 0 alone logs and
             writes checkpoints (the run dir must be one path every rank
             reads: a shared filesystem across machines)
    optim:   with `optim.shard_state`, each rank keeps the AdamW moments of
             its share of the parameters only (ZeRO stage 1), steps those
             and broadcasts them; AdamW updates every element on its own,
             so the weights are bitwise those of the unsharded run

Exactness is unchanged: each rank's engine and trainer are one process, so
`train/train_rollout_logprob_abs_diff` is 0.0 on every rank (it is measured
over the whole batch). A W-rank run is not bitwise a one-process run after
step 1: the gradient is summed in another order (last bits), and the
weights then drift by rounding. Python's and torch's random streams are
per rank and saved per rank in the checkpoint; a run resumes with the same
number of ranks.

Legend: W ranks (world size), r this rank.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from exactrl.console import stderr_line

TIMEOUT_S = 1800  # a collective waits this long for a slow or dead rank before the run fails
# after a rank fails, the launcher lets the others end on their own (a collective with a dead peer fails at
# once) before it stops them: rank 0 may be writing the checkpoint of a step every rank finished
FAILED_RANK_GRACE_S = 20
# a signal sent to the launcher alone (a job manager, kill -INT) is passed on to the ranks; a SIGINT after a
# moment, since a Ctrl-C at a terminal reaches every rank itself and a second one would cut its stop short
FORWARD_DELAY_S = 2
STOP_GRACE_S = 30  # a rank still running this long after it was told to stop is killed (SIGKILL)


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job; `Ranks(0, 1)` is a plain one-process run (every call a no-op)."""

    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def shard(self, n: int) -> list[int]:
        """Indices 0..n-1 this rank handles: r, r + W, r + 2W, ..."""
        return list(range(self.rank, n, self.world))

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, by rank, on every rank (pickled: token lists, small tensors, metrics)."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def gather_sharded(self, n: int, local: list[Any]) -> list[Any]:
        """The full list of n items from each rank's `local` items (those of `shard(n)`, in order)."""
        if self.world == 1:
            return local
        full: list[Any] = [None] * n
        for r, items in enumerate(self.gather(local)):
            for k, item in zip(range(r, n, self.world), items):
                full[k] = item
        return full

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """In place: the element-wise sum over ranks (the same bits on every rank)."""
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def sum_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sums every parameter's gradient over ranks in one all_reduce. A rank without one adds zeros;
        a parameter no rank has a gradient for keeps none (the optimizer then leaves it alone, as in one
        process: a step without a single completion token moves no weight)."""
        ps = [p for p in params if p.requires_grad]
        if self.world == 1 or not ps:
            return
        has = self.sum_(torch.tensor([float(p.grad is not None) for p in ps]))  # ranks holding each one
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in ps])
        self.sum_(flat)
        at = 0
        for p, h in zip(ps, has.tolist()):
            n = p.numel()
            p.grad = flat[at : at + n].view_as(p).to(p.dtype) if h else None
            at += n

    def check_same(self, what: str, tensors: Iterable[torch.Tensor], why: str) -> None:
        """Raises if the ranks' tensors differ: each tensor's bit patterns, read as integers, are summed
        exactly (int64) and the sums compared; a last-bit difference changes its tensor's sum. `why`: the
        likely cause, for the message."""
        if self.world == 1:
            return
        ints = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
        prints = self.gather(
            [int(t.detach().contiguous().view(ints[t.element_size()]).sum(dtype=torch.int64)) for t in tensors]
        )
        if any(p != prints[0] for p in prints):
            bad = next(i for i, xs in enumerate(zip(*prints)) if len(set(xs)) > 1)
            raise RuntimeError(f"ranks hold different {what} (tensor {bad} differs): {why}")

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def make_optimizer(params, ranks: Ranks, shard_state: bool, **adamw) -> torch.optim.Optimizer:
    """AdamW, or with `shard_state` in a multi-rank run torch's ZeroRedundancyOptimizer over AdamW: the
    moments (2x the parameters) split over the ranks by size. Its `state_dict` is the plain AdamW one
    inside `whole_optimizer_state`, so checkpoints load either way."""
    if not shard_state or ranks.world == 1:
        return torch.optim.AdamW(params, **adamw)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **adamw)


@contextlib.contextmanager
def whole_optimizer_state(optimizer: torch.optim.Optimizer):
    """Within the block rank 0's `optimizer.state_dict()` is whole: a sharded optimizer sends every rank's
    moments to rank 0 (a collective: every rank enters the block), and drops that copy after it (torch
    would keep it, and rank 0 would hold every moment again); a plain one has nothing to do."""
    if not _sharded(optimizer):
        yield
        return
    _inner(optimizer).consolidate_state_dict(to=0)
    try:
        yield
    finally:
        _inner(optimizer)._all_state_dicts = []  # torch's gathered copy (no public call clears it)


def optimizer_share(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(parameter elements whose moments this rank keeps, all parameter elements)."""
    total = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    if not _sharded(optimizer):
        return total, total
    return sum(p.numel() for g in _inner(optimizer).optim.param_groups for p in g["params"]), total


def _sharded(optimizer: torch.optim.Optimizer) -> bool:
    """A ZeroRedundancyOptimizer? (its module is not imported for a plain run: the import is slow and noisy)"""
    zero = sys.modules.get("torch.distributed.optim")
    return zero is not None and isinstance(_inner(optimizer), zero.ZeroRedundancyOptimizer)


def _inner(optimizer):
    """The optimizer that holds the moments: the inner one of fp32 master weights (train/master_weights.py)."""
    return getattr(optimizer, "inner", optimizer)


def lost_rank(e: BaseException) -> str | None:
    """gloo's reason, when `e` is a collective that failed because another rank is gone (it crashed, was
    killed, or stopped on an error of its own: its output says why), e.g. "Connection closed by peer
    [127.0.0.1]:18635"; None for any other error."""
    text = str(e)
    if not isinstance(e, RuntimeError) or "gloo" not in text:
        return None
    reason = text.split("] ", 1)[1] if text.startswith("[") and "] " in text else text  # gloo's source file
    return reason.split(". This is typically")[0].strip()


def init_from_env() -> Ranks:
    """The job's ranks from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); one rank
    if WORLD_SIZE is unset or 1. Joins the gloo process group."""
    world = _env_int("WORLD_SIZE", "1")
    if world < 1:
        raise ValueError(f"environment variable WORLD_SIZE={world} must be >= 1 (the number of ranks)")
    if world == 1:
        return Ranks()
    rank = _env_int("RANK", None)
    if not 0 <= rank < world:
        raise ValueError(f"environment variable RANK={rank} is not in [0, WORLD_SIZE={world})")
    # a rank killed by a signal (an abort in torch's C++ code, a segfault) prints every thread's Python
    # stack to stderr first: otherwise the launcher can only say which signal it was
    faulthandler.enable(all_threads=True)
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    return Ranks(rank, world)


def _env_int(name: str, default: str | None) -> int:
    """An integer environment variable of torchrun's, or a ValueError naming it."""
    raw = os.environ.get(name, default)
    if raw is None:
        raise ValueError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} but the environment variable {name} is not set "
            f"(launch the ranks with torchrun or exactrl train --nproc N)"
        )
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _dies_with(parent: int):
    """A preexec_fn: the child gets SIGTERM when `parent` dies, even by SIGKILL (Linux's PR_SET_PDEATHSIG),
    so a killed launcher leaves no rank behind holding the run dir's lock."""

    def arm():
        if sys.platform.startswith("linux"):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the parent died before the line above
                os._exit(1)

    return arm


def launch(argv: list[str], nproc: int) -> int:
    """Runs `python -m exactrl <argv>` as `nproc` ranks on this machine (torchrun's environment; the cores
    this process may use split evenly between them unless OMP_NUM_THREADS is set); waits for all. If one
    fails, the others end at their next collective, or are stopped after FAILED_RANK_GRACE_S. A SIGINT or
    SIGTERM to the launcher is passed on to the ranks, and it waits for them (`_wait_for_ranks`). Returns the
    first non-zero code, or 128 + the signal."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cores = len(os.sched_getaffinity(0))
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, cores // nproc))
    if nproc > cores:  # correct, but the ranks take turns on the cores and every collective waits for the last
        stderr_line(
            f"exactrl train: warning: --nproc {nproc} on {cores} core{'s' * (cores > 1)}: the ranks take turns "
            f"on the cores, so the run is slower than with at most {cores} rank{'s' * (cores > 1)}"
        )
    signals: list[int] = []  # the signals the launcher was sent, in order: set by the handler, read by the loop

    def note(signum, frame):  # a flag only: an exception raised at an arbitrary point (inside Popen, between
        signals.append(signum)  # a rank's start and its record) would lose a rank, left running unstopped

    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    procs: list[subprocess.Popen] = []
    try:
        for r in range(nproc):
            if signals:  # told to stop while the ranks start: no more start, the ones started are stopped
                break
            env = {
                **os.environ,
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": threads,
            }
            procs.append(
                subprocess.Popen([sys.executable, "-m", "exactrl", *argv], env=env, preexec_fn=_dies_with(os.getpid()))
            )
        return _wait_for_ranks(procs, signals)
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: set outside Python, nothing to restore
                signal.signal(sig, handler)


def _wait_for_ranks(procs: list[subprocess.Popen], signals: list[int]) -> int:
    """Waits for every rank; returns the first non-zero code, or, if the launcher was sent a signal, 128 + that
    signal (0 if every rank still ended well: the run may have ended just as the signal came).

    A failed rank: the others end at their next collective, or are sent SIGTERM after FAILED_RANK_GRACE_S.
    A signal (`signals`, appended by the launcher's handler): passed on to the ranks still running, a SIGINT
    after FORWARD_DELAY_S. Either way a rank still running STOP_GRACE_S later is killed."""
    live, code, seen = list(procs), 0, 0
    forward_at = term_at = kill_at = None
    while live:
        for p in list(live):
            rc = p.poll()
            if rc is None:
                continue
            live.remove(p)
            if rc == 0 or signals:  # a rank stopped by the signal says so itself
                continue
            how = f"exited with code {rc}" if rc > 0 else f"was killed by signal {-rc}"
            if code == 0:  # the first to fail: the others follow (the order is a race: each is named)
                code = rc if rc > 0 else 128 - rc  # killed by signal s: 128 + s, as a shell reports it
                stderr_line(
                    f"exactrl train: rank {procs.index(p)} {how}; the other ranks stop at their next "
                    f"collective (or in {FAILED_RANK_GRACE_S} s)"
                )
                term_at = time.monotonic() + FAILED_RANK_GRACE_S
            else:
                stderr_line(f"exactrl train: rank {procs.index(p)} {how}")
        now = time.monotonic()
        if len(signals) > seen:
            if seen == 0:
                forward_at = now + (FORWARD_DELAY_S if signals[0] == signal.SIGINT else 0)
                kill_at = now + STOP_GRACE_S
            seen = len(signals)
        if forward_at is not None and now >= forward_at:
            _send(live, signals[0])
            forward_at = None
        if term_at is not None and now >= term_at:  # one stuck: it would wait out TIMEOUT_S
            _send(live, signal.SIGTERM)
            term_at, kill_at = None, kill_at if kill_at is not None else now + STOP_GRACE_S
        if kill_at is not None and now >= kill_at:
            _send(live, signal.SIGKILL)
            kill_at = None
        time.sleep(0.1)
    if signals:
        return 0 if procs and all(p.returncode == 0 for p in procs) else 128 + signals[0]
    return code


def _send(procs: list[subprocess.Popen], signum: int) -> None:
    for p in procs:
        p.send_signal(signum)  # none to one that has ended (Popen checks)
