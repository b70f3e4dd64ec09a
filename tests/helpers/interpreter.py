"""The start of a test module that runs the triton backend on CPU tensors under Triton's interpreter."""

from __future__ import annotations

import os

import pytest

# numpy's inf - inf in masked lanes; the interpreter's int() of one-element arrays
MARKS = [pytest.mark.filterwarnings("ignore::RuntimeWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def use_interpreter() -> None:
    """Sets TRITON_INTERPRET=1 unless it is set (Triton reads it where a kernel is defined, at the backend's first
    use), and skips the calling module without triton or when the variable says otherwise."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    if os.environ["TRITON_INTERPRET"] != "1":
        pytest.skip("TRITON_INTERPRET is set to something else", allow_module_level=True)
