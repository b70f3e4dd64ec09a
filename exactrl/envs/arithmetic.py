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
MAX_ANSWER_DIGITS = 4000  # an answer int() can read (it refuses more than 4300 digits), with room for a sign
MAX_TERMS = 1000  # operands per expression: bounds the work of generating one problem


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

    def __init__(
        self,
        min_value: int = 0,
        max_value: int = 9,
        ops: Sequence[str] = ("+", "-"),
        num_terms: int = 2,
        nonnegative: bool = False,
    ):
        ops = tuple(ops)
        if min_value < 0:
            raise ValueError(f"min_value must be >= 0 (operands are written without a sign), got {min_value}")
        if max_value < min_value:
            raise ValueError(f"max_value ({max_value}) must be >= min_value ({min_value})")
        if not ops or any(op not in SUPPORTED_OPS for op in ops):
            raise ValueError(f"ops must be a non-empty subset of {SUPPORTED_OPS}, got {ops}")
        if not 2 <= num_terms <= MAX_TERMS:
            raise ValueError(f"num_terms must be in [2, {MAX_TERMS}], got {num_terms}")
        if (digits := answer_digits_bound(max_value, num_terms, ops)) > MAX_ANSWER_DIGITS:
            raise ValueError(
                f"max_value, num_terms={num_terms} and ops={ops} allow answers of up to "
                f"{digits} digits; at most {MAX_ANSWER_DIGITS} can be scored (lower max_value or "
                f"num_terms)"
            )
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
        raise ValueError(
            f"no non-negative expression found in {_MAX_ATTEMPTS} draws with ops={self.ops} over "
            f"[{self.min_value}, {self.max_value}]; add '+' to ops or set nonnegative=False"
        )

    def check(self, problem: Problem) -> None:
        check_integer_answer("arithmetic", problem)

    def reward(self, problem: Problem, completion: str) -> float:
        self.check(problem)
        return integer_reward(problem.answer, completion)


def answer_digits_bound(max_value: int, num_terms: int, ops: Sequence[str]) -> int:
    """At least the digits of any answer: |value| <= (max_value+1)**num_terms with `*` (the binomial expansion
    holds every sum of products), num_terms*max_value without; from bit lengths (str() refuses huge ints)."""
    bits = num_terms * (max_value + 1).bit_length() if "*" in ops else (num_terms * max_value).bit_length()
    return int(bits * 0.30103) + 1


def check_integer_answer(task: str, problem: Problem) -> None:
    """Raises ValueError unless the problem's answer is an integer `integer_reward` can read."""
    answer = problem.answer.strip()
    if not _INT.fullmatch(answer):
        raise ValueError(f"{task} problem {problem.prompt!r} has a non-integer answer {problem.answer!r}")
    if len(answer.lstrip("-")) > MAX_ANSWER_DIGITS:
        raise ValueError(
            f"{task} problem {problem.prompt!r:.60} has an answer of {len(answer.lstrip('-'))} digits; "
            f"at most {MAX_ANSWER_DIGITS} can be scored"
        )


def integer_reward(answer: str, completion: str) -> float:
    """1.0 if the first integer standing alone in the completion, reasoning dropped, is `answer` (a checked one),
    else 0.0. A digit run as long as the answer is read, never one int() refuses."""
    got = first_integer(strip_reasoning(completion), max(_MAX_DIGITS, len(answer.strip())))
    return 1.0 if got is not None and got == int(answer) else 0.0
