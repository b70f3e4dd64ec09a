"""Run-config section for the task (prompts and reward)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from exactrl.argcheck import PathText, PlainData


class TaskSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    kind: Literal["task", "verifiers"] = "task"
    """`task`: an exactrl task (`name`, with `module`, `dataset`, `reward`, ...); `verifiers`: an installed
    `verifiers` environment (`env_id`), whose episodes run against the in-process server's sessions and are
    scored by its own rewards (docs/data.md; `pip install 'exactrl[verifiers]'`)."""
    env_id: str | None = None
    """With `kind: verifiers`: the environment's taskset id, the installed package verifiers imports for it
    (its `__all__` exports a `Taskset`, and optionally a `Harness` and an `Env`)."""
    env_args: PlainData = Field(default_factory=dict)
    """With `kind: verifiers`: the fields of the environment's verifiers `EnvConfig` (`taskset: {...}` knobs,
    each seat's `harness`, `runtime`, `max_turns`, ...); every seat runs in verifiers' `subprocess`
    runtime unless it names another."""
    name: str = "arithmetic"
    """Registered task name (see `exactrl.envs.TASKS`)."""
    module: PathText | None = None
    """Python module imported before `name` is looked up: a dotted name (`mypkg.tasks`) or a .py file path.
    A task it registers with `@register_task` can then be named in `name` (a task of your own, from the CLI)."""
    kwargs: PlainData = Field(default_factory=dict)
    """Constructor arguments of the task (difficulty knobs)."""
    train_jsonl: PathText | None = None
    """Optional JSONL file of {prompt, answer} training problems; None generates them procedurally."""
    dataset: PathText | None = None
    """A dataset file or folder: JSONL, Parquet, or a `datasets` folder written by `save_to_disk`
    (docs/data.md). Its held-out fifth (`envs.dataset.held_out`) is the evaluation set, the rest the
    training set; `task.name` scores its rows. Not with `train_jsonl`."""
    columns: dict[str, str] = Field(default_factory=dict)
    """Which column of `dataset` holds each role: `prompt` (text) or `messages` (a chat list), and `answer`;
    a role left out is read from the column of its own name. Other columns go to `Problem.meta`."""
    reward: PathText | None = None
    """A reward function replacing the task's: `path/to/file.py:function` or `package.module:function`,
    called as `function(problem, completion) -> number` (docs/data.md)."""
    train_size: int = Field(4096, ge=1, le=10**6)
    """Number of procedurally generated training problems (cycled by epoch); at most 1e6, as they are
    generated and held in memory before the run starts."""
    eval_size: int = Field(200, ge=0, le=10**6)
    """Draws of held-out problems scored greedily every `eval_every` steps (0 disables evaluation; at most
    1e6), from the fifth of the task's problems that training never draws (`envs.dataset.held_out`), minus
    any prompt of `train_jsonl` (with `dataset`: its held-out rows); each distinct problem drawn is scored
    once (the default task has 200 problems, 47 of them held out, of which its 200 draws find 46). The
    default job's warm start, which stands for pretraining, saw every problem."""

    @model_validator(mode="after")
    def _check_kind(self) -> TaskSettings:
        # against the defaults, not the keys given: a run's own config.json names every key
        def changed(key: str) -> bool:
            return getattr(self, key) != type(self).model_fields[key].get_default(call_default_factory=True)

        if self.kind == "task":
            for key in ("env_id", "env_args"):
                if changed(key):
                    raise ValueError(f"task.{key} needs task.kind=verifiers (kind is task)")
            return self
        if not self.env_id:
            raise ValueError("task.kind=verifiers needs task.env_id: the installed verifiers environment to train on")
        for key in ("name", "module", "kwargs", "train_jsonl", "dataset", "columns", "reward"):
            if changed(key):
                raise ValueError(
                    f"task.{key} describes an exactrl task: with task.kind=verifiers the environment "
                    f"gives the prompts and rewards (set its own settings in task.env_args)"
                )
        return self
