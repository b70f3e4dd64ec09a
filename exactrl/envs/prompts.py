"""How a task's problem becomes tokens: the prompt through the tokenizer's chat template (the task's system
prompt first, when it has one) and, for supervised warm starts, the demonstration answer."""

from __future__ import annotations

from exactrl.envs.base import Problem, Task
from exactrl.model.tokenizer import Tokenizer


def prompt_ids(tokenizer: Tokenizer, task: Task, problem: Problem) -> list[int]:
    """The generation prompt of `problem`: [system,] user (or a dataset row's chat, `meta["messages"]`,
    exactrl/envs/sources.py; the task's system prompt first unless the chat has its own), then the
    assistant's turn opened."""
    chat = problem.meta.get("messages")
    own_system = chat is not None and chat[0]["role"] == "system"
    msgs = [{"role": "system", "content": task.system_prompt}] if task.system_prompt and not own_system else []
    msgs.extend(chat if chat is not None else [{"role": "user", "content": problem.prompt}])
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True)


def answer_ids(tokenizer: Tokenizer, problem: Problem, echo: bool = False) -> list[int]:
    """The demonstration: the answer, or (echo) the question restated before it, then end of turn."""
    text = problem.prompt + problem.answer if echo else problem.answer
    return tokenizer.encode(text) + [tokenizer.end_of_turn_id]
