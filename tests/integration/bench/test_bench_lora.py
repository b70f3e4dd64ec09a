"""`exactrl bench lora --quick` runs both modes in one process and prints them, with their ratios, as JSON."""

from __future__ import annotations

import json

from conftest import load_benchmark


def test_bench_lora_quick_prints_both_modes_and_their_ratios(capsys):
    load_benchmark("lora").main(["--quick", "--targets", "q_proj,v_proj,down_proj"])
    out = json.loads(capsys.readouterr().out)
    full, lora = out["modes"]["full"], out["modes"]["lora"]
    assert out["lora"] == {"rank": 4, "alpha": 32.0, "targets": ["q_proj", "v_proj", "down_proj"]}
    assert 0 < lora["trainable_params"] < full["trainable_params"] == out["params"]
    # a LoRA run keeps no gradient or moment of a base weight, and its engine shares the base
    assert lora["grads_mb"] < full["grads_mb"] and lora["optimizer_mb"] < full["optimizer_mb"]
    assert lora["weights_mb"] < full["weights_mb"] and lora["checkpoint_mb"] < full["checkpoint_mb"]
    assert all(m["total_mb"] == round(m["state_mb"] + m["step_peak_mb"], 1) for m in (full, lora))
    for mode in (full, lora):
        assert mode["step_s"] > 0 and mode["rollout_s"] > 0 and mode["sync_s"] > 0 and mode["step_peak_mb"] > 0
    ratios = out["lora_over_full"]
    assert ratios["state_mb"] == round(lora["state_mb"] / full["state_mb"], 4)
    assert set(ratios) >= {"step_s", "step_peak_mb", "rollout_s", "sync_s", "checkpoint_mb"}
