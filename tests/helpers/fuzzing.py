"""How many examples a property test draws: its full count when EXACTRL_FUZZ=full (`make test-slow` and
`make test-all`, which .ci/run runs after `make test`), a fifth of it and at least 5 (or all, if fewer)
otherwise (`make test`, `make test-unit`), so every property runs on every change and the full search runs in CI.

Hypothesis draws fresh examples on each run (unless a test derandomizes), so the short runs keep searching
new inputs; a failure they find is saved in .hypothesis/ and replayed first by both."""

from __future__ import annotations

import os

FULL = os.environ.get("EXACTRL_FUZZ", "") == "full"


def examples(n: int) -> int:
    """The example count for a property written to draw `n`."""
    return n if FULL else max(min(n, 5), n // 5)
