"""`exactrl report RUN_DIR`: PNG plots of a run's metrics.jsonl."""
from __future__ import annotations

from pathlib import Path

from exactrl.rl.logger import read_metrics

PANELS = [("reward", ["rollout/reward_mean"]), ("accuracy", ["eval/accuracy", "rollout/accuracy"]),
          ("logprob_diff", ["train/train_rollout_logprob_abs_diff", "train/train_rollout_logprob_abs_diff_max"]),
          ("response_length", ["rollout/response_len_mean"])]
INITIAL = "eval/initial_accuracy"


def write_report(run_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no metrics yet: the run has not finished a step")
    plotted = [INITIAL] + [k for _, keys in PANELS for k in keys]
    for i, r in enumerate(rows, start=1):
        if not isinstance(r.get("step"), int) or isinstance(r["step"], bool):
            raise ValueError(f"{run_dir / 'metrics.jsonl'}: row {i} has no integer 'step' (not exactrl's metrics?)")
        bad = [k for k in plotted if k in r and (not isinstance(r[k], (int, float)) or isinstance(r[k], bool))]
        if bad:
            raise ValueError(f"{run_dir / 'metrics.jsonl'}: row {i}: {bad[0]!r} is {r[bad[0]]!r}, not a number")
    out_dir = run_dir / "report"
    try:
        return _plot(rows, out_dir, plt)
    except OSError as e:  # a file of that name, a read-only run directory, a full disk
        raise ValueError(f"cannot write the plots to {out_dir}: {e.strerror or e}") from None
    finally:
        plt.close("all")


def _plot(rows: list[dict], out_dir: Path, plt) -> list[Path]:
    out_dir.mkdir(exist_ok=True)
    written = []
    fig_all, axes = plt.subplots(2, 2, figsize=(11, 7))
    for (name, keys), ax_all in zip(PANELS, axes.flat):
        fig, ax = plt.subplots(figsize=(6, 4))
        for a in (ax, ax_all):
            for k in keys:
                pts = [(r["step"], r[k]) for r in rows if k in r]
                if k == "eval/accuracy":  # the accuracy before training rides on step 1's row
                    pts = [(0, r[INITIAL]) for r in rows if INITIAL in r] + pts
                if pts:
                    a.plot(*zip(*pts), marker=".", label=k)
            a.set_title(name.replace("_", " "))
            a.set_xlabel("step")
            a.grid(alpha=0.3)
            if a.lines:
                a.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / f"{name}.png", dpi=100)
        plt.close(fig)
        written.append(out_dir / f"{name}.png")
    fig_all.tight_layout()
    fig_all.savefig(out_dir / "summary.png", dpi=100)
    plt.close(fig_all)
    return [out_dir / "summary.png"] + written
