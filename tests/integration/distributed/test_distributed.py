"""Data-parallel training (exactrl/distributed): `exactrl train --nproc 2` as real processes over gloo.

A two-rank run samples exactly the one-process run's first batch (seeds follow the prompt's place in the
batch, not the rank), trains with the whole batch's gradient (equal to one process's up to the order of
the sum), keeps train/rollout logprobs bitwise equal on every rank, and resumes like an uninterrupted run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from conftest import default_job_model

import exactrl
from exactrl.cli import main as cli_main
from exactrl.distributed import Ranks

SMALL = [
    "progress=false",
    "tensorboard=false",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "task.eval_size=6",
    "eval_every=2",
    "optim.lr=1e-3",
    "engine.kv_budget_tokens=4096",
    "algorithm.entropy_coef=0.01",
    "optim.warmup_steps=2",
]  # a changing lr: it must reach every shard


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
    """A row without its timings and rank 0's own engine scheduling count (its share of the batch differs)."""
    return {k: v for k, v in r.items() if not k.startswith(("time/", "perf/tokens_per_s", "rollout/preemptions"))}


def test_sharding_covers_the_batch_once_in_order():
    for world in (1, 2, 3):
        shards = [Ranks(r, world).shard(10) for r in range(world)]
        assert sorted(k for s in shards for k in s) == list(range(10))
        assert all(s == sorted(s) for s in shards)


