"""The learning-rate schedule (`optim.warmup_steps`, `optim.lr_schedule`, `optim.min_lr_ratio`; train/setup.py
`scheduled_lr`): hand-computed values, Hugging Face's schedulers after the warm-up, what a run logs as
`train/lr`, and resuming checkpoints written before the schedules existed."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import default_job_model, train_args, train_rows

from exactrl.cli import main as cli_main
from exactrl.train.checkpoint import latest_checkpoint
from exactrl.train.config import OptimSettings
from exactrl.train.setup import scheduled_lr

SMALL = [
    "progress=false",
    "tensorboard=false",
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=2",
    "task.eval_size=0",
    "engine.kv_budget_tokens=4096",
]


def lrs(schedule: str, warmup: int, steps: int, ratio: float = 0.0, lr: float = 1.0) -> list[float]:
    o = OptimSettings(lr=lr, warmup_steps=warmup, lr_schedule=schedule, min_lr_ratio=ratio)
    return [scheduled_lr(o, s, steps) for s in range(1, steps + 1)]


def test_the_schedules_by_hand():
    """10 steps, 2 of warm-up: lr·s/2, then the decay's fraction done before step s is (s − 3)/8."""
    assert lrs("constant", 2, 10) == [0.5] + [1.0] * 9
    assert lrs("linear", 2, 10) == [0.5, 1.0, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125]
    assert lrs("cosine", 2, 10) == pytest.approx(
        [0.5, 1.0] + [0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(8)], rel=1e-15
    )
    assert lrs("linear", 0, 4, ratio=0.2, lr=2.0) == pytest.approx(
        [2.0, 2 * (0.2 + 0.8 * 0.75), 2 * (0.2 + 0.8 * 0.5), 2 * (0.2 + 0.8 * 0.25)]
    )
    assert lrs("cosine", 0, 3, ratio=1.0) == [1.0, 1.0, 1.0]  # a floor at lr: constant
    assert lrs("linear", 5, 3) == [1 / 5, 2 / 5, 3 / 5]  # the run ends inside the warm-up


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_after_the_warm_up_it_is_hugging_faces_schedule(schedule, warmup):
    """transformers' get_{linear,cosine}_schedule_with_warmup (their first steps differ: they start the
    warm-up at 0, this one at lr/W), and the min-lr variant of cosine for min_lr_ratio."""
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

    steps = 12
    makers = {"linear": get_linear_schedule_with_warmup, "cosine": get_cosine_schedule_with_warmup}
    cases = [(0.0, lambda opt: makers[schedule](opt, warmup, steps))]
    if schedule == "cosine":
        cases.append(
            (0.1, lambda opt: get_cosine_with_min_lr_schedule_with_warmup(opt, warmup, steps, min_lr_rate=0.1))
        )
    for ratio, make in cases:
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=3e-5)
        sched, theirs = make(opt), []
        for _ in range(steps):
            theirs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        ours = lrs(schedule, warmup, steps, ratio, lr=3e-5)
        assert ours[warmup:] == pytest.approx(theirs[warmup:], rel=1e-12, abs=0), (ratio, ours, theirs)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return default_job_model(tmp_path_factory, sft_steps=0)


def test_a_run_logs_the_schedule_and_a_checkpoint_from_before_it_resumes_as_constant(model_dir, tmp_path, capsys):
    rows = train_rows(
        SMALL,
        model_dir,
        tmp_path / "cos",
        "max_steps=4",
        "optim.lr=1e-3",
        "optim.warmup_steps=1",
        "optim.lr_schedule=cosine",
        "optim.min_lr_ratio=0.1",
    )
    assert [r["train/lr"] for r in rows] == lrs("cosine", 1, 4, 0.1, lr=1e-3)
    d = tmp_path / "old"
    train_rows(SMALL, model_dir, d, "max_steps=1", "save_every=1")
    state_path = latest_checkpoint(d) / "state.json"
    state = json.loads(state_path.read_text())
    for key in ("lr_schedule", "min_lr_ratio"):  # as a checkpoint written before the keys existed
        del state["config"]["optim"][key]
    state_path.write_text(json.dumps(state))
    assert cli_main(train_args(SMALL, model_dir, d, "max_steps=2", "resume=true", "optim.lr_schedule=linear")) == 2
    assert "optim.lr_schedule: 'constant' -> 'linear'" in capsys.readouterr().err
    rows = train_rows(SMALL, model_dir, d, "max_steps=2", "resume=true")
    assert [r["train/lr"] for r in rows] == [5e-5, 5e-5]


def test_min_lr_ratio_without_a_decay_is_named_as_having_no_effect(model_dir, tmp_path, capsys):
    train_rows(SMALL, model_dir, tmp_path / "r", "max_steps=1", "optim.min_lr_ratio=0.5")
    assert "note: optim.min_lr_ratio has no effect: optim.lr_schedule is constant" in capsys.readouterr().out
