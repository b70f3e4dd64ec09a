"""Decode graphs (engine/graph.py): recorded decode steps replay the eager forward bit for bit.

The engine's exactness tests run with graphs on (the default); these tests
check the graph machinery itself: that replays happen and equal the eager
engine and the trainer, that padding rows and shrinking batches leave real
rows alone, that graphs follow weight changes, and that a forward with an op
a replay would miss is refused rather than replayed wrong.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_hf_model
from engine_helpers import all_pages_free, mismatches

import exactrl
from exactrl import Engine, SamplingParams
from exactrl.engine.graph import MAX_GRAPHS, DecodeGraphs, GraphCaptureError, bucket
from exactrl.kernels import native
from exactrl.kernels.native.graph import Graph, recording

V = 211


@pytest.fixture(scope="module")
def model(qwen3_dir):
    return exactrl.load_model(qwen3_dir, dtype="float32", kernels="exact")


def _workload(seed: int):
    """Prompts of mixed lengths, sampling of every kind, lengths that end at different steps (the batch
    shrinks through several buckets and within them), n > 1 (forks)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(V) for _ in range(rng.choice([1, 2, 7, 31, 32, 33, 50]))] for _ in range(11)]
    params = [
        SamplingParams(
            max_tokens=rng.randrange(1, 30),
            seed=rng.randrange(99),
            n=rng.choice([1, 1, 2, 3]),
            temperature=rng.choice([0.0, 0.7, 1.0, 1.3]),
            top_k=rng.choice([-1, 5]),
            top_p=rng.choice([1.0, 0.9]),
            ignore_eos=True,
        )
        for _ in prompts
    ]
    return prompts, params


def _completions(engine, prompts, params):
    return [[(c.token_ids, c.logprobs) for c in o] for o in engine.generate(prompts, params)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replays_equal_the_eager_engine_and_the_trainer(model, seed):
    prompts, params = _workload(seed)
    graphs = Engine(model, max_num_seqs=16)
    got = _completions(graphs, prompts, params)
    assert got == _completions(Engine(model, max_num_seqs=16, decode_graphs=False), prompts, params)
    g = graphs._graphs
    assert g.num_captures >= 3 and g.num_replays >= 2 * g.num_captures  # several buckets, each replayed
    items = [(p, c, sp) for p, sp, o in zip(prompts, params, graphs.generate(prompts, params)) for c in o]
    assert not mismatches(model, items)
    assert all_pages_free(graphs)


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 64)] == [1, 2, 4, 4, 8, 8, 16, 16, 24, 64]


def test_padding_rows_write_only_the_scratch_page(model):
    """Batches of 8, then of 5 and shrinking, in a bucket of 8 (padding rows after a step whose real rows
    filled it): every page but the scratch page ends bitwise as in an eager engine's KV store, and the
    pool never hands the scratch page out."""
    rng = random.Random(3)
    prompts = [[[rng.randrange(V) for _ in range(9)] for _ in range(k)] for k in (8, 5)]
    stores = []
    for graphs in (True, False):
        engine = Engine(model, kv_budget_tokens=16 * 32, max_num_seqs=8, decode_graphs=graphs)
        engine.generate(prompts[0], SamplingParams(max_tokens=3, seed=1))
        engine.generate(prompts[1], [SamplingParams(max_tokens=2 + k, seed=2) for k in range(5)])
        assert engine.pool.scratch_page == engine.pool.num_pages not in engine.pool._free
        stores.append([t[: engine.pool.num_pages] for layer in engine.pool.kv for t in layer])
    assert all(torch.equal(a, b) for a, b in zip(*stores))


def test_graphs_follow_weight_changes(model, qwen3_dir):
    """In-place changes (version counter) and weights_changed drop the graphs; update_weights packs the
    weights again in place and keeps them. Either way the next steps compute with the new weights, bit for
    bit as an eager engine does."""
    m = exactrl.load_model(qwen3_dir, dtype="float32", kernels="exact")
    prompts, params = _workload(4)
    engine = Engine(m, max_num_seqs=16)
    first = _completions(engine, prompts, params)
    captures = engine._graphs.num_captures
    with torch.no_grad():
        m.model.layers[0].mlp.down_proj.weight.mul_(1.5)  # in place: the version counter moves
        m.model.layers[1].input_layernorm.weight.add_(0.25)
    after = _completions(engine, prompts, params)
    assert after != first and engine._graphs.num_captures > captures
    assert after == _completions(Engine(m, max_num_seqs=16, decode_graphs=False), prompts, params)
    sd = {k: v * 0.9 for k, v in m.state_dict().items() if not k.startswith("rope")}
    captures = engine._graphs.num_captures
    engine.update_weights({k: v for k, v in sd.items() if k in dict(m.named_parameters())})
    assert engine._graphs._graphs
    updated = _completions(engine, prompts, params)
    assert engine._graphs.num_captures == captures and updated != after  # replayed on the new weights
    assert updated == _completions(Engine(m, max_num_seqs=16, decode_graphs=False), prompts, params)
    with torch.no_grad():
        m.model.layers[0].self_attn.o_proj.weight.data.mul_(0.5)  # through .data: no version change
    engine.weights_changed()
    assert not engine._graphs._graphs
    assert _completions(engine, prompts, params) == _completions(
        Engine(m, max_num_seqs=16, decode_graphs=False), prompts, params
    )


