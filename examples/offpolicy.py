"""Off-policy experiment: the default job on-policy, off-policy, and off-policy corrected.

    python examples/offpolicy.py [--steps 60] [--out runs/offpolicy] [--variants a,b,...]

Runs the default GRPO job (arithmetic, tiny warm-started Qwen3) in several
variants, one after the other in this process, and writes
`OUT/offpolicy.png` (reward, held-out accuracy, train/rollout logprob
difference and k3 KL per step, side by side) and `OUT/summary.json`
(final figures and throughput per variant). Each variant is an ordinary run
directory under OUT, so `exactrl report OUT/<variant>` works on it too.

Variants (config overrides on top of the default job):
  sync-exact        the reference: exact kernels, synchronous, on-policy (diff = 0.0)
  fast              plain torch kernels: engine and trainer disagree in the last bits
  fast-tis          the same with token-level truncated IS (upper 2)
  async-s2          asynchronous rollouts up to 2 policy versions stale, uncorrected
                    (the PPO ratio is taken against the trainer's π_old; μ is ignored)
  async-s2-decoupled  the same with decoupled PPO's weight π_old/μ truncated at 2
                    (Hilton et al. 2022) and token masked IS outside [0.5, 2]

Async vs sync throughput is read off `perf/tokens_per_s` and `time/step_s`
of `sync-exact` and `async-s2` (same job, same machine, same run of this script).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

VARIANTS: dict[str, list[str]] = {
    "sync-exact": [],
    "fast": ["model.kernels=fast"],
    "fast-tis": ["model.kernels=fast", "algorithm.corrections=[{name: token_tis, upper: 2.0}]"],
    "async-s2": ["async.enabled=true", "async.max_staleness=2"],
    "async-s2-decoupled": [
        "async.enabled=true",
        "async.max_staleness=2",
        "algorithm.corrections=[{name: decoupled, upper: 2.0}, {name: token_mask_is, lower: 0.5, upper: 2.0}]",
    ],
}

FLOOR = 1e-17  # where an exact 0.0 is drawn on the log axes (below fp32's smallest k3 of a 1-ulp gap)
PLOTS = [
    ("rollout/reward_mean", "reward (mean over samples)", False),
    ("eval/accuracy", "held-out accuracy (greedy)", False),
    ("train/train_rollout_logprob_abs_diff", "|logprob train − rollout| (mean)", True),
    ("mismatch/k3", "k3 KL(π_old ‖ μ) estimate", True),
]


def run_variant(name: str, overrides: list[str], out: Path, steps: int) -> list[dict]:
    from exactrl.train.async_loop import train_async
    from exactrl.train.config import load_config
    from exactrl.train.loop import train
    from exactrl.train.setup import build

    run_dir = out / name
    if (run_dir / "metrics.jsonl").exists():
        raise SystemExit(f"{run_dir} already holds a run: pass another --out or remove it")
    cfg = load_config(
        None,
        [
            f"max_steps={steps}",
            f"run_dir={run_dir}",
            "progress=false",
            "tensorboard=false",
            f"save_every={steps}",
            "eval_every=5",
            *overrides,
        ],
    )
    c = build(cfg, log=lambda *a: print(*a, file=sys.stderr))
    t0 = time.perf_counter()
    try:
        train_async(c, cfg.async_) if cfg.async_.enabled else train(c)
    finally:
        c.close()
    print(f"{name}: {steps} steps in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summarise(rows: list[dict]) -> dict[str, float]:
    steps = [r for r in rows if r.get("step", 0) > 0]
    evals = [r["eval/initial_accuracy"] for r in rows if "eval/initial_accuracy" in r] + [
        r["eval/accuracy"] for r in rows if "eval/accuracy" in r
    ]
    last = steps[-5:]

    def mean(key, rs):
        vals = [r[key] for r in rs if key in r]
        return sum(vals) / len(vals) if vals else float("nan")

    return {
        "eval_accuracy_first": evals[0] if evals else float("nan"),
        "eval_accuracy_last": evals[-1] if evals else float("nan"),
        "reward_mean_last5": mean("rollout/reward_mean", last),
        "logprob_abs_diff_mean": mean("train/train_rollout_logprob_abs_diff", steps),
        "logprob_abs_diff_max": max((r["train/train_rollout_logprob_abs_diff_max"] for r in steps), default=0.0),
        "k3_mean": mean("mismatch/k3", steps),
        "staleness_mean": mean("async/staleness_mean", steps),
        "tokens_per_s": mean("perf/tokens_per_s", steps[1:]),
        "step_s": mean("time/step_s", steps[1:]),
    }


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PLOTS), figsize=(5 * len(PLOTS), 4))
    for ax, (key, title, log) in zip(axes, PLOTS):
        for name, rows in results.items():
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if key == "eval/accuracy":  # the accuracy before training rides on step 1's row
                pts = [(0, r["eval/initial_accuracy"]) for r in rows if "eval/initial_accuracy" in r] + pts
            if log:  # zero cannot be drawn on a log axis: show it at the floor, labelled
                pts = [(s, max(v, FLOOR)) for s, v in pts]
            if pts:
                ax.plot(*zip(*pts), label=name, marker="." if len(pts) < 15 else None)
        ax.set_title(title + (f" (0 drawn at {FLOOR:g})" if log else ""), fontsize=10)
        ax.set_xlabel("step")
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", default="runs/offpolicy")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {list(VARIANTS)}")
    p.add_argument("--replot", action="store_true", help="only redraw the plot and summary from OUT's runs")
    a = p.parse_args(argv)
    names = a.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    from exactrl.runtime import tune_allocator

    tune_allocator()  # as the `exactrl` CLI does
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.replot:
        results = {n: [json.loads(x) for x in (out / n / "metrics.jsonl").read_text().splitlines()] for n in names}
    else:
        results = {n: run_variant(n, VARIANTS[n], out, a.steps) for n in names}
    summary = {n: summarise(rows) for n, rows in results.items()}
    if "sync-exact" in summary and "async-s2" in summary:
        summary["async_over_sync_tokens_per_s"] = (
            summary["async-s2"]["tokens_per_s"] / summary["sync-exact"]["tokens_per_s"]
        )
    # a figure a variant does not have (NaN) is null: strict JSON has no NaN
    summary = {
        n: {k: (None if isinstance(v, float) and v != v else v) for k, v in s.items()} if isinstance(s, dict) else s
        for n, s in summary.items()
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False))
    plot(results, out / "offpolicy.png")
    print(json.dumps(summary, indent=2))
    print(f"plot: {out / 'offpolicy.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
