"""The task protocol: registration, lookup, argument errors, a task in one file."""

from __future__ import annotations

import random
import re

import pytest

from exactrl.envs import TASKS, ArithmeticTask, CountdownTask, Problem, Task, get_task, register_task, strip_reasoning


def test_builtin_tasks_are_registered():
    assert TASKS["arithmetic"] is ArithmeticTask and TASKS["countdown"] is CountdownTask
    assert isinstance(get_task("countdown", num_numbers=4), CountdownTask)


def test_unknown_task_lists_known_ones():
    with pytest.raises(ValueError, match="known tasks: .*arithmetic.*countdown"):
        get_task("nope")


def test_bad_kwargs_name_the_accepted_ones():
    with pytest.raises(ValueError, match="accepts: min_value, max_value"):
        get_task("arithmetic", max_val=3)


def test_a_user_task_in_one_file():
    @register_task
    class Echo(Task):
        name = "echo_test"
        system_prompt = "Repeat the word."

        def generate(self, rng: random.Random) -> Problem:
            word = rng.choice(["cat", "dog"])
            return Problem(prompt=word, answer=word)

        def reward(self, problem: Problem, completion: str) -> float:
            return float(completion.strip() == problem.answer)

    try:
        task = get_task("echo_test")
        p = task.generate(random.Random(0))
        assert task.reward(p, p.answer + "\n") == 1.0 and task.system_prompt == "Repeat the word."
        with pytest.raises(ValueError, match="already registered"):
            register_task(type("Other", (Echo,), {}))
    finally:
        TASKS.pop("echo_test")


def test_importing_a_task_file_again_replaces_its_task(tmp_path):
    """Two runs in one process (a notebook, the tests) import the same --set task.module file twice."""
    from exactrl.envs import import_task_module

    f = tmp_path / "twice.py"
    f.write_text(
        "from exactrl.envs import ArithmeticTask, register_task\n\n\n@register_task\n"
        "class Twice(ArithmeticTask):\n    name = 'twice_test'\n"
    )
    try:
        import_task_module(str(f))
        first = TASKS["twice_test"]
        import_task_module(str(f))
        assert TASKS["twice_test"] is not first and TASKS["twice_test"].__qualname__ == "Twice"
    finally:
        TASKS.pop("twice_test", None)


def test_register_rejects_nameless_and_non_tasks():
    with pytest.raises(ValueError, match="name"):
        register_task(type("Nameless", (Task,), {}))
    with pytest.raises(ValueError, match="Task subclass"):
        register_task(int)


@pytest.mark.parametrize(
    "text, answer",
    [
        ("a<think>b</think>c", "ac"),
        ("<think>x</think>\n\n8", "\n\n8"),
        ("reasoning</think>8", "8"),
        ("8<think>unfinished", "8"),
        ("<think>1</think>2<think>3</think>4", "24"),
        ("plain", "plain"),
        ("<think>a<think>b</think>c</think>d", "d"),
        ("x</think>y<think>z</think>w", "yw"),
        ("<think>a</think>b<think>c", "b"),
    ],
)
def test_strip_reasoning(text, answer):
    assert strip_reasoning(text) == answer


def test_strip_reasoning_takes_one_pass_over_degenerate_text():
    """Thousands of unclosed <think> (a collapsed policy; a regex took ~10 s on these): the answer is what
    precedes the first."""
    assert strip_reasoning("7" + "<think>" * 20_000) == "7"
    assert strip_reasoning("<think>" * 20_000 + "</think>9") == "9"


def test_a_task_in_a_file_of_its_own_is_named_from_the_run_config(tmp_path):
    """`task.module` imports the user's file first, so `exactrl train --set task.name=...` can name its task."""
    from exactrl.envs import import_task_module
    from exactrl.train.config import load_config

    f = tmp_path / "double_task.py"
    f.write_text("""
from exactrl.envs import Problem, Task, register_task

@register_task
class Double(Task):
    name = "double_from_file"
    def generate(self, rng):
        x = rng.randint(1, 9)
        return Problem(prompt=f"2*{x}=", answer=str(2 * x))
    def reward(self, problem, completion):
        return float(completion.strip() == problem.answer)
""")
    cfg = load_config(None, [f"task.module={f}", "task.name=double_from_file"])
    with pytest.raises(ValueError, match="unknown task 'double_from_file'"):
        get_task(cfg.task.name)
    import_task_module(cfg.task.module)
    task = get_task(cfg.task.name)
    assert task.reward(task.generate(random.Random(0)), task.generate(random.Random(0)).answer) == 1.0
    with pytest.raises(ValueError, match="does not exist"):
        import_task_module(str(tmp_path / "nope.py"))
    with pytest.raises(ValueError, match="cannot import task module 'no_such_pkg.tasks'"):
        import_task_module("no_such_pkg.tasks")


def test_the_agent_task_registers_when_its_module_is_imported():
    from exactrl.envs import import_task_module

    import_task_module("exactrl.envs.tool_use")
    assert TASKS["calculator"].__name__ == "CalculatorTask"


def test_two_task_files_of_one_name_in_two_directories_are_two_modules(tmp_path):
    """a/tasks.py and b/tasks.py both registering "clash_task": the second is refused by name (it does not
    replace the first silently, as if it were a reload); a file whose import fails leaves no module behind."""
    import sys

    from exactrl.envs import import_task_module

    body = """
from exactrl.envs import Problem, Task, register_task

@register_task
class Clash(Task):
    name = "clash_task"
    def generate(self, rng):
        return Problem(prompt="1+1=", answer="2")
    def reward(self, problem, completion):
        return 1.0
"""
    files = []
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        files.append(tmp_path / d / "tasks.py")
        files[-1].write_text(body)
    try:
        import_task_module(str(files[0]))
        first = TASKS["clash_task"]
        import_task_module(str(files[0]))  # the same file again: a reload
        with pytest.raises(ValueError, match="already registered"):
            import_task_module(str(files[1]))
        assert TASKS["clash_task"].__module__ == first.__module__
    finally:
        TASKS.pop("clash_task", None)
    bad = tmp_path / "broken.py"
    bad.write_text("raise RuntimeError('broken task file')\n")
    before = set(sys.modules)
    with pytest.raises(
        ValueError,
        match=r"task module .*broken.py failed while it was imported \(RuntimeError: "
        r"broken task file\)",
    ):
        import_task_module(str(bad))
    assert set(sys.modules) == before


def test_each_builtin_task_checks_a_problem_it_cannot_score():
    """`Task.check` runs on every training-file row at the start (train/setup.py), without scoring anything."""
    from exactrl.envs import CountdownTask
    from exactrl.envs.arithmetic import ArithmeticTask
    from exactrl.envs.base import Problem
    from exactrl.envs.tool_use import CalculatorTask

    for task, bad in (
        (ArithmeticTask(), Problem("2+1=", "3.0")),
        (CalculatorTask(), Problem("2+1", "three")),
        (CountdownTask(), Problem("Use 1 2 to make 3.", "1+2")),
    ):
        with pytest.raises(ValueError, match=re.escape(repr(bad.prompt))):
            task.check(bad)
        good = task.generate(random.Random(0))
        assert task.check(good) is None and task.reward(good, good.answer) == 1.0
