"""Calculator tool use: a multi-turn agent task driven through the OpenAI API.

The environment is an async function, `calculator_episode(base_url, problem)`,
that plays one episode with the official `openai` client against whatever
server `base_url` points at — exactly how agents are usually written. For
training, `base_url` is a session URL of the exactrl server
(`<server>/sessions/<id>/v1`), which records the episode's token-level
trajectory with loss masks; the environment itself knows nothing of tokens.

An episode: the user asks for an expression's value; the agent may call the
`calculator` tool (arguments `{"expression": "..."}`), gets the result as a
tool message, and answers. Assistant messages are sent back exactly as
returned (token fields included), so every turn's prompt is token-exact.

Reward (in [0, 1], computed by a program): 1.0 if the first integer of the
final answer (reasoning dropped) is the expression's value, else 0.0. An
episode that is still calling tools after `max_turns` scores 0 (`Episode.out_of_turns`).
"""

from __future__ import annotations

import ast
import json
import operator
import random
from dataclasses import dataclass, field
from typing import Any

from exactrl.envs.arithmetic import MAX_TERMS, check_integer_answer, evaluate_terms, integer_reward
from exactrl.envs.base import Problem, Task, register_task

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an integer arithmetic expression (+, -, *, //, %, parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
SYSTEM_PROMPT = "Use the calculator, then answer with the number."

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_MAX_EXPR_CHARS = 200
_MAX_ABS = 10**30  # keeps a pathological expression from building huge integers


def calculate(expression: str) -> str:
    """The tool: the value of an integer expression, or an error message (never raises)."""
    if not isinstance(expression, str) or len(expression) > _MAX_EXPR_CHARS:
        return "error: expression must be a string of at most 200 characters"
    try:
        return str(_eval(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {type(e).__name__}"


def _eval(node) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        v = _OPS[type(node.op)](_eval(node.left), _eval(node.right))
        if abs(v) > _MAX_ABS:
            raise ValueError("value too large")
        return v
    raise ValueError("unsupported expression")


@register_task
class CalculatorTask(Task):
    """`"Compute 37*12-5"` with the answer `"439"`; meta holds the expression for the tool."""

    name = "calculator"
    system_prompt = SYSTEM_PROMPT

    def __init__(
        self, min_value: int = 10, max_value: int = 99, ops: tuple[str, ...] = ("+", "-", "*"), num_terms: int = 2
    ):
        ops = tuple(ops)
        if min_value < 0:
            raise ValueError(f"min_value must be >= 0 (operands are written without a sign), got {min_value}")
        if max_value < min_value:
            raise ValueError(f"max_value ({max_value}) must be >= min_value ({min_value})")
        if not ops or not set(ops) <= {"+", "-", "*"}:
            raise ValueError(f"ops must be a non-empty subset of ('+', '-', '*'), got {ops}")
        if not 2 <= num_terms <= MAX_TERMS:
            raise ValueError(f"num_terms must be in [2, {MAX_TERMS}], got {num_terms}")
        # the tool must compute every expression, or a correct agent is told "error"
        if (chars := num_terms * (len(str(max_value)) + 1) - 1) > _MAX_EXPR_CHARS:
            raise ValueError(
                f"max_value and num_terms={num_terms} allow expressions of {chars} characters; the "
                f"calculator reads at most {_MAX_EXPR_CHARS} (lower max_value or num_terms)"
            )
        if ((max_value + 1) ** num_terms if "*" in ops else num_terms * max_value) > _MAX_ABS:  # arithmetic.py
            raise ValueError(
                f"max_value, num_terms={num_terms} and ops={ops} allow values beyond the calculator's "
                f"limit of 10**30 (lower max_value or num_terms)"
            )
        self.min_value, self.max_value, self.ops, self.num_terms = min_value, max_value, ops, num_terms

    def generate(self, rng: random.Random) -> Problem:
        terms = [rng.randint(self.min_value, self.max_value) for _ in range(self.num_terms)]
        ops = [rng.choice(self.ops) for _ in range(self.num_terms - 1)]
        expr = str(terms[0]) + "".join(o + str(t) for o, t in zip(ops, terms[1:]))
        return Problem(prompt=f"Compute {expr}", answer=str(evaluate_terms(terms, ops)), meta={"expression": expr})

    def check(self, problem: Problem) -> None:
        check_integer_answer("calculator", problem)

    def reward(self, problem: Problem, completion: str) -> float:
        self.check(problem)
        return integer_reward(problem.answer, completion or "")


def first_messages(problem: Problem) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem.prompt}]


def ideal_transcript(problem: Problem) -> list[dict]:
    """The episode a perfect agent plays (a supervised warm-start target)."""
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": problem.meta["expression"]})},
    }
    return [
        *first_messages(problem),
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": calculate(problem.meta["expression"])},
        {"role": "assistant", "content": problem.answer},
    ]


def sft_example(tokenizer, messages: list[dict], tools=(CALCULATOR_TOOL,)) -> tuple[list[int], list[int]]:
    """Token ids of a transcript and a mask that is 1 on the assistant turns' bodies and end-of-turn tokens."""
    from exactrl.chat.messages import template_message

    tmsgs = [template_message(m, i) for i, m in enumerate(messages)]
    ids, mask = [], []
    for i, m in enumerate(tmsgs):
        if m["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(tmsgs[:i], tools=list(tools), add_generation_prompt=True)
        full = tokenizer.apply_chat_template(tmsgs[: i + 1], tools=list(tools), add_generation_prompt=False)
        body = full[len(prompt) : full.index(tokenizer.end_of_turn_id, len(prompt)) + 1]
        assert full[: len(prompt)] == prompt, "the template must render the generation prompt as a prefix"
        ids, mask = prompt + body, mask + [0] * (len(prompt) - len(mask)) + [1] * len(body)
    return ids, mask


@dataclass
class Episode:
    reward: float
    messages: list[dict] = field(default_factory=list)  # the conversation as the agent saw it
    tool_calls: int = 0
    turns: int = 0  # model calls
    out_of_turns: bool = False  # still calling tools after max_turns: why its reward is 0


async def calculator_episode(
    base_url: str,
    problem: Problem,
    *,
    model: str,
    seed: int | None = None,
    max_turns: int = 3,
    temperature: float = 1.0,
    max_tokens: int = 48,
    api_key: str = "exactrl",
    task: CalculatorTask | None = None,
    request_kwargs: dict[str, Any] | None = None,
) -> Episode:
    """Plays one episode against `base_url` with the openai client; returns its reward and transcript."""
    import openai

    task = task or CalculatorTask()
    messages: list[Any] = first_messages(problem)
    ep = Episode(0.0, messages)
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        for turn in range(max_turns):
            resp = await client.chat.completions.create(
                model=model,
                messages=messages,
                tools=[CALCULATOR_TOOL],
                temperature=temperature,
                max_tokens=max_tokens,
                seed=None if seed is None else seed + turn,
                **(request_kwargs or {}),
            )
            msg = resp.choices[0].message
            ep.turns += 1
            messages.append(msg.model_dump(exclude_none=True))  # token fields included: sent back unchanged
            if not msg.tool_calls:
                ep.reward = task.reward(problem, msg.content or "")
                return ep
            for call in msg.tool_calls:
                ep.tool_calls += 1
                try:  # untrusted model text: bad JSON, a list, deep nesting, an integer too long for int()
                    expr = json.loads(call.function.arguments).get("expression", "")
                except (ValueError, AttributeError, RecursionError):
                    expr = None
                result = calculate(expr) if call.function.name == "calculator" else "error: unknown tool"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    ep.out_of_turns = True
    return ep
