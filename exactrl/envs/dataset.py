"""Problem datasets: JSONL files, seeded procedural datasets, a resumable prompt stream.

JSONL format: one object per line with string keys "prompt" and "answer"
(an integer answer is accepted and stored as its decimal string); every other
key goes to `Problem.meta` and is written back out unchanged, so a task's
reward data (e.g. countdown's numbers and target) survives a round trip.

`PromptSource` walks a dataset epoch by epoch, each epoch in its own
permutation, which is a pure function of (seed, epoch). Its position is two
integers, so `state_dict()` fits in a checkpoint's JSON and a resumed run
draws exactly the problems the uninterrupted run would have drawn.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

from exactrl.envs.base import Problem, Task

T = TypeVar("T")

_REQUIRED = ("prompt", "answer")


def problem_to_json(problem: Problem) -> dict[str, Any]:
    clash = [k for k in _REQUIRED if k in problem.meta]
    if clash:
        raise ValueError(f"problem {problem.prompt!r} has meta keys {clash} that clash with the JSONL columns")
    return {"prompt": problem.prompt, "answer": problem.answer, **problem.meta}


def write_jsonl(path: str | Path, problems: Iterable[Problem]) -> None:
    """Writes one JSON object per problem (UTF-8, non-ASCII kept as is)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for p in problems:
            f.write(json.dumps(problem_to_json(p), ensure_ascii=False) + "\n")


def load_json_line(line: str, where: str) -> Any:
    """`json.loads` of one line of a JSONL file (a dataset, metrics.jsonl): bad syntax stays a JSONDecodeError
    (the caller knows whether a crash cut the line); a line json cannot read for its size is a ValueError naming
    `where` (it raised a bare RecursionError, or int()'s error about sys.set_int_max_str_digits)."""
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        raise
    except ValueError:  # json's only other ValueError
        raise ValueError(
            f"{where}: holds an integer too long to read (at most {sys.get_int_max_str_digits()} digits)"
        ) from None
    except RecursionError:
        raise ValueError(f"{where}: JSON nested too deeply to read") from None


def _parse_line(line: str, where: str) -> Problem:
    try:
        row = load_json_line(line, where)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object with 'prompt' and 'answer', got {type(row).__name__}")
    missing = [k for k in _REQUIRED if k not in row]
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing}; each line needs 'prompt' and 'answer'")
    for key, value in row.items():
        try:  # a lone surrogate escape ("\ud800") is no character: hashing and tokenizing the text would fail
            json.dumps([key, value], ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                f"{where}: {key!r} holds a lone surrogate escape (\\ud800-\\udfff), which is not a character"
            ) from None
        except RecursionError:
            raise ValueError(f"{where}: {key!r} is nested too deeply to read") from None
    prompt, answer = row.pop("prompt"), row.pop("answer")
    if isinstance(answer, int) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(prompt, str) or not isinstance(answer, str):
        raise ValueError(
            f"{where}: 'prompt' must be a string and 'answer' a string or integer, "
            f"got {type(prompt).__name__} and {type(answer).__name__}"
        )
    return Problem(prompt=prompt, answer=answer, meta=row)


def read_jsonl(path: str | Path, check: Callable[[Problem], None] | None = None) -> list[Problem]:
    """Reads problems; blank lines are skipped, any other bad line raises ValueError naming file:line.
    `check` (a task's `check`) runs on each problem, its ValueError named by file:line too."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"dataset file {path} is a directory: give the JSONL file in it")
    if not path.is_file():
        raise ValueError(f"dataset file {path} does not exist")
    problems = []
    with _open_dataset(path) as f:
        for lineno, raw in enumerate(f, start=1):
            try:  # a byte-order mark at the start is not part of the first line
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if line.strip():
                problems.append(_parse_line(line, f"{path}:{lineno}"))
                if check is not None:
                    _check_row(check, problems[-1], f"{path}:{lineno}")
    if not problems:
        raise ValueError(f"dataset file {path} holds no problems")
    return problems


def _check_row(check: Callable[[Problem], None], problem: Problem, where: str) -> None:
    try:
        check(problem)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _open_dataset(path: Path):
    try:
        return open(path, "rb")
    except OSError as e:  # no permission to read it
        raise ValueError(f"cannot read dataset file {path}: {e.strerror or e}") from None


HELD_OUT = 5  # one problem in HELD_OUT, chosen by a hash of its prompt, is for evaluation only
SPLITS = ("train", "eval")
MAX_SPLIT_DRAWS = 10_000  # rejection-sampling budget for one problem of a split


def held_out(problem: Problem, task: Task | None = None) -> bool:
    """Whether the problem belongs to the evaluation split: a fixed fifth of every task's problems (by a hash
    of the prompt, or of `task.split_key`), never drawn for RL training, so evaluation scores problems RL
    never trained on (the default job's warm start, which stands for pretraining, draws from every problem)."""
    key = problem.prompt if task is None else task.split_key(problem)
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % HELD_OUT == 0


def generate(task: Task, rng: random.Random, split: str | None = None) -> Problem:
    """One problem of `task` from its generator, of the given split (None: any), by rejection."""
    if split is None:
        return task.generate(rng)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} or None, got {split!r}")
    for _ in range(MAX_SPLIT_DRAWS):
        p = task.generate(rng)
        if held_out(p, task) == (split == "eval"):
            return p
    raise ValueError(
        f"task {task.name!r} drew no {split} problem in {MAX_SPLIT_DRAWS} draws: its settings leave "
        f"too few distinct problems to hold some out for evaluation (widen them)"
    )


