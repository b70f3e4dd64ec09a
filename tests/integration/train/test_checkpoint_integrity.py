"""Checkpoint digests: state.json records the sha256 of each other file, and a resume checks them first.

Flipped bytes behind an intact safetensors header load without an error: the run would train on from
garbage weights (reward 0.0) without a word. The checks name the file that differs and what to do.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
from conftest import default_job_model, train_args

import exactrl
from exactrl.cli import main
from exactrl.train import checkpoint as ck


def _opt(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.cat(exactrl.sequence_logprobs(model, [[1, 2, 3, 4]])).sum().backward()
    opt.step()
    return opt


def flip_tensor_bytes(path) -> None:
    """Flips the last bytes of a safetensors file's tensor data; its header stays intact."""
    data = bytearray(path.read_bytes())
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    assert len(data) > header_end + 4
    data[-4:] = bytes(b ^ 0x5A for b in data[-4:])
    path.write_bytes(bytes(data))


@pytest.fixture
def saved(qwen3_dir, tmp_path):
    """Checkpoints of steps 1 and 2 under tmp_path."""
    model = exactrl.load_model(qwen3_dir)
    opt = _opt(model)
    for step in (1, 2):
        ck.save_checkpoint(tmp_path, step, model, opt, {"prompts": {"pos": step}}, keep=3)
    return tmp_path / "checkpoints"


def test_a_checkpoint_records_a_digest_of_each_file_and_a_fresh_one_verifies(saved, qwen3_dir):
    state = json.loads((saved / "step_000002" / "state.json").read_text())
    assert sorted(state[ck.DIGESTS]) == sorted(
        p.name for p in (saved / "step_000002").iterdir() if p.name != "state.json"
    )
    assert ck.verify_digests(saved / "step_000002") is True
    assert ck.verify_digests(qwen3_dir) is False  # a plain model directory: nothing to check
    # the trainer's state comes back as it was given
    assert ck.load_checkpoint(saved / "step_000002", "float32", "exact")[2] == {"step": 2, "prompts": {"pos": 2}}


def test_flipped_weight_bytes_are_named_with_the_checkpoints_to_resume_from(saved):
    flip_tensor_bytes(saved / "step_000002" / "model.safetensors")
    exactrl.load_model(saved / "step_000002")  # the damage the digests are for: it loads
    with pytest.raises(ValueError, match=r"step_000002/model.safetensors is damaged: its sha256 differs"):
        ck.verify_digests(saved / "step_000002")
    with pytest.raises(
        ValueError,
        match=r"step_000002 cannot be read \(.*step_000002/model.safetensors is damaged.*"
        r"older checkpoints there: step_000001 \(remove step_000002",
    ):
        ck.load_checkpoint(saved / "step_000002", "float32", "exact")
    assert ck.load_checkpoint(saved / "step_000001", "float32", "exact")[2]["step"] == 1


def test_a_damaged_optimizer_state_or_a_missing_file_is_named(saved):
    opt = saved / "step_000002" / "optimizer.pt"
    data = bytearray(opt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    opt.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"step_000002/optimizer.pt is damaged"):
        ck.load_checkpoint(saved / "step_000002", "float32", "exact")
    (saved / "step_000001" / "config.json").unlink()
    with pytest.raises(
        ValueError,
        match=r"step_000001/config.json is missing.*older checkpoints there: "
        r"step_000002",
    ):
        ck.load_checkpoint(saved / "step_000001", "float32", "exact")


def test_with_no_other_checkpoint_the_error_says_so(qwen3_dir, tmp_path):
    model = exactrl.load_model(qwen3_dir)
    ck.save_checkpoint(tmp_path, 1, model, _opt(model), {"prompts": {}}, keep=2)
    flip_tensor_bytes(tmp_path / "checkpoints" / "step_000001" / "model.safetensors")
    with pytest.raises(ValueError, match="no other checkpoint is there"):
        ck.load_checkpoint(tmp_path / "checkpoints" / "step_000001", "float32", "exact")


def test_damaged_digests_in_state_json_are_named(saved):
    path = saved / "step_000002" / "state.json"
    for bad in ("x", {"../model.safetensors": "0"}, {"model.safetensors": 3}):
        state = json.loads(path.read_text())
        state[ck.DIGESTS] = bad
        path.write_text(json.dumps(state))
        with pytest.raises(ValueError, match=r"state.json is damaged: its file_sha256 is not a mapping"):
            ck.load_checkpoint(saved / "step_000002", "float32", "exact")


def test_a_checkpoint_written_without_digests_resumes_with_a_note(saved):
    path = saved / "step_000002" / "state.json"
    state = json.loads(path.read_text())
    del state[ck.DIGESTS]
    path.write_text(json.dumps(state))
    notes = []
    assert ck.verify_digests(saved / "step_000002") is False
    assert ck.load_checkpoint(saved / "step_000002", "float32", "exact", note=notes.append)[2]["step"] == 2
    assert notes == [
        "note: checkpoint step_000002 records no file digests (written by an earlier exactrl): its "
        "files are loaded unchecked"
    ]


TINY = [
    "progress=false",
    "tensorboard=false",
    "task.eval_size=0",
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=2",
    "engine.kv_budget_tokens=2048",
    "save_every=1",
]


def test_resuming_from_flipped_weight_bytes_is_refused_by_train(tmp_path_factory, tmp_path, capfd):
    model_dir = default_job_model(tmp_path_factory, sft_steps=0)
    run = tmp_path / "r"
    assert main(train_args(TINY, model_dir, run, "max_steps=2")) == 0
    flip_tensor_bytes(run / "checkpoints" / "step_000002" / "model.safetensors")
    capfd.readouterr()
    assert main(train_args(TINY, model_dir, run, "max_steps=3", "resume=true")) == 2
    err = capfd.readouterr().err.strip()
    assert err.startswith("exactrl train: error: checkpoint ") and "\n" not in err, err
    assert "step_000002/model.safetensors is damaged" in err and "older checkpoints there: step_000001" in err