def test_few_graphs_are_kept(model):
    engine = Engine(model, max_num_seqs=64)
    rng = random.Random(5)
    for n in (1, 2, 3, 5, 9, 17, 25, 33, 41, 49):  # 10 buckets
        engine.generate([[rng.randrange(V) for _ in range(4)] for _ in range(n)], SamplingParams(max_tokens=3))
    assert len(engine._graphs._graphs) == MAX_GRAPHS


def test_a_forward_with_a_torch_op_is_refused_not_replayed(model, qwen3_dir, monkeypatch):
    """A model change that computes with torch (here a tanh after the MLP; a product with a number or an
    add would be recorded as a native kernel) would be missing from a replay: capture raises, naming the
    op; decode_graphs=False runs it."""
    m = exactrl.load_model(qwen3_dir, dtype="float32", kernels="exact")
    mlp = m.model.layers[0].mlp
    plain = type(mlp).forward
    monkeypatch.setattr(mlp, "forward", lambda x: torch.tanh(plain(mlp, x)))
    with pytest.raises(GraphCaptureError, match="'tanh'"):
        Engine(m).generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    out = Engine(m, decode_graphs=False).generate([[1, 2, 3]], SamplingParams(max_tokens=3, seed=0))
    assert not mismatches(m, [([1, 2, 3], out[0][0], SamplingParams(max_tokens=3, seed=0))])


def test_forward_hooks_are_refused_not_skipped(qwen3_dir):
    """A replay runs no Python, so a hook on the engine's model would silently stop running: refused."""
    m = exactrl.load_model(qwen3_dir, dtype="float32", kernels="exact")
    seen = []
    handle = m.model.layers[1].mlp.register_forward_hook(lambda mod, i, o: seen.append(o.shape))
    with pytest.raises(GraphCaptureError, match="forward hooks.*model.layers.1.mlp"):
        Engine(m).generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    Engine(m, decode_graphs=False).generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    assert len(seen) > 3  # every step called it
    handle.remove()
    engine = Engine(m)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    handle = m.model.norm.register_forward_pre_hook(lambda mod, i: None)  # after the graphs were recorded
    with pytest.raises(GraphCaptureError, match="model.norm"):
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    handle.remove()


def test_only_exact_fp32_engines_record(qwen3_dir):
    for dtype, kernels in (("bfloat16", "exact"), ("float32", "fast")):
        m = exactrl.load_model(qwen3_dir, dtype=dtype, kernels=kernels)
        assert not DecodeGraphs.supported(m) and Engine(m)._graphs is None
    assert Engine(exactrl.load_model(qwen3_dir), decode_graphs=False)._graphs is None


def test_qwen2_biases_replay_as_native_adds(tmp_path):
    """Qwen2's q/k/v biases are torch adds in the forward: recorded as the native add, the same bits."""
    make_hf_model(tmp_path, "qwen2")
    m = exactrl.load_model(tmp_path, dtype="float32", kernels="exact")
    prompts, params = _workload(6)
    engine = Engine(m, max_num_seqs=16)
    got = _completions(engine, prompts, params)
    assert engine._graphs.num_replays > 0
    assert got == _completions(Engine(m, max_num_seqs=16, decode_graphs=False), prompts, params)


def test_native_add_has_torchs_bits():
    g = torch.Generator().manual_seed(0)
    a, b, bias = torch.randn(37, 50, generator=g), torch.randn(37, 50, generator=g), torch.randn(50, generator=g)
    assert torch.equal(native.add(a, b), a + b)
    assert torch.equal(native.add(a, bias), a + bias)
    assert torch.equal(native.add(a.view(37, 5, 10), bias.view(5, 10)), (a + bias).view(37, 5, 10))


def test_a_graph_replays_its_calls_and_refuses_other_kernels():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(10, generator=g), torch.randn(10, generator=g)
    calls = []
    with recording(calls):
        out = native.add(a, b)
    graph = Graph(calls)
    a.mul_(2.0)  # the replay reads the buffers as they are now
    graph.run()
    assert torch.equal(out, a + b)
    with recording(calls := []):
        native.log_softmax(a.view(2, 5))
    with pytest.raises(RuntimeError, match="exactrl_log_softmax"):
        Graph(calls)
