"""exactrl command line: train | sft | serve | parity | eval | bench | report | export.

Each command lives in its own module and is imported only when used, so
`exactrl parity` does not pay for the server's imports.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from exactrl.console import stderr_line

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"


def _parity(args) -> int:
    from exactrl.debug.parity_command import parity_main

    return parity_main(args, _fail)


def _bench(args) -> int:
    if not BENCH_DIR.is_dir():  # the wheel packages exactrl/ only
        raise ValueError(
            f"benchmarks run from a source checkout of exactrl: the benchmarks/ folder is not "
            f"installed with the package (looked in {BENCH_DIR}); clone the repository and run "
            f"exactrl bench there"
        )
    known = sorted(p.stem for p in BENCH_DIR.glob("*.py") if not p.stem.startswith("_"))
    if args.name is None:
        print(f"available benchmarks: {', '.join(known)}  (exactrl bench NAME [options]; NAME --help lists them)")
        return 0
    path = BENCH_DIR / f"{args.name}.py"
    if args.name not in known:
        raise ValueError(f"unknown benchmark {args.name!r}; available: {known} (looked in {BENCH_DIR})")
    spec = importlib.util.spec_from_file_location(f"exactrl_bench_{args.name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(args.rest)
    return 0


def _train(args) -> int:
    import os

    from exactrl.distributed.ray_engines import RayEngineError
    from exactrl.engine.engine import NonFiniteLogitsError
    from exactrl.rollout.external import ExternalEngineError
    from exactrl.train.run import train_main

    if args.nproc > 1 and "WORLD_SIZE" in os.environ:
        raise ValueError(
            f"--nproc {args.nproc} starts its own ranks, but WORLD_SIZE={os.environ['WORLD_SIZE']} says "
            f"this process already is one (torchrun): leave out --nproc under torchrun, or unset "
            f"WORLD_SIZE"
        )
    if args.nproc > 1:  # this process starts the ranks and waits for them
        from exactrl.distributed import Ranks, launch
        from exactrl.train.config import load_config
        from exactrl.train.setup import check_ranks

        check_ranks(load_config(args.config, args.set), Ranks(0, args.nproc))  # refused once, before ranks start
        return launch(
            ["train", *([args.config] if args.config else []), *[x for s in args.set for x in ("--set", s)]], args.nproc
        )
    try:
        return train_main(args.config, args.set)
    except (ExternalEngineError, RayEngineError) as e:  # a rollout server or engine failed: the message says which
        return _fail(args.command, e)
    except RuntimeError as e:  # the asynchronous loop re-raises its rollout thread's error as the cause
        cause = e.__cause__
        if isinstance(cause, (ExternalEngineError, RayEngineError)):
            return _fail(args.command, cause)
        if isinstance(cause, (ValueError, OSError, FloatingPointError, NonFiniteLogitsError)):
            raise cause from None  # named in one line by `main`, as the synchronous loop's would be
        raise


def _sft(args) -> int:
    from exactrl.train.sft_run import sft_main

    return sft_main(args.config, args.set)


def _serve(args) -> int:
    from exactrl.server.app import serve_main

    return serve_main(args)


def _report(args) -> int:
    from exactrl.train.report import write_report

    for p in write_report(args.run_dir):
        print(p)
    return 0


def _export(args) -> int:
    from exactrl.train.export import export_checkpoint

    print(export_checkpoint(args.checkpoint, args.out, merge=args.merge, base=args.base))
    return 0


def _add_export(sub) -> None:
    e = sub.add_parser("export", help="a LoRA run's checkpoint as a merged Hugging Face model or PEFT adapters")
    e.add_argument("checkpoint", type=_path, help="a LoRA run's checkpoint directory (RUN_DIR/checkpoints/step_N)")
    e.add_argument("--out", type=_path, required=True, help="the directory to write (new or empty)")
    e.add_argument(
        "--merge",
        action="store_true",
        help="write the base model with the adapters merged into its weights (W + alpha/r B A), a Hugging Face "
        "model directory; without it, the PEFT adapter files alone",
    )
    e.add_argument(
        "--base", type=_path, default=None, help="the base model directory (default: the one the adapters name)"
    )
    e.set_defaults(fn=_export)


def _convert(args) -> int:
    from exactrl.model.gguf import convert_gguf

    print(convert_gguf(args.gguf, args.out, dtype=args.dtype))
    return 0


def _add_convert(sub) -> None:
    c = sub.add_parser("convert", help="a GGUF file (llama.cpp) as a Hugging Face model directory")
    c.add_argument("gguf", type=_path, help="the .gguf file (types and architectures read: docs/gguf.md)")
    c.add_argument("out", type=_path, help="the directory to write (new or empty)")
    c.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the written weights (dequantized GGUF weights are float32)",
    )
    c.set_defaults(fn=_convert)


def _int_in(lo: int, hi: int | None = None):
    """An argparse type: an integer in [lo, hi]."""

    def parse(text: str) -> int:
        value = int(text)
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(
                f"must be {f'in {lo}..{hi}' if hi is not None else f'>= {lo}'}, got {value}"
            )
        return value

    parse.__name__ = "int"  # argparse names the type in "invalid int value: 'x'"
    return parse


def _positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


_positive_float.__name__ = "float"  # argparse names the type in "invalid float value: 'x'"


def _path(text: str) -> str:
    """An argparse type: a path or name that is not empty (an unset shell variable would otherwise be '.', and
    an empty --server no server at all)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must not be empty or only spaces, got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    from exactrl import __version__
    from exactrl.train.evaluate import add_parser as add_eval_parser

    p = argparse.ArgumentParser(prog="exactrl", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"exactrl {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="run an RL training job (default job without a config)")
    t.add_argument("config", nargs="?", default=None, type=_path, help="YAML run config")
    t.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (every key, type and default: docs/config.md)",
    )
    t.add_argument(
        "--nproc",
        type=_int_in(1),
        default=1,
        help="data-parallel ranks on this machine, >= 1 (torch.distributed, gloo; the cores are split "
        "between them); across machines start ranks with torchrun -m exactrl train",
    )
    t.set_defaults(fn=_train)
    f = sub.add_parser("sft", help="supervised fine-tuning on a JSONL file of chats or prompt/completion pairs")
    f.add_argument(
        "config",
        nargs="?",
        default=None,
        type=_path,
        help="YAML SFT config (every key, type and default: docs/config.md)",
    )
    f.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    f.set_defaults(fn=_sft)
    _add_serve(sub)
    _add_parity(sub)
    add_eval_parser(sub)  # exactrl/train/evaluate.py
    b = sub.add_parser("bench", help="benchmarks (prints JSON): kernels | engine | train | serve")
    b.add_argument("name", nargs="?", help="benchmark to run; none lists them")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options (NAME --help)")
    b.set_defaults(fn=_bench)
    r = sub.add_parser("report", help="PNG plots of a run directory")
    r.add_argument(
        "run_dir", type=_path, help="the run directory (it holds metrics.jsonl); the plots go to RUN_DIR/report/"
    )
    r.set_defaults(fn=_report)
    _add_export(sub)
    _add_convert(sub)
    return p


