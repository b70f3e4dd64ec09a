"""The `math` task's math-verify reward on LaTeX and plain answers, and reward functions from a file
(`task.reward`), their returns read by the one reward rule."""

from __future__ import annotations

import random

import pytest

from exactrl.envs import ArithmeticTask, MathTask, Problem, get_task
from exactrl.envs.custom import build_task, load_function
from exactrl.envs.settings import TaskSettings


@pytest.mark.parametrize(
    "answer, completion, reward",
    [
        ("\\frac{1}{2}", "The answer is $\\boxed{\\frac{1}{2}}$.", 1.0),
        ("\\frac{1}{2}", "So x = 0.5", 1.0),
        ("0.5", "$\\boxed{\\dfrac{1}{2}}$", 1.0),
        ("$\\sqrt{2}$", "\\boxed{2^{1/2}}", 1.0),
        ("3", "<think>maybe 4</think> The answer is \\boxed{3}", 1.0),
        ("3", "<think>3</think> \\boxed{4}", 0.0),
        ("\\frac{1}{2}", "The answer is $\\boxed{\\frac{1}{3}}$.", 0.0),
        ("12", "", 0.0),
        ("12", "\\boxed{", 0.0),
        ("12", "}}}\\frac{{{ $$ \\left( ^^^ " * 50, 0.0),
        ("12", "\x00\ud800 garbage ∑∫ \\\\\\", 0.0),
    ],
)
def test_math_reward_parses_and_compares(answer, completion, reward):
    assert MathTask().reward(Problem("q", answer), completion) == reward


def test_math_checks_references_and_has_no_generator():
    task = get_task("math", system_prompt="Put the final answer in \\boxed{}.")
    assert task.system_prompt.startswith("Put")
    task.check(Problem("q", "\\frac{3}{4}"))
    with pytest.raises(ValueError, match="math-verify reads no answer in the reference"):
        task.check(Problem("q", "no number here"))
    with pytest.raises(
        ValueError,
        match=r"no problem generator: give its problems with task.dataset \(exactrl eval: --dataset\), and its "
        r"model with model.path",
    ):
        task.generate(random.Random(0))


def test_math_reward_never_raises_in_a_thread():
    import threading

    out = []
    t = threading.Thread(target=lambda: out.append(MathTask().reward(Problem("q", "2"), "x = \\boxed{2}")))
    t.start()
    t.join()
    assert out == [1.0]


REWARDS = """
def exact(problem, completion):
    return completion.strip() == problem.answer + problem.meta.get("suffix", "")

def half(problem, completion):
    return 0.5

def text(problem, completion):
    return "1"
"""


def test_a_reward_function_in_a_file_replaces_the_task_reward(tmp_path):
    (tmp_path / "rewards.py").write_text(REWARDS)
    task = build_task(TaskSettings(name="arithmetic", kwargs={"max_value": 5}, reward=f"{tmp_path}/rewards.py:exact"))
    assert task.name == "arithmetic" and task.generate(random.Random(0)) == ArithmeticTask(max_value=5).generate(
        random.Random(0)
    )
    assert task.reward(Problem("1+1=", "2"), " 2 ") == 1.0 and task.reward(Problem("1+1=", "2"), "2 apples") == 0.0
    assert task.reward(Problem("1+1=", "2", {"suffix": "!"}), "2!") == 1.0
    with pytest.raises(ValueError, match="non-integer answer"):  # the named task still checks rows
        task.check(Problem("q", "x"))
    half = build_task(TaskSettings(reward=f"{tmp_path}/rewards.py:half"))
    assert half.reward(Problem("1+1=", "2"), "") == 0.5
    bad = build_task(TaskSettings(reward=f"{tmp_path}/rewards.py:text"))
    with pytest.raises(ValueError, match=r"task.reward .*rewards.py:text must be a finite number, got '1' \(str\)"):
        bad.reward(Problem("1+1=", "2"), "")


def test_bad_reward_specs_are_named(tmp_path):
    (tmp_path / "rewards.py").write_text(REWARDS)
    for spec, match in [
        ("rewards.py", "must be `path/to/file.py:function`"),
        (f"{tmp_path}/rewards.py:", "must be `path/to/file.py:function`"),
        (f"{tmp_path}/missing.py:f", "task.reward: task module file .*missing.py does not exist"),
        (f"{tmp_path}/rewards.py:nope", "task.reward: .*rewards.py defines no function 'nope'"),
        ("no_such_pkg_xyz:f", "task.reward: cannot import task module 'no_such_pkg_xyz'"),
    ]:
        with pytest.raises(ValueError, match=match):
            load_function(spec)
    assert load_function("exactrl.envs.arithmetic:integer_reward")("3", "3") == 1.0