def _collectives(rank: int, port: int, out) -> None:
    """Rank `rank` of 2 (torch.multiprocessing): gradient sums and the weight check."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    ranks = Ranks(rank, 2)
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    c, d = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    a.grad = torch.full((3,), float(rank + 1)) if rank == 0 else None  # only rank 0 has one for a; none for b
    c.grad = torch.full((2,), float(rank + 1))  # both ranks: 1 + 2
    d.grad = torch.full((2,), 5.0) if rank == 1 else None  # only rank 1
    ranks.sum_grads([a, b, c, d])
    got = {"a": a.grad.tolist(), "b": b.grad, "c": c.grad.tolist(), "d": d.grad.tolist()}
    try:
        ranks.check_same("test weights", [torch.tensor([1.0, float(rank)])], "the reason")
        got["check"] = "passed"
    except RuntimeError as e:
        got["check"] = str(e)
    ranks.check_same("same weights", [torch.ones(4)], "never")  # equal: no error
    out.put((rank, got))
    dist.destroy_process_group()


def test_gradients_sum_over_ranks_and_a_parameter_without_any_keeps_none():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_collectives, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    for r in (0, 1):
        assert got[r]["a"] == [1.0, 1.0, 1.0]  # rank 0's gradient plus rank 1's (none: zeros)
        assert got[r]["c"] == [3.0, 3.0]  # a sum, not either rank's own
        assert got[r]["d"] == [5.0, 5.0]  # rank 1's reaches rank 0 too
        assert got[r]["b"] is None  # no rank had one: the optimizer leaves b alone, as one process would
        assert "ranks hold different test weights (tensor 0 differs): the reason" in got[r]["check"]


def test_nproc_under_torchrun_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli_main(["train", "--nproc", "2"]) == 2
    assert "leave out --nproc under torchrun" in capsys.readouterr().err


def test_two_ranks_train_on_policy_and_sample_the_one_process_batch(model_dir, tmp_path):
    one_dir, two_dir = tmp_path / "one", tmp_path / "two"
    # micro-batches of 3: each rank's 8 sequences run as 3 + 3 + 2; the KL reward's reference forward is
    # shared out over the ranks too
    same = ("max_steps=3", "optim.micro_batch_size=3", "algorithm.kl.coef=0.05", "algorithm.kl.where=reward")
    assert cli_main(["train", *sets(model_dir, one_dir, *same)]) == 0
    done = ranks_run(model_dir, two_dir, *same)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("run dir:") == 1 and "2 ranks" in done.stdout  # rank 0 speaks for the run
    one, two = rows(one_dir), rows(two_dir)
    assert [r["step"] for r in two] == [1, 2, 3]
    # exactness holds on every rank, over the whole batch (every rank's tokens are in the metric)
    assert all(r["train/train_rollout_logprob_abs_diff_max"] == 0.0 for r in two)
    assert all(r["perf/completion_tokens"] > 0 and r["train/grad_norm"] > 0 for r in two)
    # step 1: the same weights, and seeds that follow the prompt, not the rank -> the same batch
    for k in (
        "rollout/reward_mean",
        "rollout/response_len_mean",
        "rollout/response_len_max",
        "perf/completion_tokens",
        "eval/initial_accuracy",
    ):
        assert two[0][k] == one[0][k], k
    assert two[2]["rollout/kl_ref_per_seq"] > 0
    assert two[2]["rollout/kl_ref_per_seq"] == pytest.approx(one[2]["rollout/kl_ref_per_seq"], rel=1e-3)
    # the whole batch's gradient: one process's up to the order of the sum
    assert two[0]["train/grad_norm"] == pytest.approx(one[0]["train/grad_norm"], rel=1e-4)
    assert two[0]["train/loss"] == pytest.approx(one[0]["train/loss"], rel=1e-4, abs=1e-6)
    # the weights after 3 steps: one process's up to rounding. AdamW's first steps move an element by
    # lr * g / (|g| + eps): for an element whose gradient is near eps (1e-8) the last-bit difference of
    # the two gradient sums becomes a visible one (seen: 1 element of 49,152 off by 1.6e-5 against a
    # tolerance of 1.3e-5). So: all but a few in 1e5 elements within rtol 1e-3 / atol 1e-5, and none
    # beyond what 3 steps of lr could move apart; a rank's missing or doubled gradient would move nearly
    # every element by ~lr.
    a = exactrl.load_model(one_dir / "checkpoints" / "step_000003")
    b = exactrl.load_model(two_dir / "checkpoints" / "step_000003")
    p = torch.cat([t.detach().flatten() for t in a.parameters()])
    q = torch.cat([t.detach().flatten() for t in b.parameters()])
    names = [
        n for (n, t), u in zip(a.named_parameters(), b.parameters()) if not torch.allclose(u, t, rtol=1e-3, atol=1e-5)
    ]
    assert ((q - p).abs() > 1e-5 + 1e-3 * p.abs()).sum() <= 1e-4 * p.numel(), names
    assert (q - p).abs().max() <= 2 * 3 * 1e-3, names  # optim.lr=1e-3 (SMALL)
    state = json.loads((two_dir / "checkpoints" / "step_000003" / "state.json").read_text())
    assert len(state["ranks_rng"]) == 2  # each rank's random streams


@pytest.fixture(scope="module")
def whole(model_dir, tmp_path_factory) -> list[dict]:
    """An uninterrupted synchronous 2-rank run of 3 steps."""
    d = tmp_path_factory.mktemp("whole")
    done = ranks_run(model_dir, d, "max_steps=3")
    assert done.returncode == 0, done.stderr[-3000:]
    return rows(d)


@pytest.mark.slow  # multi-rank runs: `make test-slow` (CI)
def test_a_two_rank_run_resumes_like_an_uninterrupted_one(model_dir, tmp_path, whole):
    cut = tmp_path / "cut"
    assert ranks_run(model_dir, cut, "max_steps=2").returncode == 0
    done = ranks_run(model_dir, cut, "max_steps=3", "resume=true")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [results(r) for r in rows(cut)] == [results(r) for r in whole]
    # and with another number of ranks it refuses, naming the one to use
    wrong = ranks_run(model_dir, cut, "max_steps=4", "resume=true", nproc=1)
    assert wrong.returncode != 0 and "--nproc 2" in wrong.stderr


@pytest.mark.slow  # multi-rank runs: `make test-slow` (CI)
def test_sharded_optimizer_state_trains_bitwise_as_the_replicated_one_and_checkpoints_alike(model_dir, tmp_path, whole):
    """optim.shard_state (ZeRO-1): each rank keeps part of AdamW's moments, the weights stay bitwise the
    replicated run's (warm-up included: the lr reaches the shards), and a checkpoint holds the whole
    state, so a run moves between sharded and replicated on resume."""
    sharded = tmp_path / "sharded"
    done = ranks_run(model_dir, sharded, "max_steps=2", "optim.shard_state=true")
    assert done.returncode == 0, done.stderr[-3000:]
    share = re.search(r"rank 0 keeps the moments of ([\d,]+) of ([\d,]+) parameter elements", done.stdout)
    mine, total = (int(x.replace(",", "")) for x in share.groups())
    assert 0 < mine < total
    done = ranks_run(model_dir, sharded, "max_steps=3", "resume=true")  # resumed replicated
    assert done.returncode == 0, done.stderr[-3000:]
    assert [results(r) for r in rows(sharded)] == [results(r) for r in whole]
    replicated = tmp_path / "replicated"
    assert ranks_run(model_dir, replicated, "max_steps=2").returncode == 0
    done = ranks_run(model_dir, replicated, "max_steps=3", "resume=true", "optim.shard_state=true")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [results(r) for r in rows(replicated)] == [results(r) for r in whole]


@pytest.mark.slow  # multi-rank runs: `make test-slow` (CI)
def test_two_rank_async_runs_as_the_sync_loop_at_staleness_0_and_tags_versions_beyond(model_dir, tmp_path, whole):
    done = ranks_run(model_dir, tmp_path / "s0", "max_steps=3", "async.enabled=true", "async.max_staleness=0")
    assert done.returncode == 0, done.stderr[-3000:]
    s0 = rows(tmp_path / "s0")
    drop = ("async/", "time/wait_rollout_s")
    assert [{k: v for k, v in results(r).items() if not k.startswith(drop)} for r in s0] == [results(r) for r in whole]
    done = ranks_run(
        model_dir,
        tmp_path / "s1",
        "max_steps=3",
        "async.enabled=true",
        "async.max_staleness=1",
        "async.recompute_behaviour=true",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    s1 = rows(tmp_path / "s1")
    assert [r["step"] for r in s1] == [1, 2, 3] and all(r["async/staleness_max"] <= 1 for r in s1)
    # whatever version each rank's thread sampled under, the trainer recomputes μ bitwise under it
    assert all(r["async/behaviour_recompute_abs_diff_max"] == 0.0 for r in s1)


@pytest.mark.parametrize(
    "extra, words",
    [
        (["rollout.prompts_per_step=1"], "rollout.prompts_per_step=1 gives some of the 2 ranks no prompt"),
        (
            ["rollout_backend.kind=openai", "rollout_backend.base_url=http://127.0.0.1:9", "rollout_backend.model=m"],
            "rollout_backend.kind=openai runs in one process",
        ),
    ],
)
def test_what_a_data_parallel_run_cannot_do_is_refused_naming_the_key(model_dir, tmp_path, extra, words):
    done = ranks_run(model_dir, tmp_path / "run", "max_steps=1", *extra)
    assert done.returncode != 0 and words in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # refused before the run dir was made


def test_a_sigint_to_the_launcher_alone_reaches_the_ranks(tmp_path, monkeypatch):
    """kill -INT on the launcher (a job manager), not on the process group: the ranks still running are
    sent SIGINT after a moment, stop as from a Ctrl-C, and the launcher returns 130."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    import exactrl.distributed as dist_mod

    rank = tmp_path / "rank.py"
    rank.write_text(
        "import pathlib, sys, time\ntry:\n    pathlib.Path(sys.argv[1] + '.ready').write_text('')\n"
        "    while True:\n        time.sleep(0.05)\n"
        "except KeyboardInterrupt:\n    pathlib.Path(sys.argv[1]).write_text('interrupted')\n"
        "    sys.exit(130)\n"
    )
    real = subprocess.Popen
    monkeypatch.setattr(
        dist_mod.subprocess,
        "Popen",
        lambda cmd, env, **kw: real([sys.executable, str(rank), str(tmp_path / f"rank{env['RANK']}")], env=env, **kw),
    )

    def interrupt_when_ready():  # once both ranks run their loop: the signal is the launcher's alone
        while not all((tmp_path / f"rank{r}.ready").exists() for r in (0, 1)):
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_when_ready, daemon=True).start()
    assert dist_mod.launch(["train"], 2) == 130
    assert all((tmp_path / f"rank{r}").read_text() == "interrupted" for r in (0, 1))


