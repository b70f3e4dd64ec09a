"""`exactrl sft` end to end: a tiny local model trained on a small JSONL, its checkpoints, an interrupted run
resumed to the uninterrupted one's result, RL started from a checkpoint, and bad input named in one line."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import default_job_model

import exactrl
from exactrl.cli import main as cli_main
from exactrl.train import sft_run
from exactrl.train.checkpoint import latest_checkpoint

RECORDS = [
    {"messages": [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}]}
    for a, b in [(3, 4), (12, 7), (25, 25), (9, 1)]
] + [
    {"prompt": "6+6=", "completion": "12"},
    {"prompt": "40+2=", "completion": "42"},
    {
        "messages": [
            {"role": "system", "content": "Answer with the sum."},
            {"role": "user", "content": "1+1="},
            {"role": "assistant", "content": "2"},
            {"role": "user", "content": "and 2+2="},
            {"role": "assistant", "content": "4"},
        ]
    },
]
SETTINGS = [
    "progress=false",
    "tensorboard=false",
    "data.batch_size=3",
    "data.max_tokens=96",
    "optim.lr=3e-3",
    "save_every=2",
    "max_steps=4",
]
TIMING = ("time/", "perf/")  # wall-clock metrics, the only ones allowed to differ between runs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The default job's tokenizer (with its chat template) and tiny Qwen3, before any warm-start step."""
    return default_job_model(tmp_path_factory, sft_steps=0)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    f = tmp_path_factory.mktemp("sft-data") / "train.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return f


def sft(model_dir, data, run_dir, *overrides) -> int:
    sets = [*SETTINGS, f"model.path={model_dir}", f"data.train_jsonl={data}", f"run_dir={run_dir}", *overrides]
    return cli_main(["sft", *[x for s in sets for x in ("--set", s)]])


def rows(run_dir) -> list[dict]:
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith(TIMING)}
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]


def test_sft_trains_checkpoints_and_an_interrupted_run_resumes_to_the_same_weights(
    model_dir, data, tmp_path, monkeypatch, capsys
):
    full = tmp_path / "full"
    assert sft(model_dir, data, full) == 0
    got = rows(full)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert all({"train/loss", "train/tokens", "train/lr", "train/packs"} <= set(r) for r in got)
    assert got[-1]["train/loss"] < got[0]["train/loss"]
    assert [p.name for p in sorted((full / "checkpoints").glob("step_*"))] == ["step_000002", "step_000004"]
    assert latest_checkpoint(full).name == "step_000004"

    steps = 0
    step = sft_run.sft_step

    def ctrl_c_in_step_3(*args, **kwargs):
        nonlocal steps
        steps += 1
        if steps == 3:
            raise KeyboardInterrupt
        return step(*args, **kwargs)

    part = tmp_path / "part"
    monkeypatch.setattr(sft_run, "sft_step", ctrl_c_in_step_3)
    assert sft(model_dir, data, part) == 130
    assert f"interrupted: run {part} is kept and its last checkpoint is step_000002" in capsys.readouterr().err
    monkeypatch.undo()
    assert sft(model_dir, data, part, "resume=true") == 0
    assert rows(part) == got
    for name in ("step_000004/model.safetensors", "step_000004/optimizer.pt"):
        assert (full / "checkpoints" / name).read_bytes() == (part / "checkpoints" / name).read_bytes(), name


def test_a_checkpoint_is_a_model_that_load_model_reads_and_rl_starts_from(model_dir, data, tmp_path):
    run_dir = tmp_path / "run"
    assert sft(model_dir, data, run_dir, "max_steps=2") == 0
    ckpt = latest_checkpoint(run_dir)
    model = exactrl.load_model(ckpt)
    trained = dict(model.named_parameters())
    before = dict(exactrl.load_model(model_dir).named_parameters())
    assert trained.keys() == before.keys() and any(not torch.equal(trained[k], before[k]) for k in trained)
    rl = tmp_path / "rl"
    sets = [
        f"model.path={ckpt}",
        f"model.tokenizer={model_dir}",  # checkpoints hold no tokenizer
        f"run_dir={rl}",
        "max_steps=1",
        "progress=false",
        "tensorboard=false",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2",
        "task.eval_size=0",
        "engine.kv_budget_tokens=1024",
    ]
    assert cli_main(["train", *[x for s in sets for x in ("--set", s)]]) == 0
    row = json.loads((rl / "metrics.jsonl").read_text().splitlines()[0])
    assert row["train/train_rollout_logprob_abs_diff_max"] == 0.0


def error_of(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("exactrl sft: error: ") and "\n" not in err, err
    return err


def test_bad_input_is_one_line_naming_it_and_leaves_no_run_dir(model_dir, data, tmp_path, capsys):
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps({"prompt": "1+1=" * 40, "completion": "2"}) + "\n")
    run_dir = tmp_path / "never"
    assert sft(model_dir, long, run_dir) == 2
    assert re.search(
        rf"{re.escape(str(long))}:2: \d+ tokens, more than data.max_tokens=96 \(a packed sequence's budget\)",
        error_of(capsys),
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(RECORDS[0]) + "\n" + '{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert sft(model_dir, bad, run_dir) == 2
    assert f"{bad}:2: the record has no assistant turn" in error_of(capsys)
    assert cli_main(["sft", "--set", f"data.train_jsonl={data}"]) == 2
    assert "model.path is not set" in error_of(capsys)
    assert not run_dir.exists()


def test_a_resume_refuses_other_settings_and_the_other_command(model_dir, data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert sft(model_dir, data, run_dir, "max_steps=2") == 0
    capsys.readouterr()
    assert sft(model_dir, data, run_dir, "resume=true", "optim.lr=1e-2") == 2
    assert "with changed settings (optim.lr: 0.003 -> 0.01)" in error_of(capsys)
    assert sft(model_dir, data, run_dir) == 2
    assert "already holds checkpoints: pass --set resume=true" in error_of(capsys)
    rl = ["train", "--set", f"model.path={model_dir}", "--set", f"run_dir={run_dir}", "--set", "resume=true"]
    assert cli_main(rl) == 2
    assert f"run_dir {run_dir} holds checkpoints of an `exactrl sft` run: start RL from" in capsys.readouterr().err
    state = json.loads((latest_checkpoint(run_dir) / "state.json").read_text())
    del state["command"]  # as an `exactrl train` checkpoint has it
    (latest_checkpoint(run_dir) / "state.json").write_text(json.dumps(state))
    assert sft(model_dir, data, run_dir, "resume=true") == 2
    assert "holds checkpoints of an `exactrl train` run, not an SFT run" in error_of(capsys)
