"""Per-step metrics: metrics.jsonl (the contract), TensorBoard, the trackers (W&B, MLflow), the live display;
and a few samples a step (train/samples.py).

Metric keys are flat and hierarchical (`train/…`, `rollout/…`, `mismatch/…`,
`eval/…`, `time/…`, `perf/…`), reduced once per step before they get here.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from exactrl.envs.dataset import load_json_line
from exactrl.train.checkpoint import replace_durably
from exactrl.train.samples import SamplesFile, shown_sample
from exactrl.train.settings import _STRICT
from exactrl.train.trackers import Tracker, close_all, open_trackers

# figures shown on the live display, in this order: (metric key, label, format)
DISPLAY = [
    ("rollout/reward_mean", "reward", "{:.3f}"),
    ("eval/accuracy", "eval acc", "{:.3f}"),
    ("train/train_rollout_logprob_abs_diff", "|Δlogp|", "{:.2e}"),
    ("rollout/response_len_mean", "len", "{:.1f}"),
    ("perf/tokens_per_s", "tok/s", "{:.0f}"),
]


class ProgressSettings(BaseModel):
    model_config = _STRICT

    enabled: bool = True
    """A live progress bar on a terminal; with stdout a pipe or a file, one plain line of figures per step.
    false: each step's figures as one line of JSON."""
    samples: int = Field(0, ge=0)
    """Samples printed per training step and per evaluation, one line each (reward, prompt, completion):
    the first of those samples.jsonl gets, whatever `logging.samples` is; 0 = none."""


class MetricsLogger:
    """Appends one row per step. On resume from step k (`start_step`), rows of steps after k, written
    before a crash but not covered by a checkpoint, are dropped first (they are recomputed, with the
    same values), and TensorBoard purges them too: a resumed run's log reads like an uninterrupted one,
    but for `eval/*` at the last step of a run that was extended (each run evaluates at its max_steps)."""

    def __init__(
        self,
        run_dir: Path,
        tensorboard: bool,
        progress: bool,
        total_steps: int,
        start_step: int,
        title: str = "GRPO",
        display: list[tuple[str, str, str]] = DISPLAY,
        trackers: Sequence[Tracker] = (),
        samples: int = 0,
        print_samples: int = 0,
    ):
        self.display = display  # the figures shown live: (metric key, label, format)
        self.trackers = list(trackers)  # W&B, MLflow (train/trackers.py): every row and sample table goes to each
        self.samples = SamplesFile(run_dir, start_step)  # resumed: its rows past start_step are dropped
        self.n_samples, self.print_samples = samples, print_samples  # rows per log_samples: written, printed
        self.path = Path(run_dir) / "metrics.jsonl"
        if self.path.exists():
            _keep_steps_up_to(self.path, start_step)
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            tb_dir = Path(run_dir) / "tensorboard"  # a resume, from step 0 too, purges what a crash left past it
            self.tb = SummaryWriter(str(tb_dir), purge_step=start_step + 1 if start_step or tb_dir.exists() else None)
        self.progress = None
        self.last: dict[str, Any] = {}
        # a terminal gets rich's live bar; a pipe or a file (`make run | tee`, CI logs) one plain line a step,
        # where rich would print only its last frame, squeezed to 80 columns
        self.lines = f"/{total_steps}" if progress and not sys.stdout.isatty() else None
        if progress and self.lines is None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn(f"[bold]{title}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.description}"),
            )
            self.task = self.progress.add_task("", total=total_steps, completed=start_step)
            self.progress.start()

    def log(self, metrics: dict[str, Any]) -> None:
        for k, v in metrics.items():
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"metric {k} is {v} at step {metrics.get('step')}")
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, metrics["step"])
        for t in self.trackers:
            t.log_metrics(metrics)
        self.last.update(metrics)
        if self.progress is not None:  # the latest of each figure (eval/* comes every eval_every steps)
            self.progress.update(self.task, completed=metrics["step"], description=_shown(self.last, self.display))
        elif self.lines is not None:  # this step's figures
            print(f"step {metrics['step']}{self.lines}  {_shown(metrics, self.display)}", flush=True)
        else:
            print(
                json.dumps({k: metrics[k] for k, _, _ in self.display if k in metrics} | {"step": metrics["step"]}),
                flush=True,
            )

    def log_samples(self, rows: list[dict[str, Any]]) -> None:
        """One step's samples of one kind (train/samples.py `sample_rows`): the first `samples` to
        samples.jsonl and to each tracker as a table, the first `print_samples` to the terminal."""
        kept = rows[: self.n_samples]
        self.samples.write(kept)
        if kept:
            for t in self.trackers:
                t.log_samples(kept)
        for row in rows[: self.print_samples]:
            if self.progress is not None:  # above the live bar, which stays at the bottom
                self.progress.console.print(shown_sample(row), markup=False, highlight=False)
            else:
                print(shown_sample(row), flush=True)

    def flush(self) -> None:
        """metrics.jsonl and TensorBoard's buffered events to disk, fsynced (before a checkpoint: a step it
        covers is never lost, even to a power cut)."""
        if self.path.exists():
            with open(self.path, "a") as f:
                os.fsync(f.fileno())
        self.samples.flush()
        if self.tb is not None:
            self.tb.flush()

    def close(self) -> None:
        """Stops the display and flushes TensorBoard; closing twice is harmless, after a close that raised
        too (a full disk fails TensorBoard's last flush: the second close does not try again)."""
        if self.progress is not None:
            progress, self.progress = self.progress, None
            progress.stop()
        try:
            if self.tb is not None:
                tb, self.tb = self.tb, None
                tb.close()
        finally:
            trackers, self.trackers = self.trackers, []
            close_all(trackers)