def _model_placement(parser: argparse.ArgumentParser) -> None:
    """--device and --backend, as `load_model` takes them."""
    parser.add_argument(
        "--device",
        default="cpu",
        metavar="DEVICE",
        help="cpu, cuda or cuda:N: where the model runs (cuda needs a GPU and triton)",
    )
    parser.add_argument(
        "--backend",
        default=None,
        choices=["native", "triton"],
        help="kernel implementation (default: native on cpu, triton on cuda; triton on cpu needs TRITON_INTERPRET=1)",
    )


def _add_serve(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible server over the engine")
    s.add_argument(
        "--model", required=True, type=_path, help="Hugging Face model directory to serve (config.json + safetensors)"
    )
    s.add_argument("--tokenizer", default=None, type=_path, help="tokenizer directory (default: the model directory)")
    s.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (127.0.0.1: this machine only; 0.0.0.0: all interfaces)",
    )
    s.add_argument("--port", type=_int_in(0, 65535), default=8000, help="TCP port to listen on, 0..65535")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="parameter and activation dtype")
    s.add_argument(
        "--kernels",
        default="exact",
        choices=["exact", "fast"],
        help="exact: logprobs bitwise equal to the trainer's (and batch-invariant); fast: plain torch",
    )
    _model_placement(s)
    s.add_argument(
        "--monotonicity",
        default="raise",
        choices=["raise", "split", "truncate"],
        help="when a chat history no longer matches the tokens the server returned: raise (HTTP 400), "
        "split (render it afresh as a new segment) or truncate (keep the tokens up to the last "
        "matching turn, render the rest); a request's `monotonicity` field overrides it",
    )
    s.add_argument(
        "--kv-budget-tokens",
        type=_int_in(1),
        default=16384,
        metavar="N",
        help="the engine's KV cache, in tokens (allocated once); requests beyond it wait or are preempted and resumed",
    )
    s.add_argument(
        "--max-num-seqs",
        type=_int_in(1),
        default=64,
        metavar="N",
        help="sequences in one engine step (a request's n counts each); a request's n above it is refused",
    )
    s.add_argument(
        "--session-ttl",
        type=_int_in(0),
        default=3600,
        metavar="SECONDS",
        help="drop a /sessions/{id} record no request has used for this long (a crashed trainer never "
        "deletes its own), >= 0; 0 keeps sessions until they are deleted",
    )
    _add_serve_access(s)
    s.set_defaults(fn=_serve)


