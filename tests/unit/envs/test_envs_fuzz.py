"""Property-based review of the tasks and datasets: damaged JSONL files, untrusted completions, settings.

A dataset file is user input: every bad line must be a ValueError naming the file and the line, and a good
file must read back exactly. A completion is untrusted model text: a reward never raises or hangs, stays in
[0, 1], and the reference answer of a generated problem scores 1. Task settings in range generate valid
problems; settings out of range are refused by name.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest
from fuzzing import examples
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from exactrl.envs import (
    ArithmeticTask,
    CountdownTask,
    Problem,
    PromptSource,
    get_task,
    make_dataset,
    read_jsonl,
    write_jsonl,
)
from exactrl.envs.dataset import fingerprint, held_out
from exactrl.envs.tool_use import CalculatorTask, calculate, calculator_episode, ideal_transcript

FUZZ = settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(
    json_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12
)
good_rows = st.fixed_dictionaries(
    {"prompt": st.text(max_size=40), "answer": st.text(max_size=10) | st.integers()}, optional={"extra": json_values}
)


def _surrogate_free(text: str) -> bool:
    return not any(0xD800 <= ord(c) <= 0xDFFF for c in text)


# --------------------------------------------------------------------------- dataset files


@FUZZ
@given(
    rows=st.lists(
        good_rows.filter(lambda r: _surrogate_free(json.dumps(r, ensure_ascii=False))), min_size=1, max_size=8
    ),
    eol=st.sampled_from(["\n", "\r\n"]),
    bom=st.booleans(),
    blanks=st.lists(st.sampled_from(["", " ", "\t"]), max_size=3),
)
def test_good_files_read_back_whatever_their_line_ends_bom_and_blank_lines(tmp_path, rows, eol, bom, blanks):
    text = eol.join(blanks + [json.dumps(r, ensure_ascii=False) for r in rows] + blanks) + eol
    path = tmp_path / "d.jsonl"
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
    problems = read_jsonl(path)
    assert [p.prompt for p in problems] == [r["prompt"] for r in rows]
    assert [p.answer for p in problems] == [str(r["answer"]) for r in rows]
    write_jsonl(tmp_path / "again.jsonl", problems)  # and round-trips, hashes and streams
    assert read_jsonl(tmp_path / "again.jsonl") == problems
    PromptSource(problems).take(len(problems) + 1)


BAD_LINES = [
    ('{"prompt": "x", "answer": ', "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('"just text"', "expected a JSON object"),
    ("null", "expected a JSON object"),
    ('{"prompt": "x"}', "missing key"),
    ('{"answer": "1"}', "missing key"),
    ('{"prompt": null, "answer": "1"}', "'prompt' must be a string"),
    ('{"prompt": "x", "answer": 1.5}', "'answer' a string or integer"),
    ('{"prompt": "x", "answer": true}', "'answer' a string or integer"),
    ('{"prompt": ["x"], "answer": "1"}', "'prompt' must be a string"),
    ('{"prompt": "x", "answer": 1e999}', "'answer' a string or integer"),
    ('{"prompt": "x", "answer": "1", "m": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ('{"prompt": "x", "answer": ' + "7" * 5000 + "}", "integer too long"),
    ('{"prompt": "x\\ud800", "answer": "1"}', "'prompt' holds a lone surrogate"),
    ('{"prompt": "x", "answer": "1", "meta": ["\\udfff"]}', "'meta' holds a lone surrogate"),
    ("\ufeff" + '{"prompt": "x", "answer": "1"}', "BOM"),  # a byte-order mark on a later line is damage
]


@FUZZ
@given(
    bad=st.sampled_from(BAD_LINES),
    before=st.integers(0, 3),
    blank_before=st.integers(0, 2),
    after=st.integers(0, 2),
    eol=st.sampled_from(["\n", "\r\n"]),
)
def test_a_bad_line_anywhere_is_named_by_file_and_line(tmp_path, bad, before, blank_before, after, eol):
    line, match = bad
    assume(match != "BOM" or before + blank_before)  # a byte-order mark is allowed at the start of the file
    good = '{"prompt": "1+1=", "answer": "2"}'
    lines = [good] * before + [""] * blank_before + [line] + [good] * after
    path = tmp_path / "bad.jsonl"
    path.write_bytes(eol.join(lines).encode("utf-8", "surrogatepass") + eol.encode())
    with pytest.raises(ValueError, match=match) as e:
        read_jsonl(path)
    assert f"{path}:{before + blank_before + 1}:" in str(e.value)


@FUZZ
@given(data=st.binary(min_size=1, max_size=200))
def test_arbitrary_bytes_read_or_fail_naming_the_file(tmp_path, data):
    path = tmp_path / "junk.jsonl"
    path.write_bytes(data)
    try:
        problems = read_jsonl(path)
    except ValueError as e:
        assert str(path) in str(e)
    else:
        assert problems and all(isinstance(p.prompt, str) and isinstance(p.answer, str) for p in problems)
        fingerprint(problems)
        assert all(held_out(p) in (True, False) for p in problems)


def test_invalid_utf8_is_named_by_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(ValueError, match=rf"{path}:2: not UTF-8 text"):
        read_jsonl(path)


def test_a_huge_line_reads(tmp_path):
    path = tmp_path / "big.jsonl"
    write_jsonl(path, [Problem("x" * 2_000_000, "1")])
    assert read_jsonl(path)[0].prompt == "x" * 2_000_000


def test_paths_that_are_not_dataset_files(tmp_path):
    with pytest.raises(ValueError, match=rf"dataset file {tmp_path} is a directory"):
        read_jsonl(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        read_jsonl(tmp_path / "missing.jsonl")
    for empty in ("", "\n\n", "  \r\n", "\ufeff"):
        (tmp_path / "e.jsonl").write_text(empty, encoding="utf-8")
        with pytest.raises(ValueError, match="holds no problems"):
            read_jsonl(tmp_path / "e.jsonl")


def test_an_unreadable_file_is_a_value_error(tmp_path, monkeypatch):
    """Root reads any file, so the permission error is simulated at `open`."""
    import builtins

    path = tmp_path / "locked.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n')
    real_open = builtins.open

    def refusing_open(file, *args, **kwargs):
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refusing_open)
    with pytest.raises(ValueError, match=rf"cannot read dataset file {path}: Permission denied"):
        read_jsonl(path)


@FUZZ
@given(n=st.integers(0, 50), seed=st.integers(-(2**70), 2**70), split=st.sampled_from([None, "train", "eval"]))
def test_make_dataset_is_a_pure_function_of_its_arguments(n, seed, split):
    task = ArithmeticTask()
    a = make_dataset(task, n, seed, split)
    assert len(a) == n and a == make_dataset(task, n, seed, split)
    if split is not None:
        assert all(held_out(p, task) == (split == "eval") for p in a)


# --------------------------------------------------------------------------- rewards of untrusted completions

NASTY = [
    "",
    " ",
    "\x00",
    "1e999",
    "-1e999",
    "nan",
    "NaN",
    "inf",
    "-inf",
    "9" * 100_000,
    "-" + "9" * 5000,
    "(" * 10_000 + "1" + ")" * 10_000,
    "(" * 127 + "1" + ")" * 127,
    "9**9**9",
    "9**9**9**9",
    "999999999999" + "*999999999999" * 20,
    "1/0",
    "5/(3-3)",
    "0/0",
    "(1-1)/(2-2)",
    "1/3/3/3/3/3/3/3/3/3/3/3/3/3/3/3",
    "<think>",
    "</think>",
    "<think>" * 10_000,
    "</think>" * 10_000,
    "<think>1</think>" * 5000,
    "١٢",
    "１２",
    "\u2212" * 5000 + "1",
    "١" * 5000,
    "\ud800",
    "\U0001f600" * 1000,
    "1" + "\u0301" * 1000,
    "=" * 10_000,
    "\n" * 10_000,
    "\r\n".join(["x"] * 1000),
    "1_000",
    "0x10",
    "1e5",
    "12,000",
    "-0",
    "00000000000000000001",
]
PROBLEMS = [
    (ArithmeticTask(), Problem("3+5=", "8")),
    (ArithmeticTask(), Problem("9*9-100=", "-19")),
    (
        CountdownTask(format_reward=0.1),
        Problem("Use 9 3 5 to make 72.", "9*(5+3)", {"numbers": [9, 3, 5], "target": 72}),
    ),
    (CountdownTask(use_all_numbers=True), Problem("Use 1 1 to make 1.", "1*1", {"numbers": [1, 1], "target": 1})),
    (CalculatorTask(), Problem("Compute 37*12-5", "439", {"expression": "37*12-5"})),
]


def _score_quickly(task, problem, completion: str) -> float:
    start = time.perf_counter()
    r = task.reward(problem, completion)
    # a did-not-hang bound (9**9**9 evaluated would never end), not a timing threshold: 2 shared cores vary
    assert time.perf_counter() - start < 60, (
        f"{task.name} took {time.perf_counter() - start:.1f}s on {completion[:40]!r}"
    )
    assert isinstance(r, float) and r in (0.0, getattr(task, "format_reward", 0.0), 1.0)
    return r


@pytest.mark.parametrize("completion", NASTY, ids=range(len(NASTY)))
def test_nasty_completions_score_quickly_in_range(completion):
    for task, problem in PROBLEMS:
        _score_quickly(task, problem, completion)
        _score_quickly(task, problem, problem.answer + completion)
        _score_quickly(task, problem, completion + "\n" + problem.answer)
        if completion not in ("", " ", "\n" * 10_000):
            assert calculate(completion[:300]).startswith(("error: ", "-", *"0123456789"))


@FUZZ
@given(completion=st.text(max_size=300) | st.text(alphabet="0123456789+-*/()= .e<>/thinkn\n", max_size=300))
def test_arbitrary_text_never_raises_and_stays_in_range(completion):
    for task, problem in PROBLEMS:
        _score_quickly(task, problem, completion)
    result = calculate(completion)
    assert isinstance(result, str)


@FUZZ
@given(depth=st.integers(0, 400), inner=st.sampled_from(["1", "9*5*3", "0", "", "1/0", "-1"]))
def test_nested_parentheses_never_raise(depth, inner):
    text = "(" * depth + inner + ")" * depth
    for task, problem in PROBLEMS:
        _score_quickly(task, problem, text)
    assert calculate(text).startswith(("error: ", "-", *"0123456789"))


# --------------------------------------------------------------------------- generated problems

operator_sets = st.lists(st.sampled_from(["+", "-", "*"]), min_size=1, max_size=3, unique=True)


@FUZZ
@given(
    lo=st.integers(0, 10**6),
    span=st.integers(0, 10**6),
    ops=operator_sets,
    num_terms=st.integers(2, 6),
    nonnegative=st.booleans(),
    seed=st.integers(0, 2**32),
    think=st.booleans(),
)
def test_arithmetic_problems_are_solved_by_their_answer(lo, span, ops, num_terms, nonnegative, seed, think):
    task = get_task(
        "arithmetic", min_value=lo, max_value=lo + span, ops=ops, num_terms=num_terms, nonnegative=nonnegative
    )
    try:
        p = task.generate(random.Random(seed))
    except ValueError as e:  # only '-' over equal operands: named
        assert "no non-negative expression" in str(e) and ops == ["-"]
        return
    task.check(p)
    assert p.prompt.endswith("=") and (not nonnegative or int(p.answer) >= 0)
    prefix = "<think>maybe 12</think>" if think else ""
    assert task.reward(p, prefix + p.answer) == 1.0
    assert task.reward(p, f"The answer is {p.answer}.") == 1.0
    assert task.reward(p, str(int(p.answer) + 1)) == 0.0


@FUZZ
@given(
    num_numbers=st.integers(2, 6),
    max_number=st.integers(1, 1000),
    max_target=st.integers(1, 10**6),
    ops=st.lists(st.sampled_from(["+", "-", "*", "/"]), min_size=1, max_size=4, unique=True),
    use_all=st.booleans(),
    fmt=st.floats(0, 0.99),
    seed=st.integers(0, 2**32),
)
def test_countdown_problems_are_solved_by_their_answer(num_numbers, max_number, max_target, ops, use_all, fmt, seed):
    task = get_task(
        "countdown",
        num_numbers=num_numbers,
        max_number=max_number,
        max_target=max_target,
        ops=ops,
        use_all_numbers=use_all,
        format_reward=fmt,
    )
    try:
        p = task.generate(random.Random(seed))
    except ValueError as e:  # e.g. only '-' over small numbers: no positive target; named
        assert "no target in" in str(e)
        return
    task.check(p)
    assert 1 <= p.meta["target"] <= max_target and len(p.meta["numbers"]) == num_numbers
    assert task.reward(p, p.answer) == 1.0
    assert task.reward(p, f"<think>hm</think>{p.answer} = {p.meta['target']}\nmore") == 1.0
    assert task.reward(p, f"({p.answer})+1") in (0.0, fmt)


@FUZZ
@given(
    lo=st.integers(0, 10**4),
    span=st.integers(0, 10**4),
    ops=operator_sets,
    num_terms=st.integers(2, 5),
    seed=st.integers(0, 2**32),
)
def test_calculator_problems_are_solved_by_the_tool_and_their_answer(lo, span, ops, num_terms, seed):
    task = get_task("calculator", min_value=lo, max_value=lo + span, ops=ops, num_terms=num_terms)
    p = task.generate(random.Random(seed))
    assert calculate(p.meta["expression"]) == p.answer  # what the tool answers is the reference
    assert task.reward(p, p.answer) == 1.0
    assert ideal_transcript(p)[-1]["content"] == p.answer


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_value": 10**29, "max_value": 10**29 + 5, "ops": ("+",), "num_terms": 2},
        {"min_value": 0, "max_value": 10**5, "ops": ("*",), "num_terms": 5},
        {"min_value": 0, "max_value": 9, "ops": ("+",), "num_terms": 100},
    ],
)
def test_calculator_settings_at_the_limits_of_the_tool(kwargs):
    """Every problem of accepted settings is one the tool computes (operands of 10**40 were accepted, and the
    tool answered the reference expression with "error: ValueError")."""
    task = CalculatorTask(**kwargs)
    for seed in range(20):
        p = task.generate(random.Random(seed))
        assert calculate(p.meta["expression"]) == p.answer and task.reward(p, p.answer) == 1.0


def test_long_answers_score_and_too_long_ones_are_named():
    task = ArithmeticTask(min_value=10**99, max_value=10**100, ops=("*",), num_terms=39)  # answers of ~3900 digits
    p = task.generate(random.Random(0))
    assert len(p.answer) > 3800 and task.reward(p, p.answer) == 1.0
    assert task.reward(p, p.answer[:-1]) == 0.0 and task.reward(p, p.answer + "1") == 0.0
    for t in (ArithmeticTask(), CalculatorTask()):
        with pytest.raises(ValueError, match="answer of 4500 digits; at most 4000 can be scored"):
            t.reward(Problem("big", "9" * 4500), "9" * 4500)
        assert t.reward(Problem("p", "7"), "9" * 5000) == 0.0  # a long digit run in a completion is no answer


@pytest.mark.parametrize(
    "name, kwargs, match",
    [
        ("arithmetic", {"num_terms": 1}, "num_terms must be in"),
        ("arithmetic", {"num_terms": 10**9}, "num_terms must be in"),
        ("arithmetic", {"min_value": -1}, "min_value must be >= 0"),
        ("arithmetic", {"max_value": 10**400, "ops": ["*"], "num_terms": 20}, "max_value, num_terms=20 and ops"),
        ("arithmetic", {"ops": []}, "ops must be"),
        ("arithmetic", {"ops": ["/"]}, "ops must be"),
        ("countdown", {"num_numbers": 1}, "num_numbers must be >= 2"),
        ("countdown", {"num_numbers": 100}, "num_numbers=100 and max_number=10 allow answers of"),
        ("countdown", {"max_number": 10**12}, "max_number must have at most 12 digits"),
        ("countdown", {"max_target": 0}, "max_target must be >= 1"),
        ("countdown", {"format_reward": 1.0}, "format_reward must be in"),
        ("calculator", {"min_value": -5}, "min_value must be >= 0"),
        ("calculator", {"min_value": 50, "max_value": 40}, r"max_value \(40\) must be >= min_value \(50\)"),
        ("calculator", {"ops": ["/"]}, "ops must be"),
        ("calculator", {"num_terms": 1}, "num_terms must be in"),
        ("calculator", {"num_terms": 150, "max_value": 99}, "num_terms=150 allow expressions of"),
        ("calculator", {"max_value": 10**20, "ops": ["*"]}, "beyond the calculator's limit"),
    ],
)
def test_out_of_range_settings_are_refused_by_name(name, kwargs, match):
    import exactrl.envs.tool_use  # noqa: F401  (registers "calculator")

    with pytest.raises(ValueError, match=match):
        get_task(name, **kwargs)


@FUZZ
@given(num_numbers=st.integers(2, 200), digits=st.integers(1, 14))
def test_countdown_settings_either_refused_or_answers_parse(num_numbers, digits):
    """Accepted settings never generate a reference answer the parser refuses (12-digit literals, 256 chars)."""
    try:
        task = CountdownTask(
            num_numbers=num_numbers, max_number=10**digits - 1, max_target=10**4000, ops=("+", "*")
        )  # every value a positive integer: each draw is a problem
    except ValueError as e:
        assert "num_numbers" in str(e) or "max_number" in str(e)
        return
    p = task.generate(random.Random(num_numbers * 31 + digits))
    assert task.reward(p, p.answer) == 1.0


def test_countdown_use_all_numbers_refuses_a_number_no_answer_can_write():
    p = Problem("Use -3 5 to make 2.", "5-3", {"numbers": [-3, 5], "target": 2})
    CountdownTask().check(p)  # at most once: -3 is just never used
    with pytest.raises(ValueError, match="use_all_numbers needs every number written in the answer, and -3"):
        CountdownTask(use_all_numbers=True).check(p)


# --------------------------------------------------------------------------- the calculator episode


@pytest.mark.parametrize(
    "arguments",
    [
        '{"expression": "2+3"}',
        "not json",
        "[1, 2]",
        '"2+3"',
        "[" * 100_000,
        '{"expression": ' + "9" * 5000 + "}",
        '{"expression": 5}',
        "{}",
    ],
)
def test_calculator_episode_survives_any_tool_call_arguments(monkeypatch, arguments):
    """The arguments of a tool call are model text: bad JSON (deeply nested, an integer too long for int())
    is an error for the agent to read, not an exception that ends the rollout."""
    replies = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c0", "type": "function", "function": {"name": "calculator", "arguments": arguments}}
            ],
        },
        {"role": "assistant", "content": "5"},
    ]
    _fake_openai(monkeypatch, replies)
    problem = Problem("Compute 2+3", "5", {"expression": "2+3"})
    ep = asyncio.run(calculator_episode("http://unused", problem, model="m"))
    assert ep.reward == 1.0 and ep.tool_calls == 1 and not ep.out_of_turns
    tool_reply = ep.messages[-2]["content"]
    assert tool_reply == "5" if arguments == '{"expression": "2+3"}' else tool_reply.startswith("error")


def test_a_calculator_episode_out_of_turns_says_so(monkeypatch):
    """Its reward is 0 whatever it computed; `out_of_turns` says why (only turns == max_turns hinted at it)."""
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}
        ],
    }
    _fake_openai(monkeypatch, [call, call])
    problem = Problem("Compute 2+3", "5", {"expression": "2+3"})
    ep = asyncio.run(calculator_episode("http://unused", problem, model="m", max_turns=2))
    assert (ep.reward, ep.turns, ep.tool_calls, ep.out_of_turns) == (0.0, 2, 2, True)


def _fake_openai(monkeypatch, replies: list[dict]) -> None:
    """openai.AsyncOpenAI answering each chat request with the next of `replies` (assistant messages)."""
    import openai
    from openai.types.chat import ChatCompletion

    class FakeClient:
        def __init__(self, **kwargs):
            self.chat = self
            self.completions = self

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

        async def create(self, **kwargs):
            return ChatCompletion.model_validate(
                {
                    "id": "x",
                    "object": "chat.completion",
                    "created": 0,
                    "model": "m",
                    "choices": [{"index": 0, "finish_reason": "stop", "message": replies.pop(0)}],
                }
            )

    monkeypatch.setattr(openai, "AsyncOpenAI", FakeClient)
