"""`task.kind: verifiers` without running an episode: its keys, what a run with it refuses, the extra named
when verifiers is missing, and the loss mask an episode's rollouts carry into the TrainBatch."""

from __future__ import annotations

import sys

import pytest

from exactrl.envs.base import Problem
from exactrl.envs.settings import TaskSettings
from exactrl.rollout.groups import Rollout, to_train_batch
from exactrl.train.config import load_config

V = ["task.kind=verifiers", "task.env_id=my_env"]


def test_task_keys():
    ts = TaskSettings(kind="verifiers", env_id="my_env", env_args={"taskset": {"count": 3}})
    assert ts.env_args == {"taskset": {"count": 3}}
    with pytest.raises(ValueError, match="task.kind=verifiers needs task.env_id"):
        TaskSettings(kind="verifiers")
    with pytest.raises(ValueError, match="task.env_id needs task.kind=verifiers"):
        TaskSettings(env_id="my_env")
    with pytest.raises(ValueError, match="task.env_args needs task.kind=verifiers"):
        TaskSettings(env_args={"a": 1})
    with pytest.raises(ValueError, match="task.dataset describes an exactrl task"):
        TaskSettings(kind="verifiers", env_id="my_env", dataset="rows.jsonl")
    # a run's own config.json names every key at its default: still valid either way
    assert TaskSettings(**TaskSettings(kind="verifiers", env_id="e").model_dump()).kind == "verifiers"
    assert TaskSettings(**TaskSettings().model_dump()).kind == "task"


@pytest.mark.parametrize(
    "override, need",
    [
        ("async.enabled=true", "async.enabled=false"),
        ("algorithm.overlong.buffer_len=4", "algorithm.overlong off"),
        ("rollout.ignore_eos=true", "rollout.ignore_eos=false"),
        ("algorithm.kl.coef=0.1", None),  # in the loss: fine
    ],
)
def test_a_run_refuses_what_reads_single_completions(override, need):
    if need is None:
        assert load_config(None, [*V, override]).task.env_id == "my_env"
        with pytest.raises(ValueError, match="needs algorithm.kl.where=loss"):
            load_config(None, [*V, override, "algorithm.kl.where=reward"])
        return
    with pytest.raises(ValueError, match=f"task.kind=verifiers needs {need}"):
        load_config(None, [*V, override])


def test_train_size_is_noted_as_ignored():
    from exactrl.train.config import ignored_settings

    assert ignored_settings(load_config(None, [*V, "task.train_size=10"])) == [
        "task.train_size has no effect: task.kind is verifiers: its taskset's tasks are the prompts"
    ]
    assert ignored_settings(load_config(None, ["task.train_size=10"])) == []


def test_missing_verifiers_names_the_extra(monkeypatch):
    from exactrl.envs.verifiers_env import VerifiersEnv

    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # an import of it now fails
    with pytest.raises(ValueError, match=r"pip install 'exactrl\[verifiers\]'"):
        VerifiersEnv.load("my_env")


def test_episode_rollouts_carry_their_loss_mask():
    p = Problem("q", "a")

    def rollout(completion, reward, mask):
        return Rollout(p, [1, 2], completion, [-0.5] * len(completion), [0] * len(completion), "stop", "", reward, mask)

    groups = [[rollout([5, 6, 7, 8], 1.0, [1, 0, 0, 1]), rollout([5, 9], 0.0, [1, 1])]]
    b = to_train_batch(groups, "grpo", {})
    assert b.loss_mask == b.generated_mask == [[1, 0, 0, 1], [1, 1]]
    assert to_train_batch([[rollout([5], 1.0, None), rollout([6], 0.0, None)]], "grpo", {}).loss_mask is None


@pytest.mark.parametrize(
    "sets", [["task.dataset=x.jsonl", "task.columns={prompt: q}"], [*V, "task.env_args={taskset: {count: 8}}"]]
)
def test_a_run_with_a_task_mapping_resumes(sets):
    """A mapping key (task.columns, task.env_args) that is not empty is saved as the keys below it: the
    defaults supplied for keys older checkpoints lack must not add it again as an empty one."""
    from pathlib import Path

    from exactrl.train.resume import _check_same_run, _identity

    cfg = load_config(None, sets)
    _check_same_run(_identity(cfg.model_dump(mode="json", by_alias=True), None), cfg, Path("ckpt"))
    other = load_config(None, [*sets[:-1], sets[-1].replace("q", "r").replace("8", "9")])
    with pytest.raises(ValueError, match="changed settings"):
        _check_same_run(_identity(other.model_dump(mode="json", by_alias=True), None), cfg, Path("ckpt"))
