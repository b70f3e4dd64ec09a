"""A run's lifecycle: errors on the rollout thread, SIGTERM and Ctrl-C at chosen moments, resume after them.

Signals are real: the run installs its SIGTERM handler (rl/run.py) and the tests send SIGTERM to this
process from inside the run at a chosen point (a reward, a training step, a checkpoint save), so where it
lands is known; one test sends it from outside, to a child process, at whatever moment it is in.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import default_job_model
from exactrl.cli import main as cli_main
from exactrl.rl.checkpoint import latest_checkpoint, load_checkpoint

SMALL = ["progress=false", "tensorboard=false", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
         "task.eval_size=8", "eval_every=2", "optim.lr=1e-3", "engine.kv_budget_tokens=4096"]
TIMING = ("time/", "perf/tokens_per_s")  # wall-clock metrics, the only ones allowed to differ between runs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return default_job_model(tmp_path_factory, sft_steps=20)


def args_of(model_dir, run_dir, *overrides) -> list[str]:
    return ["train"] + [x for o in SMALL + [f"model.path={model_dir}", f"run_dir={run_dir}", *overrides]
                        for x in ("--set", o)]


def rows_of(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run(model_dir, run_dir, *overrides) -> list[dict]:
    assert cli_main(args_of(model_dir, run_dir, *overrides)) == 0
    return rows_of(run_dir)


def same_metrics(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        keys = {k for k in x if not k.startswith(TIMING)}
        assert keys == {k for k in y if not k.startswith(TIMING)}, (x["step"], keys ^ {k for k in y})
        diff = {k: (x[k], y[k]) for k in keys if x[k] != y[k]}
        assert not diff, (x["step"], diff)


def no_rollout_thread_left() -> bool:
    """The asynchronous loop's thread has ended (it is a daemon: a leak would outlive the run silently)."""
    return not any(t.name == "exactrl-rollout" and t.is_alive() for t in threading.enumerate())


def intact(run_dir) -> str:
    """The name of the checkpoint `latest` resolves to, after loading it whole; no half-written directory
    is left beside the complete ones."""
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None
    load_checkpoint(ckpt, "float32", "exact")
    left = [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith((".tmp_", ".old_"))]
    assert not left, left
    return ckpt.name


def sigterm_self() -> None:
    """SIGTERM to this process, as a job manager sends it; the run's handler raises in the main thread."""
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None), "no handler: this would kill pytest"
    os.kill(os.getpid(), signal.SIGTERM)


TASK = """
import os
from exactrl.envs import register_task
from exactrl.envs.arithmetic import ArithmeticTask

calls = [0]


@register_task
class Judge(ArithmeticTask):
    name = "NAME"

    def reward(self, problem, completion):
        calls[0] += 1
        if calls[0] == AT:
            ACTION
        return super().reward(problem, completion)
"""


def task_module(tmp_path, name: str, at: int, action: str) -> list[str]:
    """Settings for a task whose reward does `action` at its `at`-th call (16 calls a step here)."""
    path = tmp_path / f"{name}.py"
    path.write_text(TASK.replace("NAME", name).replace("AT", str(at)).replace("ACTION", action))
    return [f"task.module={path}", f"task.name={name}"]


# ---------------------------------------------------------------- an error on the rollout thread


@pytest.mark.parametrize("error", ["KeyError('no answer key for problem 7')",
                                   "ZeroDivisionError('judge divided by zero')"])
def test_an_unexpected_error_on_the_rollout_thread_is_raised_with_its_own_message(model_dir, tmp_path, error):
    """Not a ValueError (which the CLI prints in one line): the traceback's last line must still say what
    went wrong, not only that the rollout thread failed; the thread is gone and step 1's checkpoint stays."""
    name = f"judge_{error.split('(')[0].lower()}"
    d = tmp_path / "run"
    sets = task_module(tmp_path, name, 20, f"raise {error}")  # within step 2's rollouts
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:
        cli_main(args_of(model_dir, d, "max_steps=4", "save_every=1", "task.eval_size=0", "async.enabled=true",
                         *sets))
    assert time.monotonic() - t0 < 120  # it did not hang
    message = error.split("'")[1]
    assert message in str(info.value), str(info.value)
    assert type(info.value.__cause__).__name__ == error.split("(")[0]
    assert no_rollout_thread_left()
    assert intact(d) == "step_000001"
