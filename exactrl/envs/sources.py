"""Datasets from files (`task.dataset`): JSONL, Parquet, or a `datasets` folder saved with `save_to_disk`.

Each row becomes a `Problem` through a column mapping (`task.columns`, role -> column; a role left out is
read from the column of its own name):

    prompt    the user message text, or
    messages  a chat list of {"role", "content"} (the chat template renders it, as it renders a prompt);
              it ends with the turn the model answers, so its last message is not the assistant's
    answer    the reference answer the reward compares with (a string or an integer)

Every other column is kept in `Problem.meta` under its own name, for rewards and for distillation's
privileged context. A row is named in errors by file and line (JSONL) or by file and row index counted
from 0 (Parquet, `datasets`); a missing column is named with the columns that exist.

Parquet needs `pyarrow` and a `datasets` folder the `datasets` package: `pip install 'exactrl[data]'`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from exactrl.envs.base import Problem
from exactrl.envs.dataset import load_json_line

ROLES = ("prompt", "messages", "answer")


def _need(module: str, what: str):
    """`module` imported, or a ValueError naming the extra that installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"{what} needs the `{module}` package: pip install 'exactrl[data]'") from None


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:  # a byte-order mark at the start is not part of the first line
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if line.strip():
                try:
                    yield where, load_json_line(line, where)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None


def _parquet_rows(path: Path) -> tuple[list[str], Iterator[tuple[str, Any]]]:
    pq = _need("pyarrow.parquet", f"the Parquet dataset {path}")
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow's errors have no common base the caller could name
        raise ValueError(f"cannot read {path} as Parquet: {e}") from None
    return table.column_names, ((f"{path} row {i}", row) for i, row in enumerate(table.to_pylist()))


def _saved_rows(path: Path) -> tuple[list[str], Iterator[tuple[str, Any]]]:
    datasets = _need("datasets", f"the `datasets` folder {path}")
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises FileNotFoundError for a folder it did not write, others on damage
        raise ValueError(f"cannot read {path} as a folder written by datasets' save_to_disk: {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        if len(ds) != 1:
            raise ValueError(
                f"{path} holds the splits {sorted(ds)}: give one split's folder (e.g. {path / sorted(ds)[0]})"
            )
        ds = next(iter(ds.values()))
    return list(ds.column_names), ((f"{path} row {i}", row) for i, row in enumerate(ds))


def read_dataset(
    path: str | Path, columns: dict[str, str] | None = None, check: Callable[[Problem], None] | None = None
) -> list[Problem]:
    """The rows of a JSONL (`.jsonl`/`.json`), Parquet (`.parquet`) file or `save_to_disk` folder as problems
    (module docstring); `check` (a task's `check`) runs on each, its ValueError named by the row."""
    path = Path(path)
    mapping = _mapping(columns or {})
    if path.is_dir():
        names, rows = _saved_rows(path)
    elif not path.is_file():
        raise ValueError(f"dataset {path} does not exist")
    elif path.suffix == ".parquet":
        names, rows = _parquet_rows(path)
    elif path.suffix in (".jsonl", ".json"):
        names, rows = None, _jsonl_rows(path)
    else:
        raise ValueError(
            f"dataset {path}: unknown file type {path.suffix!r}; give a .jsonl or .parquet file or a folder "
            f"written by datasets' save_to_disk"
        )
    if names is not None:
        _check_columns(mapping, names, str(path))
    problems = []
    for where, row in rows:
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object of columns, got {type(row).__name__}")
        if names is None:
            _check_columns(mapping, list(row), where)
        problems.append(_problem(row, mapping, where))
        if check is not None:
            try:
                check(problems[-1])
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
    if not problems:
        raise ValueError(f"dataset {path} holds no rows")
    return problems


def _mapping(columns: dict[str, str]) -> dict[str, str]:
    unknown = sorted(set(columns) - set(ROLES))
    if unknown:
        raise ValueError(f"task.columns: unknown role(s) {unknown}; the roles are {list(ROLES)}")
    if "prompt" in columns and "messages" in columns:
        raise ValueError("task.columns maps both 'prompt' and 'messages': a row's prompt is one or the other")
    return {role: columns.get(role, role) for role in ROLES}


def _check_columns(mapping: dict[str, str], names: list[str], where: str) -> None:
    """A missing answer column, or neither a prompt nor a messages column, named with the columns there are."""
    has = set(names)
    prompt_role = "messages" if mapping["messages"] in has and mapping["prompt"] not in has else "prompt"
    missing = [f"{role} (column {mapping[role]!r})" for role in (prompt_role, "answer") if mapping[role] not in has]
    if missing:
        raise ValueError(
            f"{where}: no column for {', '.join(missing)}; the columns are {sorted(names)} "
            f"(map them with task.columns, e.g. {{prompt: question, answer: solution}})"
        )


def _problem(row: dict[str, Any], mapping: dict[str, str], where: str) -> Problem:
    row = dict(row)
    answer = row.pop(mapping["answer"])
    if isinstance(answer, int) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str):
        raise ValueError(
            f"{where}: column {mapping['answer']!r} (the answer) must be a string or an integer, "
            f"got {type(answer).__name__}"
        )
    meta: dict[str, Any] = {}
    if mapping["prompt"] in row:
        prompt = row.pop(mapping["prompt"])
        if not isinstance(prompt, str):
            raise ValueError(
                f"{where}: column {mapping['prompt']!r} (the prompt) must be a string, got {type(prompt).__name__}"
            )
    else:
        messages = row.pop(mapping["messages"])
        _check_messages(messages, mapping["messages"], where)
        meta["messages"] = [{"role": m["role"], "content": m["content"]} for m in messages]
        prompt = messages[-1]["content"]
    for key, value in row.items():
        if key in ("prompt", "answer", "messages"):
            raise ValueError(
                f"{where}: column {key!r} is neither mapped nor free to keep (its name is a role's): "
                f"map it with task.columns or drop it"
            )
        try:  # meta is written to checkpoints' fingerprints and samples as JSON
            json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
        except (TypeError, ValueError, UnicodeEncodeError, RecursionError) as e:
            raise ValueError(f"{where}: column {key!r} holds a value JSON cannot store ({e})") from None
        meta[key] = value
    return Problem(prompt=prompt, answer=answer, meta=meta)


def _check_messages(messages: Any, column: str, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: column {column!r} must be a non-empty list of messages")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(
                f"{where}: message {i} of column {column!r} must be an object with string 'role' and 'content'"
            )
    if messages[-1]["role"] == "assistant":
        raise ValueError(f"{where}: column {column!r} ends with an assistant message: nothing is left to answer")


def split_rows(problems: list[Problem], task, eval_size: int, where: str) -> tuple[list[Problem], list[Problem]]:
    """A dataset's training rows and at most `eval_size` evaluation rows, each distinct problem once: the
    held-out fifth (`envs.dataset.held_out`, by the task's `split_key`) is never trained on."""
    from exactrl.envs.dataset import held_out

    train = [p for p in problems if not held_out(p, task)]
    evals, seen = [], set()
    for p in problems:
        if len(evals) < eval_size and held_out(p, task) and (key := task.split_key(p)) not in seen:
            seen.add(key)
            evals.append(p)
    if not train:
        raise ValueError(f"{where}: every row is in the held-out fifth, none is left to train on")
    if eval_size and not evals:
        raise ValueError(
            f"{where}: none of its {len(problems)} rows is in the held-out fifth, so nothing is left to "
            f"evaluate on (set task.eval_size=0, or give more rows)"
        )
    return train, evals
