"""`exactrl train` on a mixture-of-experts model end to end: the engine's experts reach the trainer, which
logs `mismatch/routing_agreement` 1.0 beside a logprob diff of 0.0, and `optim.router_aux_loss_coef` adds
the load-balancing loss (`train/router_aux_loss`)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import default_job_model, train_rows

SMALL = [
    "progress=false",
    "tensorboard=false",
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=2",
    "task.eval_size=0",
    "engine.kv_budget_tokens=4096",
]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A random Qwen3-MoE with the default job's tokenizer (its vocabulary and special tokens)."""
    import transformers

    base = default_job_model(tmp_path_factory, sft_steps=0)
    cfg = json.loads((base / "config.json").read_text())
    d = tmp_path_factory.mktemp("moe_job")
    torch.manual_seed(0)
    keep = ("vocab_size", "eos_token_id", "bos_token_id", "pad_token_id", "max_position_embeddings")
    moe = transformers.Qwen3MoeConfig(
        **{k: cfg[k] for k in keep if k in cfg},
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    )
    transformers.Qwen3MoeForCausalLM(moe).eval().save_pretrained(d)
    for f in base.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(f, d / f.name)
    return d


def test_a_moe_run_logs_routing_agreement_and_the_aux_loss(moe_dir, tmp_path):
    rows = train_rows(SMALL, moe_dir, tmp_path / "run", "max_steps=2", "optim.router_aux_loss_coef=0.01")
    steps = [r for r in rows if "mismatch/routing_agreement" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["mismatch/routing_agreement"] == 1.0
        assert r["train/train_rollout_logprob_abs_diff_max"] == 0.0
        assert r["train/router_aux_loss"] > 0