def make_dataset(task: Task, n: int, seed: int, split: str | None = None) -> list[Problem]:
    """`n` problems from `task`, a pure function of (task settings, n, seed, split); `split` "train" or
    "eval" keeps to one side of `held_out` (None: both)."""
    if n < 0:
        raise ValueError(f"dataset size must be >= 0, got {n}")
    rng = random.Random(seed)
    return [generate(task, rng, split) for _ in range(n)]


EVAL_SEED_OFFSET = 7919  # held-out problems are drawn with seed + this, apart from the training draws


def held_out_problems(task: Task, n: int, seed: int, exclude: set[str] = frozenset()) -> list[Problem]:
    """The evaluation problems of a run with `seed`: `n` draws of the task's held-out split, each distinct
    problem (`task.split_key`) once, none whose key is in `exclude` (a training file's)."""
    seen, out = set(exclude), []
    for p in make_dataset(task, n, seed + EVAL_SEED_OFFSET, split="eval"):
        if (key := task.split_key(p)) not in seen:
            seen.add(key)
            out.append(p)
    return out


def fingerprint(problems: list[Problem]) -> str:
    """Short content hash; a resumed PromptSource checks it to refuse a changed dataset."""
    h = hashlib.sha256()
    for p in problems:
        h.update(json.dumps(problem_to_json(p), sort_keys=True, ensure_ascii=False).encode() + b"\n")
    return h.hexdigest()[:16]


class ResumableStream(Generic[T]):
    """An endless, resumable stream of items: each epoch in its own seeded order (or file order), its position
    two integers, so a resumed run draws exactly what the uninterrupted run would have. `fingerprint` names
    the data a saved position is valid for; `order_key` is part of every epoch's order."""

    order_key = "exactrl.PromptSource"
    what = "PromptSource state"  # how a refused position is named
    fix = "resume with the same dataset, seed and shuffle setting"

    def __init__(self, items: list[T], seed: int, shuffle: bool, fingerprint: str):
        if not items:
            raise ValueError(f"{type(self).__name__} needs at least one item")
        self.items = list(items)  # the dataset, never mutated
        self.seed = seed  # with the epoch, determines each epoch's order
        self.shuffle = shuffle  # False walks the dataset in file order every epoch
        self.epoch = 0  # epochs completed so far
        self.index = 0  # position within the current epoch's order
        self.fingerprint = fingerprint
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:  # a string seed hashes to the same state in every process and Python version
            random.Random(f"{self.order_key}:{self.seed}:{epoch}").shuffle(order)
        return order

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self.index == len(self._order):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        item = self.items[self._order[self.index]]
        self.index += 1
        return item

    def take(self, n: int) -> list[T]:
        """The next `n` items (crossing epoch boundaries as needed)."""
        if n < 0:
            raise ValueError(f"take expects n >= 0, got {n}")
        return [next(self) for _ in range(n)]

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position (plus what it is valid for)."""
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "size": len(self.items),
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Moves to a saved position; ValueError if it was saved for other data, seed or order."""
        mine = self.state_dict()
        for key in ("seed", "shuffle", "size", "fingerprint"):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"{self.what} was saved with {key}={state.get(key)!r} but this run's data has "
                    f"{key}={mine[key]!r}: {self.fix}"
                )
        epoch, index = state.get("epoch"), state.get("index")
        if type(epoch) is not int or type(index) is not int or epoch < 0 or not 0 <= index <= len(self.items):
            raise ValueError(f"{self.what} has an invalid position: epoch={epoch!r}, index={index!r}")
        self.epoch, self.index = epoch, index
        self._order = self._epoch_order(epoch)


class PromptSource(ResumableStream[Problem]):
    """The training problems as an endless, resumable stream (`ResumableStream`)."""

    def __init__(self, problems: list[Problem], seed: int = 0, shuffle: bool = True):
        if not problems:
            raise ValueError("PromptSource needs at least one problem")
        super().__init__(problems, seed, shuffle, fingerprint(problems))

    @property
    def problems(self) -> list[Problem]:
        return self.items
