"""`exactrl bench engine --quick` runs end to end and prints the figures as JSON."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "engine.py"


def test_bench_engine_quick(capsys):
    spec = importlib.util.spec_from_file_location("exactrl_bench_engine", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--quick"])
    out = json.loads(capsys.readouterr().out)
    for row in out["models"]["tiny"]["batches"].values():
        for key in ("exact_tok_s", "fast_tok_s", "hf_tok_s", "exact_over_fast", "exact_over_hf", "kv_cache_mb",
                    "gemm_floor_tok_s", "gemm_floor_over_hf"):
            assert row[key] > 0, key
    assert out["process_max_rss_mb"] > 0
