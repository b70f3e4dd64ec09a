"""CountdownTask: the exact expression parser, legal number use, reachable targets."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest
from fuzzing import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from exactrl.envs import CountdownTask, ExpressionError, Problem, make_dataset, parse_expression

P = Problem(prompt="Use 9 3 5 to make 72.", answer="9*(5+3)", meta={"numbers": [9, 3, 5], "target": 72})


@pytest.mark.parametrize(
    "text, value",
    [
        ("2+3*4", 14),
        ("(2+3)*4", 20),
        ("8/4/2", 1),
        ("8-3-2", 3),
        ("2*(3+(4-1))", 12),
        ("1/3*3", 1),
        ("7/2", Fraction(7, 2)),
        (" ( 2 + 3 ) ", 5),
        ("10-2*3+4/2", 6),
        ("((5))", 5),
    ],
)
def test_parser_values(text, value):
    assert parse_expression(text).value == value


def test_parser_records_numbers_in_order():
    assert parse_expression("(10-2)*3").numbers == (10, 2, 3)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "2+",
        "(2+3",
        "2 3",
        "2+3)",
        "-2+5",
        "2**3",
        "abc",
        "2+x",
        "()",
        "2^3",
        "(" * 1000 + "1" + ")" * 1000,
        "\u0669*(\u0665+\u0663)",
        "\uff19*8",
    ],
)  # non-ASCII digits: Arabic-Indic, fullwidth
def test_parser_rejects_malformed(text):
    with pytest.raises(ExpressionError):
        parse_expression(text)


def test_division_by_zero_scores_zero_not_exception():
    with pytest.raises(ZeroDivisionError):
        parse_expression("5/(3-3)")
    p = Problem("Use 5 3 3 to make 5.", "5", {"numbers": [5, 3, 3], "target": 5})
    assert CountdownTask().reward(p, "5/(3-3)") == 0.0
    assert CountdownTask(format_reward=0.1).reward(p, "5/(3-3)") == 0.0


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("9*(5+3)", 1.0),
        ("(3+5)*9", 1.0),
        (" 9 * (3 + 5) \n", 1.0),
        ("9*(5+3) = 72", 1.0),  # a trailing "= target" is allowed
        ("<think>try 9*8</think>\n9*(5+3)", 1.0),
        ("9*5+3", 0.0),  # well-formed, wrong value
        ("9*8", 0.0),  # 8 is not a given number
        ("9*(3+3+2)", 0.0),  # 3 reused, 2 not given
        ("9*9-9", 0.0),  # 9 reused
        ("The answer is 9*(5+3)", 0.0),  # prose is not an expression
        ("", 0.0),
        ("9*(5+3", 0.0),
        ("\u0669*(\u0665+\u0663)", 0.0),  # the same expression in Arabic-Indic digits is not ours to read
    ],
)
def test_reward(completion, expected):
    assert CountdownTask().reward(P, completion) == expected


def test_at_most_once_versus_exactly_once():
    p = Problem("Use 9 3 5 to make 45.", "9*5", {"numbers": [9, 3, 5], "target": 45})
    assert CountdownTask().reward(p, "9*5") == 1.0
    assert CountdownTask(use_all_numbers=True).reward(p, "9*5") == 0.0
    assert CountdownTask(use_all_numbers=True).reward(p, "9*5*3/3") == 0.0  # 3 twice
    assert CountdownTask(use_all_numbers=True).reward(P, "9*(5+3)") == 1.0


@pytest.mark.parametrize(
    "meta",
    [
        {"numbers": [3, 5, 7], "target": 15.9},
        {"numbers": [3.7, 5, 7], "target": 15},
        {"numbers": "357", "target": 15},
        {"numbers": [True, 5, 7], "target": 5},
        {"numbers": [], "target": 15},
    ],
)
def test_bad_row_metadata_is_refused_not_coerced(meta):
    """A JSONL row's numbers and target must be integers: 15.9 is refused, not cut to 15 (where 3*5 would score
    1.0)."""
    with pytest.raises(ValueError, match="must be a non-empty list of integers"):
        CountdownTask().reward(Problem("Use 3 5 7 to make 15.", "3*5", meta), "3*5")


def test_format_reward():
    task = CountdownTask(format_reward=0.1)
    assert task.reward(P, "9*5+3") == 0.1
    assert task.reward(P, "9*9") == 0.1
    assert task.reward(P, "nine") == 0.0
    assert task.reward(P, "9*(5+3)") == 1.0


def test_reference_answers_are_correct_and_targets_in_range():
    for kwargs in (dict(), dict(num_numbers=4, max_number=20, max_target=200), dict(ops=("+", "-"))):
        task = CountdownTask(**kwargs)
        for p in make_dataset(task, 200, seed=0):
            assert 1 <= p.meta["target"] <= task.max_target
            assert len(p.meta["numbers"]) == task.num_numbers
            assert task.reward(p, p.answer) == 1.0, p
            assert CountdownTask(use_all_numbers=True, **kwargs).reward(p, p.answer) == 1.0
            assert p.prompt == f"Use {' '.join(map(str, p.meta['numbers']))} to make {p.meta['target']}."


def test_determinism():
    assert make_dataset(CountdownTask(), 30, seed=5) == make_dataset(CountdownTask(), 30, seed=5)
    assert make_dataset(CountdownTask(), 30, seed=5) != make_dataset(CountdownTask(), 30, seed=6)


def test_problem_without_meta_is_a_clear_error():
    with pytest.raises(ValueError, match="numbers"):
        CountdownTask().reward(Problem("Use 1 2 to make 3.", "1+2"), "1+2")


@pytest.mark.parametrize("kwargs", [dict(num_numbers=1), dict(ops=("^",)), dict(max_target=0), dict(format_reward=1.0)])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        CountdownTask(**kwargs)


def test_unreachable_configuration_is_reported():
    with pytest.raises(ValueError, match="max_target"):
        CountdownTask(max_number=1, ops=("+",), max_target=2).generate(random.Random(0))


@settings(max_examples=examples(300), deadline=None)
@given(st.text(alphabet="0123456789+-*/() x=\n", max_size=40))
def test_reward_never_raises(text):
    assert CountdownTask(format_reward=0.1).reward(P, text) in (0.0, 0.1, 1.0)


def test_reward_of_deeply_nested_parentheses_is_zero_even_deep_in_the_stack():
    """The parser recurses per parenthesis: within the 256-character cap, a caller already deep in its
    own stack saw a RecursionError (the reward must never raise on bad text)."""

    def deep(n):
        return CountdownTask().reward(P, "(" * 255 + "3") if n == 0 else deep(n - 1)

    assert deep(400) == 0.0


def test_the_held_out_split_keeps_a_puzzle_whole_whatever_the_order_of_its_numbers():
    """Prompts list the numbers as drawn: a split that hashed the prompt would train on held-out puzzles with
    their numbers in another order."""
    from exactrl.envs.dataset import held_out, make_dataset

    task = CountdownTask()
    train = make_dataset(task, 2000, seed=0, split="train")
    evals = make_dataset(task, 300, seed=7919, split="eval")
    assert not {task.split_key(p) for p in train} & {task.split_key(p) for p in evals}
    assert len({task.split_key(p) for p in evals}) < len({p.prompt for p in evals})  # orders of one puzzle
    p = evals[0]
    shuffled = Problem(p.prompt, p.answer, {**p.meta, "numbers": p.meta["numbers"][::-1]})
    assert held_out(shuffled, task) and task.split_key(shuffled) == task.split_key(p)
