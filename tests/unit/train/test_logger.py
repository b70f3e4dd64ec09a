"""metrics.jsonl on resume: rows past the checkpoint go, a row cut short by a crash goes, other damage is named."""

from __future__ import annotations

import json

import pytest

from exactrl.train.logger import _keep_steps_up_to


def _rows(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_rows_after_the_checkpoint_and_a_torn_last_row_are_dropped(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": s, "x": 1.0}) + "\n" for s in range(4)) + '{"step": 4, "x"')
    _keep_steps_up_to(p, 2)
    assert _rows(p) == [0, 1, 2]


def test_a_whole_last_row_without_its_newline_gets_one_so_the_next_row_does_not_join_it(tmp_path):
    """A full disk can leave the last row complete but without "\n": the resumed run's next row was
    appended to it, and the resume after that dropped both as one torn line."""
    from exactrl.train.logger import MetricsLogger

    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1}\n{"step": 2}')
    MetricsLogger(tmp_path, False, False, 5, 2).log({"step": 3})
    assert _rows(p) == [1, 2, 3]
    MetricsLogger(tmp_path, False, False, 5, 3)
    assert _rows(p) == [1, 2, 3]


def test_a_bad_row_before_the_last_is_named(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 0}\n{"step": 1\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not valid JSON"):
        _keep_steps_up_to(p, 2)
    assert p.read_text() == '{"step": 0}\n{"step": 1\n{"step": 2}\n'  # left as it was


def _tb_steps(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [e.step for e in acc.Scalars("x")]


def test_tensorboard_keeps_checkpointed_steps_and_purges_redone_ones(tmp_path):
    """flush() (before each checkpoint) puts the steps on disk; a resume, from step 0 too, purges the steps
    past it that a crash left, so each step shows once."""
    from exactrl.train.logger import MetricsLogger

    first = MetricsLogger(tmp_path, True, False, 4, 0)
    for s in (1, 2):
        first.log({"step": s, "x": float(s)})
    first.flush()  # a checkpoint at step 2; the process is then killed without closing
    first.tb = None  # (its writer's later buffers are lost)
    assert _tb_steps(tmp_path) == [1, 2]
    resumed = MetricsLogger(tmp_path, True, False, 4, 0)  # resume=true before any checkpoint: from step 0
    for s in (1, 2, 3):
        resumed.log({"step": s, "x": float(s)})
    resumed.close()
    assert _tb_steps(tmp_path) == [1, 2, 3]


def test_flush_fsyncs_the_metrics_file(tmp_path, monkeypatch):
    """Before a checkpoint the rows it covers reach the disk itself, not only the page cache."""
    import os

    from exactrl.train.logger import MetricsLogger

    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    log = MetricsLogger(tmp_path, False, False, 2, 0)
    log.log({"step": 1, "x": 1.0})
    log.flush()
    log.close()
    assert str(tmp_path / "metrics.jsonl") in synced


@pytest.mark.parametrize("bad", ["[1, 2]", '{"step": "x"}'])
def test_a_row_of_the_wrong_shape_is_named(tmp_path, bad):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 0}\n' + bad + '\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a row of metrics with an integer step"):
        _keep_steps_up_to(p, 1)


def test_a_metrics_file_that_is_a_directory_or_not_utf8_is_named(tmp_path):
    from exactrl.train.logger import read_metrics

    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(ValueError, match="is not a file"):
        _keep_steps_up_to(tmp_path / "metrics.jsonl", 1)
    (tmp_path / "metrics.jsonl").rmdir()
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n\xff\n')
    with pytest.raises(ValueError, match="is not UTF-8 text"):
        _keep_steps_up_to(tmp_path / "metrics.jsonl", 1)
    with pytest.raises(ValueError, match="is not UTF-8 text"):
        read_metrics(tmp_path)


def test_progress_is_a_live_bar_on_a_terminal_and_a_plain_line_a_step_in_a_pipe(tmp_path, monkeypatch, capsys):
    """`progress: true` with stdout a pipe or a file (`make run | tee`, CI): one line per step with that
    step's figures (rich would print only its last frame, squeezed); on a terminal rich's bar, which prints
    no such lines; `progress: false` prints the figures as JSON."""
    import sys

    from exactrl.train.logger import MetricsLogger

    row = {"step": 2, "rollout/reward_mean": 0.5, "train/train_rollout_logprob_abs_diff": 0.0}
    for d in ("pipe", "tty", "quiet"):
        (tmp_path / d).mkdir()
    log = MetricsLogger(tmp_path / "pipe", False, True, 3, 0)
    log.log({"step": 1, "rollout/reward_mean": 0.25, "eval/accuracy": 0.75})
    log.log(row)
    log.close()
    assert capsys.readouterr().out.splitlines() == [
        "step 1/3  reward 0.250  eval acc 0.750",
        "step 2/3  reward 0.500  |Δlogp| 0.00e+00",
    ]
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    log = MetricsLogger(tmp_path / "tty", False, True, 3, 0)
    assert log.progress is not None
    log.log(row)
    log.close()
    assert "step 2/3" not in capsys.readouterr().out
    MetricsLogger(tmp_path / "quiet", False, False, 3, 0).log(row)
    assert json.loads(capsys.readouterr().out) == {
        "rollout/reward_mean": 0.5,
        "train/train_rollout_logprob_abs_diff": 0.0,
        "step": 2,
    }
