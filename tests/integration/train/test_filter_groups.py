"""DAPO's dynamic sampling (`rollout.filter_groups`, train/loop.py `sample_step`): groups whose rewards are all
equal are set aside and more batches sampled; what is trained, what is logged, resuming, exactness."""

from __future__ import annotations

import pytest
from conftest import default_job_model, train_rows

import exactrl.train.loop as loop
from exactrl.train.config import load_config

SMALL = [
    "progress=false",
    "tensorboard=false",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "task.eval_size=0",
    "optim.lr=1e-3",
    "engine.kv_budget_tokens=4096",
    "rollout.filter_groups=true",
]
TIMING = ("time/", "perf/tokens_per_s")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return default_job_model(tmp_path_factory, sft_steps=20)  # part trained: some groups vary, many do not


def varies(group) -> bool:
    return len({r.reward for r in group}) > 1


def test_the_trained_groups_vary_and_the_metrics_count_what_was_set_aside(model_dir, tmp_path, monkeypatch):
    trained = []
    real = loop.train_on
    monkeypatch.setattr(loop, "train_on", lambda c, step, groups: (trained.append(groups), real(c, step, groups))[1])
    P, R = 1, 5  # one group a step: a step stops at the first varied group, or runs out of rounds
    rows = train_rows(
        SMALL,
        model_dir,
        tmp_path / "r",
        "max_steps=6",
        f"rollout.prompts_per_step={P}",
        f"rollout.max_sampling_rounds={R}",
    )
    assert len(trained) == 6
    for row, groups in zip(rows, trained):
        rounds, uniform_trained = row["rollout/sampling_rounds"], row["rollout/uniform_groups_trained"]
        assert len(groups) == P and 1 <= rounds <= R
        assert sum(not varies(g) for g in groups) == uniform_trained
        assert all(varies(g) for g in groups[: P - uniform_trained])  # the varied ones first
        varied = rounds * P - row["rollout/filtered_groups"]  # of every group sampled in the step
        assert uniform_trained == max(0, P - varied)
        if rounds < R:  # it stopped early because enough groups varied
            assert varied >= P
        # every sampled group counts in the rollout metrics and the throughput: rounds x P groups of 4
        assert row["perf/completion_tokens"] >= rounds * P * 4
        assert row["train/train_rollout_logprob_abs_diff"] == 0.0 == row["train/train_rollout_logprob_abs_diff_max"]
    # the filter did something here: (rounds, set aside, uniform trained) per step
    shown = [
        (r["rollout/sampling_rounds"], r["rollout/filtered_groups"], r["rollout/uniform_groups_trained"]) for r in rows
    ]
    assert any(x[0] > 1 for x in shown) and any(x[0] < R for x in shown), shown


def test_a_resumed_filtered_run_is_the_uninterrupted_one(model_dir, tmp_path):
    """Extra batches move the data position: the checkpoint keeps it, and a resume samples the same."""
    full = train_rows(SMALL, model_dir, tmp_path / "full", "max_steps=4", "save_every=2")
    part = tmp_path / "part"
    train_rows(SMALL, model_dir, part, "max_steps=2", "save_every=2")
    resumed = train_rows(SMALL, model_dir, part, "max_steps=4", "save_every=2", "resume=true")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for x, y in zip(full, resumed):
        assert {k: v for k, v in x.items() if not k.startswith(TIMING)} == {
            k: v for k, v in y.items() if not k.startswith(TIMING)
        }


def test_off_by_default_and_refused_where_it_cannot_work(model_dir, tmp_path, capsys):
    rows = train_rows(
        [s for s in SMALL if "filter_groups" not in s],
        model_dir,
        tmp_path / "off",
        "max_steps=1",
        "rollout.max_sampling_rounds=2",
    )
    assert "rollout/sampling_rounds" not in rows[0]
    assert "note: rollout.max_sampling_rounds has no effect: rollout.filter_groups is false" in capsys.readouterr().out
    with pytest.raises(ValueError, match="rollout.filter_groups with rollout.samples_per_prompt=1"):
        load_config(None, ["rollout.filter_groups=true", "rollout.samples_per_prompt=1"])
    with pytest.raises(ValueError, match="rollout.filter_groups with async.enabled"):
        load_config(None, ["rollout.filter_groups=true", "async.enabled=true"])
