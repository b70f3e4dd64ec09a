"""Countdown: combine the given numbers with + - * / and parentheses to hit a target.

Problems are reachable by construction: the target is the value of a random
expression tree over all the drawn numbers (kept when it is a positive integer
no larger than `max_target`), and that expression, printed with minimal
parentheses, is the reference answer (a warm start's supervised target).

Rules (the classic game's): each given number may be used **at most once**;
`use_all_numbers=True` switches to TinyZero's "exactly once". Intermediate
values may be fractions: everything is computed exactly with `Fraction`, never
with floats, and never with `eval` — a completion is untrusted text, parsed by
the small recursive-descent parser below (no unary minus: "-3" would be a
number that was not given).

Reward: the answer is the first line of the completion after dropping any
`<think>` reasoning, with an optional trailing "= ..." ignored. 1.0 if it
parses, uses the numbers legally and equals the target; `format_reward`
(default 0.0; TinyZero uses 0.1) if it parses but is wrong; 0.0 if it is
malformed or divides by zero.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from exactrl.envs.base import Problem, Task, register_task, strip_reasoning

SUPPORTED_OPS = ("+", "-", "*", "/")
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_TOKEN = re.compile(r"\s*(?:([0-9]+)|([-+*/()]))")  # ASCII digits only (\d also takes e.g. "٣")
MAX_EXPRESSION_CHARS = 256  # bounds parser recursion (nesting) and big-integer work on untrusted text
_MAX_LITERAL_DIGITS = 12
_MAX_ATTEMPTS = 10_000  # rejection-sampling budget for a valid target


class ExpressionError(ValueError):
    """Raised for text that is not a well-formed expression."""


@dataclass(frozen=True)
class Parsed:
    """A parsed expression."""

    value: Fraction  # exact value
    numbers: tuple[int, ...]  # integer literals in order of appearance


def _tokenize(text: str) -> list[str]:
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    tokens, pos, stripped = [], 0, text.rstrip()
    while pos < len(stripped):
        m = _TOKEN.match(stripped, pos)
        if m is None:
            raise ExpressionError(f"unexpected character {stripped[pos:].lstrip()[:1]!r} at {pos}")
        tok = m.group(1) or m.group(2)
        if tok.isdigit() and len(tok) > _MAX_LITERAL_DIGITS:
            raise ExpressionError(f"number {tok[:16]}... is too long")
        tokens.append(tok)
        pos = m.end()
    return tokens


class _Parser:
    """expr := term (('+'|'-') term)* ; term := factor (('*'|'/') factor)* ; factor := INT | '(' expr ')'"""

    def __init__(self, tokens: list[str]):
        self.tokens, self.i, self.numbers = tokens, 0, []

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise ExpressionError("expression ends too early")
        self.i += 1
        return tok

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = value + self.term() if self.take() == "+" else value - self.term()
        return value

    def term(self) -> Fraction:
        value = self.factor()
        while self.peek() in ("*", "/"):
            value = value * self.factor() if self.take() == "*" else value / self.factor()  # ZeroDivisionError
        return value

    def factor(self) -> Fraction:
        tok = self.take()
        if tok.isdigit():
            self.numbers.append(int(tok))
            return Fraction(int(tok))
        if tok == "(":
            value = self.expr()
            if self.take() != ")":
                raise ExpressionError("missing ')'")
            return value
        raise ExpressionError(f"expected a number or '(' but found {tok!r}")


def parse_expression(text: str) -> Parsed:
    """Parses `text` exactly; ExpressionError if malformed, ZeroDivisionError on division by zero."""
    parser = _Parser(_tokenize(text))
    value = parser.expr()
    if parser.peek() is not None:
        raise ExpressionError(f"unexpected {parser.peek()!r} after a complete expression")
    return Parsed(value=value, numbers=tuple(parser.numbers))


def extract_expression(completion: str) -> str:
    """The candidate answer of a completion: first non-empty line, reasoning and '= ...' dropped."""
    lines = [ln for ln in strip_reasoning(completion).strip().splitlines() if ln.strip()]
    return lines[0].split("=", 1)[0].strip() if lines else ""


# --------------------------------------------------------------------------- generation

_Tree = int | tuple[str, "_Tree", "_Tree"]


def _random_tree(rng: random.Random, numbers: list[int], ops: Sequence[str]) -> _Tree:
    if len(numbers) == 1:
        return numbers[0]
    k = rng.randint(1, len(numbers) - 1)
    return (rng.choice(ops), _random_tree(rng, numbers[:k], ops), _random_tree(rng, numbers[k:], ops))


def _render(tree: _Tree) -> tuple[str, int]:
    """Text with minimal parentheses, and its precedence (3 for a number)."""
    if isinstance(tree, int):
        return str(tree), 3
    op, (left, lp), (right, rp) = tree[0], _render(tree[1]), _render(tree[2])
    p = _PRECEDENCE[op]
    if lp < p:
        left = f"({left})"
    if rp < p or (rp == p and op in "-/"):  # a-(b+c) and a/(b*c) need them; a+(b-c) does not
        right = f"({right})"
    return left + op + right, p


def _is_int(x) -> bool:
    """A JSON integer (bools and floats are not: 15.9 is not read as 15, nor true as 1)."""
    return isinstance(x, int) and not isinstance(x, bool)


@register_task
class CountdownTask(Task):
    """Reach `target` from `num_numbers` numbers in [1, max_number] with + - * /."""

    name = "countdown"

    def __init__(
        self,
        num_numbers: int = 3,
        max_number: int = 10,
        max_target: int = 100,
        ops: Sequence[str] = SUPPORTED_OPS,
        use_all_numbers: bool = False,
        format_reward: float = 0.0,
    ):
        ops = tuple(ops)
        if num_numbers < 2:
            raise ValueError(f"num_numbers must be >= 2, got {num_numbers}")
        if max_number < 1 or max_target < 1:
            raise ValueError(f"max_number and max_target must be >= 1, got {max_number} and {max_target}")
        if max_number >= 10**_MAX_LITERAL_DIGITS:  # an answer could not write it
            raise ValueError(f"max_number must have at most {_MAX_LITERAL_DIGITS} digits, got {max_number}")
        # n numbers, n-1 operators and at most n-2 pairs of parentheses: the reference answer must parse
        if (
            chars := num_numbers * len(str(max_number)) + (num_numbers - 1) + 2 * (num_numbers - 2)
        ) > MAX_EXPRESSION_CHARS:
            raise ValueError(
                f"num_numbers={num_numbers} and max_number={max_number} allow answers of {chars} "
                f"characters; at most {MAX_EXPRESSION_CHARS} are read (lower num_numbers)"
            )
        if not ops or any(op not in SUPPORTED_OPS for op in ops):
            raise ValueError(f"ops must be a non-empty subset of {SUPPORTED_OPS}, got {ops}")
        if not 0.0 <= format_reward < 1.0:
            raise ValueError(f"format_reward must be in [0, 1), got {format_reward}")
        self.num_numbers = num_numbers  # numbers per problem
        self.max_number = max_number  # numbers are drawn uniformly from [1, max_number]
        self.max_target = max_target  # targets are integers in [1, max_target]
        self.ops = ops  # the operators targets are built from (completions may use all four)
        self.use_all_numbers = use_all_numbers  # False: each number at most once; True: exactly once
        self.format_reward = format_reward  # score of a well-formed but wrong expression
        usage = "exactly once" if use_all_numbers else "at most once"
        self.system_prompt = (
            f"Answer with one expression using + - * / and parentheses that uses each "
            f"given number {usage} and equals the target."
        )

    def generate(self, rng: random.Random) -> Problem:
        for _ in range(_MAX_ATTEMPTS):
            numbers = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
            order = rng.sample(numbers, len(numbers))
            text, _ = _render(_random_tree(rng, order, self.ops))
            try:
                value = parse_expression(text).value
            except ZeroDivisionError:
                continue
            if value.denominator == 1 and 1 <= value <= self.max_target:
                target = int(value)
                prompt = f"Use {' '.join(map(str, numbers))} to make {target}."
                return Problem(prompt=prompt, answer=text, meta={"numbers": numbers, "target": target})
        raise ValueError(
            f"no target in [1, {self.max_target}] found in {_MAX_ATTEMPTS} draws with ops={self.ops}; "
            f"raise max_target or allow more operators"
        )

    def split_key(self, problem: Problem) -> str:
        """The numbers in any order and the target are one puzzle ("Use 7 3 2 to make 13." and "Use 3 2 7
        ..."): the held-out split keeps it whole, on one side."""
        numbers, target = problem.meta.get("numbers"), problem.meta.get("target")
        if isinstance(numbers, list) and all(_is_int(x) for x in numbers) and _is_int(target):
            return f"countdown {sorted(numbers)} -> {target}"
        return problem.prompt  # a row without them: the reward names it

    def check(self, problem: Problem) -> None:
        if "numbers" not in problem.meta or "target" not in problem.meta:
            raise ValueError(
                f"countdown problem {problem.prompt!r} lacks meta 'numbers' and 'target' "
                f"(JSONL rows need them as extra keys)"
            )
        numbers, target = problem.meta["numbers"], problem.meta["target"]
        if not (isinstance(numbers, list) and numbers and all(_is_int(x) for x in numbers) and _is_int(target)):
            raise ValueError(
                f"countdown problem {problem.prompt!r}: meta 'numbers' must be a non-empty list of "
                f"integers and 'target' an integer, got {numbers!r} and {target!r}"
            )
        unwritable = [x for x in numbers if not 0 <= x < 10**_MAX_LITERAL_DIGITS]  # no sign, at most 12 digits
        if self.use_all_numbers and unwritable:  # every answer must write it: the problem could never score
            raise ValueError(
                f"countdown problem {problem.prompt!r}: use_all_numbers needs every number written "
                f"in the answer, and {unwritable[0]} cannot be (integers in [0, "
                f"10**{_MAX_LITERAL_DIGITS}) can)"
            )

    def reward(self, problem: Problem, completion: str) -> float:
        self.check(problem)
        numbers, target = problem.meta["numbers"], problem.meta["target"]
        try:
            parsed = parse_expression(extract_expression(completion))
        except (ExpressionError, ZeroDivisionError, RecursionError):  # deep parentheses too: bad text scores 0
            return 0.0
        used, given = Counter(parsed.numbers), Counter(numbers)
        legal = used == given if self.use_all_numbers else not (used - given)
        correct = legal and parsed.value == target
        return 1.0 if correct else self.format_reward