def _add_serve_access(s) -> None:
    """`serve`'s flags for who may call it and what it accepts (exactrl/server/guard.py)."""
    s.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route (repeat for several keys); default: "
        "the comma-separated keys in EXACTRL_API_KEY, which other users cannot read in the "
        "process list",
    )
    s.add_argument(
        "--enable-weight-updates",
        action="store_true",
        help="turn on POST /update_weights_from_disk (the external rollout backend's weight_sync: "
        "disk), which lets a client swap the served weights",
    )
    s.add_argument(
        "--weights-root",
        default=None,
        type=_path,
        metavar="DIR",
        help="with --enable-weight-updates: load only checkpoints under DIR",
    )
    s.add_argument(
        "--allowed-hosts",
        action="append",
        default=None,
        metavar="HOST[,HOST...]",
        help="Host header names to accept besides localhost, 127.0.0.1 and [::1] on a loopback --host "
        "(which refuses others: DNS rebinding); on another --host, the only names accepted",
    )
    s.add_argument(
        "--max-body-mb",
        type=_positive_float,
        default=8.0,
        metavar="MB",
        help="refuse a request body larger than this (HTTP 413)",
    )
    s.add_argument(
        "--header-timeout",
        type=_positive_float,
        default=10.0,
        metavar="SECONDS",
        help="close a connection that has not sent a whole request head (line and headers) in this long",
    )


