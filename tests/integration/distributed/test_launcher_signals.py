"""Signals to the `--nproc N` launcher (exactrl/distributed `launch`): its handler only sets a flag that its
wait loop reads, so a signal at any moment (while a rank starts, too) reaches every rank started, and the
launcher waits for them; a rank that ignores it is killed after STOP_GRACE_S.

The ranks are small scripts (not exactrl): each writes `ready` once its handlers are set, and what stopped it.
No wall-clock bounds: the outcome is asserted, pytest-timeout is the hang guard.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import exactrl.distributed as dist_mod

RANK = textwrap.dedent("""
    import pathlib, signal, sys, time
    out = pathlib.Path(sys.argv[1])
    mode = sys.argv[2]
    if mode == "deaf":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "term":
        def on_term(signum, frame):
            time.sleep(0.5)  # a rank's own shutdown: the launcher must wait for it
            out.write_text("terminated")
            sys.exit(143)
        signal.signal(signal.SIGTERM, on_term)
    pathlib.Path(sys.argv[1] + ".ready").write_text("")
    try:
        while True:
            time.sleep(0.05)
    except KeyboardInterrupt:
        out.write_text("interrupted")
        sys.exit(130)
    """)


@pytest.fixture
def ranks(tmp_path, monkeypatch):
    """Makes `launch` start RANK scripts; yields (started Popen objects, set_mode, after_start hook list)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    started: list[subprocess.Popen] = []
    mode, after_start = ["plain"], []
    real = subprocess.Popen

    def popen(cmd, env, **kw):
        p = real([sys.executable, str(script), str(tmp_path / f"rank{env['RANK']}"), mode[0]], env=env, **kw)
        started.append(p)
        for hook in after_start:
            hook(p)
        return p

    monkeypatch.setattr(dist_mod.subprocess, "Popen", popen)
    monkeypatch.setattr(dist_mod, "FORWARD_DELAY_S", 0.2, raising=False)
    yield started, mode, after_start
    for p in started:  # a rank the launcher lost would outlive the test
        if p.poll() is None:
            p.kill()
            p.wait()


def signal_when_ready(paths, signum: int) -> threading.Thread:
    """Sends `signum` to this process (the launcher) once every rank has written its ready file."""

    def run():
        while not all(os.path.exists(f"{p}.ready") for p in paths):
            time.sleep(0.02)
        os.kill(os.getpid(), signum)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_sigint_while_a_rank_starts_stops_every_rank_started(ranks, tmp_path):
    """The SIGINT lands inside the Popen call that starts rank 0: no further rank starts, rank 0 is sent
    SIGINT and waited for, and the launcher returns 130 (a KeyboardInterrupt raised there lost rank 0, which
    ran on, and the launcher returned 0)."""
    started, _, after_start = ranks
    after_start.append(lambda p: os.kill(os.getpid(), signal.SIGINT))
    assert dist_mod.launch(["train"], 3) == 130
    assert len(started) == 1
    assert started[0].poll() is not None  # stopped, not left running


def test_a_rank_that_ignores_the_signal_is_killed_after_the_grace_period(ranks, tmp_path, monkeypatch):
    started, mode, _ = ranks
    mode[0] = "deaf"
    monkeypatch.setattr(dist_mod, "STOP_GRACE_S", 1, raising=False)
    signal_when_ready([tmp_path / "rank0", tmp_path / "rank1"], signal.SIGINT)
    assert dist_mod.launch(["train"], 2) == 130
    assert [p.returncode for p in started] == [-signal.SIGKILL] * 2


def test_a_sigterm_to_the_launcher_is_passed_on_and_the_ranks_are_waited_for(ranks, tmp_path):
    started, mode, _ = ranks
    mode[0] = "term"
    signal_when_ready([tmp_path / "rank0", tmp_path / "rank1"], signal.SIGTERM)
    assert dist_mod.launch(["train"], 2) == 143
    assert [p.returncode for p in started] == [143, 143]
    assert all((tmp_path / f"rank{r}").read_text() == "terminated" for r in (0, 1))


def test_the_launchers_own_handlers_are_restored(ranks, tmp_path):
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signal_when_ready([tmp_path / "rank0"], signal.SIGINT)
    assert dist_mod.launch(["train"], 1) == 130
    assert (tmp_path / "rank0").read_text() == "interrupted"
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
