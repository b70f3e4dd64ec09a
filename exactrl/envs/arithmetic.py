"""Integer arithmetic: the default job's task, small enough for a CPU.

A problem is a bare expression such as `"12+7="` and its answer the integer
value (`"19"`). Prompts are deliberately short, with no instructions and no
system prompt: a model trained from scratch on a CPU must learn the format and
the task in minutes, and every prompt token costs prefill time.

Expressions use the usual precedence (`*` before `+`/`-`, left to right
otherwise); operands are non-negative, so `-` only ever appears as an operator
in prompts (answers may still be negative unless `nonnegative=True`).

Reward: 1.0 if the first integer in the completion (after dropping any
`<think>...</think>` reasoning) equals the answer, else 0.0. "The answer is 19"
and "19" both score; "12+7=19" does not (its first integer is 12), which
teaches the model to answer rather than to echo the question. An integer is a
whole number on its own: not the start of "19.5" or "19,000" (those hold no
integer), not a piece of a word ("Step-1"), and "−19" (U+2212) is −19.
"""
from __future__ import annotations

import random
import re
from collections.abc import Sequence

from exactrl.envs.base import Problem, Task, register_task, strip_reasoning

SUPPORTED_OPS = ("+", "-", "*")
_INT = re.compile(r"-?[0-9]+")  # ASCII digits only (\d would also take e.g. Arabic-Indic digits)
# an integer standing alone: no letter, digit, point, comma or hyphen just before it (a word's "-1", the
# "5" of "19.5", the "000" of "19,000"), and no digit, decimal/thousands part, fraction or exponent just
# after it ("3/4" and "3e5" are not the integer 3)
_WHOLE_INT = re.compile(r"(?<![\w.,-])-?[0-9]+(?![0-9]|[.,/][0-9]|[eE][-+]?[0-9])")
_MAX_DIGITS = 64  # longer digit runs are not answers, unless the answer itself is (int() refuses > 4300 digits)
_MAX_ATTEMPTS = 1000  # rejection-sampling budget for `nonnegative`


def evaluate_terms(terms: Sequence[int], ops: Sequence[str]) -> int:
    """Value of terms[0] ops[0] terms[1] ... with `*` binding tighter than `+` and `-`."""
    assert len(ops) == len(terms) - 1
    total, sign, product = 0, 1, terms[0]
    for op, x in zip(ops, terms[1:]):
        if op == "*":
            product *= x
        else:  # close the running product, start a new additive term
            total += sign * product
            sign, product = (1 if op == "+" else -1), x
    return total + sign * product


def first_integer(text: str, max_digits: int = _MAX_DIGITS) -> int | None:
    """The first (optionally negative) integer standing alone in `text` (module docstring), or None if there is
    none (or it is too long)."""
    m = _WHOLE_INT.search(text.replace("\u2212", "-"))
    if m is None or len(m.group()) > max_digits:
        return None
    return int(m.group())


@register_task
class ArithmeticTask(Task):
    """Random expressions like `"3+5="` over integers in [min_value, max_value]."""

    name = "arithmetic"
    system_prompt = None  # the prompt is the bare expression

    def __init__(self, min_value: int = 0, max_value: int = 9, ops: Sequence[str] = ("+", "-"),
                 num_terms: int = 2, nonnegative: bool = False):
        ops = tuple(ops)
        if min_value < 0:
            raise ValueError(f"min_value must be >= 0 (operands are written without a sign), got {min_value}")
        if max_value < min_value:
            raise ValueError(f"max_value ({max_value}) must be >= min_value ({min_value})")
        if not ops or any(op not in SUPPORTED_OPS for op in ops):
            raise ValueError(f"ops must be a non-empty subset of {SUPPORTED_OPS}, got {ops}")
        if num_terms < 2:
            raise ValueError(f"num_terms must be >= 2, got {num_terms}")
        self.min_value = min_value  # smallest operand
        self.max_value = max_value  # largest operand
        self.ops = ops  # operators drawn uniformly between operands
        self.num_terms = num_terms  # operands per expression
        self.nonnegative = nonnegative  # resample expressions whose value is negative

    def generate(self, rng: random.Random) -> Problem:
        for _ in range(_MAX_ATTEMPTS):
            terms = [rng.randint(self.min_value, self.max_value) for _ in range(self.num_terms)]
            ops = [rng.choice(self.ops) for _ in range(self.num_terms - 1)]
            value = evaluate_terms(terms, ops)
            if value >= 0 or not self.nonnegative:
                expr = str(terms[0]) + "".join(op + str(x) for op, x in zip(ops, terms[1:]))
                return Problem(prompt=expr + "=", answer=str(value))
        raise ValueError(f"no non-negative expression found in {_MAX_ATTEMPTS} draws with ops={self.ops} over "
                         f"[{self.min_value}, {self.max_value}]; add '+' to ops or set nonnegative=False")

    def check(self, problem: Problem) -> None:
        if not _INT.fullmatch(problem.answer.strip()):
            raise ValueError(f"arithmetic problem {problem.prompt!r} has a non-integer answer {problem.answer!r}")

    def reward(self, problem: Problem, completion: str) -> float:
        self.check(problem)
        got = first_integer(strip_reasoning(completion), max(_MAX_DIGITS, len(problem.answer.strip())))
        return 1.0 if got is not None and got == int(problem.answer) else 0.0