def _add_parity(sub) -> None:
    q = sub.add_parser(
        "parity",
        help="check the exactness contract on a model",
        epilog="exit code: 0 bitwise exact, 1 not exact (or, with --server, no token returned), 2 an error",
    )
    q.add_argument("--model", required=True, type=_path, help="Hugging Face model directory")
    q.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="parameter and activation dtype")
    q.add_argument(
        "--kernels",
        default="exact",
        choices=["exact", "fast"],
        help="exact: the kernels the contract is for; fast: plain torch, which must differ",
    )
    _model_placement(q)
    q.add_argument(
        "--length", type=_int_in(1), default=80, help="target sequence length, >= 1 (capped at the model's context)"
    )
    q.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the random token sequences (and, with --server, of the server's sampling)",
    )
    q.add_argument("--json", action="store_true", help="also print the results as JSON")
    q.add_argument(
        "--server",
        default=None,
        metavar="URL",
        type=_path,
        help="instead: compare a rollout server's logprobs (exactrl serve, vLLM, SGLang; its root URL, "
        "serving the same weights) with this trainer's on random prompts of --length tokens",
    )
    q.add_argument(
        "--served-model", default=None, type=_path, help="--server: the model name it serves (default: --model)"
    )
    q.add_argument(
        "--prompts",
        type=_int_in(1, 100_000),
        default=8,  # all are built before the first is sent
        help="--server: random prompts to send, 1..100000",
    )
    q.add_argument("--max-tokens", type=_int_in(1), default=32, help="--server: tokens generated per prompt, >= 1")
    q.add_argument("--temperature", type=float, default=1.0, help="--server: sampling temperature (0: greedy)")
    q.set_defaults(fn=_parity)


def _refuse_dropped_values(parser: argparse.ArgumentParser, args, argv: list[str]) -> None:
    """`--port=--`: Python 3.11's argparse drops the '--' and sets the flag to [] without calling its type (a
    port of [], a benchmark run with --repeat []). Refused by the command's parser, naming the flag."""
    for a in argv:
        if a == "--":
            return
        flag, eq, value = a.partition("=")
        if flag.startswith("--") and eq and value == "--":  # `--set=k=--` keeps its value: 'k=--' is no '--'
            sub = next(x for x in parser._actions if isinstance(x, argparse._SubParsersAction))
            sub.choices[args.command].error(f"argument {flag}: expected one argument, got '--'")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _refuse_dropped_values(parser, args, sys.argv[1:] if argv is None else argv)
    from exactrl.runtime import exec_with_huge_pages, tune_allocator

    if argv is None:  # the `exactrl` program (not a call from Python): start again with huge pages on
        exec_with_huge_pages()
    if args.command != "serve":  # a server gives back what a large request took (server/guard.py)
        tune_allocator()  # freed memory stays in the heap: no page faults per step (exactrl/runtime.py)
    from exactrl.engine.engine import NonFiniteLogitsError

    try:
        code = args.fn(args)
    except ValueError as e:  # bad input: a clear message, no traceback
        code = _fail(args.command, e)
    except (FloatingPointError, NonFiniteLogitsError) as e:  # a run that diverged: what it saved stays
        code = _fail(
            args.command,
            f"{e}. The training diverged; its checkpoints are kept. Try a new run with "
            f"a lower optim.lr or optim.grad_clip"
            if args.command == "train"
            else e,
        )
    except OSError as e:  # a full disk, a file gone: one line (a run's checkpoints say what is kept)
        code = _fail(args.command, e)
    except KeyboardInterrupt as e:  # outside a training loop (loading, a report): nothing to save, no traceback
        from exactrl.train.run import stopped_by  # Ctrl-C, or SIGTERM to a one-process `train`

        how, code = stopped_by(e)
        stderr_line(f"\nexactrl {args.command}: {how}")
    if argv is None and os.environ.get("WORLD_SIZE", "1") not in ("", "1"):
        _exit_rank(code)
    return code


def _exit_rank(code: int) -> None:
    """A rank of a distributed run leaves without the C++ teardown that follows Python's.

    By now its work is saved and its process group destroyed (train/run.py). Yet twice in CI (a suite runs
    ~15 two-rank jobs) a rank then aborted in torch's C++ teardown ("terminate called without an active
    exception"; faulthandler: one thread, no Python frame): the run was done, the rank's exit code said
    it failed. So the rank flushes its output and ends here."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _fail(command: str, e: Exception) -> int:
    import os

    rank = f" (rank {os.environ.get('RANK', '?')})" if os.environ.get("WORLD_SIZE", "1") not in ("", "1") else ""
    stderr_line(f"exactrl {command}{rank}: error: {e}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
