"""Sample logging: a few of each step's (and each evaluation's) prompts with their completions, token ids,
engine logprobs and rewards, so a run shows what the model says and not only its reward.

Rows go to `samples.jsonl` in the run dir (one JSON object per sample), to the trackers as tables
(train/trackers.py) and, `progress.samples` of them, to the terminal. Which samples: the first sample of
the first groups, then the second sample of each, ... (one per prompt before two of any), deterministic,
so a resumed run writes the rows the uninterrupted run would have.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from exactrl.rollout.groups import Rollout

COLUMNS = ("step", "kind", "prompt", "completion", "reward", "finish_reason")  # a table's text columns


def sample_rows(groups: list[list[Rollout]], n: int, step: int, kind: str, tokenizer) -> list[dict[str, Any]]:
    """Up to `n` rollouts of `groups` as rows: step, kind (train | eval), the prompt as the model saw it
    (chat template and special tokens included) and its ids, the completion text (special tokens dropped)
    and ids, the engine's logprob of each completion token, the reward and why sampling stopped."""
    width = max((len(g) for g in groups), default=0)
    picked = [g[i] for i in range(width) for g in groups if i < len(g)][:n]
    return [
        {
            "step": step,
            "kind": kind,
            "prompt": tokenizer.decode(r.prompt_ids, skip_special_tokens=False),
            "prompt_ids": list(r.prompt_ids),
            "completion": r.text,
            "completion_ids": list(r.completion_ids),
            "logprobs": list(r.behav_logprobs),
            "reward": r.reward,
            "finish_reason": r.finish_reason,
        }
        for r in picked
    ]


class SamplesFile:
    """run_dir/samples.jsonl, appended row by row; on resume from step k its rows of steps after k are
    dropped first, as metrics.jsonl's are (they are redone). A run resumed from step 0 redoes its initial
    evaluation, so it drops the step-0 rows too."""

    def __init__(self, run_dir: Path, start_step: int):
        from exactrl.train.logger import _keep_steps_up_to

        self.path = Path(run_dir) / "samples.jsonl"
        if self.path.exists():
            _keep_steps_up_to(self.path, start_step if start_step else -1, "samples")

    def write(self, rows: list[dict[str, Any]]) -> None:
        if rows:
            with open(self.path, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in rows))

    def flush(self) -> None:
        if self.path.exists():
            with open(self.path, "a") as f:
                os.fsync(f.fileno())


def shown_sample(row: dict[str, Any], width: int = 160) -> str:
    """One sample on one line for the terminal: where it is from, its reward, its prompt and completion
    (each cut to `width` characters, from the end for the prompt: its question comes last)."""
    prompt = " ".join(row["prompt"].split())
    prompt = prompt if len(prompt) <= width else "…" + prompt[-width:]
    completion = row["completion"] if len(row["completion"]) <= width else row["completion"][:width] + "…"
    return f"  [{row['kind']} step {row['step']}] reward {row['reward']:.3f}  {prompt!r} -> {completion!r}"


def read_samples(run_dir: Path) -> list[dict[str, Any]]:
    """samples.jsonl's rows (an empty list if the run wrote none)."""
    path = Path(run_dir) / "samples.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
