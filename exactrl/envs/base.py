"""The task protocol: one file adds a task and its verifiable reward.

A task is a small object that (1) generates problems procedurally from a
`random.Random` it is handed (never the global RNG, so a dataset is a pure
function of its seed) and (2) scores a completion against a problem with a
reward in [0, 1] computed by a program, not a model. Problems are plain data
(`Problem`), so the same reward works on procedurally generated problems and on
problems read back from a JSONL file.

Adding a task:

    @register_task
    class MyTask(Task):
        name = "my_task"
        def generate(self, rng): ...
        def reward(self, problem, completion): ...

after which `get_task("my_task", **kwargs)` builds it (the run config names
tasks this way: `--set task.module=path/to/my_task.py --set task.name=my_task`). Unlike
tinker-cookbook's `Env`, these tasks are single-turn and stateless; multi-turn tool use goes through the chat server.
"""

from __future__ import annotations

import abc
import hashlib
import inspect
import random
from dataclasses import dataclass, field
from typing import Any, TypeVar

from exactrl.argcheck import check_arg_types


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer; what datasets store and rewards read."""

    prompt: str  # the user message text, e.g. "12+7="
    answer: str  # reference answer; also the supervised target of a warm start
    meta: dict[str, Any] = field(default_factory=dict)  # task-specific data the reward needs (JSON-serialisable)


class Task(abc.ABC):
    """A procedural problem generator with a verifiable reward."""

    name: str = ""  # registry key; set on every concrete subclass
    system_prompt: str | None = None  # rendered as the system message when not None

    @abc.abstractmethod
    def generate(self, rng: random.Random) -> Problem:
        """Returns one problem drawn with `rng` only (deterministic for a given rng state)."""

    @abc.abstractmethod
    def reward(self, problem: Problem, completion: str) -> float:
        """Scores `completion` (decoded text, special tokens dropped) in [0, 1]; never raises on bad text."""

    def check(self, problem: Problem) -> None:  # noqa: B027 (optional: a task without needs keeps it)
        """Raises ValueError if `reward` cannot score `problem` (a training-file row without what the task
        needs). Run on every row of `task.train_jsonl` at the start; the default checks nothing."""

    def split_key(self, problem: Problem) -> str:
        """What makes two problems one, for the held-out split (`envs.dataset.held_out`): the prompt, unless
        the task's prompts state one problem in several ways (countdown's numbers in any order)."""
        return problem.prompt


T = TypeVar("T", bound=type[Task])

TASKS: dict[str, type[Task]] = {}  # name -> task class, filled by @register_task


def register_task(cls: T) -> T:
    """Class decorator adding `cls` to `TASKS` under `cls.name`."""
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ValueError(f"register_task expects a Task subclass, got {cls!r}")
    if not cls.name:
        raise ValueError(f"task class {cls.__name__} must set a non-empty class attribute `name`")
    old = TASKS.get(cls.name)
    reloaded = old is not None and (old.__module__, old.__qualname__) == (cls.__module__, cls.__qualname__)
    if old is not None and old is not cls and not reloaded:  # a re-import of the same module replaces its class
        raise ValueError(f"task name {cls.name!r} is already registered by {old.__module__}.{old.__qualname__}")
    TASKS[cls.name] = cls
    return cls


def import_task_module(module: str):
    """Imports a module (dotted name or .py file path) so the tasks it registers can be named; returns it."""
    import importlib
    import importlib.util
    import sys
    from pathlib import Path

    if module.endswith(".py"):
        path = Path(module)
        if not path.is_file():
            raise ValueError(f"task module file {module} does not exist")
        # named by the file's whole path: two tasks.py in two directories are two modules
        name = f"exactrl_user_tasks_{path.stem}_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]}"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # dataclasses and pickling look modules up by name
        try:
            spec.loader.exec_module(mod)
        except BaseException as e:
            del sys.modules[name]  # a failed import leaves no half-made module behind
            if isinstance(e, (Exception, SystemExit)):  # a Ctrl-C stays a Ctrl-C
                raise _import_failure(module, e) from e
            raise
        return mod
    if module.startswith("."):
        raise ValueError(f"task module {module!r} is a relative name: give its full dotted name or a .py file path")
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise ValueError(
            f"cannot import task module {module!r}: {e} (give a module on sys.path or a .py file path)"
        ) from None
    except (Exception, SystemExit) as e:
        raise _import_failure(module, e) from e


def _module_source(module: str) -> bytes:
    """The source of a task module (a .py path or a dotted name; the name itself if it has no file)."""
    import importlib.util
    from pathlib import Path

    if module.endswith(".py"):
        return Path(module).read_bytes()
    spec = importlib.util.find_spec(module)
    origin = Path(spec.origin) if spec is not None and spec.origin else None
    return origin.read_bytes() if origin is not None and origin.is_file() else module.encode()


def module_sha256(module: str | None) -> str | None:
    """The sha256 of a task module's source (None without one): the warm start's cache key and the
    resume check (exactrl/train/setup.py) both see an edited task as another task."""
    return hashlib.sha256(_module_source(module)).hexdigest() if module else None


def _import_failure(module: str, e: Exception | SystemExit) -> ValueError:
    """The error for a task module whose own code failed while it was imported, naming it (a `sys.exit` there
    would otherwise end `train` with no message at all)."""
    if isinstance(e, SystemExit):
        return ValueError(
            f"task module {module} called sys.exit({e.code!r}) while it was imported: a module that "
            f"registers tasks must not exit (guard a script's own code with "
            f"`if __name__ == '__main__':`)"
        )
    return ValueError(f"task module {module} failed while it was imported ({type(e).__name__}: {e})")


def get_task(name: str, **kwargs: Any) -> Task:
    """Builds the registered task `name` with its constructor arguments."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    cls = TASKS[name]
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        params = ", ".join(inspect.signature(cls).parameters)
        raise ValueError(f"bad arguments for task {name!r}: {e}; it accepts: {params}") from None
    check_arg_types(cls, kwargs, f"task {name!r}")
    return cls(**kwargs)


# --------------------------------------------------------------------------- completion helpers


def strip_reasoning(completion: str) -> str:
    """The answer part of a completion: `<think>...</think>` blocks dropped.

    Text before a lone `</think>` (the prompt opened the block) is reasoning too;
    an unclosed `<think>` means the answer was never written, so nothing is kept.
    One pass of `str.find` (a regex rescanned the rest of the text for every
    unclosed `<think>`: 32k of them took 30 s, and a collapsed policy writes them).
    """
    parts, i = [], 0  # each <think> with the first </think> after it goes, left to right
    while (o := completion.find("<think>", i)) >= 0 and (c := completion.find("</think>", o + 7)) >= 0:
        parts.append(completion[i:o])
        i = c + len("</think>")
    text = "".join(parts) + completion[i:]
    close_at = text.rfind("</think>")
    if close_at >= 0:
        text = text[close_at + len("</think>") :]
    open_at = text.find("<think>")
    return text if open_at < 0 else text[:open_at]
