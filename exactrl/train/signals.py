"""SIGTERM to a one-process `exactrl train`: met as Ctrl-C is, what is saved stays and the run says how to
go on.

The handler raises `Terminated` where the main thread is, and also sets a flag. A raise can land where
Python cannot pass it on (a garbage-collector callback, a `__del__`: it is printed and dropped there), so the
training loops also call `check_terminated()` between steps: a SIGTERM stops the run at the latest after the
step it arrived in.
"""

from __future__ import annotations

import threading

_received = threading.Event()


class Terminated(KeyboardInterrupt):
    """SIGTERM, a job manager's stop (SLURM, Kubernetes). Only in a one-process run: ranks are stopped by
    their launcher."""


def on_sigterm(signum, frame) -> None:
    _received.set()
    raise Terminated()


def check_terminated() -> None:
    """Raises Terminated if a SIGTERM arrived whose own raise was dropped."""
    if _received.is_set():
        raise Terminated()


def reset() -> None:
    """Forgets a SIGTERM met before (a new run in the same process)."""
    _received.clear()
