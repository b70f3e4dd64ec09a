"""Atomic checkpoints: a crash mid-save leaves the previous checkpoint usable."""
from __future__ import annotations

import pytest
import torch

import exactrl
from exactrl.rl import checkpoint as ck


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
