"""Process-level allocator settings that make CPU training fast; none changes a numerical result.

PyTorch's CPU tensors come straight from glibc's malloc, which serves every
block over its mmap threshold (at most 32 MB) with a fresh mapping and
returns it to the kernel on free. A training step allocates and frees
hundreds of such blocks (activations of [tokens, hidden], logits chunks,
gradients), and every 4 kB page of each is then faulted in and zeroed again:
at the `bench train` shape the kernel's page faulting takes a large share of
the step (docs/performance.md).

`tune_allocator` tells glibc (mallopt) to serve every block from the heap and
never to trim it, so memory freed by one step is reused by the next without
faults. The price: the resident size stays at its peak (as with any caching
allocator). The `exactrl` CLI calls it at start; set EXACTRL_MALLOC=default
to keep glibc's behaviour. Library users call it themselves if they want it.
It changes no numerical result (allocation never touches values).

`huge_pages_env` goes one step further: glibc's tunable
`glibc.malloc.hugetlb=1` (glibc >= 2.35) asks the kernel for transparent
2 MB pages (madvise) wherever malloc takes memory. A page fault then brings
in 2 MB instead of 4 kB, and the weights a decode step streams through sit
on 512x fewer pages (fewer TLB misses; the CPU's prefetchers stop at page
ends): a decode step's matmuls run faster, and a training step grows its
heap with far fewer faults (docs/performance.md has the figures).
A tunable is read when the process starts, so the `exactrl` command runs
itself again with it set (`exec`, before any work); EXACTRL_MALLOC=default
turns this off too.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from pathlib import Path

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4


def tune_allocator() -> bool:
    """Keeps freed memory in the heap (glibc only); returns whether it was applied."""
    if os.environ.get("EXACTRL_MALLOC", "").lower() == "default":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    ok = libc.mallopt(_M_MMAP_MAX, 0)  # no per-block mappings: every block from the heap
    ok &= libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(2**31 - 1))  # never hand the heap's top back
    ok &= libc.mallopt(_M_TOP_PAD, 64 << 20)  # grow the heap in 64 MB steps
    return bool(ok)


HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_env(environ=os.environ) -> dict[str, str] | None:
    """The environment to run this process again with huge pages, or None (already on, turned off with
    EXACTRL_MALLOC=default, or not available: not glibc >= 2.35 on Linux, or transparent huge pages off)."""
    if environ.get("EXACTRL_MALLOC", "").lower() == "default":
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in tunables:  # set: by us before the exec, or by the user (kept as they set it)
        return None
    if platform.system() != "Linux":
        return None
    libc, version = platform.libc_ver()
    try:
        if libc != "glibc" or tuple(int(x) for x in version.split(".")[:2]) < (2, 35):
            return None
        if "[never]" in _THP_MODE.read_text():
            return None
    except (OSError, ValueError):
        return None
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{HUGE_PAGES_TUNABLE}" if tunables else HUGE_PAGES_TUNABLE}


def exec_with_huge_pages() -> None:
    """Runs this command again (same interpreter, same arguments) with huge pages on, if `huge_pages_env`
    gives an environment for it; returns only when it does not. Call it first thing in a program."""
    env = huge_pages_env()
    argv = getattr(sys, "orig_argv", None)
    if env is None or not argv:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, env)
    except OSError:  # cannot exec (a sandbox): run on as we are
        return
