"""The examples run: a tiny version of each, so they do not rot as the API they show moves."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
