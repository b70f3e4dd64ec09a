"""A LoRA run end to end (`exactrl train --set model.lora.rank=...`): diff 0.0 at every step, checkpoints
in PEFT's format that peft loads onto the transformers model, a resume equal to the uninterrupted run, and
`exactrl export --merge` giving a model exactrl and transformers load, within 1e-4 of the adapters' logits.

Runs go through the CLI on the default job's model, warm started for a few steps and built once per module.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import default_job_model, train_rows
from safetensors.torch import load_file

import exactrl
from exactrl.cli import main as cli_main
from exactrl.model import forward_logits
from exactrl.model.lora_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_adapters

SMALL = [
    "progress=false",
    "tensorboard=false",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=8",
    "task.eval_size=0",
    "optim.lr=2e-2",
    "engine.kv_budget_tokens=4096",
    "model.lora.rank=4",
    "model.lora.alpha=8",
]
TIMING = ("time/", "perf/tokens_per_s")  # wall-clock metrics, the only ones allowed to differ between runs
IDS = [[3, 17, 42, 99, 120, 7, 250, 31, 64, 5, 88, 13]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return default_job_model(tmp_path_factory, sft_steps=20)


@pytest.fixture(scope="module")
def full_run(model_dir, tmp_path_factory):
    """An uninterrupted 4-step LoRA run: (run dir, metrics rows)."""
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    return run_dir, train_rows(SMALL, model_dir, run_dir, "max_steps=4", "save_every=2")


def lora_logits(model_dir, ckpt) -> torch.Tensor:
    return forward_logits(load_adapters(exactrl.load_model(model_dir), ckpt), IDS)[0]


def test_every_step_is_exact_and_checkpoints_are_peft_adapters(model_dir, full_run):
    run_dir, rows = full_run
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert r["train/train_rollout_logprob_abs_diff"] == 0.0
        assert r["train/train_rollout_logprob_abs_diff_max"] == 0.0
    assert any(r["train/grad_norm"] > 0 for r in steps[:-1])  # the adapters moved before a later step sampled
    ckpt = run_dir / "checkpoints" / "step_000004"
    assert {p.name for p in ckpt.iterdir()} == {ADAPTER_WEIGHTS, ADAPTER_CONFIG, "optimizer.pt", "state.json"}
    cfg = json.loads((ckpt / ADAPTER_CONFIG).read_text())
    assert (cfg["peft_type"], cfg["task_type"], cfg["r"], cfg["lora_alpha"]) == ("LORA", "CAUSAL_LM", 4, 8.0)
    assert cfg["base_model_name_or_path"] == str(model_dir.resolve())
    ours = lora_logits(model_dir, ckpt)
    assert (ours - forward_logits(exactrl.load_model(model_dir), IDS)[0]).abs().max() > 0  # trained adapters


def test_peft_loads_a_runs_checkpoint(model_dir, full_run):
    import peft
    import transformers

    ckpt = full_run[0] / "checkpoints" / "step_000004"
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(hf, ckpt).eval()
    with torch.no_grad():
        theirs = pm(torch.tensor(IDS)).logits[0]
    assert (lora_logits(model_dir, ckpt) - theirs).abs().max() < 1e-4


def test_resumed_run_equals_uninterrupted_run(model_dir, full_run, tmp_path):
    part = tmp_path / "part"
    train_rows(SMALL, model_dir, part, "max_steps=2", "save_every=2")
    resumed = train_rows(SMALL, model_dir, part, "max_steps=4", "save_every=2", "resume=true")
    full = full_run[1]
    assert [r["step"] for r in resumed] == [r["step"] for r in full]
    for x, y in zip(full, resumed):
        diff = {k: (x[k], y.get(k)) for k in x if not k.startswith(TIMING) and x[k] != y.get(k)}
        assert not diff, (x["step"], diff)
    a, b = (load_file(d / "checkpoints" / "step_000004" / ADAPTER_WEIGHTS) for d in (full_run[0], part))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the adapters, bit for bit


def test_export_merge_loads_in_exactrl_and_transformers(model_dir, full_run, tmp_path, capsys):
    import transformers

    ckpt = full_run[0] / "checkpoints" / "step_000004"
    out = tmp_path / "merged"
    assert cli_main(["export", str(ckpt), "--out", str(out), "--merge"]) == 0
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    ours = lora_logits(model_dir, ckpt)
    assert (forward_logits(exactrl.load_model(out), IDS)[0] - ours).abs().max() < 1e-4
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        assert (hf(torch.tensor(IDS)).logits[0] - ours).abs().max() < 1e-4
    assert cli_main(["export", str(ckpt), "--out", str(out)]) == 2  # not empty: refused
    assert "not an empty directory" in capsys.readouterr().err
    assert cli_main(["export", str(ckpt), "--out", str(tmp_path / "adapters")]) == 0
    assert {p.name for p in (tmp_path / "adapters").iterdir()} >= {ADAPTER_WEIGHTS, ADAPTER_CONFIG, "tokenizer.json"}


def test_resume_onto_another_base_is_refused(model_dir, full_run, tmp_path, capsys):
    """The adapters record their base's digest: a run resumed with model.path at other weights stops."""
    other = exactrl.load_model(model_dir)
    with torch.no_grad():
        other.model.norm.weight[0] += 1.0
    exactrl.save_model(other, tmp_path / "other")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(model_dir / name, tmp_path / "other" / name)
    shutil.copytree(full_run[0], tmp_path / "run")
    args = [*SMALL, f"model.path={tmp_path / 'other'}", f"run_dir={tmp_path / 'run'}", "max_steps=5", "resume=true"]
    assert cli_main(["train", *[x for o in args for x in ("--set", o)]]) == 2
    assert "trained on a base model whose weights differ" in capsys.readouterr().err


def test_lora_with_an_external_backend_is_refused(model_dir, tmp_path, capsys):
    server = ["rollout_backend.kind=openai", "rollout_backend.base_url=http://127.0.0.1:9", "rollout_backend.model=m"]
    args = [*SMALL, f"model.path={model_dir}", f"run_dir={tmp_path / 'r'}", *server]
    assert cli_main(["train", *[x for o in args for x in ("--set", o)]]) == 2
    assert "only the in-process engine runs" in capsys.readouterr().err
