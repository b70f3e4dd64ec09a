"""Engine == trainer, bitwise, on mixture-of-experts models (prefill, chunked prefill, batched decode, forked
samples), and the engine's experts == the trainer's (`mismatch/routing_agreement` 1.0); the fast twin differs
in logprobs and, with near-tied router logits, in routing too."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_hf_model
from engine_helpers import mismatches

import exactrl
from exactrl import Engine, SamplingParams
from exactrl.model.moe import moe_layers
from exactrl.model.routing import routing_agreement, trainer_experts

V = 211
FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    out = {}
    for arch in FAMILIES:
        out[arch] = tmp_path_factory.mktemp(arch)
        make_hf_model(out[arch], arch, **(dict(clip_qkv=2.0) if arch == "olmoe" else {}))
    return out


def _generate(model, **config):
    rng = random.Random(7)
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (3, 24, 9)]
    sp = SamplingParams(max_tokens=10, n=2, seed=5, ignore_eos=True)
    outs = Engine(model, **config).generate(prompts, sp)
    return [(p, c, sp) for p, o in zip(prompts, outs) for c in o]


def _agreement(model, items):
    prompts, comps = [p for p, _, _ in items], [c for _, c, _ in items]
    ours = trainer_experts(model, prompts, [c.token_ids for c in comps])
    return routing_agreement([c.experts for c in comps], ours)


def _generate_with(model, **config):
    rng = random.Random(7)
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (3, 24, 9)]
    sp = SamplingParams(max_tokens=10, n=2, seed=5, ignore_eos=True)
    engine = Engine(model, **config)
    outs = engine.generate(prompts, sp)
    return engine, [(p, c, sp) for p, o in zip(prompts, outs) for c in o]


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("config", [{}, dict(max_num_batched_tokens=16), dict(decode_graphs=False)])
def test_moe_engine_equals_trainer(moe_dirs, arch, config):
    """Decode graphs (the default) replay the routed experts as one recorded call (and Qwen2-MoE's shared
    expert through its native gate, OLMoE's clip_qkv through the native clamp)."""
    model = exactrl.load_model(moe_dirs[arch], block_size=8)
    engine, items = _generate_with(model, **config)
    graphs = config.get("decode_graphs", True)
    assert (engine._graphs is not None and engine._graphs.num_replays > 0) == graphs
    assert not mismatches(model, items)
    assert all(len(c.experts) == len(c.token_ids) and len(c.experts[0]) == 2 for _, c, _ in items)
    assert _agreement(model, items) == 1.0


def test_moe_graph_replays_report_their_own_bucket(moe_dirs):
    """Two buckets recorded, then the first replayed: the experts each step reports are that step's (the
    replayed graph's buffers), so routing agreement stays 1.0 whatever bucket was recorded last."""
    model = exactrl.load_model(moe_dirs["qwen3_moe"], block_size=8)
    engine = Engine(model)
    rng = random.Random(3)
    sp = SamplingParams(max_tokens=6, n=1, seed=2, ignore_eos=True)
    for batch in (5, 1, 5):
        prompts = [[rng.randrange(V) for _ in range(4 + i)] for i in range(batch)]
        comps = [o[0] for o in engine.generate(prompts, sp)]
        ours = trainer_experts(model, prompts, [c.token_ids for c in comps])
        assert routing_agreement([c.experts for c in comps], ours) == 1.0
    assert engine._graphs.num_captures == 2


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_fast_twin_differs(moe_dirs, arch):
    assert mismatches(*_fast(moe_dirs[arch]))


def _fast(path, tie: float | None = None):
    model = exactrl.load_model(path, block_size=8, kernels="fast")
    if tie is not None:  # expert 1's router row a hair from expert 0's: their logits tie to a few ulps
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for m in moe_layers(model):
                w = m.gate.weight
                w[1] = w[0] + tie * torch.randn(w.shape[1], generator=g)
    return model, _generate(model)


def test_routing_agreement_below_one_with_fast_kernels_on_near_ties(moe_dirs):
    """Where two experts' router logits differ by rounding-sized amounts, the fast kernels' batch-dependent
    rounding picks different experts in the engine and the trainer; the exact kernels never do."""
    model, items = _fast(moe_dirs["qwen3_moe"], tie=1e-7)
    fast = _agreement(model, items)
    assert 0.0 < fast < 1.0
    exact = exactrl.load_model(moe_dirs["qwen3_moe"], block_size=8)
    with torch.no_grad():
        for m, f in zip(moe_layers(exact), moe_layers(model)):
            m.gate.weight.copy_(f.gate.weight)
    assert _agreement(exact, _generate(exact)) == 1.0


def test_routing_agreement_formula():
    t = torch.tensor([[[0, 1], [2, 3]], [[1, 2], [0, 3]]])  # 2 tokens, 2 layers, k = 2
    assert routing_agreement([[[[1, 0], [3, 2]], [[1, 2], [0, 3]]]], [t]) == 1.0  # order within a set is free
    assert routing_agreement([[[[0, 1], [2, 3]], [[1, 2], [0, 2]]]], [t]) == 0.5  # one layer differs: token differs
    assert routing_agreement([[[[0, 1], [2, 3]], [[1, 2], [0, 2]]]], [t], mask=[[1, 0]]) == 1.0
    with pytest.raises(ValueError, match="sequence 0: rollout experts have shape"):
        routing_agreement([[[[0, 1]]]], [t])


def test_moe_lora_on_experts_decodes_eagerly_and_exactly(moe_dirs):
    """LoRA adapters on the experts' projections: the one-call path (and so the decode graphs) steps aside
    for the module path, which applies them; engine == trainer still, and a LoRA on attention only keeps
    the graphs."""
    from exactrl.model.lora import add_lora

    for targets, graphs in ((("gate_proj", "down_proj"), False), (("q_proj", "o_proj"), True)):
        model = add_lora(exactrl.load_model(moe_dirs["qwen3_moe"], block_size=8), 2, 4.0, targets, 0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(len(name)))
        engine, items = _generate_with(model)
        assert (engine._graphs.num_replays > 0) == graphs
        assert not mismatches(model, items)
        assert _agreement(model, items) == 1.0
