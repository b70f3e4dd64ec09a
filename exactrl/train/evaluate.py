"""`exactrl eval`: pass@k and mean@k of a model on a task's held-out problems or on a dataset.

Each problem gets n samples (n >= k, default k) from the in-process engine or an OpenAI-compatible server
(`--server`, rollout/external.py), scored by the task's reward (or `--reward`'s function). A sample is
correct when its reward is >= 1.0, as `rollout/accuracy` counts. With c correct of n:

    pass@k = mean over problems of 1 - C(n-c, k) / C(n, k)    (Chen et al. 2021's unbiased estimator)
    mean@k = mean over problems of the mean reward of its n samples

Problem i samples with seed `derive_seed(seed, 0, i)` (the training step's rule, rollout/groups.py), so a
result does not depend on `--batch`. Without `--dataset` the problems are the task's held-out ones, the
same draws as a training run's evaluation with the same seed and `task.eval_size` (`--size`).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exactrl.envs.base import Problem, Task

DEFAULT_MAX_TOKENS = 256  # --max-tokens unset: at most this many, as the model's context allows
HELD_OUT_DRAWS = 200  # --size without --dataset: task.eval_size's default, a training run's evaluation set


@dataclass
class Sampling:
    """What generate_groups reads of a rollout config."""

    samples_per_prompt: int  # n
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    ignore_eos: bool = False  # evaluation stops at eos, as a user's sampling would


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k): the chance that k of the n samples, drawn without replacement, hold a correct one."""
    assert 0 <= c <= n and 1 <= k <= n
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks(k: int) -> list[int]:
    """The k of the pass@k reported: 1, 2, 4, ... below k, and k."""
    out = [1]
    while out[-1] * 2 < k:
        out.append(out[-1] * 2)
    return out if out[-1] == k else [*out, k]


def summarise(rewards: list[list[float]], k: int) -> dict[str, float]:
    """pass@j for `ks(k)` and mean@k over problems, from each problem's n sample rewards."""
    out = {}
    for j in ks(k):
        out[f"pass@{j}"] = sum(pass_at_k(len(r), sum(x >= 1.0 for x in r), j) for r in rewards) / len(rewards)
    out[f"mean@{k}"] = sum(sum(r) / len(r) for r in rewards) / len(rewards)
    return out


def eval_problems(args, task: Task) -> list[Problem]:
    """The dataset's rows (its held-out ones with --held-out), or the task's held-out problems."""
    from exactrl.envs.dataset import held_out_problems
    from exactrl.envs.sources import read_dataset, split_rows

    if args.dataset is None:
        if args.held_out or args.columns:
            raise ValueError(f"{'--held-out' if args.held_out else '--columns'} needs --dataset")
        size = args.size or HELD_OUT_DRAWS
        problems = held_out_problems(task, size, args.seed)
        if not problems:
            raise ValueError(f"task {task.name!r} drew no held-out problem in --size {size} draws")
        return problems
    columns = {}
    for item in args.columns:
        role, eq, column = item.partition("=")
        if not eq or not column:
            raise ValueError(f"--columns takes ROLE=COLUMN (e.g. prompt=question), got {item!r}")
        columns[role] = column
    rows = read_dataset(args.dataset, columns, check=task.check)
    if args.held_out:
        return split_rows(rows, task, args.size or len(rows), args.dataset)[1]
    return rows[: args.size or len(rows)]


def _model_dir(path: str) -> Path:
    """A model directory, or a run directory's latest checkpoint."""
    from exactrl.train.checkpoint import latest_checkpoint

    p = Path(path)
    if (p / "config.json").is_file():
        return p
    if (p / "checkpoints").is_dir():
        ckpt = latest_checkpoint(p)
        if ckpt is None:
            raise ValueError(f"--model {path}: the run directory holds no complete checkpoint")
        return ckpt
    raise ValueError(f"--model {path}: neither a model directory (config.json) nor a run directory (checkpoints/)")


