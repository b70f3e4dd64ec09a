"""Building the configured task, with a reward function from a file when `task.reward` names one.

`task.reward: path/to/file.py:function` (or `package.module:function`) replaces the reward of the task
`task.name`, which still generates the problems (or checks a dataset's rows), renders prompts and decides
the held-out split. The function is called as `function(problem, completion)`: `problem` an
`exactrl.envs.Problem` (`.prompt`, `.answer`, `.meta` with the dataset's other columns), `completion` the
decoded text (special tokens dropped, reasoning kept). It returns a reward by the rule of
exactrl/envs/rewards.py: a finite number or a bool; anything else stops the run naming the function.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import Any

from exactrl.envs.base import Problem, Task, get_task, import_task_module, module_sha256
from exactrl.envs.rewards import as_reward
from exactrl.envs.settings import TaskSettings


def build_task(ts: TaskSettings) -> Task:
    """The task of a run's `task` section: `module` imported, `name` built with `kwargs`, `reward` applied;
    with `kind: verifiers`, the environment `env_id` loaded (exactrl/envs/verifiers_env.py)."""
    if ts.kind == "verifiers":
        from exactrl.envs.verifiers_env import VerifiersEnv, VerifiersTask

        return VerifiersTask(VerifiersEnv.load(ts.env_id, ts.env_args))
    if ts.module:
        import_task_module(ts.module)
    task = get_task(ts.name, **ts.kwargs)
    return RewardFnTask(task, ts.reward) if ts.reward else task


def task_sha256(ts: TaskSettings) -> str | None:
    """What a resume checks of the task's code (exactrl/train/resume.py): the sha256 of `module`'s source,
    and with `reward`, of the two sources together (None with neither): an edited file is another task. With
    `kind: verifiers`: the sha256 of the environment package's `__init__` (the module verifiers imports)."""
    if ts.kind == "verifiers":
        return module_sha256(ts.env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower())
    if not ts.reward:
        return module_sha256(ts.module)
    h = hashlib.sha256()
    for source in (ts.module, ts.reward.rpartition(":")[0]):
        h.update((module_sha256(source) or "").encode() + b"\n")
    return h.hexdigest()


def load_function(spec: str, what: str = "task.reward") -> Callable[..., Any]:
    """The function `spec` names: `file.py:name` or `dotted.module:name`."""
    module, sep, name = spec.rpartition(":")
    if not sep or not module or not name.isidentifier():
        raise ValueError(f"{what} must be `path/to/file.py:function` or `package.module:function`, got {spec!r}")
    try:
        mod = import_task_module(module)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ValueError(f"{what}: {module} defines no function {name!r}")
    return fn


class RewardFnTask(Task):
    """`task` with its reward replaced by a function (module docstring)."""

    def __init__(self, task: Task, spec: str):
        self.task = task  # generates, checks, renders and splits
        self.spec = spec  # where the reward function lives, for messages
        self.fn = load_function(spec)
        self.name = task.name
        self.system_prompt = task.system_prompt

    def generate(self, rng: random.Random) -> Problem:
        return self.task.generate(rng)

    def check(self, problem: Problem) -> None:
        self.task.check(problem)

    def split_key(self, problem: Problem) -> str:
        return self.task.split_key(problem)

    def reward(self, problem: Problem, completion: str) -> float:
        return as_reward(self.fn(problem, completion), f"task.reward {self.spec}")
