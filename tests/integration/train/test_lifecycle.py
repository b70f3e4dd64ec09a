"""A run's lifecycle: errors on the rollout thread, SIGTERM and Ctrl-C at chosen moments, resume after them.

Signals are real: the run installs its SIGTERM handler (train/run.py) and the tests send SIGTERM to this
process from inside the run at a chosen point (a reward, a training step, a checkpoint save), so where it
lands is known; one test sends it from outside, to a child process, at whatever moment it is in.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import default_job_model, train_args

from exactrl.cli import main as cli_main
from exactrl.train.checkpoint import latest_checkpoint, load_checkpoint

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


def args_of(model_dir, run_dir, *overrides) -> list[str]:
    return train_args(SMALL, model_dir, run_dir, *overrides)


def rows_of(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run(model_dir, run_dir, *overrides) -> list[dict]:
    assert cli_main(args_of(model_dir, run_dir, *overrides)) == 0
    return rows_of(run_dir)


def same_metrics(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        keys = {k for k in x if not k.startswith(TIMING)}
        assert keys == {k for k in y if not k.startswith(TIMING)}, (x["step"], keys ^ {k for k in y})
        diff = {k: (x[k], y[k]) for k in keys if x[k] != y[k]}
        assert not diff, (x["step"], diff)


def no_rollout_thread_left() -> bool:
    """The asynchronous loop's thread has ended (it is a daemon: a leak would outlive the run silently)."""
    return not any(t.name == "exactrl-rollout" and t.is_alive() for t in threading.enumerate())


def intact(run_dir) -> str:
    """The name of the checkpoint `latest` resolves to, after loading it whole; no half-written directory
    is left beside the complete ones."""
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None
    load_checkpoint(ckpt, "float32", "exact")
    left = [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith((".tmp_", ".old_"))]
    assert not left, left
    return ckpt.name


def sigterm_self() -> None:
    """SIGTERM to this process, as a job manager sends it; the run's handler raises in the main thread."""
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None), "no handler: this would kill pytest"
    os.kill(os.getpid(), signal.SIGTERM)


TASK = """
import os
import signal
import time
from exactrl.envs import register_task
from exactrl.envs.arithmetic import ArithmeticTask

calls = [0]


@register_task
class Judge(ArithmeticTask):
    name = "NAME"

    def reward(self, problem, completion):
        # EXACTRL_TEST_STOP=N:what: the N-th call of this run stops it; unset: the arithmetic task as it is
        at, _, what = os.environ.get("EXACTRL_TEST_STOP", "0:").partition(":")
        calls[0] += 1
        if calls[0] == int(at):
            if what == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)  # the run's handler raises in the main thread
            elif what.startswith("hang "):  # SIGTERM, then a reward that returns only once the file is gone
                os.kill(os.getpid(), signal.SIGTERM)
                while os.path.exists(what[5:]):
                    time.sleep(0.02)
            else:
                raise eval(what)
        return super().reward(problem, completion)
"""


@pytest.fixture(scope="module")
def judge(tmp_path_factory) -> list[str]:
    """Settings for the arithmetic task behind a judge that stops the run at a reward call chosen by
    EXACTRL_TEST_STOP (16 calls a step here, 8 an evaluation); one file, so a resumed run imports the same
    task source."""
    path = tmp_path_factory.mktemp("task") / "lifecycle_judge.py"
    path.write_text(TASK.replace("NAME", "lifecycle_judge"))
    return [f"task.module={path}", "task.name=lifecycle_judge"]


# ---------------------------------------------------------------- an error on the rollout thread


@pytest.mark.parametrize(
    "error", ["KeyError('no answer key for problem 7')", "ZeroDivisionError('judge divided by zero')"]
)
def test_an_unexpected_error_on_the_rollout_thread_is_raised_with_its_own_message(
    model_dir, tmp_path, judge, monkeypatch, error
):
    """Not a ValueError (which the CLI prints in one line): the traceback's last line must still say what
    went wrong, not only that the rollout thread failed; the thread is gone and step 1's checkpoint stays."""
    monkeypatch.setenv("EXACTRL_TEST_STOP", f"20:{error}")  # within step 2's rollouts
    d = tmp_path / "run"
    with pytest.raises(RuntimeError) as info:  # a hang: pytest-timeout fails it
        cli_main(args_of(model_dir, d, "max_steps=4", "save_every=1", "task.eval_size=0", "async.enabled=true", *judge))
    assert error.split("'")[1] in str(info.value), str(info.value)
    assert type(info.value.__cause__).__name__ == error.split("(")[0]
    assert no_rollout_thread_left()
    assert intact(d) == "step_000001"


