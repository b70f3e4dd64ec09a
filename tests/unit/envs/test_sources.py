"""task.dataset: JSONL, Parquet and `datasets` folders through a column mapping; bad rows and missing
columns named; chats rendered with the chat template; the held-out split of a dataset's rows."""

from __future__ import annotations

import json

import pytest

from exactrl.envs import ArithmeticTask, Problem
from exactrl.envs.dataset import held_out
from exactrl.envs.sources import read_dataset, split_rows

ROWS = [{"question": "1+2=", "solution": 3, "level": 1}, {"question": "4+4=", "solution": 8, "level": 2}]
COLUMNS = {"prompt": "question", "answer": "solution"}
EXPECTED = [Problem("1+2=", "3", {"level": 1}), Problem("4+4=", "8", {"level": 2})]


def write(tmp_path, kind: str, rows: list[dict]):
    if kind == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path
    import datasets

    ds = datasets.Dataset.from_list(rows)
    if kind == "parquet":
        path = tmp_path / "d.parquet"
        ds.to_parquet(str(path))
    else:
        path = tmp_path / "saved"
        ds.save_to_disk(str(path))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "saved"])
def test_every_format_maps_columns_and_keeps_the_rest_in_meta(tmp_path, kind):
    assert read_dataset(write(tmp_path, kind, ROWS), COLUMNS) == EXPECTED


def test_unmapped_roles_read_their_own_column_and_a_dataset_dict_of_one_split_is_read(tmp_path):
    import datasets

    rows = [{"prompt": "1+2=", "answer": "3"}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    assert read_dataset(tmp_path / "dd") == [Problem("1+2=", "3")]
    datasets.DatasetDict({s: datasets.Dataset.from_list(rows) for s in ("train", "test")}).save_to_disk(
        str(tmp_path / "two")
    )
    with pytest.raises(ValueError, match=r"splits \['test', 'train'\]: give one split's folder"):
        read_dataset(tmp_path / "two")


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "saved"])
def test_a_missing_column_is_named_with_the_columns_there_are(tmp_path, kind):
    path = write(tmp_path, kind, ROWS)
    with pytest.raises(ValueError, match=r"no column for answer \(column 'answer'\); the columns are \[") as e:
        read_dataset(path, {"prompt": "question"})
    assert "'question', 'solution'" in str(e.value)
    with pytest.raises(ValueError, match=r"no column for prompt \(column 'prompt'\)"):
        read_dataset(path, {"answer": "solution"})


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_bad_row_is_named_by_its_row(tmp_path, kind):
    rows = [*ROWS, {"question": "9+9=", "solution": None, "level": 3}]
    with pytest.raises(ValueError, match="must be a string or an integer, got NoneType") as e:
        read_dataset(write(tmp_path, kind, rows), COLUMNS)
    assert str(e.value).startswith(f"{tmp_path / ('d.' + kind)}" + (":3:" if kind == "jsonl" else " row 2:"))


def test_the_task_check_runs_on_every_row_named_by_row(tmp_path):
    rows = [{**r, "solution": str(r["solution"])} for r in ROWS] + [{"question": "x", "solution": "seven", "level": 0}]
    path = write(tmp_path, "parquet", rows)
    with pytest.raises(ValueError, match=r"row 2: arithmetic problem 'x' has a non-integer answer 'seven'"):
        read_dataset(path, COLUMNS, check=ArithmeticTask().check)


@pytest.mark.parametrize(
    "setup, match",
    [
        (lambda p: p.with_suffix(".csv").write_text("a,b\n"), "unknown file type '.csv'"),
        (lambda p: None, "does not exist"),
        (lambda p: p.write_text("{not json\n"), r"d.jsonl:1: not valid JSON"),
        (lambda p: p.write_text("[1, 2]\n"), r"d.jsonl:1: expected an object of columns, got list"),
        (lambda p: p.write_text("\n\n"), "holds no rows"),
    ],
)
def test_bad_files_are_refused_by_name(tmp_path, setup, match):
    path = tmp_path / "d.jsonl"
    setup(path)
    with pytest.raises(ValueError, match=match):
        read_dataset(path.with_suffix(".csv") if "csv" in match else path)


def test_a_file_that_is_not_parquet_is_named(tmp_path):
    (tmp_path / "d.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=r"cannot read .*d.parquet as Parquet"):
        read_dataset(tmp_path / "d.parquet")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="cannot read .*plain as a folder written by datasets' save_to_disk"):
        read_dataset(tmp_path / "plain")


