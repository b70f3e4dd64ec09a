"""Engine == trainer, bitwise, on Gemma 2 (with and without soft-capping) and Gemma 3 text models (prompts and
generations past the sliding window, chunked prefill, batched decode, forked samples); the fast twin differs."""

from __future__ import annotations

import random

import pytest
from conftest import make_hf_model
from engine_helpers import mismatches

import exactrl
from exactrl import Engine, SamplingParams

V = 211
GEMMA = {
    "gemma3": dict(
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=20,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    "gemma2": dict(sliding_window=5, attn_logit_softcapping=None, final_logit_softcapping=None),
    # caps a tiny random model's scores and logits reach (the defaults, 50 and 30, are nearly linear here)
    "gemma2-capped": dict(sliding_window=5, attn_logit_softcapping=1.5, final_logit_softcapping=2.0),
}


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory):
    out = {}
    for arch, over in GEMMA.items():
        out[arch] = tmp_path_factory.mktemp(arch)
        make_hf_model(out[arch], arch.split("-")[0], **over)
    return out


def _run(model, **config):
    rng = random.Random(7)
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (3, 24, 9)]
    sp = SamplingParams(max_tokens=12, n=2, seed=5, ignore_eos=True)
    outs = Engine(model, **config).generate(prompts, sp)
    return mismatches(model, [(p, c, sp) for p, o in zip(prompts, outs) for c in o])


@pytest.mark.parametrize("arch", list(GEMMA))
@pytest.mark.parametrize("config", [{}, dict(max_num_batched_tokens=16)])
def test_gemma_engine_equals_trainer(gemma_dirs, arch, config):
    assert not _run(exactrl.load_model(gemma_dirs[arch], block_size=8), **config)


@pytest.mark.parametrize("arch", list(GEMMA))
def test_gemma_fast_twin_differs(gemma_dirs, arch):
    assert _run(exactrl.load_model(gemma_dirs[arch], block_size=8, kernels="fast"))


@pytest.mark.parametrize("arch", ["gemma2-capped", "gemma3"])
def test_gemma_decodes_through_graphs_bit_for_bit(gemma_dirs, arch):
    """Gemma 2 (GeGLU, (1 + w) norms, capped scores and logits) and Gemma 3 (per-head q/k norms, each layer's
    half of the [global | local] RoPE tables read in place) replay recorded decode steps: the same tokens and
    logprobs as the eager engine."""
    model = exactrl.load_model(gemma_dirs[arch], block_size=8)
    rng = random.Random(3)
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (3, 11, 6)]
    sp = SamplingParams(max_tokens=10, n=2, seed=4, ignore_eos=True)
    engine = Engine(model)
    got = [[(c.token_ids, c.logprobs) for c in o] for o in engine.generate(prompts, sp)]
    assert engine._graphs is not None and engine._graphs.num_replays > 0
    eager = Engine(model, decode_graphs=False).generate(prompts, sp)
    assert got == [[(c.token_ids, c.logprobs) for c in o] for o in eager]
