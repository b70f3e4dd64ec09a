"""Process-level settings that make CPU training fast: the heap keeps freed memory.

PyTorch's CPU tensors come straight from glibc's malloc, which serves every
block over its mmap threshold (at most 32 MB) with a fresh mapping and
returns it to the kernel on free. A training step allocates and frees
hundreds of such blocks (activations of [tokens, hidden], logits chunks,
gradients), and every 4 kB page of each is then faulted in and zeroed again.
Measured on this 2-core VM, one exactrl GRPO train step at the `bench train`
shape (64 sequences x 160 tokens, 20M model): 1.8 M page faults, ~10 s of
kernel time, 10 s per step; with the heap keeping its memory: 7 s per step.

`tune_allocator` tells glibc (mallopt) to serve every block from the heap and
never to trim it, so memory freed by one step is reused by the next without
faults. The price: the resident size stays at its peak (as with any caching
allocator). The `exactrl` CLI calls it at start; set EXACTRL_MALLOC=default
to keep glibc's behaviour. Library users call it themselves if they want it.
It changes no numerical result (allocation never touches values).
"""
from __future__ import annotations

import ctypes
import os
import platform

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