# ---------------------------------------------------------------- stopped at a chosen moment, then resumed

FULL = ["max_steps=4", "save_every=1"]


@pytest.fixture(scope="module")
def full_run(model_dir, judge, tmp_path_factory):
    """The uninterrupted sync run every stopped-and-resumed one must reproduce, bit for bit."""
    return run(model_dir, tmp_path_factory.mktemp("full") / "run", *FULL, *judge)


def stopped_then_resumed(model_dir, d, monkeypatch, code: int, *overrides) -> tuple[str, list[dict]]:
    """(the checkpoint the stopped run left, the rows after resuming it with nothing in its way)."""
    assert cli_main(args_of(model_dir, d, *FULL, *overrides)) == code
    assert no_rollout_thread_left()
    kept = intact(d)
    assert [r["step"] for r in rows_of(d)] >= list(range(1, int(kept[5:]) + 1))
    monkeypatch.undo()
    return kept, run(model_dir, d, *FULL, *overrides, "resume=true")


def test_sigterm_while_a_checkpoint_is_written_keeps_the_previous_one(
    model_dir, tmp_path, judge, full_run, monkeypatch
):
    import exactrl.train.checkpoint as ckpt_mod

    real = ckpt_mod.save_model

    def save_model(model, path, *rest):
        real(model, path, *rest)  # step 3's weights are in its temporary directory, its optimizer state not yet
        if path.name == ".tmp_step_000003":
            sigterm_self()

    monkeypatch.setattr(ckpt_mod, "save_model", save_model)
    d = tmp_path / "run"
    kept, rows = stopped_then_resumed(model_dir, d, monkeypatch, 143, *judge)
    assert kept == "step_000002"
    same_metrics(full_run, rows)


def test_sigterm_between_a_checkpoints_rename_and_its_pointer(model_dir, tmp_path, judge, full_run, monkeypatch):
    """step_000003 is complete but `latest` still names step_000002: the run goes on from what the pointer
    names, and its redone step 3 replaces the directory."""
    import exactrl.train.checkpoint as ckpt_mod

    real = ckpt_mod.replace_durably

    def replace_durably(path, text):
        if path.name == "latest" and text.startswith("step_000003"):
            assert (path.parent / "step_000003" / "state.json").is_file()
            sigterm_self()
        real(path, text)

    monkeypatch.setattr(ckpt_mod, "replace_durably", replace_durably)
    d = tmp_path / "run"
    kept, rows = stopped_then_resumed(model_dir, d, monkeypatch, 143, *judge)
    assert kept == "step_000002"
    same_metrics(full_run, rows)
    assert intact(d) == "step_000004"


