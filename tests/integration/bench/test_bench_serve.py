"""`exactrl bench serve --quick`: starts `exactrl serve` in its own process and prints the JSON figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow  # a benchmark run: `make test-slow` (CI)
def test_bench_serve_quick_runs_the_cli_server():
    out = subprocess.run(
        [sys.executable, "-m", "exactrl.cli", "bench", "serve", "--quick", "--clients", "1,4"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout)
    assert [r["clients"] for r in res["results"]] == [1, 4]
    for r in res["results"]:
        assert r["requests"] == r["clients"] and r["generated_tokens"] == 16 * r["clients"]
        assert r["requests_per_s"] > 0 and r["gen_tokens_per_s"] > 0


def test_bench_serve_names_a_model_dir_that_is_not_one(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "exactrl.cli", "bench", "serve", "--model", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"--model {tmp_path / 'nope'}: no config.json there" in out.stderr