def test_after_a_rank_fails_the_others_may_finish_a_save_and_a_stuck_one_is_stopped(tmp_path, monkeypatch):
    """Rank 1 fails while rank 0 writes a checkpoint (here: 1 s of work, then its next collective fails):
    rank 0 finishes instead of being killed mid-write (it lost the checkpoint of a step every rank had
    finished). A rank that never ends on its own is stopped after the grace period."""
    import signal
    import subprocess
    import sys
    import textwrap

    import exactrl.distributed as dist_mod

    rank = tmp_path / "rank.py"
    rank.write_text(
        textwrap.dedent("""
        import os, pathlib, sys, time
        out = pathlib.Path(sys.argv[1])
        if os.environ["RANK"] == "1":
            sys.exit(2)
        if sys.argv[2] == "stuck":
            while True:
                time.sleep(0.05)
        time.sleep(1.0)
        out.write_text("saved")
        sys.exit(1)
        """)
    )
    real, started = subprocess.Popen, []

    def popen(cmd, env, **kw):
        started.append(real([sys.executable, str(rank), str(tmp_path / f"{mode}{env['RANK']}"), mode], env=env, **kw))
        return started[-1]

    monkeypatch.setattr(dist_mod.subprocess, "Popen", popen)
    for mode, grace in (("saving", 120), ("stuck", 1)):  # 120 s: rank 0's second of saving, on any machine
        monkeypatch.setattr(dist_mod, "FAILED_RANK_GRACE_S", grace)
        started.clear()
        assert dist_mod.launch(["train"], 2) == 2  # the first failure's code
        assert (tmp_path / f"{mode}0").exists() == (mode == "saving")
        # rank 0 ended on its own after its save; stuck, it was stopped (SIGTERM after the grace period)
        assert [p.returncode for p in started] == ([1, 2] if mode == "saving" else [-signal.SIGTERM, 2])


