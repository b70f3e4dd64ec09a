"""The examples run: a tiny version of each, so they do not rot as the API they show moves."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow  # a whole example run: `make test-slow` (CI)
def test_the_agent_example_trains_through_the_server_with_no_mismatch(tmp_path, capsys):
    agent = load("agent")
    out = tmp_path / "agent"
    assert agent.main(["--steps", "2", "--sft-steps", "30", "--problems", "2", "--group", "2", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["train/train_rollout_logprob_abs_diff"] == 0.0 and r["train/train_rollout_logprob_abs_diff_max"] == 0.0
        assert r["engine/version"] == r["step"] and r["rollout/failed_episodes"] == 0
    assert "step   2  reward" in capsys.readouterr().out


def test_the_agent_examples_arguments_are_checked(capsys):
    import pytest

    agent = load("agent")
    for argv, needle in ((["--group", "1"], "--group must be >= 2"), (["--steps", "0"], "--steps must be >= 1")):
        with pytest.raises(SystemExit):
            agent.main(argv)
        assert needle in capsys.readouterr().err


def test_the_distill_example_runs_every_arm_exactly(tmp_path, monkeypatch):
    from exactrl.train import warmstart

    monkeypatch.setattr(warmstart, "ARTIFACTS", tmp_path / "artifacts")
    distill = load("distill")
    out = tmp_path / "distill"
    small = ["sft.steps=5", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "task.eval_size=4"]
    argv = ["--steps", "2", "--teacher-steps", "2", "--out", str(out)] + [x for s in small for x in ("--set", s)]
    assert distill.main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"grpo", "distill", "dgrpo"}
    assert all(s["logprob_abs_diff_max"] == 0.0 for s in summary.values())
    assert summary["grpo"]["reverse_kl_first"] is None and summary["distill"]["reverse_kl_first"] is not None
    assert (out / "distill.png").stat().st_size > 0 and (out / "summary.md").read_text().count("\n") == 5


@pytest.mark.slow  # a whole example run (~30 s): `make test-slow` (CI)
def test_the_real_model_example_runs_on_a_gguf_file(tmp_path, capsys):
    """The recipe of examples/real_model.py on a tiny generated GGUF file (the real one is a package install
    away: docs/gguf.md): convert, check, parity, serve + openai chat, decode speed, GRPO with |Δlogp| = 0."""
    from conftest import make_hf_model
    from gguf_files import write_gguf

    import exactrl
    from exactrl.envs.arithmetic import ArithmeticTask
    from exactrl.model.tokenizer import build_tokenizer, default_tokenizer_corpus

    build_tokenizer(tmp_path / "tok", default_tokenizer_corpus([ArithmeticTask()], 200, 0), vocab_size=300)
    make_hf_model(tmp_path / "hf", "qwen3", vocab_size=300, max_position_embeddings=256)
    write_gguf(tmp_path / "tiny.gguf", exactrl.load_model(tmp_path / "hf"), tokenizer_dir=tmp_path / "tok")
    example = load("real_model")
    out = tmp_path / "out"
    argv = ["--model", str(tmp_path / "tiny.gguf"), "--steps", "2", "--batch", "2", "--new", "4", "--out", str(out)]
    assert example.main(argv) == 0
    printed = capsys.readouterr().out
    assert "verdict: BITWISE EXACT" in printed and "[serve] 'What is 12+7?" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["step_s"]) == 2 and summary["decode"]["exactrl"] > 0
