"""`exactrl bench train --quick` runs end to end and prints the figures as JSON.

The exactrl side must report a train/rollout logprob difference of exactly 0.0
with exact kernels (from `train_step`'s own metrics) and a non-zero one with
fast kernels; the TRL side runs only when trl is installed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "train.py"
DIFF, DIFF_MAX = "train/train_rollout_logprob_abs_diff", "train/train_rollout_logprob_abs_diff_max"


def run_bench(capsys, *args) -> dict:
    spec = importlib.util.spec_from_file_location("exactrl_bench_train", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--quick", *args])
    return json.loads(capsys.readouterr().out)


def check_side(row: dict) -> None:
    assert row["completion_tokens_per_s"] > 0 and row["step_s_mean"] > 0
    assert len(row["step_s"]) == 1  # --quick: one timed step after the warm-up


def test_bench_train_quick_exactrl_side(capsys):
    out = run_bench(capsys, "--no-trl", "--fast")
    assert out["shapes"]["completion_tokens_per_step"] == 2 * 4 * 8
    assert out["model"]["params"] > 0 and out["threads"] >= 1
    assert out["trl"] == "skipped (--no-trl)" and out["order"] == "sequential"
    exact, fast = out["exactrl"]["exact"], out["exactrl"]["fast"]
    check_side(exact), check_side(fast)
    assert exact[DIFF] == 0.0 and exact[DIFF_MAX] == 0.0
    assert fast[DIFF_MAX] > 0.0  # the inverse check: the metric can see a mismatch
    floor = out["flop_floor"]  # --quick: 2 prompts x 4 samples of 8 + 8 tokens
    m, B = out["model"], 2 * 4
    # each prompt once (a group shares it), every completion token but the last (whose output predicts
    # nothing) through the layers; the head on the rows that predict a completion token
    flop = 6 * m["matmul_params_body"] * (2 * 8 + B * 7) + 6 * m["matmul_params_head"] * B * 8
    assert floor["gflop_train"] == pytest.approx(flop / 1e9, abs=5e-4)
    # the rollout: the prefill, whose last row's head gives each prompt's samples their first token,
    # then the generated tokens fed back (not the last)
    flop = 2 * m["matmul_params_body"] * (2 * 8 + B * 7) + 2 * m["matmul_params_head"] * (2 + B * 7)
    assert floor["gflop_rollout"] == pytest.approx(flop / 1e9, abs=5e-4)
    assert floor["floor_step_s"] > 0 and floor["matmul_peak_gflops_fp32"] > 0
    assert "ceiling_over_trl" not in floor


def test_bench_train_quick_trl_side(capsys):
    pytest.importorskip("trl")
    out = run_bench(capsys)
    trl = out["trl"]
    check_side(trl)
    assert out["versions"]["trl"]
    assert trl["logprob_diff_sequences"] == 2 * 4
    assert 0.0 <= trl[DIFF] <= trl[DIFF_MAX] < 1e-3  # fp32: small, measured, not assumed
    assert out["exactrl"]["exact"][DIFF] == 0.0
    check_side(out["exactrl"]["exact"])  # its steps ran between TRL's, each timed alone
    assert out["order"].startswith("interleaved")
    assert out["ratio_exact_over_trl"] > 0 and "ratio_fast_over_trl" not in out
    assert out["flop_floor"]["ceiling_over_trl"] > 0
    assert out["phase_ratio_exact_over_trl"]["rollout"] > 0 and out["phase_ratio_exact_over_trl"]["rest"] > 0