def test_sigterm_in_the_middle_of_a_training_step(model_dir, tmp_path, judge, full_run, monkeypatch):
    import exactrl.train.loop as loop_mod

    real, calls = loop_mod.train_step, []

    def train_step(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            sigterm_self()
        return real(*args, **kw)

    monkeypatch.setattr(loop_mod, "train_step", train_step)
    kept, rows = stopped_then_resumed(model_dir, tmp_path / "run", monkeypatch, 143, *judge)
    assert kept == "step_000002"
    same_metrics(full_run, rows)


# reward calls: 1-8 the evaluation before training, 9-24 step 1, 25-40 step 2, 41-48 its evaluation,
# 49-64 step 3, 65-80 step 4: the first of step 2, in step 2's evaluation, in step 3, the last of step 4
@pytest.mark.parametrize("at, kept", [(25, 1), (44, 1), (60, 2), (80, 3)])
@pytest.mark.parametrize("how", ["ValueError('judge crashed')", "sigterm"])
def test_stopped_in_the_step_after_a_checkpoint_the_resumed_run_is_the_uninterrupted_one(
    model_dir, tmp_path, judge, full_run, monkeypatch, at, kept, how
):
    """The step's prompts were taken and its samples drawn before it stopped: the checkpoint's data
    position and random streams, not the ones at the stop, are where the resumed run goes on."""
    monkeypatch.setenv("EXACTRL_TEST_STOP", f"{at}:{how}")
    left, rows = stopped_then_resumed(model_dir, tmp_path / "run", monkeypatch, 143 if how == "sigterm" else 2, *judge)
    assert left == f"step_{kept:06d}"
    same_metrics(full_run, rows)


# ---------------------------------------------------------------- the asynchronous loop stopped

ASYNC = ["async.enabled=true", "async.max_staleness=0", "task.eval_size=0"]  # evaluation would call the judge
# from the trainer thread meanwhile: its count would depend on timing


@pytest.fixture(scope="module")
def full_async_run(model_dir, judge, tmp_path_factory):
    return run(model_dir, tmp_path_factory.mktemp("full_async") / "run", *FULL, *ASYNC, *judge)


@pytest.mark.parametrize("where", ["reward", "engine step"])
def test_sigterm_while_the_rollout_thread_samples(model_dir, tmp_path, judge, full_async_run, monkeypatch, where):
    """SIGTERM sent while the rollout thread scores or samples step 3's batch: the trainer thread may be
    saving step 2 or waiting for the batch; either way the run stops, its thread ends, what it saved is
    whole, and at max_staleness 0 the resumed run is the uninterrupted one bit for bit."""
    import exactrl.train.async_loop as async_mod

    if where == "reward":
        monkeypatch.setenv("EXACTRL_TEST_STOP", "40:sigterm")  # step 3's batch (16 rewards a step)
    else:
        real, steps = async_mod.generate_groups, []

        def generate_groups(*args, on_step=None, **kw):
            def hook():
                steps.append(1)
                if args[6] == 3 and len(steps) == 2:
                    sigterm_self()
                on_step()

            if args[6] == 3:
                steps.clear()
            return real(*args, on_step=hook, **kw)

        monkeypatch.setattr(async_mod, "generate_groups", generate_groups)
    kept, rows = stopped_then_resumed(model_dir, tmp_path / "run", monkeypatch, 143, *ASYNC, *judge)
    assert kept in ("step_000001", "step_000002")
    same_metrics(full_async_run, rows)


def test_a_reward_that_does_not_return_does_not_keep_a_stopped_run_waiting(
    model_dir, tmp_path, judge, monkeypatch, capsys
):
    """SIGTERM while the rollout thread is stuck in the task's reward: the run waits STOP_WAIT_S for the
    thread, says it goes on without it, and stops keeping what it saved; the thread ends once the reward
    returns, handing the trainer nothing more."""
    import exactrl.train.async_loop as async_mod

    hold = tmp_path / "hold"
    hold.touch()
    monkeypatch.setattr(async_mod, "STOP_WAIT_S", 0.5)
    monkeypatch.setenv("EXACTRL_TEST_STOP", f"40:hang {hold}")  # step 3's batch (16 rewards a step)
    d = tmp_path / "run"
    try:
        assert cli_main(args_of(model_dir, d, *FULL, *ASYNC, *judge)) == 143
        err = capsys.readouterr().err
        assert "the rollout thread did not stop within 0.5 s (a task's reward that does not return?)" in err, err
        assert "terminated (SIGTERM)" in err
        assert not no_rollout_thread_left()  # still in the reward
    finally:
        hold.unlink()
    for t in threading.enumerate():
        if t.name == "exactrl-rollout":
            t.join(30)
    assert no_rollout_thread_left()
    assert intact(d) in ("step_000001", "step_000002")


def test_a_non_finite_engine_on_the_rollout_thread_is_named_as_divergence(model_dir, tmp_path, capsys, monkeypatch):
    import exactrl.train.async_loop as async_mod
    from exactrl.engine.engine import NonFiniteLogitsError

    real = async_mod.generate_groups

    def generate_groups(*args, **kw):
        if args[6] == 2:
            raise NonFiniteLogitsError(["req-7"])
        return real(*args, **kw)

    monkeypatch.setattr(async_mod, "generate_groups", generate_groups)
    d = tmp_path / "run"
    assert cli_main(args_of(model_dir, d, *FULL, *ASYNC)) == 2
    err = capsys.readouterr().err
    assert "error: non-finite logits (NaN or inf) for request(s) ['req-7']" in err
    assert "The training diverged; its checkpoints are kept" in err
    assert no_rollout_thread_left() and intact(d) == "step_000001"


def test_sigterm_from_outside_stops_an_asynchronous_run_which_then_resumes(model_dir, tmp_path):
    """A child process, stopped at whatever moment it is in once a checkpoint exists (the rollout thread a
    step ahead): exit 143 without hanging, a whole checkpoint, and a resume that goes on from it."""
    d = tmp_path / "run"
    sets = [
        *SMALL,
        f"model.path={model_dir}",
        f"run_dir={d}",
        "max_steps=1000",
        "save_every=1",
        "async.enabled=true",
        "async.max_staleness=1",
        "task.eval_size=0",
    ]
    code = "import sys; from exactrl.cli import main; sys.exit(main(sys.argv[1:]))"
    p = subprocess.Popen(
        [sys.executable, "-c", code, "train", *[x for o in sets for x in ("--set", o)]],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        t0 = time.monotonic()
        while not (d / "checkpoints" / "latest").is_file():
            assert p.poll() is None and time.monotonic() - t0 < 120, p.communicate()
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)  # it did not hang
    finally:
        p.kill()
    assert p.returncode == 143, err
    assert "terminated (SIGTERM)" in err and "Traceback" not in err, err
    kept = int(intact(d)[5:])
    rows = run(
        model_dir,
        d,
        f"max_steps={kept + 1}",
        "save_every=1",
        "async.enabled=true",
        "async.max_staleness=1",
        "task.eval_size=0",
        "resume=true",
    )
    assert [r["step"] for r in rows] == list(range(1, kept + 2))
    assert intact(d) == f"step_{kept + 1:06d}"


# ---------------------------------------------------------------- async settings that cannot do what they say


def test_inflight_updates_at_max_staleness_zero_are_named_as_having_no_effect(model_dir, tmp_path, capsys):
    """Batch k starts only once version k − 1 is out and version k needs batch k: no weights ever arrive
    in the middle of a batch, which the run says instead of leaving the user to think they did."""
    from exactrl.train.config import ignored_settings, load_config

    cfg = load_config(None, ["async.enabled=true", "async.max_staleness=0", "async.inflight_updates=true"])
    assert ignored_settings(cfg) == [
        "async.inflight_updates has no effect: async.max_staleness is 0, so no new "
        "weights come out while a batch is sampled"
    ]
    assert (
        ignored_settings(
            load_config(None, ["async.enabled=true", "async.max_staleness=1", "async.inflight_updates=true"])
        )
        == []
    )
    run(
        model_dir,
        tmp_path / "run",
        "max_steps=1",
        "async.enabled=true",
        "async.max_staleness=0",
        "async.inflight_updates=true",
        "task.eval_size=0",
    )
    assert "note: async.inflight_updates has no effect" in capsys.readouterr().out


def test_async_without_weight_sync_is_refused_when_it_would_stop_half_way():
    """An external server with weight_sync none samples every token as version 0: the asynchronous loop
    drops it all from step max_staleness + 2 on, so a longer run is refused before it starts."""
    from exactrl.train.config import load_config

    server = [
        "rollout_backend.kind=openai",
        "rollout_backend.base_url=http://h:1",
        "rollout_backend.model=m",
        "async.enabled=true",
        "async.max_staleness=2",
    ]
    with pytest.raises(
        ValueError,
        match=r"async.enabled with rollout_backend.weight_sync=none: .* from step 4 every "
        r"sample is staler than async.max_staleness=2 .* max_steps=4; use "
        r"rollout_backend.weight_sync=disk",
    ):
        load_config(None, [*server, "max_steps=4"])
    assert load_config(None, [*server, "max_steps=3"]).max_steps == 3  # it ends before then
    assert (
        load_config(
            None, [*server, "max_steps=40", "rollout_backend.weight_sync=disk", "rollout_backend.sync_dir=/tmp"]
        ).max_steps
        == 40
    )
    assert load_config(None, [*server, "max_steps=40", "async.enabled=false"]).max_steps == 40
