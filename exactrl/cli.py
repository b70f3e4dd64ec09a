"""exactrl command line: train | serve | parity | bench | report.

Each command lives in its own module and is imported only when used, so
`exactrl parity` does not pay for the server's imports.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"


def _parity(args) -> int:
    import exactrl
    from exactrl.debug.parity import run_parity

    model = exactrl.load_model(args.model, dtype=args.dtype, kernels=args.kernels)
    results = run_parity(model, length=args.length, seed=args.seed)
    for r in results:
        line = f"{r.name:12s} {'exact' if r.exact else 'DIFFERS'}"
        if not r.exact:
            line += f"  max|Δlogit|={r.max_abs_diff:.3e}  first divergent op: {r.first_divergent_op} (|Δ|={r.op_diff:.3e})"
        print(line)
    ok = all(r.exact for r in results)
    print(f"verdict: {'BITWISE EXACT' if ok else 'NOT EXACT'} ({args.kernels} kernels, {args.dtype})")
    if args.json:
        print(json.dumps([r.__dict__ for r in results]))
    return 0 if ok else 1


def _bench(args) -> int:
    path = BENCH_DIR / f"{args.name}.py"
    if not path.is_file():
        known = sorted(p.stem for p in BENCH_DIR.glob("*.py") if not p.stem.startswith("_"))
        raise SystemExit(f"unknown benchmark {args.name!r}; available: {known} (looked in {BENCH_DIR})")
    spec = importlib.util.spec_from_file_location(f"exactrl_bench_{args.name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(args.rest)
    return 0


def _train(args) -> int:
    from exactrl.rl.run import train_main

    return train_main(args.config, args.set)


def _serve(args) -> int:
    from exactrl.server.app import serve_main

    return serve_main(args)


def _report(args) -> int:
    from exactrl.rl.report import write_report

    for p in write_report(args.run_dir):
        print(p)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="exactrl", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="run an RL training job (default job without a config)")
    t.add_argument("config", nargs="?", default=None, help="YAML run config")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    t.set_defaults(fn=_train)
    s = sub.add_parser("serve", help="OpenAI-compatible server over the engine")
    s.add_argument("--model", required=True)
    s.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the model dir)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    s.add_argument("--kernels", default="exact", choices=["exact", "fast"])
    s.add_argument("--monotonicity", default="raise", choices=["raise", "split", "truncate"])
    s.set_defaults(fn=_serve)
    q = sub.add_parser("parity", help="check the exactness contract on a model")
    q.add_argument("--model", required=True, help="Hugging Face model directory")
    q.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    q.add_argument("--kernels", default="exact", choices=["exact", "fast"])
    q.add_argument("--length", type=int, default=80, help="target sequence length")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--json", action="store_true", help="also print the results as JSON")
    q.set_defaults(fn=_parity)
    b = sub.add_parser("bench", help="benchmarks (prints JSON): kernels | engine | train | serve")
    b.add_argument("name")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(fn=_bench)
    r = sub.add_parser("report", help="PNG plots of a run directory")
    r.add_argument("run_dir")
    r.set_defaults(fn=_report)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from exactrl.runtime import tune_allocator

    tune_allocator()  # freed memory stays in the heap: no page faults per step (exactrl/runtime.py)
    try:
        return args.fn(args)
    except ValueError as e:  # bad input: a clear message, no traceback
        print(f"exactrl {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
