"""A wrong value type in a free-form kwargs dict (loss, correction, task) is a ValueError naming the
component and the argument, checked against the constructor's annotations; right values still build."""

from __future__ import annotations

import pytest

from exactrl.algo.corrections import build_corrections
from exactrl.algo.losses import PPOClipLoss, build_loss
from exactrl.envs import ArithmeticTask, CountdownTask, get_task
from exactrl.train.config import load_config


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"eps_low": "abc"}, "loss 'ppo' argument eps_low: expected a finite number, got 'abc'"),
        ({"eps_high": True}, "loss 'ppo' argument eps_high: expected a finite number, got True"),
        ({"dual_clip": "3"}, "loss 'ppo' argument dual_clip: expected a finite number or null, got '3'"),
        ({"eps_high": float("nan")}, "loss 'ppo' argument eps_high: expected a finite number, got nan"),
        ({"dual_clip": float("inf")}, "loss 'ppo' argument dual_clip: expected a finite number or null, got inf"),
        ({"eps_high": 10**400}, "loss 'ppo' argument eps_high: expected a finite number, got 1000"),  # beyond floats
    ],
)
def test_loss_kwargs_of_the_wrong_type(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_loss("ppo", **kwargs)


def test_loss_kwargs_from_the_command_line():
    cfg = load_config(None, ["algorithm.loss_kwargs={eps_low: abc}"])
    with pytest.raises(ValueError, match="loss 'ppo' argument eps_low: expected a finite number, got 'abc'"):
        build_loss(cfg.algorithm.loss, **cfg.algorithm.loss_kwargs)


def test_right_loss_kwargs_still_build():
    loss = build_loss("ppo", eps_low=0, eps_high=0.28, dual_clip=None)  # an int is a fine float
    assert isinstance(loss, PPOClipLoss) and loss.eps_low == 0
    assert build_loss("topr", level="token").level == "token"
    with pytest.raises(ValueError, match="loss 'topr' argument level: expected a string, got 1"):
        build_loss("topr", level=1)


@pytest.mark.parametrize(
    "spec, match",
    [
        (
            {"name": "token_tis", "upper": "abc"},
            "correction 'token_tis' argument upper: expected a finite number or null",
        ),
        (
            {"name": "kl_rejection", "threshold": [1.0]},
            "correction 'kl_rejection' argument threshold: expected a finite number",
        ),
    ],
)
def test_correction_kwargs_of_the_wrong_type(spec, match):
    with pytest.raises(ValueError, match=match):
        build_corrections([spec])


def test_right_correction_kwargs_still_build():
    build_corrections([{"name": "token_tis", "lower": None, "upper": 2}, {"name": "opsm", "delta": 0.1}])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"min_value": "abc"}, "task 'arithmetic' argument min_value: expected an integer, got 'abc'"),
        ({"max_value": 5.5}, "argument max_value: expected an integer, got 5.5"),
        ({"ops": ["+", 1]}, r"argument ops: expected a list \(a string each\), got \['\+', 1\]"),
        ({"nonnegative": "yes"}, "argument nonnegative: expected true or false, got 'yes'"),
    ],
)
def test_task_kwargs_of_the_wrong_type(kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_task("arithmetic", **kwargs)


def test_right_task_kwargs_still_build():
    assert get_task("arithmetic", ops=["+", "*"], max_value=20).ops == ("+", "*")  # YAML gives lists
    assert isinstance(get_task("arithmetic", ops="+-"), ArithmeticTask)  # a str is a Sequence[str]
    assert get_task("countdown", format_reward=0).format_reward == 0  # an int is a fine float
    assert isinstance(get_task("countdown", ops=("+", "-")), CountdownTask)


def test_advantage_kwargs_of_the_wrong_type():
    import torch

    from exactrl.algo.advantages import compute_advantages

    rewards = torch.tensor([[1.0, 0.0]])
    with pytest.raises(ValueError, match="advantage estimator 'grpo' argument normalize_std: expected true or false"):
        compute_advantages("grpo", rewards, normalize_std="no")
    assert compute_advantages("grpo", rewards, normalize_std=False).tolist() == [[0.5, -0.5]]
