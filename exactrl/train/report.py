"""`exactrl report RUN_DIR`: PNG plots of a run's metrics.jsonl.

What can be plotted is: a value that is not finite, or too large for matplotlib to lay out an axis around
(a file edited by hand, or logged by another tool), is left out, and so is a panel with no values at all;
each is named in a note (stderr), so a plot never silently misses a point.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from exactrl.console import stderr_line
from exactrl.train.logger import read_metrics

PANELS = [
    ("reward", ["rollout/reward_mean"]),
    ("accuracy", ["eval/accuracy", "rollout/accuracy"]),
    ("logprob_diff", ["train/train_rollout_logprob_abs_diff", "train/train_rollout_logprob_abs_diff_max"]),
    ("response_length", ["rollout/response_len_mean"]),
]
INITIAL = "eval/initial_accuracy"
PLOTTABLE = 1e300  # beyond it matplotlib overflows computing an axis' margins ("arange: cannot compute length")


def _note(text: str) -> None:
    stderr_line(f"report: {text}")


def write_report(run_dir: str | Path, warn: Callable[[str], None] = _note) -> list[Path]:
    """Writes report/*.png; then `warn` gets a note for each value or panel left out of them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no metrics yet: the run has not finished a step")
    _check_rows(rows, run_dir / "metrics.jsonl")
    notes = []
    series = _series(rows, run_dir / "metrics.jsonl", notes.append)
    out_dir = run_dir / "report"
    try:
        written = _plot(series, out_dir, plt)
    except OSError as e:  # a file of that name, a read-only run directory, a full disk
        raise ValueError(f"cannot write the plots to {out_dir}: {e.strerror or e}") from None
    finally:
        plt.close("all")
    for note in notes:  # about the plots written: none when the error above is all there is to say
        warn(note)
    return written


def _check_rows(rows: list[dict], path: Path) -> None:
    """A row without a plottable integer step, or with a plotted metric that is no number, is an error."""
    plotted = [INITIAL] + [k for _, keys in PANELS for k in keys]
    for i, r in enumerate(rows, start=1):
        if not isinstance(r.get("step"), int) or isinstance(r["step"], bool):
            raise ValueError(f"{path}: row {i} has no integer 'step' (not exactrl's metrics?)")
        if abs(r["step"]) > PLOTTABLE:
            raise ValueError(f"{path}: row {i}: 'step' is {_short(r['step'])}, too large to plot")
        bad = [k for k in plotted if k in r and (not isinstance(r[k], (int, float)) or isinstance(r[k], bool))]
        if bad:
            raise ValueError(f"{path}: row {i}: {bad[0]!r} is {r[bad[0]]!r}, not a number")


def _plottable(value: int | float) -> bool:
    return abs(value) <= PLOTTABLE if isinstance(value, int) else math.isfinite(value) and abs(value) <= PLOTTABLE


def _short(value: int | float) -> str:
    text = repr(value)
    return text if len(text) <= 16 else text[:12] + "..."


def _series(rows: list[dict], path: Path, warn: Callable[[str], None]) -> dict[str, list[tuple[int, float]]]:
    """Each plotted metric's (step, value) points; what cannot be plotted is named to `warn`."""
    series = {}
    for name, keys in PANELS:
        for k in keys:
            pts = [(r["step"], r[k]) for r in rows if k in r]
            if k == "eval/accuracy":  # the accuracy before training rides on step 1's row
                pts = [(0, r[INITIAL]) for r in rows if INITIAL in r] + pts
            left_out = [(s, v) for s, v in pts if not _plottable(v)]
            if left_out:
                shown = ", ".join(f"{_short(v)} at step {s}" for s, v in left_out[:3])
                more = f" and {len(left_out) - 3} more" if len(left_out) > 3 else ""
                warn(f"{path}: {k} left out of the plot where it cannot be drawn: {shown}{more}")
            series[k] = [(s, float(v)) for s, v in pts if _plottable(v)]
        if not any(series[k] for k in keys):
            warn(f"panel {name!r} is empty: {path} has no plottable values of {', '.join(keys)}")
    return series


def _plot(series: dict[str, list[tuple[int, float]]], out_dir: Path, plt) -> list[Path]:
    out_dir.mkdir(exist_ok=True)
    written = []
    fig_all, axes = plt.subplots(2, 2, figsize=(11, 7))
    for (name, keys), ax_all in zip(PANELS, axes.flat):
        fig, ax = plt.subplots(figsize=(6, 4))
        for a in (ax, ax_all):
            for k in keys:
                if series[k]:
                    a.plot(*zip(*series[k]), marker=".", label=k)
            a.set_title(name.replace("_", " "))
            a.set_xlabel("step")
            a.grid(alpha=0.3)
            if a.lines:
                a.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / f"{name}.png", dpi=100)
        plt.close(fig)
        written.append(out_dir / f"{name}.png")
    fig_all.tight_layout()
    fig_all.savefig(out_dir / "summary.png", dpi=100)
    plt.close(fig_all)
    return [out_dir / "summary.png"] + written
