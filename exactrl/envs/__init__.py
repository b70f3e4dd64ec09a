"""Tasks and verifiable rewards (arithmetic, countdown, math), datasets from files, a resumable prompt stream.

Importing this package registers the built-in single-turn tasks (arithmetic,
countdown, math) in `TASKS`; `exactrl.envs.tool_use` registers `calculator`, the
agent task of the chat server, when imported (`task.module: exactrl.envs.tool_use`).
"""

from exactrl.envs.arithmetic import ArithmeticTask
from exactrl.envs.base import TASKS, Problem, Task, get_task, import_task_module, register_task, strip_reasoning
from exactrl.envs.countdown import CountdownTask, ExpressionError, parse_expression
from exactrl.envs.dataset import PromptSource, make_dataset, read_jsonl, write_jsonl
from exactrl.envs.mathverify import MathTask

__all__ = [
    "TASKS",
    "ArithmeticTask",
    "CountdownTask",
    "ExpressionError",
    "MathTask",
    "Problem",
    "PromptSource",
    "Task",
    "get_task",
    "import_task_module",
    "make_dataset",
    "parse_expression",
    "read_jsonl",
    "register_task",
    "strip_reasoning",
    "write_jsonl",
]
