"""Atomic checkpoints: a crash mid-save leaves the previous checkpoint usable."""

from __future__ import annotations

import pytest
import torch

import exactrl
from exactrl.train import checkpoint as ck


def _opt(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.cat(exactrl.sequence_logprobs(model, [[1, 2, 3, 4]])).sum().backward()
    opt.step()
    return opt


def test_save_load_keep_and_crash(qwen3_dir, tmp_path, monkeypatch):
    model = exactrl.load_model(qwen3_dir)
    opt = _opt(model)
    for step in (1, 2, 3):
        ck.save_checkpoint(tmp_path, step, model, opt, {"prompts": {"pos": step}}, keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert names == ["step_000002", "step_000003"]
    latest = ck.latest_checkpoint(tmp_path)
    assert latest.name == "step_000003"
    loaded, opt_state, state = ck.load_checkpoint(latest, "float32", "exact")
    assert state == {"step": 3, "prompts": {"pos": 3}}
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    assert opt_state["state"][0]["exp_avg"].shape == next(model.parameters()).shape

    def crash(*a, **k):  # the process dies while writing the optimizer state
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(ck.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        ck.save_checkpoint(tmp_path, 4, model, opt, {"prompts": {"pos": 4}}, keep=2)
    monkeypatch.undo()
    latest = ck.latest_checkpoint(tmp_path)
    assert latest.name == "step_000003"
    assert ck.load_checkpoint(latest, "float32", "exact")[2]["step"] == 3
    assert not list((tmp_path / "checkpoints").glob(".tmp_step_*"))  # the failed save's partial dir is gone


def test_a_full_disk_is_named_with_the_checkpoint_that_is_kept(qwen3_dir, tmp_path, monkeypatch):
    model = exactrl.load_model(qwen3_dir)
    opt = _opt(model)
    ck.save_checkpoint(tmp_path, 2, model, opt, {"prompts": {}}, keep=2)

    def full(*a, **k):  # what torch's zip writer raises when the disk fills under it
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 2576768 vs 2576656")

    monkeypatch.setattr(ck.torch, "save", full)
    with pytest.raises(
        OSError,
        match=r"the checkpoint of step 4 could not be written .*unexpected pos.*"
        r"step_000002 is intact: free disk space and resume",
    ):
        ck.save_checkpoint(tmp_path, 4, model, opt, {"prompts": {}}, keep=2)
    assert ck.latest_checkpoint(tmp_path).name == "step_000002"
    (tmp_path / "checkpoints" / "latest").unlink()  # the kept one is found as a resume finds it
    with pytest.raises(OSError, match=r"step_000002 is intact: free disk space and resume"):
        ck.save_checkpoint(tmp_path, 4, model, opt, {"prompts": {}}, keep=2)

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(ck.torch, "save", denied)
    with pytest.raises(OSError, match=r"Permission denied\); step_000002 is intact: fix that and resume"):
        ck.save_checkpoint(tmp_path, 4, model, opt, {"prompts": {}}, keep=2)

    def bug(*a, **k):  # not the disk: no advice about it
        raise RuntimeError("some other failure")

    monkeypatch.setattr(ck.torch, "save", bug)
    with pytest.raises(RuntimeError, match="^some other failure$"):
        ck.save_checkpoint(tmp_path, 4, model, opt, {"prompts": {}}, keep=2)
    assert ck.latest_checkpoint(tmp_path).name == "step_000002"


def test_a_lost_or_bad_pointer_falls_back_to_the_newest_complete_checkpoint(qwen3_dir, tmp_path):
    model = exactrl.load_model(qwen3_dir)
    opt = _opt(model)
    for step in (1, 2):
        ck.save_checkpoint(tmp_path, step, model, opt, {"prompts": {}}, keep=3)
    root = tmp_path / "checkpoints"
    (root / "latest").unlink()  # killed between step 2's rename and its pointer's
    assert ck.latest_checkpoint(tmp_path).name == "step_000002"
    (root / "latest").write_text("")  # an empty pointer
    assert ck.latest_checkpoint(tmp_path).name == "step_000002"
    (root / "latest").write_text("step_000002\n")
    (root / "step_000002" / "state.json").unlink()  # the pointer's target incomplete
    assert ck.latest_checkpoint(tmp_path).name == "step_000001"
    assert ck.latest_checkpoint(tmp_path / "nowhere") is None


def test_checkpoints_are_pruned_by_step_number_and_an_unreadable_one_is_named(qwen3_dir, tmp_path):
    model = exactrl.load_model(qwen3_dir)
    opt = _opt(model)
    for step in (999_990, 1_000_000, 1_000_010):  # by name, step_999990 would sort last and stay
        ck.save_checkpoint(tmp_path, step, model, opt, {"prompts": {}}, keep=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_1000000", "step_1000010"]
    (root / "step_1000010" / "optimizer.pt").write_bytes(b"truncated")
    with pytest.raises(ValueError, match=r"step_1000010 cannot be read .*older checkpoints there: step_1000000"):
        ck.load_checkpoint(ck.latest_checkpoint(tmp_path), "float32", "exact")


def test_a_pruned_checkpoint_cut_short_never_looks_complete(qwen3_dir, tmp_path, monkeypatch):
    """An old checkpoint is renamed before it is deleted: a crash mid-delete leaves a hidden .old_ directory
    (removed by the next save), never a step_ directory with state.json but half its files."""
    import shutil

    model = exactrl.load_model(qwen3_dir)
    opt = _opt(model)
    ck.save_checkpoint(tmp_path, 1, model, opt, {"prompts": {}}, keep=1)
    real = shutil.rmtree

    def interrupted(path, *a, **kw):
        if ".old_" in str(path):
            (path / "model.safetensors").unlink()
            raise KeyboardInterrupt
        return real(path, *a, **kw)

    monkeypatch.setattr(ck.shutil, "rmtree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ck.save_checkpoint(tmp_path, 2, model, opt, {"prompts": {}}, keep=1)
    monkeypatch.setattr(ck.shutil, "rmtree", real)
    root = tmp_path / "checkpoints"
    assert [p.name for p in ck._step_dirs(root)] == ["step_000002"] and (root / ".old_step_000001").is_dir()
    ck.save_checkpoint(tmp_path, 3, model, opt, {"prompts": {}}, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000003"]


def test_a_step_saved_again_replaces_the_old_one_by_renaming_and_a_failed_prune_stops_nothing(
    qwen3_dir, tmp_path, monkeypatch
):
    """A complete step_N a crash left unnamed (after its rename, before the pointer) is renamed away before
    it is deleted, as pruning does; an old checkpoint that cannot be removed leaves a warning, not a failed
    run (the new checkpoint and its pointer are already on disk)."""
    import shutil

    model = exactrl.load_model(qwen3_dir)
    opt = _opt(model)
    ck.save_checkpoint(tmp_path, 1, model, opt, {"prompts": {}}, keep=2)
    root = tmp_path / "checkpoints"
    shutil.copytree(root / "step_000001", root / "step_000002")  # the crash's unnamed step 2
    real, removed = shutil.rmtree, []

    def watch(path, *a, **kw):
        removed.append(path.name)
        return real(path, *a, **kw)

    monkeypatch.setattr(ck.shutil, "rmtree", watch)
    ck.save_checkpoint(tmp_path, 2, model, opt, {"prompts": {"pos": 2}}, keep=2)
    assert ".old_step_000002" in removed and "step_000002" not in removed
    assert ck.load_checkpoint(ck.latest_checkpoint(tmp_path), "float32", "exact")[2]["prompts"] == {"pos": 2}

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(
        ck.os,
        "replace",
        lambda src, dst, real=ck.os.replace: refuse(src, dst) if ".old_" in str(dst) else real(src, dst),
    )
    assert ck.save_checkpoint(tmp_path, 3, model, opt, {"prompts": {}}, keep=2).name == "step_000003"
    assert ck.latest_checkpoint(tmp_path).name == "step_000003"
    assert [p.name for p in ck._step_dirs(root)] == ["step_000001", "step_000002", "step_000003"]  # left, warned
    assert (root / "latest").read_text() == "step_000003\n" and not list(root.glob(".*.tmp"))


@pytest.mark.parametrize(
    "state",
    [
        "[]",
        "{}",
        '{"step": "3", "prompts": {}}',
        '{"step": -5, "prompts": {}}',
        '{"step": 3, "prompts": {}, "config": [1]}',
    ],
)
def test_a_damaged_state_json_is_named(qwen3_dir, tmp_path, state):
    model = exactrl.load_model(qwen3_dir)
    path = ck.save_checkpoint(tmp_path, 3, model, _opt(model), {"prompts": {}}, keep=1)
    (path / "state.json").write_text(state)
    with pytest.raises(ValueError, match="state.json is damaged"):
        ck.load_checkpoint(path, "float32", "exact")


def test_a_checkpoint_past_the_saved_step_is_set_aside_not_kept_as_the_newest(qwen3_dir, tmp_path, caplog):
    """A complete step_5 the pointer never named (killed between its rename and the pointer's: the run
    resumed from step_3) would, kept, count as the newest when pruning pushed step_3 out, and a lost
    pointer would resume from it. The next save moves it to abandoned_step_000005, deleting nothing."""
    model = exactrl.load_model(qwen3_dir)
    opt = _opt(model)
    for step in (3, 5):
        ck.save_checkpoint(tmp_path, step, model, opt, {"prompts": {"pos": step}}, keep=2)
    root = tmp_path / "checkpoints"
    (root / "latest").write_text("step_000003\n")  # as a crash before step 5's pointer leaves it
    assert ck.latest_checkpoint(tmp_path).name == "step_000003"
    with caplog.at_level("WARNING", logger="exactrl.checkpoint"):
        ck.save_checkpoint(tmp_path, 4, model, opt, {"prompts": {"pos": 4}}, keep=2)
    assert "step_000005 is past the step this run saved (4): moved to abandoned_step_000005" in caplog.text
    assert [p.name for p in ck._step_dirs(root)] == ["step_000003", "step_000004"]
    assert ck.load_checkpoint(root / "abandoned_step_000005", "float32", "exact")[2]["prompts"] == {"pos": 5}
    (root / "latest").unlink()
    assert ck.latest_checkpoint(tmp_path).name == "step_000004"
    ck.save_checkpoint(tmp_path, 5, model, opt, {"prompts": {"pos": 5}}, keep=2)  # the run goes on past it
    assert [p.name for p in ck._step_dirs(root)] == ["step_000004", "step_000005"]
    assert (root / "abandoned_step_000005").is_dir()
