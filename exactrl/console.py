"""Messages to the user on stderr, each line in one write."""

from __future__ import annotations

import sys


def stderr_line(text: str) -> None:
    """Writes `text` and its newline to stderr in one write. `print` writes them apart when stderr is unbuffered
    (PYTHONUNBUFFERED), and the ranks of a run share one stderr with their launcher: another process's line
    could then land between a message and its newline."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
