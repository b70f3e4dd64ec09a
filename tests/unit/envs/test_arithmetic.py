"""ArithmeticTask: generation, precedence, and the reward's parsing rules."""

from __future__ import annotations

import random
import re

import pytest

from exactrl.envs import ArithmeticTask, Problem, get_task, make_dataset
from exactrl.envs.arithmetic import evaluate_terms, first_integer

P = Problem(prompt="3+5=", answer="8")


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("8", 1.0),
        (" 8\n", 1.0),  # whitespace
        ("8<|im_end|>", 1.0),  # end-of-text marker right after the number
        ("The answer is 8.", 1.0),  # extra text: the first integer counts
        ("8, because 3+5 is 8", 1.0),
        ("<think>3+5 is 7? no</think>\n\n8", 1.0),  # reasoning is ignored
        ("9", 0.0),  # wrong
        ("80", 0.0),
        ("3+5=8", 0.0),  # echoing the question: first integer is 3
        ("", 0.0),  # malformed
        ("eight", 0.0),
        ("<think>8", 0.0),  # unfinished reasoning, no answer
        ("9" * 5000, 0.0),  # absurd digit runs score 0 instead of raising
        ("8.5", 0.0),  # not an integer: its "8" is not the answer
        ("8,000", 0.0),
        ("8/3", 0.0),  # a fraction, not the integer 8
        ("8e2", 0.0),  # nor is 800 written as 8e2
        ("8e", 1.0),  # a letter after the number is not an exponent
        ("Step-8: 9", 0.0),  # a word's number is no answer: the first integer is 9
        ("Step-1: 8", 1.0),
    ],
)
def test_reward(completion, expected):
    assert ArithmeticTask().reward(P, completion) == expected


def test_negative_answers():
    task, p = ArithmeticTask(), Problem("3-5=", "-2")
    assert task.reward(p, "-2") == 1.0
    assert task.reward(p, " -2 ") == 1.0
    assert task.reward(p, "2") == 0.0
    assert task.reward(p, "\u22122") == 1.0  # the Unicode minus sign
    assert task.reward(p, "Step-2: 5") == 0.0  # a hyphen inside a word is no minus


def test_non_integer_reference_answer_is_a_clear_error():
    with pytest.raises(ValueError, match="non-integer answer"):
        ArithmeticTask().reward(Problem("3+5=", "eight"), "8")


def test_precedence():
    assert evaluate_terms([2, 3, 4], ["+", "*"]) == 14
    assert evaluate_terms([2, 3, 4], ["*", "-"]) == 2
    assert evaluate_terms([10, 2, 3], ["-", "-"]) == 5
    assert evaluate_terms([2, 3, 4, 5], ["-", "*", "+"]) == -5
    assert first_integer("x -12 y") == -12 and first_integer("none") is None


def test_generated_problems_are_short_and_correct():
    task = ArithmeticTask(min_value=0, max_value=99, ops=("+", "-", "*"), num_terms=3)
    rng = random.Random(0)
    for _ in range(300):
        p = task.generate(rng)
        assert re.fullmatch(r"\d+([-+*]\d+){2}=", p.prompt), p.prompt
        assert int(p.answer) == eval(p.prompt[:-1])  # our own generated digits and operators only
        assert task.reward(p, p.answer) == 1.0


def test_defaults_are_single_digit_sums_and_differences():
    for p in make_dataset(ArithmeticTask(), 200, seed=1):
        assert re.fullmatch(r"\d[-+]\d=", p.prompt), p.prompt


def test_nonnegative():
    task = ArithmeticTask(ops=("-",), num_terms=3, nonnegative=True)
    assert all(int(p.answer) >= 0 for p in make_dataset(task, 200, seed=0))
    with pytest.raises(ValueError, match="nonnegative"):
        ArithmeticTask(min_value=1, max_value=1, ops=("-",), num_terms=3, nonnegative=True).generate(random.Random(0))


def test_determinism():
    task = get_task("arithmetic", max_value=50)
    assert make_dataset(task, 50, seed=3) == make_dataset(task, 50, seed=3)
    assert make_dataset(task, 50, seed=3) != make_dataset(task, 50, seed=4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(ops=("/",)), "ops"),
        (dict(ops=()), "ops"),
        (dict(num_terms=1), "num_terms"),
        (dict(min_value=5, max_value=4), "max_value"),
        (dict(min_value=-1), "min_value"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArithmeticTask(**kwargs)


def test_ops_from_a_yaml_list():
    assert ArithmeticTask(ops=["+", "*"]).ops == ("+", "*")


def test_reward_takes_ascii_digits_only_and_long_true_answers():
    task = ArithmeticTask()
    assert task.reward(Problem("x", "-6"), "-\u0666") == 0.0  # Arabic-Indic six is not the answer's digit
    big = "1" + "0" * 70  # a true answer longer than the 64-digit cap on stray digit runs
    assert task.reward(Problem("x", big), big) == 1.0
    assert task.reward(Problem("x", "7"), "1" + "0" * 70) == 0.0
