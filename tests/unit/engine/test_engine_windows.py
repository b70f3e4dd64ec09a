"""Engine == trainer, bitwise, on sliding-window and RoPE-scaled models: prompts and generations well past
the window, across KV pages (block size 8), with chunked prefill and decode graphs; the fast twin differs."""

from __future__ import annotations

import random

import pytest
from conftest import make_hf_model
from engine_helpers import mismatches

import exactrl
from exactrl import Engine, SamplingParams

V = 211


@pytest.fixture(scope="module")
def window_dirs(tmp_path_factory):
    out = {}
    for name, arch, over in [
        (
            "mistral",
            "mistral",
            dict(sliding_window=6, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
        ),
        (
            "qwen2",
            "qwen2",
            dict(
                use_sliding_window=True,
                sliding_window=11,
                max_window_layers=1,
                rope_parameters={
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "rope_theta": 1e6,
                    "original_max_position_embeddings": 32,
                },
            ),
        ),
        (
            "llama3",
            "llama",
            dict(
                rope_parameters={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                    "rope_theta": 5e5,
                }
            ),
        ),
    ]:
        out[name] = tmp_path_factory.mktemp(name)
        make_hf_model(out[name], arch, **over)
    return out


def _run(model, **config):
    rng = random.Random(7)
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (3, 40, 29, 9)]
    sp = SamplingParams(max_tokens=30, n=2, seed=5, ignore_eos=True)
    outs = Engine(model, **config).generate(prompts, sp)
    return mismatches(model, [(p, c, sp) for p, o in zip(prompts, outs) for c in o])


@pytest.mark.parametrize("name", ["mistral", "qwen2", "llama3"])
@pytest.mark.parametrize("config", [{}, dict(max_num_batched_tokens=16), dict(decode_graphs=False)])
def test_engine_equals_trainer_past_the_window(window_dirs, name, config):
    assert not _run(exactrl.load_model(window_dirs[name], block_size=8), **config)


@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_fast_twin_differs(window_dirs, name):
    assert _run(exactrl.load_model(window_dirs[name], block_size=8, kernels="fast"))
