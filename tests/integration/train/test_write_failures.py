"""A full disk (or any failed write) in any of a run's writers ends `exactrl train` with one line: what failed,
the checkpoint that is intact, and the command that continues the run.

The writers are replaced by ones that raise what a full disk raises: OSError(ENOSPC) from files and
TensorBoard, SafetensorError from safetensors' `save_file`.
"""

from __future__ import annotations

import errno

import pytest
from conftest import default_job_model
from safetensors import SafetensorError

import exactrl.model.checkpoint as model_checkpoint
from exactrl.cli import main

TINY = [
    "progress=false",
    "task.eval_size=0",
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=2",
    "engine.kv_budget_tokens=2048",
    "save_every=1",
]
# what safetensors 0.4-0.8 raise when the disk fills while model.safetensors is written
FULL_SAFETENSORS = (
    'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return default_job_model(tmp_path_factory, sft_steps=0)


def train(model_dir, run, *overrides: str) -> int:
    sets = [*TINY, f"model.path={model_dir}", f"run_dir={run}", *overrides]
    return main(["train"] + [x for o in sets for x in ("--set", o)])


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("exactrl train: error: ") and "\n" not in err, err
    return err


def test_a_full_disk_while_model_safetensors_is_written_names_the_kept_checkpoint(
    model_dir, tmp_path, capsys, monkeypatch
):
    real, calls = model_checkpoint.save_file, []

    def save_file(*a, **k):
        calls.append(1)
        if len(calls) == 2:  # the checkpoint of step 2
            raise SafetensorError(FULL_SAFETENSORS)
        return real(*a, **k)

    monkeypatch.setattr(model_checkpoint, "save_file", save_file)
    run = tmp_path / "r"
    assert train(model_dir, run, "tensorboard=false", "max_steps=3") == 2
    err = error_line(capsys)
    assert "the checkpoint of step 2 could not be written" in err and "No space left on device" in err
    assert (
        f"step_000001 is intact: free disk space and resume: exactrl train --set run_dir={run} --set resume=true" in err
    )
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000001"]


def test_a_safetensors_error_that_is_not_a_full_disk_says_fix_that(model_dir, tmp_path, capsys, monkeypatch):
    def save_file(*a, **k):
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 13, kind: PermissionDenied, message: "Permission denied" })'
        )

    monkeypatch.setattr(model_checkpoint, "save_file", save_file)
    run = tmp_path / "r"
    assert train(model_dir, run, "tensorboard=false", "max_steps=1") == 2
    err = error_line(capsys)
    assert "Permission denied" in err and "no earlier checkpoint is kept: fix that and resume" in err


class FullDiskTensorBoard:
    """SummaryWriter's methods once the disk is full: a write fails, and so does every flush and the close
    (TensorBoard's writer raises its worker thread's error again at each)."""

    def __init__(self, monkeypatch, from_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.full = False
        real_add, real_flush, real_close = SummaryWriter.add_scalar, SummaryWriter.flush, SummaryWriter.close

        def add_scalar(writer, tag, value, step, *a, **k):
            self.full = self.full or step >= from_step
            self.check()
            return real_add(writer, tag, value, step, *a, **k)

        def flush(writer):
            self.check()
            return real_flush(writer)

        def close(writer):
            real_close(writer)
            self.check()

        monkeypatch.setattr(SummaryWriter, "add_scalar", add_scalar)
        monkeypatch.setattr(SummaryWriter, "flush", flush)
        monkeypatch.setattr(SummaryWriter, "close", close)

    def check(self) -> None:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_in_tensorboard_keeps_the_resume_hint(model_dir, tmp_path, capsys, monkeypatch):
    """The close in the error path fails on the same full disk: the error that stopped the run is named."""
    FullDiskTensorBoard(monkeypatch, from_step=2)
    run = tmp_path / "r"
    assert train(model_dir, run, "tensorboard=true", "max_steps=3") == 2
    err = error_line(capsys)
    assert (
        f"No space left on device; run {run} is kept and its last checkpoint step_000001 is intact: fix that "
        f"and continue it with exactrl train --set run_dir={run} --set resume=true" in err
    )


def test_a_full_disk_met_only_by_tensorboards_last_flush_keeps_the_resume_hint(
    model_dir, tmp_path, capsys, monkeypatch
):
    tb = FullDiskTensorBoard(monkeypatch, from_step=10**9)
    from exactrl.train.logger import MetricsLogger

    real_close = MetricsLogger.close

    def close(logger):  # the disk fills after the last step's checkpoint
        tb.full = True
        real_close(logger)

    monkeypatch.setattr(MetricsLogger, "close", close)
    run = tmp_path / "r"
    assert train(model_dir, run, "tensorboard=true", "max_steps=2") == 2
    err = error_line(capsys)
    assert f"run {run} is kept and its last checkpoint step_000002 is intact" in err
    assert f"exactrl train --set run_dir={run} --set resume=true" in err
