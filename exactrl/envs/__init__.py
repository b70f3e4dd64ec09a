"""Tasks and verifiable rewards (arithmetic, countdown), JSONL datasets, a resumable prompt stream.

Importing this package registers the built-in tasks in `TASKS`.
"""
from exactrl.envs.arithmetic import ArithmeticTask
from exactrl.envs.base import TASKS, Problem, Task, get_task, register_task, strip_reasoning
from exactrl.envs.countdown import CountdownTask, ExpressionError, parse_expression
from exactrl.envs.dataset import PromptSource, make_dataset, read_jsonl, write_jsonl

__all__ = ["TASKS", "ArithmeticTask", "CountdownTask", "ExpressionError", "Problem", "PromptSource", "Task",
           "get_task", "make_dataset", "parse_expression", "read_jsonl", "register_task", "strip_reasoning",
           "write_jsonl"]
