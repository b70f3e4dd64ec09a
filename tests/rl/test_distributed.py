"""Data-parallel training (exactrl/distributed): `exactrl train --nproc 2` as real processes over gloo.

A two-rank run samples exactly the one-process run's first batch (seeds follow the prompt's place in the
batch, not the rank), trains with the whole batch's gradient (equal to one process's up to the order of
the sum), keeps train/rollout logprobs bitwise equal on every rank, and resumes like an uninterrupted run.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import exactrl
from conftest import default_job_model
from exactrl.cli import main as cli_main
from exactrl.distributed import Ranks

SMALL = ["progress=false", "tensorboard=false", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
         "task.eval_size=6", "eval_every=2", "optim.lr=1e-3", "engine.kv_budget_tokens=4096",
         "algorithm.entropy_coef=0.01"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return default_job_model(tmp_path_factory, sft_steps=0)


def sets(model_dir, run_dir, *extra: str) -> list[str]:
    return [x for o in SMALL + [f"model.path={model_dir}", f"run_dir={run_dir}", *extra] for x in ("--set", o)]


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def ranks_run(model_dir, run_dir, *extra: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """`exactrl train --nproc N` in a child process (it starts the N ranks itself)."""
    cmd = [sys.executable, "-m", "exactrl", "train", "--nproc", str(nproc), *sets(model_dir, run_dir, *extra)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def results(r: dict) -> dict:
    """A row without its timings."""
    return {k: v for k, v in r.items() if not k.startswith(("time/", "perf/tokens_per_s"))}


def test_sharding_covers_the_batch_once_in_order():
    for world in (1, 2, 3):
        shards = [Ranks(r, world).shard(10) for r in range(world)]
        assert sorted(k for s in shards for k in s) == list(range(10))
        assert all(s == sorted(s) for s in shards)


def test_two_ranks_train_on_policy_and_sample_the_one_process_batch(model_dir, tmp_path):
    one_dir, two_dir = tmp_path / "one", tmp_path / "two"
    assert cli_main(["train", *sets(model_dir, one_dir, "max_steps=3")]) == 0
    done = ranks_run(model_dir, two_dir, "max_steps=3")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("run dir:") == 1 and "2 ranks" in done.stdout  # rank 0 speaks for the run
    one, two = rows(one_dir), rows(two_dir)
    assert [r["step"] for r in two] == [1, 2, 3]
    # exactness holds on every rank, over the whole batch (every rank's tokens are in the metric)
    assert all(r["train/train_rollout_logprob_abs_diff_max"] == 0.0 for r in two)
    assert all(r["perf/completion_tokens"] > 0 and r["train/grad_norm"] > 0 for r in two)
    # step 1: the same weights, and seeds that follow the prompt, not the rank -> the same batch
    for k in ("rollout/reward_mean", "rollout/response_len_mean", "rollout/response_len_max",
              "perf/completion_tokens", "eval/initial_accuracy"):
        assert two[0][k] == one[0][k], k
    # the whole batch's gradient: one process's up to the order of the sum
    assert two[0]["train/grad_norm"] == pytest.approx(one[0]["train/grad_norm"], rel=1e-4)
    assert two[0]["train/loss"] == pytest.approx(one[0]["train/loss"], rel=1e-4, abs=1e-6)
    a = exactrl.load_model(one_dir / "checkpoints" / "step_000003")
    b = exactrl.load_model(two_dir / "checkpoints" / "step_000003")
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-3, atol=1e-5, msg=name)
    state = json.loads((two_dir / "checkpoints" / "step_000003" / "state.json").read_text())
    assert len(state["ranks_rng"]) == 2  # each rank's random streams


def test_a_two_rank_run_resumes_like_an_uninterrupted_one(model_dir, tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert ranks_run(model_dir, whole, "max_steps=3").returncode == 0
    assert ranks_run(model_dir, cut, "max_steps=2").returncode == 0
    done = ranks_run(model_dir, cut, "max_steps=3", "resume=true")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [results(r) for r in rows(cut)] == [results(r) for r in rows(whole)]
    # and with another number of ranks it refuses, naming the one to use
    wrong = ranks_run(model_dir, cut, "max_steps=4", "resume=true", nproc=1)
    assert wrong.returncode != 0 and "--nproc 2" in wrong.stderr


@pytest.mark.parametrize("extra, words", [
    (["async.enabled=true"], "async.enabled=true runs in one process"),
    (["rollout.prompts_per_step=1"], "rollout.prompts_per_step=1 gives some of the 2 ranks no prompt"),
    (["rollout_backend.kind=openai", "rollout_backend.base_url=http://127.0.0.1:9", "rollout_backend.model=m"],
     "rollout_backend.kind=openai runs in one process"),
])
def test_what_a_data_parallel_run_cannot_do_is_refused_naming_the_key(model_dir, tmp_path, extra, words):
    done = ranks_run(model_dir, tmp_path / "run", "max_steps=1", *extra)
    assert done.returncode != 0 and words in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # refused before the run dir was made