def _tokenizer_dir(args) -> Path:
    """--tokenizer, or --model's directory (with --server: the served model's directory, if it is one)."""
    if args.tokenizer:
        return Path(args.tokenizer)
    if args.server:
        if args.model is None or not Path(args.model).is_dir():
            raise ValueError("--server needs a tokenizer: give --tokenizer (or --model, the served model's directory)")
        return Path(args.model)
    model_dir = _model_dir(args.model)
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(
            f"--model {args.model}: {model_dir} holds no tokenizer (a run's checkpoint keeps none): give --tokenizer"
        )
    return model_dir


def _engine(args, tokenizer):
    """The in-process engine over --model's weights, or the client of --server."""
    stops = sorted(tokenizer.stop_token_ids)
    if args.server:
        from exactrl.debug.parity import server_settings
        from exactrl.rollout.external import ExternalEngine

        name = args.served_model or args.model
        if name is None:
            raise ValueError("--server needs the served model's name: give --served-model (or --model)")
        return ExternalEngine(server_settings(args.server, name), stop_token_ids=stops)
    from exactrl.engine import Engine
    from exactrl.model import load_model

    model = load_model(
        _model_dir(args.model), dtype=args.dtype, kernels=args.kernels, device=args.device, backend=args.backend
    )
    tokenizer.check_fits(model.config.vocab_size, "--tokenizer" if args.tokenizer else "--model")
    return Engine(model, stop_token_ids=stops)


def _max_tokens(args, engine, tokenizer, task: Task, problems: list[Problem]) -> int:
    """--max-tokens, by default DEFAULT_MAX_TOKENS or what the model's context leaves after the longest prompt
    (a server's context is its own to check)."""
    from exactrl.envs.prompts import prompt_ids

    if args.server:
        return args.max_tokens or DEFAULT_MAX_TOKENS
    context = engine.model.config.context_length
    longest = max(len(prompt_ids(tokenizer, task, p)) for p in problems)
    room = context - longest
    max_tokens = args.max_tokens or min(DEFAULT_MAX_TOKENS, room)
    if max_tokens > room or room < 1:
        raise ValueError(
            f"--max-tokens {max_tokens}: the longest prompt ({longest} tokens) leaves {max(room, 0)} of the "
            f"model's context of {context} tokens"
        )
    return max_tokens