def test_bad_mappings_and_clashing_columns_are_refused(tmp_path):
    path = write(tmp_path, "jsonl", ROWS)
    with pytest.raises(ValueError, match=r"unknown role\(s\) \['question'\]"):
        read_dataset(path, {"question": "prompt"})
    with pytest.raises(ValueError, match="maps both 'prompt' and 'messages'"):
        read_dataset(path, {"prompt": "question", "messages": "chat", "answer": "solution"})
    clash = write(tmp_path, "jsonl", [{"question": "1+2=", "solution": "3", "answer": "x"}])
    with pytest.raises(ValueError, match="column 'answer' is neither mapped nor free to keep"):
        read_dataset(clash, COLUMNS)


def test_messages_become_the_prompt_and_are_rendered_with_the_chat_template(tmp_path):
    from exactrl.envs.prompts import prompt_ids
    from exactrl.model.tokenizer import build_tokenizer, load_tokenizer

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]
    path = write(tmp_path, "jsonl", [{"chat": chat, "answer": "4", "source": "x"}])
    (problem,) = read_dataset(path, {"messages": "chat"})
    assert problem == Problem("2+2=", "4", {"messages": chat, "source": "x"})
    build_tokenizer(tmp_path / "tok", ["Be brief. 2+2=4 Sys"], vocab_size=300)
    tok = load_tokenizer(tmp_path / "tok")
    task = ArithmeticTask()
    assert prompt_ids(tok, task, problem) == tok.apply_chat_template(chat, add_generation_prompt=True)
    task.system_prompt = "Sys"  # a chat with its own system message keeps it; one without gets the task's
    assert prompt_ids(tok, task, problem) == tok.apply_chat_template(chat, add_generation_prompt=True)
    bare = Problem("2+2=", "4", {"messages": chat[1:]})
    assert prompt_ids(tok, task, bare) == tok.apply_chat_template(
        [{"role": "system", "content": "Sys"}, *chat[1:]], add_generation_prompt=True
    )


@pytest.mark.parametrize(
    "chat, match",
    [
        ([], "non-empty list of messages"),
        ("hi", "non-empty list of messages"),
        ([{"role": "user"}], "message 0 .* string 'role' and 'content'"),
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "ends with an assistant"),
    ],
)
def test_bad_chats_are_named_by_row(tmp_path, chat, match):
    path = write(tmp_path, "jsonl", [{"messages": [{"role": "user", "content": "ok"}], "answer": "1"}])
    path.write_text(path.read_text() + json.dumps({"messages": chat, "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=f"d.jsonl:2: .*{match}"):
        read_dataset(path)


def test_split_rows_holds_out_the_fifth_the_generated_split_holds_out():
    task = ArithmeticTask(max_value=30)
    rows = [Problem(f"{a}+{b}=", str(a + b)) for a in range(20) for b in range(20)]
    train, evals = split_rows(rows + rows[:50], task, eval_size=1000, where="d")
    assert all(not held_out(p, task) for p in train) and all(held_out(p, task) for p in evals)
    assert len(evals) == len({p.prompt for p in evals}) == sum(held_out(p, task) for p in rows)  # once each
    assert len(train) + sum(held_out(p, task) for p in rows + rows[:50]) == len(rows) + 50
    assert split_rows(rows, task, eval_size=3, where="d")[1] == evals[:3]
    kept = [p for p in rows if not held_out(p, task)][:2]
    with pytest.raises(ValueError, match="d: none of its 2 rows is in the held-out fifth"):
        split_rows(kept, task, eval_size=1, where="d")
    assert split_rows(kept, task, eval_size=0, where="d") == (kept, [])
    with pytest.raises(ValueError, match="every row is in the held-out fifth"):
        split_rows(evals[:2], task, eval_size=1, where="d")


def test_a_run_trains_on_the_rows_evaluation_leaves_out(tmp_path):
    from exactrl.train.config import load_config
    from exactrl.train.setup import _datasets

    task = ArithmeticTask()
    rows = [{"q": f"{a}+{b}=", "a": a + b} for a in range(10) for b in range(10)]
    path = write(tmp_path, "jsonl", rows)
    cfg = load_config(None, [f"task.dataset={path}", "task.columns={prompt: q, answer: a}", "task.eval_size=5"])
    source, evals = _datasets(cfg, task)
    assert len(evals) == 5 and all(held_out(p, task) for p in evals)
    assert {p.prompt for p in source.problems} == {r["q"] for r in rows} - {
        r["q"] for r in rows if held_out(Problem(r["q"], "0"), task)
    }
    for extra, match in [
        ([f"task.train_jsonl={path}"], "task.dataset and task.train_jsonl both give training problems"),
        (["task.columns={answer: a}"], r"task.dataset: .*no column for prompt"),
    ]:
        with pytest.raises(ValueError, match=match):
            _datasets(load_config(None, [f"task.dataset={path}", *extra]), task)
    with pytest.raises(ValueError, match="task.columns maps the columns of task.dataset, which is not set"):
        _datasets(load_config(None, ["task.columns={answer: a}"]), task)
