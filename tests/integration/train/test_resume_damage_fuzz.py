"""Resuming from a damaged run directory: a parametrized list of damages on copies of one tiny run.

Rules: bad input always gets a clear error that names the problem, and a crash does not lose a run's
checkpoints. Each damaged copy is resumed through `exactrl train` (the CLI) by one more step; the resume
either continues (from the newest complete checkpoint: `latest_checkpoint` falls back past one without
state.json) or fails with exit code 2, one line on stderr naming the damaged file, and no traceback.
Either way every checkpoint that was intact before stays byte for byte as it was.
tests/unit/train/test_checkpoint.py and tests/integration/train/test_loop.py cover the damages one at a time on a
fresh save (an unreadable optimizer.pt, a bad state.json's shape, a lost pointer, a half-written metrics row, a
held lock); this file resumes whole runs from them and from the ones they leave out.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from conftest import default_job_model, train_args

from exactrl.cli import main as cli_main

SMALL = [
    "progress=false",
    "tensorboard=false",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "task.eval_size=0",
    "optim.lr=1e-3",
    "engine.kv_budget_tokens=4096",
    "save_every=1",
    "keep_checkpoints=3",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return default_job_model(tmp_path_factory, sft_steps=20)


def train(model_dir, run_dir, *overrides) -> int:
    return cli_main(train_args(SMALL, model_dir, run_dir, *overrides))


@pytest.fixture(scope="module")
def base(model_dir, tmp_path_factory):
    """A run of 2 steps with a checkpoint after each: step_000001, step_000002."""
    d = tmp_path_factory.mktemp("base") / "run"
    assert train(model_dir, d, "max_steps=2") == 0
    assert sorted(p.name for p in (d / "checkpoints").glob("step_*")) == ["step_000001", "step_000002"]
    return d


def _digest(ckpt) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(ckpt.iterdir())}


def _truncate(path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _edit_state(d, step: int, edit) -> None:
    path = d / "checkpoints" / f"step_{step:06d}" / "state.json"
    state = json.loads(path.read_text())
    edit(state)
    path.write_text(json.dumps(state))


def _ckpt(d, step):
    return d / "checkpoints" / f"step_{step:06d}"


# (name, damage(run_dir), what a failing resume must name, or None if the resume must continue)
DAMAGES = [
    ("state_truncated", lambda d: _truncate(_ckpt(d, 2) / "state.json"), "step_000002"),
    ("state_not_json", lambda d: (_ckpt(d, 2) / "state.json").write_text("not json"), "step_000002"),
    ("state_empty", lambda d: (_ckpt(d, 2) / "state.json").write_text(""), "step_000002"),
    ("state_binary", lambda d: (_ckpt(d, 2) / "state.json").write_bytes(b"\xff\xfe\x00garbage"), "step_000002"),
    ("state_no_step", lambda d: _edit_state(d, 2, lambda s: s.pop("step")), "step_000002"),
    ("state_no_prompts", lambda d: _edit_state(d, 2, lambda s: s.pop("prompts")), "step_000002"),
    ("state_no_torch_rng", lambda d: _edit_state(d, 2, lambda s: s.pop("torch_rng")), "step_000002"),
    ("state_no_python_rng", lambda d: _edit_state(d, 2, lambda s: s.pop("python_rng")), "step_000002"),
    (
        "state_torch_rng_short",
        lambda d: _edit_state(d, 2, lambda s: s.update(torch_rng=s["torch_rng"][:10])),
        "step_000002",
    ),
    ("state_torch_rng_str", lambda d: _edit_state(d, 2, lambda s: s.update(torch_rng="x")), "step_000002"),
    (
        "state_python_rng_short",
        lambda d: _edit_state(d, 2, lambda s: s.update(python_rng=s["python_rng"][:5])),
        "step_000002",
    ),
    ("state_numpy_rng_bad", lambda d: _edit_state(d, 2, lambda s: s.update(numpy_rng=[1, 2])), "step_000002"),
    ("state_numpy_rng_str", lambda d: _edit_state(d, 2, lambda s: s.update(numpy_rng="x")), "step_000002"),
    ("state_prompts_list", lambda d: _edit_state(d, 2, lambda s: s.update(prompts=[1])), "step_000002"),
    ("state_prompts_index_str", lambda d: _edit_state(d, 2, lambda s: s["prompts"].update(index="x")), "step_000002"),
    ("state_prompts_no_epoch", lambda d: _edit_state(d, 2, lambda s: s["prompts"].pop("epoch")), "step_000002"),
    ("state_step_float", lambda d: _edit_state(d, 2, lambda s: s.update(step=2.0)), "step_000002"),
    ("state_step_bool", lambda d: _edit_state(d, 2, lambda s: s.update(step=True)), "step_000002"),
    ("state_step_disagrees", lambda d: _edit_state(d, 2, lambda s: s.update(step=7)), "step_000002"),
    ("state_step_behind", lambda d: _edit_state(d, 2, lambda s: s.update(step=1)), "step_000002"),
    ("state_config_str", lambda d: _edit_state(d, 2, lambda s: s.update(config="x")), "step_000002"),
    ("state_config_task_str", lambda d: _edit_state(d, 2, lambda s: s["config"].update(task="x")), "step_000002"),
    ("state_tokenizer_int", lambda d: _edit_state(d, 2, lambda s: s.update(tokenizer=3)), "step_000002"),
    ("state_missing", lambda d: (_ckpt(d, 2) / "state.json").unlink(), None),  # falls back to step_000001
    ("optimizer_missing", lambda d: (_ckpt(d, 2) / "optimizer.pt").unlink(), "step_000002"),
    ("optimizer_truncated", lambda d: _truncate(_ckpt(d, 2) / "optimizer.pt"), "step_000002"),
    ("optimizer_empty", lambda d: (_ckpt(d, 2) / "optimizer.pt").write_bytes(b""), "step_000002"),
    ("weights_missing", lambda d: (_ckpt(d, 2) / "model.safetensors").unlink(), "step_000002"),
    ("weights_truncated", lambda d: _truncate(_ckpt(d, 2) / "model.safetensors"), "step_000002"),
    ("weights_header_only", lambda d: _truncate(_ckpt(d, 2) / "model.safetensors", 0.01), "step_000002"),
    # bytes flipped behind an intact header load as weights: state.json's digests name the file
    ("weights_bytes_flipped", lambda d: _flip_last_bytes(_ckpt(d, 2) / "model.safetensors"), "model.safetensors"),
    ("optimizer_bytes_flipped", lambda d: _flip_last_bytes(_ckpt(d, 2) / "optimizer.pt"), "optimizer.pt"),
    ("state_digests_garbage", lambda d: _edit_state(d, 2, lambda s: s.update(file_sha256=[1])), "step_000002"),
    ("model_config_missing", lambda d: (_ckpt(d, 2) / "config.json").unlink(), "step_000002"),
    ("model_config_not_json", lambda d: (_ckpt(d, 2) / "config.json").write_text("{"), "step_000002"),
    ("model_config_no_layers", lambda d: _edit_json(_ckpt(d, 2) / "config.json", "num_hidden_layers"), "step_000002"),
    ("pointer_names_nothing", lambda d: (d / "checkpoints" / "latest").write_text("step_000009\n"), None),
    ("pointer_is_garbage", lambda d: (d / "checkpoints" / "latest").write_bytes(b"\xff\x00/../x"), None),
    # the step is trained, step_000003 renamed in place, then the pointer cannot replace a directory
    ("pointer_is_dir", lambda d: _replace_with_dir(d / "checkpoints" / "latest"), "latest"),
    ("pointer_names_older", lambda d: (d / "checkpoints" / "latest").write_text("step_000001\n"), None),
    ("stray_tmp_dir", lambda d: shutil.copytree(_ckpt(d, 2), d / "checkpoints" / ".tmp_step_000003"), None),
    ("stray_half_tmp_dir", lambda d: _half_tmp(d), None),
    ("stray_old_dir", lambda d: shutil.copytree(_ckpt(d, 1), d / "checkpoints" / ".old_step_000000"), None),
    ("stray_step_file", lambda d: (d / "checkpoints" / "step_000005").write_text("x"), None),
    ("stray_step_dir_empty", lambda d: (d / "checkpoints" / "step_000005").mkdir(), None),
    ("stray_pointer_tmp", lambda d: (d / "checkpoints" / ".latest.tmp").write_text("step_0"), None),
    ("metrics_half_last_line", lambda d: _append(d / "metrics.jsonl", '{"step": 3, "train/lo'), None),
    ("metrics_garbage_middle", lambda d: _insert_line(d / "metrics.jsonl", "garbage"), "metrics.jsonl"),
    ("metrics_row_list", lambda d: _insert_line(d / "metrics.jsonl", "[1, 2]"), "metrics.jsonl"),
    ("metrics_step_str", lambda d: _insert_line(d / "metrics.jsonl", '{"step": "1"}'), "metrics.jsonl"),
    ("metrics_binary", lambda d: _append(d / "metrics.jsonl", "\udcff", binary=b"\xff\xfe"), "metrics.jsonl"),
    ("metrics_missing", lambda d: (d / "metrics.jsonl").unlink(), None),
    ("metrics_is_dir", lambda d: _replace_with_dir(d / "metrics.jsonl"), "metrics.jsonl"),
    ("run_config_damaged", lambda d: (d / "config.json").write_text("{not json"), None),
    ("run_config_changed", lambda d: _edit_json(d / "config.json", "seed", 99), None),
    ("run_config_missing", lambda d: (d / "config.json").unlink(), None),
    ("lock_left_behind", lambda d: (d / ".lock").write_text("12345\n"), None),
    ("checkpoints_is_file", lambda d: _replace_with_file(d / "checkpoints"), "checkpoints"),
]


def _edit_json(path, key, value=...) -> None:
    data = json.loads(path.read_text())
    if value is ...:
        data.pop(key)
    else:
        data[key] = value
    path.write_text(json.dumps(data))


def _flip_last_bytes(path) -> None:
    data = bytearray(path.read_bytes())
    data[-4:] = bytes(b ^ 0x5A for b in data[-4:])
    path.write_bytes(bytes(data))


def _replace_with_dir(path) -> None:
    path.unlink()
    path.mkdir()


def _replace_with_file(path) -> None:
    shutil.rmtree(path)
    path.write_text("x")


def _half_tmp(d) -> None:
    tmp = d / "checkpoints" / ".tmp_step_000003"
    shutil.copytree(_ckpt(d, 2), tmp)
    (tmp / "state.json").unlink()
    _truncate(tmp / "optimizer.pt")


def _append(path, text: str, binary: bytes | None = None) -> None:
    with open(path, "ab") as f:
        f.write(binary if binary is not None else text.encode())


def _insert_line(path, line: str) -> None:
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], line, *lines[1:]]) + "\n")


@pytest.mark.parametrize("name,damage,named", DAMAGES, ids=[d[0] for d in DAMAGES])
def test_resume_from_a_damaged_run_dir_continues_or_names_the_problem(
    model_dir, base, tmp_path, capfd, name, damage, named
):
    d = tmp_path / "run"
    shutil.copytree(base, d)
    root = d / "checkpoints"
    before = {p.name: _digest(p) for p in root.glob("step_*")}
    damage(d)
    # the ones the damage left alone; a complete step_000002 the pointer does not name is one a crash left
    # unnamed, which a resume from step_000001 redoes by design (checkpoint.py)
    intact = {
        n: h
        for n, h in before.items()
        if (root / n).is_dir() and _digest(root / n) == h and not (name == "pointer_names_older" and n == "step_000002")
    }
    capfd.readouterr()
    code = train(model_dir, d, "max_steps=3", "resume=true")
    out, err = capfd.readouterr()
    for ckpt, digest in intact.items():  # never deleted nor overwritten
        assert (root / ckpt).is_dir() and _digest(root / ckpt) == digest, ckpt
    if named is None:
        assert code == 0, err
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        assert rows[-1]["step"] == 3 and len({r["step"] for r in rows}) == len(rows), rows
        assert (root / "latest").read_text() == "step_000003\n"
        assert json.loads((root / "step_000003" / "state.json").read_text())["step"] == 3
    else:
        assert code == 2, (out, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("exactrl train: error: "), err
        assert "Traceback" not in err and named in lines[0], err


def test_a_checkpoint_records_the_software_and_a_resume_under_another_torch_says_so(model_dir, base, tmp_path, capfd):
    import torch

    import exactrl

    saved = json.loads((_ckpt(base, 2) / "state.json").read_text())["software"]
    assert saved == {"exactrl": exactrl.__version__, "torch": torch.__version__, "python": saved["python"]}
    for torch_then, warned in ((torch.__version__, False), ("2.0.0", True)):
        d = tmp_path / f"run_{warned}"
        shutil.copytree(base, d)
        _edit_state(d, 2, lambda s: s["software"].update(torch=torch_then))
        capfd.readouterr()
        assert train(model_dir, d, "max_steps=3", "resume=true") == 0
        out, err = capfd.readouterr()
        assert ("written under torch 2.0.0, this run has " + torch.__version__ in out + err) == warned, (out, err)
        assert "resuming" in out + err