def run_logger(cfg, run_dir: Path, start_step: int) -> MetricsLogger:
    """An `exactrl train` run's logger (`cfg` a RunConfig): metrics.jsonl, TensorBoard, the display, the
    samples and the trackers `logging` enables, started or (by run_dir/trackers.json) continued."""
    log = MetricsLogger(
        run_dir,
        cfg.tensorboard,
        cfg.progress.enabled,
        cfg.max_steps,
        start_step,
        samples=cfg.logging.samples,
        print_samples=cfg.progress.samples,
    )
    try:
        log.trackers = open_trackers(cfg.logging, cfg.model_dump(mode="json", by_alias=True), Path(run_dir))
    except BaseException:
        log.close()
        raise
    return log


def _shown(metrics: dict[str, Any], display: list[tuple[str, str, str]]) -> str:
    return "  ".join(f"{label} {fmt.format(metrics[k])}" for k, label, fmt in display if k in metrics)


def _keep_steps_up_to(path: Path, step: int, what: str = "metrics") -> None:
    """Rewrites a log of rows by step (metrics.jsonl, samples.jsonl) without the rows of steps after `step`,
    atomically (a crash keeps the old file).

    A last line that is not valid JSON is a row cut short by a crash mid-write: it is dropped (its step,
    past the checkpoint, is redone). A bad line anywhere else is an error naming it.
    """
    if not path.is_file():
        raise ValueError(f"{path} is not a file: move it away to resume")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte {e.start}): fix or move it away to resume") from None
    lines = text.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    keep = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = load_json_line(line, f"{path}:{lineno}")
        except json.JSONDecodeError as e:
            if lineno == len(lines):
                continue  # the unfinished last row of a crash
            raise ValueError(
                f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); fix or delete that line to resume"
            ) from None
        if not isinstance(row, dict) or not isinstance(row.get("step", 0), int):
            raise ValueError(
                f"{path}:{lineno}: not a row of {what} with an integer step; fix or delete that line to resume"
            )
        if row.get("step", 0) <= step:
            keep.append(line)
    if len(keep) == len(lines) and (not text or text.endswith("\n")):  # else the next row would join the last
        return
    replace_durably(path, "".join(line + "\n" for line in keep))  # the rows checkpoints cover survive a power cut


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if Path(run_dir).is_file():
        raise ValueError(f"{run_dir} is a file: give the run directory that holds metrics.jsonl")
    if not Path(run_dir).exists():  # a typo: "has no metrics.jsonl" read as if the directory were there
        raise ValueError(f"run directory {run_dir} does not exist")
    if path.is_dir():
        raise ValueError(f"{path} is a directory, not the run's metrics file")
    if not path.is_file():
        raise ValueError(f"{run_dir} has no metrics.jsonl (is it a run directory?)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte {e.start})") from None
    rows = []
    lines = text.splitlines()
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = load_json_line(line, f"{path}:{lineno}")
        except json.JSONDecodeError as e:
            if lineno == len(lines) and not text.endswith("\n"):  # cut while written (a killed run): not a row
                break
            raise ValueError(
                f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); fix or delete that line"
            ) from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object of metrics, got {type(row).__name__}")
        rows.append(row)
    return rows


class NullLogger:
    """The logger of ranks other than 0 in a data-parallel run: rank 0 writes the run's log."""

    def __init__(self):
        self.last: dict[str, Any] = {}

    def log(self, metrics: dict[str, Any]) -> None:
        pass

    def log_samples(self, rows: list[dict[str, Any]]) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
