"""How rollouts are scored (rollout/groups.py): what a completion that hits the length limit gets (DAPO's soft
overlong punishment and overlong filtering, `algorithm.overlong`, against hand-computed values), and what a
task's reward may be."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from exactrl.envs.base import Problem
from exactrl.rollout.groups import Rollout, overlong_penalty, overlong_shaped, to_train_batch
from exactrl.train.config import load_config


def _rollout(n_tokens: int, reward: float, finish: str = "stop") -> Rollout:
    return Rollout(
        Problem("1+1", "2"),
        [1, 2],
        list(range(3, 3 + n_tokens)),
        [-0.5] * n_tokens,
        [0] * n_tokens,
        finish,
        "2",
        reward,
    )


@pytest.mark.parametrize("length,expected", [(0, 0.0), (4, 0.0), (5, -0.25), (6, -0.5), (8, -1.0)])
def test_soft_overlong_penalty_is_linear_across_the_buffer(length, expected):
    # L = 8, L_b = 4: no penalty up to 4 tokens, then (4 - |y|) / 4
    assert overlong_penalty(length, 8, 4, 1.0) == expected
    assert overlong_penalty(length, 8, 4, 0.5) == expected * 0.5
    assert overlong_penalty(length, 8, 0, 1.0) == 0.0  # off


def test_overlong_shaping_moves_the_advantages_not_the_task_reward():
    groups = [[_rollout(2, 1.0), _rollout(8, 1.0, "length")]]
    shaped, metrics = overlong_shaped(groups, 8, 4, 1.0)
    assert [r.reward for r in shaped[0]] == [1.0, 0.0] and [r.reward for r in groups[0]] == [1.0, 1.0]
    assert metrics == {"rollout/overlong_penalty_mean": -0.5, "rollout/overlong_penalised_frac": 0.5}
    plain = to_train_batch(groups, "grpo", {})
    assert plain.advantages == [0.0, 0.0]  # equal task rewards: nothing to learn
    adv = to_train_batch(shaped, "grpo", {}).advantages
    assert adv[0] > 0 > adv[1]  # the short answer is now preferred


def test_mask_truncated_zeroes_the_loss_mask_of_cut_completions_only():
    groups = [[_rollout(3, 1.0), _rollout(4, 0.0, "length")], [_rollout(0, 0.0), _rollout(2, 1.0)]]
    batch = to_train_batch(groups, "grpo", {}, mask_truncated=True)
    assert batch.loss_mask == [[1, 1, 1], [0, 0, 0, 0], [], [1, 1]]
    # the cut completion still counts in its group's baseline
    assert batch.advantages == to_train_batch(groups, "grpo", {}).advantages
    assert to_train_batch(groups, "grpo", {}).loss_mask is None


def test_a_buffer_longer_than_the_completion_limit_is_refused():
    with pytest.raises(ValueError, match=r"algorithm.overlong.buffer_len=9 exceeds rollout.max_tokens=8"):
        load_config(None, ["rollout.max_tokens=8", "algorithm.overlong.buffer_len=9"])
    with pytest.raises(ValueError, match="unknown config key 'algorithm.overlong.buffer'"):
        load_config(None, ["algorithm.overlong.buffer=2"])
    assert load_config(None, ["algorithm.overlong.buffer_len=8"]).algorithm.overlong.buffer_len == 8


def test_a_step_whose_completions_are_all_masked_learns_nothing(qwen3_dir):
    """Every completion truncated and masked: the loss and the gradient are 0 and the metrics stay finite."""
    import exactrl
    from exactrl.algo.losses import build_loss
    from exactrl.train.trainer import StepSettings, train_step

    model = exactrl.load_model(qwen3_dir)
    before = [p.detach().clone() for p in model.parameters()]
    batch = to_train_batch([[_rollout(3, 1.0, "length"), _rollout(3, 0.0, "length")]], "grpo", {}, mask_truncated=True)
    s = StepSettings(
        temperature=1.0,
        top_k=-1,
        top_p=1.0,
        micro_batch_size=8,
        agg_mode="token-mean",
        agg_constant=None,
        grad_clip=1.0,
    )
    m = train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), build_loss("ppo"), batch, s)
    assert m["train/grad_norm"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


class _FixedReward:
    name = "mine"

    def __init__(self, r):
        self.r = r

    def reward(self, problem, text):
        return self.r


def test_a_reward_that_is_not_a_finite_number_names_the_task():
    """A user task's reward() returning None, text or NaN is named with the prompt, not a float() traceback or a
    silently accepted "1.0"; bools and numpy numbers are numbers."""
    import numpy as np

    from exactrl.rollout.groups import _reward

    for bad in (None, "1.0", float("nan"), [1]):
        with pytest.raises(
            ValueError, match=r"task 'mine': reward\(\) for the prompt '1\+1=' must be a finite number, got "
        ):
            _reward(_FixedReward(bad), Problem("1+1=", "2"), "2")
    assert [_reward(_FixedReward(x), Problem("1+1=", "2"), "2") for x in (True, 0, np.float32(0.5))] == [1.0, 0, 0.5]


@pytest.mark.parametrize(
    "verdict, value",
    [
        (True, 1.0),
        (False, 0.0),
        (np.True_, 1.0),
        (np.array(False), 0.0),
        (torch.tensor(True), 1.0),
        (torch.tensor([False]), 0.0),
    ],
)
def test_a_bool_reward_is_one_or_zero_for_tasks_and_agents_alike(verdict, value):
    """One rule (exactrl/envs/rewards.py): a verdict of any bool kind reads as 1.0 or 0.0 wherever a reward
    comes from."""
    from exactrl.rollout.agents import _reward as agent_reward
    from exactrl.rollout.groups import _reward

    assert _reward(_FixedReward(verdict), Problem("1+1=", "2"), "2") == value
    assert agent_reward(verdict) == value


def test_a_correction_name_that_is_not_text_is_named():
    from exactrl.algo.corrections import build_corrections

    with pytest.raises(ValueError, match=r"unknown correction \['a'\]"):
        build_corrections([{"name": ["a"]}])
