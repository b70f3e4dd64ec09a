"""`exactrl bench kernels --quick` runs end to end and prints its figures as JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "kernels.py"


def test_bench_kernels_quick(capsys):
    spec = importlib.util.spec_from_file_location("exactrl_bench_kernels", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--quick"])
    out = json.loads(capsys.readouterr().out)
    assert out["matmul_peak_gflops_fp32"] > 0 and out["peak_rss_mb"] > 0
    row = out["models"]["tiny"]
    for kind in ("exact", "fast"):
        for key in ("train_tokens_per_s", "train_mfu", "decode_b1_tokens_per_s", "decode_b32_tokens_per_s"):
            assert row[kind][key] > 0, (kind, key)
    assert all(r > 0 for r in row["ratio_exact_over_fast"].values())