def test_a_rank_dies_with_its_launcher_even_a_sigkilled_one(tmp_path):
    """A launcher killed with SIGKILL (OOM killer, `kill -9`) can forward nothing: its ranks are armed to get
    SIGTERM from the kernel when it dies, so none is left running (holding the run dir's lock)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    launcher = (
        "import os, subprocess, sys, time\nfrom exactrl.distributed import _dies_with\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
        "preexec_fn=_dies_with(os.getpid()))\nprint(p.pid, flush=True)\ntime.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 60  # a hang guard: the kernel's SIGTERM ends it at once
    while time.monotonic() < deadline:
        try:  # the child is re-parented (to init or a subreaper), which reaps it once it is gone
            os.kill(child, 0)
            with open(f"/proc/{child}/stat") as f:
                if f.read().split(") ")[1][0] == "Z":
                    break
        except (ProcessLookupError, FileNotFoundError):
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the rank outlived its SIGKILLed launcher")


@pytest.mark.parametrize(
    "env, words",
    [
        ({"WORLD_SIZE": "2"}, "the environment variable RANK is not set"),
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not an integer"),
        ({"WORLD_SIZE": "2", "RANK": "5"}, "RANK=5 is not in [0, WORLD_SIZE=2)"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
        ({"WORLD_SIZE": "-2", "RANK": "0"}, "WORLD_SIZE=-2 must be >= 1"),
    ],
)
def test_a_bad_torchrun_environment_is_named(monkeypatch, env, words):
    import re

    from exactrl.distributed import init_from_env

    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=re.escape(words)):
        init_from_env()


@pytest.mark.slow  # multi-rank runs: `make test-slow` (CI)
def test_a_run_dir_rank_0_cannot_claim_stops_every_rank_without_a_traceback(model_dir, tmp_path):
    """Rank 0 alone claims the run dir: when it cannot, the other ranks are told and stop with a named error
    (they do not wait in a collective and die with gloo tracebacks). The claim is made to fail by a
    sitecustomize module in the ranks' path."""
    import os

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('RANK') == '0':\n    import exactrl.train.setup as s\n"
        "    def refused(*a):\n        raise ValueError('injected: another run took the dir')\n"
        "    s._claim_run_dir = refused\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "exactrl", "train", "--nproc", "2", *sets(model_dir, tmp_path / "run", "max_steps=1")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "rank 0): error: injected: another run took the dir" in done.stderr
    assert "rank 1): error: rank 0 could not start the run: injected" in done.stderr


@pytest.mark.slow  # multi-rank runs: `make test-slow` (CI)
def test_ranks_started_with_different_settings_are_refused_naming_the_keys(model_dir, tmp_path):
    """torchrun gives every rank its own command line: a rank with another `model.kernels` would train
    what no rank's settings describe. Both ranks stop before the model loads, naming the key and values."""
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank, kernels in ((0, "exact"), (1, "fast")):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        cmd = [
            sys.executable,
            "-m",
            "exactrl",
            "train",
            *sets(model_dir, tmp_path / "run", "max_steps=1", f"model.kernels={kernels}"),
        ]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    errs = [p.communicate(timeout=300)[1] for p in procs]
    for rank, (p, err) in enumerate(zip(procs, errs)):
        assert p.returncode == 2 and "Traceback" not in err, err[-3000:]
        assert (
            f"(rank {rank}): error: the ranks were started with different settings (rank 1: model.kernels "
            f"('fast' vs rank 0's 'exact'))" in err
        ), err[-3000:]
    assert not (tmp_path / "run").exists()


