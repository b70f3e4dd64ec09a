"""Per-step metrics: metrics.jsonl (the contract), TensorBoard, and the live display.

Metric keys are flat and hierarchical (`train/…`, `rollout/…`, `mismatch/…`,
`eval/…`, `time/…`, `perf/…`), reduced once per step before they get here.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

# figures shown on the live display, in this order: (metric key, label, format)
DISPLAY = [("rollout/reward_mean", "reward", "{:.3f}"), ("eval/accuracy", "eval acc", "{:.3f}"),
           ("train/train_rollout_logprob_abs_diff", "|Δlogp|", "{:.2e}"), ("rollout/response_len_mean", "len", "{:.1f}"),
           ("perf/tokens_per_s", "tok/s", "{:.0f}")]


class MetricsLogger:
    def __init__(self, run_dir: Path, tensorboard: bool, progress: bool, total_steps: int, start_step: int):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        self.progress = None
        self.last: dict[str, Any] = {}
        if progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]GRPO"), BarColumn(), MofNCompleteColumn(),
                                     TimeRemainingColumn(), TextColumn("{task.description}"))
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
        self.last.update(metrics)
        if self.progress is not None:
            desc = "  ".join(f"{label} {fmt.format(self.last[k])}" for k, label, fmt in DISPLAY if k in self.last)
            self.progress.update(self.task, completed=metrics["step"], description=desc)
        else:
            print(json.dumps({k: metrics[k] for k, _, _ in DISPLAY if k in metrics} | {"step": metrics["step"]}),
                  flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.tb is not None:
            self.tb.close()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir} has no metrics.jsonl (is it a run directory?)")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); "
                             f"fix or delete that line") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object of metrics, got {type(row).__name__}")
        rows.append(row)
    return rows
