"""`math`: answers checked by Hugging Face's `math-verify` (pip install 'exactrl[math]').

The task has no generator: its problems come from a dataset (`task.dataset`, docs/data.md) whose answer
column holds the reference, in LaTeX (`\\frac{1}{2}`, `$\\sqrt{2}$`, `\\boxed{3}`) or plain (`0.5`, `3`).

Reward: 1.0 if math-verify reads an answer in the completion (reasoning in `<think>...</think>` dropped;
a `\\boxed{}` answer first, then the last LaTeX or plain expression) that equals the reference
symbolically or numerically (to 6 decimals), else 0.0. Text math-verify cannot read scores 0.0, never an
error. math-verify bounds each parse and comparison with a 5 s alarm signal, which only the main thread
can set; in other threads (the server's, async rollouts) the bound is off.
"""

from __future__ import annotations

import random
import threading

from exactrl.envs.base import Problem, Task, register_task, strip_reasoning

TIMEOUT_S = 5  # math-verify's own default per parse and per comparison


def _math_verify():
    try:
        import math_verify
    except ImportError:
        raise ValueError("task 'math' needs the `math-verify` package: pip install 'exactrl[math]'") from None
    return math_verify


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@register_task
class MathTask(Task):
    """Problems from a dataset; the reward compares answers with math-verify."""

    name = "math"

    def __init__(self, system_prompt: str | None = None):
        _math_verify()  # a missing package fails when the task is built, not at the first reward
        self.system_prompt = system_prompt  # e.g. "Put the final answer in \\boxed{}."

    def generate(self, rng: random.Random) -> Problem:
        raise ValueError(
            "task 'math' has no problem generator: give its problems with task.dataset (exactrl eval: "
            "--dataset), and its model with model.path (the default job's warm start trains on generated problems)"
        )

    def check(self, problem: Problem) -> None:
        if not _parse(problem.answer):
            raise ValueError(f"math-verify reads no answer in the reference {problem.answer!r:.80}")

    def reward(self, problem: Problem, completion: str) -> float:
        mv = _math_verify()
        gold, got = _parse(problem.answer), _parse(strip_reasoning(completion))
        if not gold or not got:
            return 0.0
        try:  # math-verify catches its own errors, but sympy can still raise on odd expressions
            return 1.0 if mv.verify(gold, got, timeout_seconds=_timeout()) else 0.0
        except Exception:
            return 0.0


def _parse(text: str) -> list:
    """What math-verify reads in `text` ([] for nothing). A bare reference ("1/2") is read as LaTeX too."""
    mv = _math_verify()
    try:
        return mv.parse(text, parsing_timeout=_timeout())
    except Exception:  # the task's contract: a completion never makes the reward raise
        return []