def run_eval(args) -> dict[str, Any]:
    """Samples, scores and summarises (module docstring); the result written to --out as JSON."""
    from pydantic import ValidationError

    from exactrl.envs.custom import build_task
    from exactrl.envs.settings import TaskSettings
    from exactrl.model.tokenizer import load_tokenizer
    from exactrl.rollout.external import ExternalEngineError
    from exactrl.rollout.groups import generate_groups

    if args.model is None and args.server is None:
        raise ValueError("give --model (a model or run directory) or --server URL")
    if args.n is not None and args.n < args.k:
        raise ValueError(f"--n {args.n} samples per problem cannot give pass@{args.k}: use --n >= --k")
    try:
        kwargs = json.loads(args.task_kwargs)
    except json.JSONDecodeError as e:
        raise ValueError(f"--task-kwargs is not JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise ValueError(f"--task-kwargs must be a JSON object, got {args.task_kwargs!r}")
    try:
        ts = TaskSettings(name=args.task, kwargs=kwargs, module=args.module, reward=args.reward)
    except ValidationError as e:  # one line, in the flags' words
        raise ValueError("; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())) from None
    task = build_task(ts)
    problems = eval_problems(args, task)
    tokenizer = load_tokenizer(_tokenizer_dir(args))
    engine = _engine(args, tokenizer)
    groups = []
    try:
        rs = Sampling(
            args.n or args.k,
            args.temperature,
            args.top_p,
            args.top_k,
            _max_tokens(args, engine, tokenizer, task, problems),
        )
        with _Bar(len(problems)) as bar:
            for lo in range(0, len(problems), args.batch):
                batch = problems[lo : lo + args.batch]
                idx = list(range(lo, lo + len(batch)))
                groups += generate_groups(engine, tokenizer, task, batch, rs, args.seed, 0, indices=idx)
                bar.advance(len(batch))
    except ExternalEngineError as e:
        raise ValueError(str(e).replace("rollout_backend.base_url / base_urls", "--server")) from None
    finally:
        engine.close()
    rewards = [[r.reward for r in g] for g in groups]
    result = {
        "model": args.model,
        "server": args.server,
        "task": args.task,
        "dataset": args.dataset,
        "problems": len(problems),
        "k": args.k,
        "n": rs.samples_per_prompt,
        "temperature": args.temperature,
        "max_tokens": rs.max_tokens,
        "seed": args.seed,
        **summarise(rewards, args.k),
        "per_problem": [
            {
                "prompt": g[0].problem.prompt,
                "answer": g[0].problem.answer,
                "rewards": r,
                "completions": [x.text for x in g],
            }
            for g, r in zip(groups, rewards)
        ],
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    return result


class _Bar:
    """rich's progress bar on a terminal; nothing on a pipe or a file."""

    def __init__(self, total: int):
        self.progress = None
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn("[bold]eval"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self.task = self.progress.add_task("", total=total)

    def __enter__(self):
        if self.progress is not None:
            self.progress.start()
        return self

    def advance(self, n: int) -> None:
        if self.progress is not None:
            self.progress.advance(self.task, n)

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()


def print_table(result: dict[str, Any]) -> None:
    source = result["dataset"] or f"task {result['task']!r} held-out problems"
    print(
        f"{result['server'] or result['model']} on {source}: {result['problems']} problems, n={result['n']} "
        f"samples each (T={result['temperature']}, max_tokens={result['max_tokens']}, seed={result['seed']})"
    )
    metrics = [k for k in result if k.startswith(("pass@", "mean@"))]
    width = max(len(k) for k in metrics)
    print(f"{'metric':<{width}}  value")
    for key in metrics:
        print(f"{key:<{width}}  {result[key]:.4f}")


def eval_main(args) -> int:
    result = run_eval(args)
    print_table(result)
    if args.out:
        print(f"wrote {args.out}")
    return 0


def add_parser(sub) -> None:
    """The `eval` subcommand's flags (cli.py)."""
    from exactrl.cli import _int_in, _model_placement, _path

    e = sub.add_parser("eval", help="pass@k and mean@k of a model or server on a task or dataset")
    e.add_argument("--model", type=_path, help="model directory, or a run directory (its latest checkpoint)")
    e.add_argument("--tokenizer", type=_path, help="tokenizer directory (default: --model's)")
    e.add_argument("--server", type=_path, help="OpenAI-compatible server root to sample from instead of --model")
    e.add_argument("--served-model", help="the model name the server serves (default: --model)")
    e.add_argument("--task", default="arithmetic", help="registered task that scores (default arithmetic)")
    e.add_argument("--task-kwargs", default="{}", help="the task's constructor arguments as a JSON object")
    e.add_argument("--module", type=_path, help="module or .py file registering the task (as task.module)")
    e.add_argument("--reward", type=_path, help="reward function FILE.py:NAME replacing the task's (task.reward)")
    e.add_argument("--dataset", type=_path, help="JSONL, Parquet or save_to_disk folder (default: the task's)")
    e.add_argument("--columns", action="append", default=[], metavar="ROLE=COLUMN", help="as task.columns")
    e.add_argument("--held-out", action="store_true", help="only the dataset's held-out rows (training's eval set)")
    e.add_argument(
        "--size",
        type=_int_in(1, 10**6),
        default=None,
        help="problems at most: held-out draws (200, as task.eval_size) or dataset rows (all)",
    )
    e.add_argument("--k", type=_int_in(1), default=4, help="pass@k and mean@k (4)")
    e.add_argument("--n", type=_int_in(1), default=None, help="samples per problem, >= k (default k)")
    e.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (1.0; 0 greedy)")
    e.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1.0: off)")
    e.add_argument("--top-k", type=int, default=-1, help="top-k sampling (-1: off)")
    e.add_argument(
        "--max-tokens",
        type=_int_in(1),
        default=None,
        help=f"tokens per completion at most (default {DEFAULT_MAX_TOKENS}, or what the context leaves)",
    )
    e.add_argument("--seed", type=int, default=0, help="sampling and held-out draw seed (0, as a run's seed)")
    e.add_argument("--batch", type=_int_in(1), default=32, help="problems per engine call (32)")
    e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    e.add_argument("--kernels", default="exact", choices=["exact", "fast"])
    _model_placement(e)
    e.add_argument("--out", type=_path, help="write the result (metrics and every sample) to this JSON file")
    e.set_defaults(fn=eval_main)
