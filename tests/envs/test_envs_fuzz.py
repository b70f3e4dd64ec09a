"""Property-based review of the tasks and datasets: damaged JSONL files, untrusted completions, settings.

A dataset file is user input: every bad line must be a ValueError naming the file and the line, and a good
file must read back exactly. A completion is untrusted model text: a reward never raises or hangs, stays in
[0, 1], and the reference answer of a generated problem scores 1. Task settings in range generate valid
problems; settings out of range are refused by name.
"""
from __future__ import annotations

import json
import random
import time

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from exactrl.envs import ArithmeticTask, CountdownTask, Problem, PromptSource, get_task, make_dataset, read_jsonl, \
    write_jsonl
from exactrl.envs.dataset import fingerprint, held_out
from exactrl.envs.tool_use import CalculatorTask, calculate, ideal_transcript

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                                               max_size=4),
                           max_leaves=12)
good_rows = st.fixed_dictionaries({"prompt": st.text(max_size=40), "answer": st.text(max_size=10) | st.integers()},
                                  optional={"extra": json_values})


def _surrogate_free(text: str) -> bool:
    return not any(0xD800 <= ord(c) <= 0xDFFF for c in text)


# --------------------------------------------------------------------------- dataset files

@FUZZ
@given(rows=st.lists(good_rows.filter(lambda r: _surrogate_free(json.dumps(r, ensure_ascii=False))), min_size=1,
                     max_size=8),
       eol=st.sampled_from(["\n", "\r\n"]), bom=st.booleans(), blanks=st.lists(st.sampled_from(["", " ", "\t"]),
                                                                              max_size=3))
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
@given(bad=st.sampled_from(BAD_LINES), before=st.integers(0, 3), blank_before=st.integers(0, 2),
       after=st.integers(0, 2), eol=st.sampled_from(["\n", "\r\n"]))
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
@given(n=st.integers(0, 50), seed=st.integers(-2**70, 2**70), split=st.sampled_from([None, "train", "eval"]))
def test_make_dataset_is_a_pure_function_of_its_arguments(n, seed, split):
    task = ArithmeticTask()
    a = make_dataset(task, n, seed, split)
    assert len(a) == n and a == make_dataset(task, n, seed, split)
    if split is not None:
        assert all(held_out(p, task) == (split == "eval") for p in a)