def test_the_settings_check_passes_equal_settings_and_names_each_difference():
    """The check's two sides in one process, as rank 1 of 2 whose collectives hand it rank 0's settings."""
    from dataclasses import dataclass

    from exactrl.train.config import load_config
    from exactrl.train.run import _check_same_settings, settings_leaves

    @dataclass(frozen=True)
    class Rank1(Ranks):
        first: dict = None

        def broadcast(self, obj):
            return self.first

        def gather(self, obj):
            return [[], obj]

    rank0 = settings_leaves(load_config(None, ["algorithm.loss_kwargs={eps_high: 0.3}"]))
    _check_same_settings(load_config(None, ["algorithm.loss_kwargs={eps_high: 0.3}"]), Rank1(1, 2, rank0))
    with pytest.raises(
        ValueError,
        match=re.escape("(rank 1: algorithm.loss_kwargs.eps_high (unset vs rank 0's 0.3)); start every rank"),
    ):
        _check_same_settings(load_config(), Rank1(1, 2, rank0))


def test_more_ranks_than_cores_is_run_with_a_warning(tmp_path, monkeypatch, capsys):
    """--nproc above the cores this process may use runs (each rank one thread) but says it will be slow;
    at or below them nothing is said."""
    import exactrl.distributed as dist_mod

    started = []
    real = subprocess.Popen
    monkeypatch.setattr(
        dist_mod.subprocess,
        "Popen",
        lambda cmd, env, **kw: (
            started.append(env["OMP_NUM_THREADS"]),
            real([sys.executable, "-c", "pass"], env=env, **kw),
        )[1],
    )
    monkeypatch.setattr(dist_mod.os, "sched_getaffinity", lambda pid: {0, 1})
    assert dist_mod.launch(["train"], 3) == 0
    assert "warning: --nproc 3 on 2 cores" in capsys.readouterr().err and started == ["1"] * 3
    assert dist_mod.launch(["train"], 2) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.slow  # multi-rank runs: `make test-slow` (CI)
def test_a_rank_that_dies_mid_run_leaves_one_line_on_the_others_not_a_gloo_traceback(model_dir, tmp_path):
    """Rank 1 is killed at step 2 (a sitecustomize hook in the ranks' path): the launcher names it, and rank
    0, whose next collective fails, says in one line that a rank left, what is kept and how to resume
    (it printed gloo's traceback); the run dir keeps step 1's checkpoint."""
    import os

    from exactrl.distributed import lost_rank

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('RANK') == '1':\n    import signal\n    import exactrl.train.loop as loop\n"
        "    real = loop.train_on\n    def dying(c, step, groups):\n        if step == 2:\n"
        "            os.kill(os.getpid(), signal.SIGKILL)\n        return real(c, step, groups)\n"
        "    loop.train_on = dying\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])}
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "exactrl",
        "train",
        "--nproc",
        "2",
        *sets(model_dir, run, "max_steps=4", "save_every=1"),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    # the launcher's code is the first failure it sees, a race between rank 1's death and rank 0's error
    assert done.returncode in (2, 137) and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert (
        "exactrl train: rank 1 was killed by signal 9" in done.stderr
        and "exactrl train: rank 0 exited with code 2" in done.stderr
    ), done.stderr[-3000:]
    # gloo's reason is "Connection closed by peer [...]" or "Read error [...]: Connection reset by peer"
    assert re.search(
        r"\(rank 0\): error: another rank left the run \((Connection closed|Read error)[^)]*\); "
        r"its own output says why; run .* is kept and its last checkpoint step_000001 is intact: fix that and "
        rf"continue it with exactrl train --nproc 2 --set run_dir={re.escape(str(run))} --set "
        r"resume=true",
        done.stderr,
    ), done.stderr[-3000:]
    assert lost_rank(ValueError("gloo")) is None and lost_rank(RuntimeError("an error of ours")) is None


@pytest.mark.slow  # multi-rank runs: `make test-slow` (CI)
def test_a_rank_that_dies_while_setting_up_leaves_one_line_on_the_others(model_dir, tmp_path):
    """Rank 1 is killed before the training loop (as it builds the run): rank 0, waiting in setup's first
    collective, says in one line that a rank left (it printed gloo's traceback, exit code 1)."""
    import os

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('RANK') == '1':\n    import signal\n    import exactrl.train.setup as setup\n"
        "    def dying(*args, **kwargs):\n        os.kill(os.getpid(), signal.SIGKILL)\n    setup.build = dying\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "exactrl", "train", "--nproc", "2", *sets(model_dir, tmp_path / "run", "max_steps=2")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode in (2, 137) and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "exactrl train: rank 1 was killed by signal 9" in done.stderr, done.stderr[-3000:]
    assert re.search(
        r"\(rank 0\): error: another rank left the run \((Read error \[[^]]*\]:\d+: )?Connection (closed|reset) by peer"
        r"[^)]*\); its "
        r"own output says why\n",
        done.stderr,
    ), done.stderr[-3000:]
