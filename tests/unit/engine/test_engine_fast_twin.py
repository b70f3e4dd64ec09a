"""Inverse twins: with `fast` kernels the same engine-vs-trainer comparison finds a difference.

Proof that the exactness tests can fail. fp32 fast already differs on plain
decode (the GEMM kernel depends on the number of rows); bf16 fast only shows
it on longer sequences / chunked prefill of a wider model, where SDPA's
split-dependent rounding appears — so the bf16 twin uses those, and its
exact-mode counterpart is checked in the same scenario.
"""

from __future__ import annotations

import random

import pytest
from conftest import make_hf_model
from engine_helpers import long_context_dir, long_prompts, mismatches, small_rope_chunk  # noqa: F401

import exactrl
from exactrl import Engine, SamplingParams

V = 211


def _run(model, prompts, sp, **config):
    outs = Engine(model, **config).generate(prompts, sp)
    return mismatches(model, [(p, c, sp) for p, o in zip(prompts, outs) for c in o])


def test_fast_fp32_engine_differs_from_trainer(qwen3_dir):
    rng = random.Random(0)
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (3, 40, 77, 20)]
    sp = SamplingParams(max_tokens=12, n=2, seed=1)
    assert not _run(exactrl.load_model(qwen3_dir, kernels="exact"), prompts, sp)
    assert _run(exactrl.load_model(qwen3_dir, kernels="fast"), prompts, sp)


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("wide_engine")
    make_hf_model(d, "qwen3", hidden_size=256, intermediate_size=512, head_dim=64, num_hidden_layers=1)
    return d


@pytest.mark.parametrize("kernels", ["exact", "fast"])
def test_bf16_long_chunked_prefill(wide_dir, kernels):
    rng = random.Random(1)
    prompts = [[rng.randrange(V) for _ in range(300)] for _ in range(3)]
    sp = SamplingParams(max_tokens=100, seed=2, ignore_eos=True)
    bad = _run(exactrl.load_model(wide_dir, dtype="bfloat16", kernels=kernels), prompts, sp, max_num_batched_tokens=150)
    assert bool(bad) == (kernels == "fast")


def test_fast_engine_differs_on_the_onednn_path_model(onednn_dir):
    """Twin of test_engine_exact's oneDNN-path test: same wide model and sampling, fast kernels."""
    rng = random.Random(5)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (3, 40, 70, 9)]
    sp = SamplingParams(max_tokens=12, n=2, seed=3, temperature=0.8, top_k=50)
    assert not _run(exactrl.load_model(onednn_dir, kernels="exact"), prompts, sp)
    assert _run(exactrl.load_model(onednn_dir, kernels="fast"), prompts, sp)


def test_fast_differs_where_the_rotary_tables_grow(long_context_dir):
    """The twin of test_engine_exact.py's test_exact_where_the_rotary_tables_grow."""
    sp = SamplingParams(max_tokens=8, n=2, seed=3, temperature=0.9, top_k=50)
    assert _run(
        exactrl.load_model(long_context_dir, kernels="fast"),
        long_prompts(),
        sp,
        kv_budget_tokens=32768,
        max_num_batched_tokens=48,
    )
