"""JSONL round trips and errors, seeded datasets, PromptSource order and exact resume."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from exactrl.envs import ArithmeticTask, CountdownTask, Problem, PromptSource, make_dataset, read_jsonl, write_jsonl


def test_jsonl_round_trip_keeps_meta_and_unicode(tmp_path):
    problems = make_dataset(CountdownTask(), 20, seed=0) + [Problem('héllo ✓ 漢字\n"q"', "42", {"k": [1, {"a": None}]})]
    write_jsonl(tmp_path / "sub" / "d.jsonl", problems)
    assert read_jsonl(tmp_path / "sub" / "d.jsonl") == problems
    first = json.loads((tmp_path / "sub" / "d.jsonl").read_text(encoding="utf-8").splitlines()[0])
    assert set(first) == {"prompt", "answer", "numbers", "target"}


def test_read_accepts_integer_answers_and_skips_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": 2}\n\n{"prompt": "2+2=", "answer": "4", "level": 1}\n')
    assert read_jsonl(path) == [Problem("1+1=", "2"), Problem("2+2=", "4", {"level": 1})]


@pytest.mark.parametrize(
    "line, match",
    [
        ('{"prompt": "1+1=", "answer": ', "not valid JSON"),
        ('{"prompt": "1+1="}', r"missing key\(s\) \['answer'\]"),
        ('["1+1=", "2"]', "expected a JSON object"),
        ('{"prompt": 5, "answer": "2"}', "'prompt' must be a string"),
        ('{"prompt": "x", "answer": [2]}', "answer"),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=match) as e:
        read_jsonl(path)
    assert f"{path}:3" in str(e.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_jsonl(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no problems"):
        read_jsonl(tmp_path / "empty.jsonl")


def test_meta_clash_on_write(tmp_path):
    with pytest.raises(ValueError, match="clash"):
        write_jsonl(tmp_path / "d.jsonl", [Problem("p", "a", {"answer": "b"})])


@pytest.mark.parametrize("task", [ArithmeticTask(), CountdownTask()])
def test_train_and_eval_splits_never_share_a_problem(task):
    """A fixed fifth of a task's problems (by a hash of the prompt) is evaluation's alone: the default
    arithmetic task has 200 problems, so fresh draws of an eval set would otherwise be all training problems."""
    from exactrl.envs.dataset import held_out

    train = make_dataset(task, 2000, seed=0, split="train")
    evals = make_dataset(task, 200, seed=7919, split="eval")
    assert not {p.prompt for p in train} & {p.prompt for p in evals}
    assert all(held_out(p, task) for p in evals) and not any(held_out(p, task) for p in train)
    anyp = make_dataset(task, 2000, seed=0)
    assert 0.1 < sum(held_out(p, task) for p in anyp) / len(anyp) < 0.3  # about a fifth
    with pytest.raises(ValueError, match="split must be one of"):
        make_dataset(task, 1, seed=0, split="test")


def test_a_task_too_small_to_hold_problems_out_is_a_clear_error():
    from exactrl.envs.dataset import held_out

    task = ArithmeticTask(min_value=1, max_value=1, ops=("+",))  # one problem, "1+1=": on one side only
    missing = "train" if held_out(make_dataset(task, 1, seed=0)[0], task) else "eval"
    with pytest.raises(ValueError, match="too few distinct problems"):
        make_dataset(task, 1, seed=0, split=missing)


def test_make_dataset_is_deterministic():
    assert make_dataset(ArithmeticTask(), 100, seed=7) == make_dataset(ArithmeticTask(), 100, seed=7)
    assert make_dataset(ArithmeticTask(), 0, seed=7) == []
    with pytest.raises(ValueError):
        make_dataset(ArithmeticTask(), -1, seed=7)


def _problems(n):
    return [Problem(f"p{i}", str(i)) for i in range(n)]


def test_each_epoch_is_a_permutation_with_its_own_order():
    src = PromptSource(_problems(10), seed=1)
    e0, e1 = src.take(10), src.take(10)
    assert Counter(p.prompt for p in e0) == Counter(p.prompt for p in _problems(10)) == Counter(p.prompt for p in e1)
    assert e0 != e1
    assert (src.epoch, src.index) == (1, 10)
    assert PromptSource(_problems(10), seed=1).take(25) == e0 + e1 + PromptSource(_problems(10), seed=1).take(25)[20:]
    assert PromptSource(_problems(10), seed=2).take(10) != e0
    assert PromptSource(_problems(10), shuffle=False).take(12) == _problems(10) + _problems(10)[:2]


@pytest.mark.parametrize("stop", [0, 7, 10, 23])
def test_resume_continues_exactly(stop):
    reference = PromptSource(_problems(10), seed=3).take(40)
    first = PromptSource(_problems(10), seed=3)
    head = first.take(stop)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint's state.json holds
    resumed = PromptSource(_problems(10), seed=3)
    resumed.load_state_dict(state)
    assert head + resumed.take(40 - stop) == reference
    assert [next(iter(first)) for _ in range(3)] == reference[stop : stop + 3]


def test_resume_refuses_another_dataset_or_seed():
    state = PromptSource(_problems(10), seed=3).state_dict()
    for other in (
        PromptSource(_problems(11), seed=3),
        PromptSource(_problems(10), seed=4),
        PromptSource(_problems(9) + [Problem("p9", "x")], seed=3),
    ):
        with pytest.raises(ValueError, match="PromptSource state"):
            other.load_state_dict(state)
    with pytest.raises(ValueError, match="invalid position"):
        PromptSource(_problems(10), seed=3).load_state_dict({**state, "index": 11})


def test_empty_source():
    with pytest.raises(ValueError, match="at least one"):
        PromptSource([])


def test_a_file_that_is_not_utf8_is_named_by_line_and_a_bom_is_accepted(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"prompt": "1+1=", "answer": "2"}\n{"prompt": "\xff", "answer": "1"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: not UTF-8"):
        read_jsonl(p)
    p.write_bytes(b'\xef\xbb\xbf{"prompt": "1+1=", "answer": "2"}\n')
    assert read_jsonl(p) == [Problem("1+1=", "2")]


def test_evaluation_scores_each_held_out_problem_once(tmp_path):
    """200 draws from the default task's ~40 held-out problems: each distinct one is scored once (they used
    to be scored as often as drawn), and a prompt of a training file is not evaluated."""
    from exactrl.envs import get_task
    from exactrl.train.config import load_config
    from exactrl.train.setup import _datasets

    cfg = load_config(None, [])
    task = get_task(cfg.task.name, **cfg.task.kwargs)
    _, evals = _datasets(cfg, task)
    drawn = make_dataset(task, cfg.task.eval_size, cfg.seed + 7919, split="eval")
    assert [p.prompt for p in evals] == list(dict.fromkeys(p.prompt for p in drawn))  # first-drawn order
    assert 30 < len(evals) < 60
    write_jsonl(tmp_path / "t.jsonl", evals[:5])
    _, fewer = _datasets(load_config(None, [f"task.train_jsonl={tmp_path / 't.jsonl'}"]), task)
    assert [p.prompt for p in fewer] == [p.prompt for p in evals[5:]]
