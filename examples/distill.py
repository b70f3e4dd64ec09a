"""On-policy distillation experiment: a student distilled from a teacher the default job trained, against
GRPO alone on the same student for the same steps.

    python examples/distill.py [--steps 30] [--teacher-steps 60] [--out runs/distill] [--set key=value ...]

1. teacher: the default GRPO job (arithmetic, the tiny warm-started Qwen3) for `--teacher-steps` steps;
   its last checkpoint is the teacher.
2. on the same student (the default job's warm start), `--steps` steps each of
     grpo      the default job: GRPO on the task reward
     distill   on-policy distillation alone: reverse-KL advantages log π_t − log π_s, no reward
     dgrpo     both: the GRPO advantage plus the distillation advantage (reward_coef 1, coef 1)

Writes OUT/distill.png (held-out accuracy per step and per second of training, train/rollout logprob
difference per step), OUT/summary.json and OUT/summary.md (one row per arm). Every arm is an ordinary run
directory under OUT.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ARMS: dict[str, list[str]] = {
    "grpo": [],
    "distill": ["distill.teacher={teacher}", "distill.reward_coef=0"],
    "dgrpo": ["distill.teacher={teacher}", "distill.reward_coef=1", "distill.coef=1"],
}


def run(name: str, overrides: list[str], out: Path, steps: int, common: list[str] = ()) -> tuple[list[dict], float]:
    """One run in this process: its metrics rows and its wall time."""
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
            "eval_every=5",
            f"save_every={steps}",
            *common,
            *overrides,
        ],
    )
    c = build(cfg, log=lambda *a: print(*a, file=sys.stderr))
    t0 = time.perf_counter()
    try:
        train(c)
    finally:
        c.close()
    wall = time.perf_counter() - t0
    print(f"{name}: {steps} steps in {wall:.0f}s", file=sys.stderr)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()], wall


def accuracy_curve(rows: list[dict]) -> list[tuple[int, float, float]]:
    """(step, seconds of training so far, held-out accuracy), from step 0 (before training) on."""
    out, elapsed = [], 0.0
    for r in rows:
        if "eval/initial_accuracy" in r:
            out.append((0, 0.0, r["eval/initial_accuracy"]))
        elapsed += r.get("time/step_s", 0.0)
        if "eval/accuracy" in r:
            out.append((r["step"], elapsed, r["eval/accuracy"]))
    return out


def summarise(rows: list[dict], wall: float) -> dict:
    curve = accuracy_curve(rows)
    steps = [r for r in rows if r.get("step", 0) > 0]
    return {
        "accuracy_before": curve[0][2],
        "accuracy_after": curve[-1][2],
        "best_accuracy": max(a for _, _, a in curve),
        "train_seconds": round(sum(r.get("time/step_s", 0.0) for r in steps), 1),
        "wall_seconds": round(wall, 1),
        "logprob_abs_diff_max": max(r["train/train_rollout_logprob_abs_diff_max"] for r in steps),
        "reverse_kl_first": steps[0].get("distill/reverse_kl"),
        "reverse_kl_last": steps[-1].get("distill/reverse_kl"),
    }


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, rows in results.items():
        curve = accuracy_curve(rows)
        axes[0].plot([s for s, _, _ in curve], [a for _, _, a in curve], marker=".", label=name)
        axes[1].plot([t for _, t, _ in curve], [a for _, _, a in curve], marker=".", label=name)
        steps = [r for r in rows if r.get("step", 0) > 0]
        axes[2].plot(
            [r["step"] for r in steps], [r["train/train_rollout_logprob_abs_diff_max"] for r in steps], label=name
        )
    for ax, (title, x) in zip(
        axes,
        [
            ("held-out accuracy (greedy)", "step"),
            ("held-out accuracy (greedy)", "seconds of training"),
            ("max |logprob train − rollout|", "step"),
        ],
    ):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(x)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="steps of each arm")
    p.add_argument("--teacher-steps", type=int, default=60, help="GRPO steps that make the teacher")
    p.add_argument("--out", default="runs/distill")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {list(ARMS)}")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for every run")
    a = p.parse_args(argv)
    for flag, v in (("--steps", a.steps), ("--teacher-steps", a.teacher_steps)):
        if v < 1:
            p.error(f"{flag} must be >= 1, got {v}")
    arms = a.arms.split(",")
    if unknown := [n for n in arms if n not in ARMS]:
        p.error(f"unknown arms {unknown}; choose from {list(ARMS)}")
    from exactrl.runtime import tune_allocator

    tune_allocator()  # as the `exactrl` CLI does
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    run("teacher", [], out, a.teacher_steps, a.set)
    teacher = out / "teacher" / "checkpoints" / f"step_{a.teacher_steps:06d}"
    results, summary = {}, {}
    for name in arms:
        rows, wall = run(name, [o.format(teacher=teacher) for o in ARMS[name]], out, a.steps, a.set)
        results[name], summary[name] = rows, summarise(rows, wall)
    plot(results, out / "distill.png")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        "| arm | held-out accuracy before → after (best) | training s | max train/rollout diff "
        "| reverse KL first → last |",
        "|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        kl = "—" if s["reverse_kl_first"] is None else f"{s['reverse_kl_first']:.3f} → {s['reverse_kl_last']:.3f}"
        lines.append(
            f"| {name} | {s['accuracy_before']:.3f} → {s['accuracy_after']:.3f} ({s['best_accuracy']:.3f}) "
            f"| {s['train_seconds']} | {s['logprob_abs_diff_max']} | {kl} |"
        )
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
