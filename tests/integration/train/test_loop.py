"""The training loop end to end: exactness per step, resume equivalence, asynchronous mode.

Runs go through `exactrl train` (the CLI) on the default job's model, warm
started for a few steps only and cached once per session in a temp dir.
"""

from __future__ import annotations

import json
import math

import pytest
from conftest import default_job_model, train_rows

from exactrl.cli import main as cli_main
from exactrl.rollout.groups import Rollout
from exactrl.train.async_loop import drop_stale
from exactrl.train.config import load_config

# a few seconds per run: 4 prompts x 4 samples, short answers, a small eval set
SMALL = [
    "progress=false",
    "tensorboard=false",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "task.eval_size=8",
    "eval_every=2",
    "optim.lr=1e-3",
    "engine.kv_budget_tokens=4096",
]
TIMING = ("time/", "perf/tokens_per_s")  # wall-clock metrics, the only ones allowed to differ between runs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return default_job_model(tmp_path_factory, sft_steps=20)


def run(model_dir, run_dir, *overrides) -> list[dict]:
    return train_rows(SMALL, model_dir, run_dir, *overrides)


def training_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["step"] > 0]


def same_metrics(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        keys = {k for k in x if not k.startswith(TIMING)}
        assert keys == {k for k in y if not k.startswith(TIMING)}
        diff = {k: (x[k], y[k]) for k in keys if x[k] != y[k]}
        assert not diff, (x["step"], diff)


# ---------------------------------------------------------------- synchronous loop


def test_exact_run_has_zero_mismatch_every_step(model_dir, tmp_path):
    rows = run(model_dir, tmp_path / "run", "max_steps=3")
    # every row is a training step with docs/design.md §3's keys; the accuracy before training rides on step 1
    contract = (
        "step",
        "train/train_rollout_logprob_abs_diff",
        "train/train_rollout_logprob_abs_diff_max",
        "rollout/reward_mean",
    )
    assert all(k in r for r in rows for k in contract)
    assert 0.0 <= rows[0]["eval/initial_accuracy"] <= 1.0 and not any("eval/initial_accuracy" in r for r in rows[1:])
    train = training_rows(rows)
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        assert r["train/train_rollout_logprob_abs_diff"] == 0.0
        assert r["train/train_rollout_logprob_abs_diff_max"] == 0.0
        assert r["mismatch/k3"] == 0.0
        assert r["engine/version"] == r["step"] and not any(k.startswith("external/") for k in r)
        for key in (
            "rollout/reward_mean",
            "rollout/response_len_mean",
            "train/entropy",
            "train/grad_norm",
            "loss/clip_frac_low",
            "loss/clip_frac_high",
            "perf/tokens_per_s",
            "time/rollout_s",
            "time/train_s",
        ):
            assert math.isfinite(r[key]), key
    assert "eval/accuracy" in train[1] and "eval/accuracy" in train[2]  # eval_every=2 and the last step
    out = tmp_path / "run"
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000003"
    assert (out / "report" / "summary.png").stat().st_size > 0
    assert json.loads((out / "config.json").read_text())["async"]["enabled"] is False


def test_activation_checkpointing_runs_bitwise_the_same_steps(model_dir, tmp_path):
    """optim.activation_checkpointing through `exactrl train` (train/setup.py applies it to the trainer's model
    only): every metric of every step equals the plain run's; token-budget micro-batches run exact too."""
    plain = run(model_dir, tmp_path / "plain", "max_steps=2")
    same_metrics(plain, run(model_dir, tmp_path / "full", "max_steps=2", "optim.activation_checkpointing=full"))
    budget = training_rows(run(model_dir, tmp_path / "budget", "max_steps=2", "optim.max_tokens_per_micro_batch=64"))
    assert [r["train/train_rollout_logprob_abs_diff_max"] for r in budget] == [0.0, 0.0]


def test_fast_kernels_show_a_mismatch(model_dir, tmp_path):
    """The inverse twin: the same job on plain torch kernels is not on-policy."""
    rows = training_rows(run(model_dir, tmp_path / "run", "max_steps=2", "model.kernels=fast"))
    assert any(r["train/train_rollout_logprob_abs_diff"] > 0 for r in rows)
    assert all(r["train/train_rollout_logprob_abs_diff_max"] >= r["train/train_rollout_logprob_abs_diff"] for r in rows)


def test_resumed_run_equals_uninterrupted_run(model_dir, tmp_path):
    full = run(model_dir, tmp_path / "full", "max_steps=4", "save_every=2")
    part = tmp_path / "part"
    run(model_dir, part, "max_steps=2", "save_every=2")
    resumed = run(model_dir, part, "max_steps=4", "save_every=2", "resume=true")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # one file: steps 3-4 appended
    same_metrics(full, resumed)


NOISY_TASK = """
import random
import numpy as np
from exactrl.envs import register_task
from exactrl.envs.arithmetic import ArithmeticTask


@register_task
class NoisyArithmetic(ArithmeticTask):
    name = "noisy_arithmetic_for_resume"

    def reward(self, problem, completion):  # a sampled judge: Python's and numpy's global random streams
        return super().reward(problem, completion) + random.random() + float(np.random.random())
"""


def test_resume_restores_pythons_and_numpys_random_streams_for_tasks_that_use_them(model_dir, tmp_path):
    task = tmp_path / "noisy_task.py"
    task.write_text(NOISY_TASK)
    args = (f"task.module={task}", "task.name=noisy_arithmetic_for_resume", "task.eval_size=0", "save_every=2")
    full = run(model_dir, tmp_path / "full", "max_steps=4", *args)
    run(model_dir, tmp_path / "part", "max_steps=2", *args)
    resumed = run(model_dir, tmp_path / "part", "max_steps=4", "resume=true", *args)
    same_metrics(full, resumed)
    again = run(model_dir, tmp_path / "again", "max_steps=2", *args)  # seeded: a fresh run repeats itself
    same_metrics(full[:2], again)


def test_evaluation_moves_none_of_the_training_streams(model_dir, tmp_path, capsys):
    """A reward that draws from the global streams (a sampled judge) scores the held-out problems from
    streams of their own: a run extended past its last (evaluated) step, or resumed with another
    eval_every, trains exactly as the uninterrupted run. And an edited task file is another task: refused."""
    task = tmp_path / "noisy_eval_task.py"  # a name of its own: another test registers NOISY_TASK's
    task.write_text(NOISY_TASK.replace("noisy_arithmetic_for_resume", "noisy_arithmetic_for_eval"))
    args = (f"task.module={task}", "task.name=noisy_arithmetic_for_eval", "save_every=2", "eval_every=4")
    full = training_rows(run(model_dir, tmp_path / "full", "max_steps=4", *args))
    run(model_dir, tmp_path / "part", "max_steps=2", *args)  # evaluates at its last step, 2
    resumed = training_rows(run(model_dir, tmp_path / "part", "max_steps=4", "resume=true", *args[:-1], "eval_every=1"))
    same_metrics(
        *([{k: v for k, v in r.items() if not k.startswith("eval/")} for r in rows] for rows in (full, resumed))
    )
    task.write_text(NOISY_TASK.replace("+ random.random()", "* 10.0 + random.random()"))
    args = ["train"] + [
        x
        for o in SMALL
        + [f"model.path={model_dir}", f"run_dir={tmp_path / 'part'}", "max_steps=6", "resume=true", *args]
        for x in ("--set", o)
    ]
    assert cli_main(args) == 2
    assert "task.module_sha256" in capsys.readouterr().err
    # a dotted module name whose package is gone: a named error, not find_spec's ModuleNotFoundError
    gone = [a if not a.startswith("task.module=") else "task.module=nosuchpkg.tasks" for a in args]
    assert cli_main(gone) == 2
    assert "nosuchpkg" in capsys.readouterr().err


def test_resume_refuses_to_overwrite_or_invent(model_dir, tmp_path, capsys):
    run(model_dir, tmp_path / "r", "max_steps=1")
    args = ["train"] + [
        x for o in SMALL + [f"model.path={model_dir}", f"run_dir={tmp_path / 'r'}", "max_steps=2"] for x in ("--set", o)
    ]
    assert cli_main(args) == 2
    assert "resume=true" in capsys.readouterr().err


def test_bypass_mode_runs_and_stays_exact(model_dir, tmp_path):
    rows = training_rows(run(model_dir, tmp_path / "run", "max_steps=2", "algorithm.bypass=true"))
    assert all(r["train/train_rollout_logprob_abs_diff"] == 0.0 for r in rows)


# ---------------------------------------------------------------- asynchronous loop


def test_async_staleness_zero_is_bitwise_the_synchronous_loop(model_dir, tmp_path):
    sync = run(model_dir, tmp_path / "sync", "max_steps=3")
    asyn = run(
        model_dir,
        tmp_path / "async",
        "max_steps=3",
        "async.enabled=true",
        "async.max_staleness=0",
        "async.recompute_behaviour=false",
    )
    same_metrics(sync, [{k: v for k, v in r.items() if not k.startswith("async/")} for r in asyn])
    assert all(r["async/staleness_max"] == 0 for r in training_rows(asyn))


def test_async_evaluation_fits_any_sequence_the_rollout_engine_takes(model_dir, tmp_path):
    """The evaluation engine of an asynchronous run keeps a quarter of the KV budget, but never less than
    its longest problem and answer: a budget that serves the rollouts serves the evaluation (96 // 4 tokens, one page of
    32, would not hold a prompt and its 32 answer tokens; 3 // 4 would be no budget at all)."""
    small = ("max_steps=1", "engine.kv_budget_tokens=96", "rollout.max_tokens=32")
    sync = run(model_dir, tmp_path / "sync", *small)
    asyn = run(model_dir, tmp_path / "async", *small, "async.enabled=true")
    assert asyn[-1]["eval/accuracy"] == sync[-1]["eval/accuracy"]


@pytest.mark.parametrize("kernels", ["exact", "fast"])
def test_async_run_is_stale_and_its_behaviour_policy_is_recomputed(model_dir, tmp_path, kernels):
    rows = training_rows(
        run(
            model_dir,
            tmp_path / "run",
            "max_steps=4",
            "async.enabled=true",
            "async.max_staleness=2",
            f"model.kernels={kernels}",
        )
    )
    assert max(r["async/staleness_max"] for r in rows) == 2
    assert all(r["async/staleness_max"] <= 2 and r["async/dropped_samples"] == 0 for r in rows)
    # stale data: the engine's μ is not the trainer's π_old, and the diagnostics say so
    assert rows[-1]["train/train_rollout_logprob_abs_diff"] > 0
    assert rows[-1]["mismatch/k3"] > 0
    recomputed = [r["async/behaviour_recompute_abs_diff_max"] for r in rows]
    if kernels == "exact":  # μ is exactly the policy of the version that sampled each token
        assert recomputed == [0.0] * len(rows)
    else:  # inverse twin: fast kernels cannot reproduce the engine's logprobs
        assert max(recomputed) > 0


def test_async_inflight_updates_keep_every_token_exact(model_dir, tmp_path):
    rows = training_rows(
        run(
            model_dir,
            tmp_path / "run",
            "max_steps=3",
            "async.enabled=true",
            "async.max_staleness=1",
            "async.inflight_updates=true",
        )
    )
    assert all(r["async/behaviour_recompute_abs_diff_max"] == 0.0 for r in rows)
    assert all(r["async/staleness_max"] <= 1 for r in rows)


NOISY_ROLLOUT_TASK = """
import random
import threading
import time
from exactrl.envs import register_task
from exactrl.envs.arithmetic import ArithmeticTask


@register_task
class NoisyRollouts(ArithmeticTask):
    name = "noisy_rollouts_for_async_resume"

    def reward(self, problem, completion):
        if threading.current_thread().name == "exactrl-rollout":  # a sampled judge for training rollouts
            return super().reward(problem, completion) + random.random()
        time.sleep(0.05)  # evaluation: slow, so the next batch is scored while this step is saved
        return super().reward(problem, completion)
"""


def test_async_resume_after_a_crash_is_bitwise_although_the_next_batch_drew_ahead(model_dir, tmp_path):
    """max_staleness 0: the rollout thread scores batch k+1 (drawing from the global random stream) while
    the trainer evaluates and saves step k. The checkpoint keeps the streams as they were after batch k."""
    import shutil

    task = tmp_path / "noisy_rollouts.py"
    task.write_text(NOISY_ROLLOUT_TASK)
    args = (
        f"task.module={task}",
        "task.name=noisy_rollouts_for_async_resume",
        "task.eval_size=16",
        "eval_every=2",
        "save_every=2",
        "async.enabled=true",
        "async.max_staleness=0",
        "async.recompute_behaviour=false",
    )
    full = run(model_dir, tmp_path / "full", "max_steps=4", *args)
    crashed = tmp_path / "crashed"  # killed after step 2's checkpoint
    shutil.copytree(tmp_path / "full", crashed)
    shutil.rmtree(crashed / "checkpoints" / "step_000004")
    (crashed / "checkpoints" / "latest").write_text("step_000002\n")
    same_metrics(full, run(model_dir, crashed, "max_steps=4", "resume=true", *args))


def test_async_resume_continues_from_the_trained_data_position(model_dir, tmp_path):
    d = tmp_path / "run"
    run(model_dir, d, "max_steps=2", "save_every=2", "async.enabled=true", "async.max_staleness=2")
    state = json.loads((d / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["prompts"]["index"] == 2 * 4  # two batches of 4 prompts, not what the rollout thread took
    rows = run(model_dir, d, "max_steps=3", "resume=true", "async.enabled=true", "async.max_staleness=2")
    assert [r["step"] for r in rows] == [1, 2, 3]


# ---------------------------------------------------------------- staleness filter (unit)


def _group(versions_per_sample: list[list[int]]) -> list[Rollout]:
    return [Rollout(None, [1], [2] * len(v), [0.0] * len(v), v, "stop", "", 0.0) for v in versions_per_sample]


def test_drop_stale_removes_whole_groups_and_counts_them():
    groups = [_group([[5, 5], [5]]), _group([[2, 3], [5]]), _group([[4], []])]
    kept, m = drop_stale(groups, version=5, max_staleness=1)
    assert kept == [groups[0], groups[2]]
    assert m["async/dropped_samples"] == 2.0
    assert m["async/staleness_max"] == 1.0
    assert m["async/staleness_mean"] == pytest.approx(1 / 4)  # ages 0, 0, 0, 1


def test_drop_stale_refuses_a_batch_with_nothing_fresh():
    with pytest.raises(ValueError, match="weight_sync"):
        drop_stale([_group([[0]])], version=3, max_staleness=1)


def test_async_config_key_and_errors():
    cfg = load_config(None, ["async.enabled=true", "async.max_staleness=3"])
    assert cfg.async_.enabled and cfg.async_.max_staleness == 3
    with pytest.raises(ValueError, match="async.max_staleness"):
        load_config(None, ["async.max_staleness=-1"])
    with pytest.raises(ValueError, match="unknown config key 'async.staleness'"):
        load_config(None, ["async.staleness=1"])


def test_kl_in_the_reward_shapes_the_advantages(model_dir, tmp_path):
    """`kl.where: reward`: step 1 samples from π_ref itself (KL exactly 0); later steps pay β·Σ KL in the reward."""
    plain = run(model_dir, tmp_path / "plain", "max_steps=3")
    kl = run(
        model_dir,
        tmp_path / "kl",
        "max_steps=3",
        "algorithm.kl.coef=0.5",
        "algorithm.kl.where=reward",
        "algorithm.kl.kind=k1",
    )
    assert kl[0]["rollout/kl_ref_per_seq"] == 0.0 and kl[0]["rollout/kl_penalty_mean"] == 0.0
    assert kl[0]["train/grad_norm"] == plain[0]["train/grad_norm"]  # no penalty yet: the same step
    assert kl[2]["rollout/kl_ref_per_seq"] != 0.0
    assert kl[2]["rollout/kl_penalty_mean"] == pytest.approx(0.5 * kl[2]["rollout/kl_ref_per_seq"])
    assert kl[2]["train/grad_norm"] != plain[2]["train/grad_norm"]  # the penalty moved the advantages
    assert "train/kl_ref" not in kl[2]  # not in the loss as well


def test_kl_in_the_reward_with_truncated_sampling_is_finite(model_dir, tmp_path):
    """top-k sampling: π_ref is scored untruncated (algo/kl.py), so a token outside its own top-k costs a
    finite penalty (not +inf, on which the run would stop with a non-finite reward)."""
    kl = run(
        model_dir,
        tmp_path / "kl",
        "max_steps=3",
        "algorithm.kl.coef=0.5",
        "algorithm.kl.where=reward",
        "rollout.top_k=2",
    )
    assert all(math.isfinite(r["rollout/kl_ref_per_seq"]) for r in kl)
    assert kl[0]["rollout/kl_ref_per_seq"] > 0  # π_θ truncated against π_ref whole: not 0 even at step 1


def test_resume_after_a_crash_between_checkpoints_has_no_duplicate_rows(model_dir, tmp_path):
    """A crash after step 3's row but before its checkpoint: resuming from step 2 redoes step 3, once."""
    import shutil

    full = run(model_dir, tmp_path / "full", "max_steps=4", "save_every=2")
    part = tmp_path / "part"
    run(model_dir, part, "max_steps=3", "save_every=2")
    ckpts = part / "checkpoints"
    shutil.rmtree(ckpts / "step_000003")  # as if killed between logging step 3 and saving it
    (ckpts / "latest").write_text("step_000002\n")
    with open(part / "metrics.jsonl", "a") as f:  # and killed while writing step 4's row
        f.write('{"step": 4, "train/lo')
    resumed = run(model_dir, part, "max_steps=4", "save_every=2", "resume=true")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    same_metrics(full, resumed)


def test_a_run_dir_in_use_by_another_run_is_refused(model_dir, tmp_path, capsys):
    """Another run holds the dir (its lock): a second start on it fails before writing anything."""
    from exactrl.train.run_dir import lock_run_dir as _lock_run_dir

    d = tmp_path / "busy"
    run(model_dir, d, "max_steps=1")
    before = (d / "metrics.jsonl").read_text()
    held = _lock_run_dir(d)
    try:
        args = ["train"] + [
            x
            for o in SMALL + [f"model.path={model_dir}", f"run_dir={d}", "max_steps=2", "resume=true"]
            for x in ("--set", o)
        ]
        assert cli_main(args) == 2
        err = capsys.readouterr().err
        assert f"run_dir {d} is in use by another run" in err and "resuming" not in err
        assert cli_main(args[:-2]) == 2  # without resume=true: not the advice to pass it, which would fail
        err = capsys.readouterr().err
        assert f"run_dir {d} is in use by another run" in err and "resume=true" not in err
    finally:
        held.close()
    assert (d / "metrics.jsonl").read_text() == before
    assert [r["step"] for r in run(model_dir, d, "max_steps=2", "resume=true")] == [1, 2]  # free again


def test_the_ranks_of_one_run_may_probe_its_lock_at_once_and_a_held_lock_still_refuses(tmp_path):
    """Every rank of a data-parallel resume asks whether a run holds the dir's lock, at the same moment: two
    exclusive probes refused one rank as "in use by another run" (seen in CI). Probes share the lock; a run
    holding it still refuses them, and holds it against the next run."""
    from exactrl.train.run_dir import lock_run_dir as _lock_run_dir

    d = tmp_path / "run"
    d.mkdir()
    one = _lock_run_dir(d, probe=True)
    _lock_run_dir(d, probe=True).close()  # the other rank's probe, while the first is open
    one.close()
    held = _lock_run_dir(d)
    try:
        for probe in (True, False):
            with pytest.raises(ValueError, match="is in use by another run"):
                _lock_run_dir(d, probe=probe)
    finally:
        held.close()


def test_resume_before_the_first_checkpoint_starts_again(model_dir, tmp_path, capsys):
    import shutil

    d = tmp_path / "r"
    first = run(model_dir, d, "max_steps=1")
    shutil.rmtree(d / "checkpoints")  # killed before its first checkpoint
    args = ["train"] + [
        x for o in SMALL + [f"model.path={model_dir}", f"run_dir={d}", "max_steps=1"] for x in ("--set", o)
    ]
    assert cli_main(args) == 2 and "start it again from step 0" in capsys.readouterr().err
    again = run(model_dir, d, "max_steps=1", "resume=true")
    same_metrics(first, again)


def test_resume_refuses_changed_settings_and_names_them(model_dir, tmp_path, capsys):
    d = tmp_path / "r"
    run(model_dir, d, "max_steps=2", "save_every=2")
    args = ["train"] + [
        x
        for o in SMALL
        + [
            f"model.path={model_dir}",
            f"run_dir={d}",
            "max_steps=3",
            "resume=true",
            "model.kernels=fast",
            "optim.lr=0.5",
        ]
        for x in ("--set", o)
    ]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert "model.kernels: 'exact' -> 'fast'" in err and "optim.lr: 0.001 -> 0.5" in err
    import exactrl.train.setup as setup_mod  # refused before any model is loaded (or warm-started)

    real = setup_mod._model_dir
    setup_mod._model_dir = lambda *a: (_ for _ in ()).throw(AssertionError("the model was loaded"))
    try:
        assert cli_main(args) == 2 and "optim.lr: 0.001 -> 0.5" in capsys.readouterr().err
    finally:
        setup_mod._model_dir = real
    rows = run(model_dir, d, "max_steps=3", "resume=true", "eval_every=3", "engine.kv_budget_tokens=8192")
    assert [r["step"] for r in rows] == [1, 2, 3]  # where, how long and how fast may change


def test_with_kl_on_resume_refuses_another_model_path(model_dir, tmp_path, capsys):
    """The KL reference is read from model.path: with KL on, a resumed run may not point it elsewhere."""
    import shutil

    d, moved = tmp_path / "r", tmp_path / "moved"
    shutil.copytree(model_dir, moved)
    run(model_dir, d, "max_steps=1", "algorithm.kl.coef=0.01")
    args = ["train"] + [
        x
        for o in SMALL + [f"model.path={moved}", f"run_dir={d}", "max_steps=2", "resume=true", "algorithm.kl.coef=0.01"]
        for x in ("--set", o)
    ]
    assert cli_main(args) == 2 and "model.path: " in capsys.readouterr().err
    e = tmp_path / "e"  # without KL the weights come from the checkpoint alone: the path may move
    run(model_dir, e, "max_steps=1")
    assert [r["step"] for r in training_rows(run(moved, e, "max_steps=2", "resume=true"))] == [1, 2]


def test_resume_refuses_another_tokenizer(model_dir, tmp_path, capsys):
    """A moved copy of the tokenizer is the same one (above); one whose chat template differs is not."""
    import shutil

    d, other = tmp_path / "r", tmp_path / "other"
    shutil.copytree(model_dir, other)
    cfg_path = other / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = cfg["chat_template"] + " "
    cfg_path.write_text(json.dumps(cfg))
    run(model_dir, d, "max_steps=1")
    args = ["train"] + [
        x
        for o in SMALL
        + [f"model.path={model_dir}", f"model.tokenizer={other}", f"run_dir={d}", "max_steps=2", "resume=true"]
        for x in ("--set", o)
    ]
    assert cli_main(args) == 2 and "with another tokenizer" in capsys.readouterr().err


def test_ctrl_c_keeps_the_run_and_says_how_to_resume(model_dir, tmp_path, capsys, monkeypatch):
    import exactrl.train.loop as loop_mod

    real = loop_mod.train_on

    def interrupted_at_step_2(c, step, groups):
        if step == 2:
            raise KeyboardInterrupt
        return real(c, step, groups)

    monkeypatch.setattr(loop_mod, "train_on", interrupted_at_step_2)
    d = tmp_path / "r"
    args = ["train"] + [
        x
        for o in SMALL + [f"model.path={model_dir}", f"run_dir={d}", "max_steps=3", "save_every=1"]
        for x in ("--set", o)
    ]
    assert cli_main(args) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "step_000001" in err and "resume=true" in err
    monkeypatch.setattr(loop_mod, "train_on", real)
    rows = run(model_dir, d, "max_steps=3", "save_every=1", "resume=true")
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_async_ctrl_c_drops_the_batch_in_flight(model_dir, tmp_path, capsys, monkeypatch):
    """A Ctrl-C while the rollout thread samples the next batch: the run stops at the engine's next step
    instead of finishing the batch first, and says how to resume."""
    import threading
    import time

    import exactrl.train.async_loop as async_mod

    started, outcome = threading.Event(), {}
    real_generate = async_mod.generate_groups

    def generate(engine, *args, on_step=None, **kw):
        step = args[5]
        if step == 2:  # sample step 2 in the background, one engine step after another

            def hook():
                started.set()
                if on_step is not None:
                    # the batch is held here until the Ctrl-C has reached the worker: else, on a busy machine,
                    # the thread may finish the batch before the main thread gets to stop it
                    worker, t0 = on_step.__self__, time.monotonic()
                    while not worker._stopping and time.monotonic() - t0 < 60:
                        time.sleep(0.01)
                    on_step()

            try:
                out = real_generate(engine, *args, on_step=hook, **kw)
                outcome[step] = "finished"
                return out
            except BaseException as e:
                outcome[step] = type(e).__name__
                raise
        return real_generate(engine, *args, on_step=on_step, **kw)

    def interrupted(c, step, groups):
        assert started.wait(60)  # the rollout thread is in the middle of step 2's batch
        raise KeyboardInterrupt

    monkeypatch.setattr(async_mod, "generate_groups", generate)
    monkeypatch.setattr(async_mod, "train_on", interrupted)
    args = ["train"] + [
        x
        for o in SMALL
        + [
            f"model.path={model_dir}",
            f"run_dir={tmp_path / 'r'}",
            "max_steps=3",
            "async.enabled=true",
            "rollout.max_tokens=64",
            "rollout.prompts_per_step=8",
        ]
        for x in ("--set", o)
    ]
    assert cli_main(args) == 130
    assert outcome == {2: "_Stopped"}
    assert "interrupted" in capsys.readouterr().err


@pytest.mark.parametrize("interrupt", [False, True])
def test_failure_before_the_first_step_leaves_no_run_dir(model_dir, tmp_path, capsys, monkeypatch, interrupt):
    import contextlib

    import exactrl.train.loop as loop_mod

    def fails(c, step, groups):
        raise KeyboardInterrupt if interrupt else RuntimeError("rollout server died")

    monkeypatch.setattr(loop_mod, "train_on", fails)

    def train_in(d):
        args = ["train"] + [
            x for o in SMALL + [f"model.path={model_dir}", f"run_dir={d}", "max_steps=2"] for x in ("--set", o)
        ]
        with contextlib.nullcontext() if interrupt else pytest.raises(RuntimeError, match="rollout server died"):
            assert cli_main(args) == 130

    train_in(tmp_path / "new")
    assert not (tmp_path / "new").exists()
    assert ("held nothing and was removed" in capsys.readouterr().err) == interrupt
    # a directory that existed before the run is the user's: it stays, with what was in it
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    train_in(mine)
    assert (mine / "notes.txt").read_text() == "keep" and (mine / "config.json").exists()


def test_runs_started_in_the_same_second_get_their_own_default_dirs(tmp_path, monkeypatch):
    from pathlib import Path

    from exactrl.train import run_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(run_dir.time, "strftime", lambda fmt: "20260101-000000")
    first = run_dir.default_run_dir()
    assert first == str(Path("runs") / "20260101-000000") and run_dir.make_dir(Path(first))
    second = run_dir.default_run_dir()  # the first exists now
    assert second == str(Path("runs") / "20260101-000000_2") and run_dir.make_dir(Path(second))
    assert not run_dir.make_dir(Path(first))  # creating is atomic: only its creator may remove it


def test_overlong_settings_reach_the_step(model_dir, tmp_path):
    """Completions limited to 4 tokens, a penalty over the last 2: the penalty shows in the metrics and,
    masking the cut completions out of the loss changes it again; task reward and exactness do not move."""
    short = ["max_steps=1", "rollout.max_tokens=4"]
    plain = run(model_dir, tmp_path / "plain", *short)[0]
    pen = run(model_dir, tmp_path / "pen", *short, "algorithm.overlong.buffer_len=2")[0]
    masked = run(
        model_dir,
        tmp_path / "mask",
        *short,
        "algorithm.overlong.buffer_len=2",
        "algorithm.overlong.mask_truncated=true",
    )[0]
    assert 0 < plain["rollout/truncated_frac"] < 1
    # every cut completion is 4 tokens long and pays the whole penalty; some shorter ones pay half
    assert pen["rollout/overlong_penalised_frac"] >= plain["rollout/truncated_frac"]
    assert pen["rollout/overlong_penalty_mean"] <= -plain["rollout/truncated_frac"]
    assert pen["rollout/reward_mean"] == plain["rollout/reward_mean"] == masked["rollout/reward_mean"]
    assert pen["train/grad_norm"] != plain["train/grad_norm"]
    assert masked["train/grad_norm"] not in (0.0, pen["train/grad_norm"])  # the shorter penalised ones remain
    assert masked["train/train_rollout_logprob_abs_diff"] == pen["train/train_rollout_logprob_abs_diff"] == 0.0


def test_a_warm_start_leaves_the_runs_random_streams_as_they_were(model_dir, monkeypatch):
    """The default model is built (drawing from the global streams) only when it is not cached: a run's
    streams after setup must not depend on whether it was."""
    import random

    import numpy as np
    import torch

    import exactrl.train.warmstart as warmstart
    from exactrl.distributed import Ranks
    from exactrl.train.setup import _model_dir

    def building(cfg, log):  # an uncached warm start: initialisation and SFT batches draw
        random.random(), np.random.rand(3), torch.rand(100)
        return model_dir

    monkeypatch.setattr(warmstart, "default_model_dir", building)
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    assert _model_dir(load_config(), print, Ranks()) == model_dir
    after = random.random(), np.random.rand(), torch.rand(1).item()
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    assert after == (random.random(), np.random.rand(), torch.rand(1).item())


FAILING_TASK = """
from exactrl.envs import register_task
from exactrl.envs.arithmetic import ArithmeticTask

calls = [0]


@register_task
class FailingJudge(ArithmeticTask):
    name = "failing_judge_for_async"

    def reward(self, problem, completion):
        calls[0] += 1
        if calls[0] > 20:  # within the second step's rollouts (16 a step)
            raise ValueError("the judge says: malformed problem")
        return super().reward(problem, completion)
"""


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_tasks_error_on_the_rollout_thread_is_named_in_one_line_as_in_the_sync_loop(
    model_dir, tmp_path, capsys, asynchronous
):
    task = tmp_path / f"failing_task_{asynchronous}.py"
    task.write_text(FAILING_TASK.replace("failing_judge_for_async", f"failing_judge_{asynchronous}"))
    args = ["train"] + [
        x
        for o in SMALL
        + [
            f"model.path={model_dir}",
            f"run_dir={tmp_path / 'run'}",
            "max_steps=3",
            f"task.module={task}",
            f"task.name=failing_judge_{asynchronous}",
            "task.eval_size=0",
            "save_every=1",
            f"async.enabled={asynchronous}",
        ]
        for x in ("--set", o)
    ]
    assert cli_main(args) == 2
    assert "exactrl train: error: the judge says: malformed problem" in capsys.readouterr().err
    assert (tmp_path / "run" / "checkpoints" / "step_000001").is_dir()  # what was done is kept
