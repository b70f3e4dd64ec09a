"""Decode graphs of the triton backend (engine/cuda_graph.py), under Triton's interpreter, where a step is
recorded on a tape that replays kernel launches and torch ops as a CUDA graph does (tests/unit/kernels/
test_cuda.py runs the CUDA graphs themselves on a GPU).

Replays equal the eager engine and the trainer bit for bit, padding rows write only the scratch page, a
forward that reads a tensor on the host is refused, a replay does not re-run the model's Python, and it
reads weights written in place.
Kept small: the interpreter is slow.
"""

from __future__ import annotations

import random

import pytest
import torch
from interpreter import MARKS, use_interpreter

use_interpreter()

from conftest import make_hf_model  # noqa: E402
from engine_helpers import all_pages_free, mismatches  # noqa: E402

import exactrl  # noqa: E402
from exactrl import Engine, SamplingParams  # noqa: E402
from exactrl.engine.cuda_graph import TritonDecodeGraphs, _Tape  # noqa: E402
from exactrl.engine.graph import GraphCaptureError  # noqa: E402

pytestmark = MARKS
V = 211


@pytest.fixture(scope="module")
def model(qwen3_dir):
    return exactrl.load_model(qwen3_dir, kernels="exact", backend="triton")


def _run(model, graphs: bool):
    """Decode steps of 8 rows, then 6 in the same bucket of 8 (padding rows where real rows were), then 2 in a
    bucket of their own; forks (n = 2)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(V) for _ in range(rng.choice([2, 9, 17]))] for _ in range(4)]
    params = [SamplingParams(max_tokens=m, n=2, seed=m, temperature=0.8, ignore_eos=True) for m in (2, 3, 3, 6)]
    engine = Engine(model, kv_budget_tokens=16 * 16, max_num_seqs=8, decode_graphs=graphs)
    outs = engine.generate(prompts, params)
    items = [(p, c, sp) for p, sp, o in zip(prompts, params, outs) for c in o]
    store = [t[: engine.pool.num_pages].clone() for layer in engine.pool.kv for t in layer]
    return engine, items, store


def test_replays_equal_the_eager_engine_the_trainer_and_its_kv_store(model):
    engine, items, store = _run(model, graphs=True)
    g = engine._graphs
    assert isinstance(g, TritonDecodeGraphs) and g.num_captures == 2 and g.num_replays == 3
    _, eager_items, eager_store = _run(model, graphs=False)
    assert [c.logprobs for _, c, _ in items] == [c.logprobs for _, c, _ in eager_items]
    assert [c.token_ids for _, c, _ in items] == [c.token_ids for _, c, _ in eager_items]
    assert not mismatches(model, items)
    assert all(torch.equal(a, b) for a, b in zip(store, eager_store))  # every page but the scratch page
    assert all_pages_free(engine)


def test_the_tape_replays_torch_ops_on_the_same_tensors():
    """New tensors are recomputed into themselves, in-place ops (an index write, index_copy_) run again, views
    stay views; a value read on the host raises."""
    a, b, buf, idx = torch.randn(4), torch.randn(4), torch.zeros(6), torch.tensor([1, 3])
    with _Tape() as tape:
        y = (a + b) * 2.0
        buf[idx] = y[:2]
        buf.index_copy_(0, idx + 2, y[2:])
    a.copy_(torch.randn(4))
    idx.copy_(torch.tensor([0, 1]))
    want_y, want = (a + b) * 2.0, buf.clone()
    want[idx] = want_y[:2]
    want.index_copy_(0, idx + 2, want_y[2:])
    tape.run()
    assert torch.equal(y, want_y) and torch.equal(buf, want)
    with pytest.raises(GraphCaptureError, match="equal"), _Tape():
        torch.equal(a, b)


def test_a_host_read_in_the_forward_is_refused(model, monkeypatch):
    """CUDA refuses a sync inside a capture: the tape raises where a GPU would."""
    norm = model.model.norm
    monkeypatch.setattr(norm, "forward", lambda x: x * float(x[0, 0]))
    with pytest.raises(GraphCaptureError, match="__float__"):
        Engine(model, kv_budget_tokens=256).generate([[1, 2, 3]], SamplingParams(max_tokens=3))


@pytest.mark.slow  # the interpreter: `make test-slow` (CI)
def test_a_replay_does_not_rerun_the_models_python(model, monkeypatch):
    """What a CUDA graph holds is what the recording launched: a Python value the forward computes anew at each
    step stays as recorded in a replay (the eager engine sees it change)."""
    calls = []
    forward = model.model.norm.forward

    def counted(x):
        calls.append(1)
        return forward(x) * float(len(calls))  # a host number, different at every call

    monkeypatch.setattr(model.model.norm, "forward", counted)
    runs = []
    for graphs in (True, False):
        calls.clear()
        out = Engine(model, kv_budget_tokens=256, decode_graphs=graphs).generate(
            [[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0)
        )
        runs.append((len(calls), out[0][0].logprobs))
    (graph_calls, graph_lp), (eager_calls, eager_lp) = runs
    assert graph_calls == 2 and eager_calls == 4  # prefill + the recording; prefill + 3 decode steps
    assert graph_lp[:2] == eager_lp[:2] and graph_lp[2:] != eager_lp[2:]


@pytest.mark.slow  # the interpreter: `make test-slow` (CI)
def test_a_write_in_place_keeps_the_graphs_and_replays_see_it(qwen3_dir):
    """The graphs read the parameters themselves: after a LoRA trainer's optimizer-like write in place to the
    adapters they are kept, and the replays compute with the new weights, as an eager engine does."""
    from exactrl.model.lora import adapter_weights, add_lora

    m = add_lora(exactrl.load_model(qwen3_dir, kernels="exact", backend="triton"), 2, 4.0)
    engine, sp = Engine(m, kv_budget_tokens=256), SamplingParams(max_tokens=3, temperature=0.0)
    before = engine.generate([[1, 2, 3]], sp)[0][0].logprobs
    captures = engine._graphs.num_captures
    with torch.no_grad():
        for name, w in adapter_weights(m).items():
            if "lora_B" in name:  # zero at the start: the adapters then change the model
                w.add_(0.05)
    got = engine.generate([[1, 2, 3]], sp)[0][0].logprobs
    assert engine._graphs.num_captures == captures and engine._graphs.num_replays >= 2
    assert got == Engine(m, kv_budget_tokens=256, decode_graphs=False).generate([[1, 2, 3]], sp)[0][0].logprobs
    assert got[1:] != before[1:]


def test_only_exact_dense_triton_engines_record(model, qwen3_dir, tmp_path):
    assert TritonDecodeGraphs.supported(model)
    assert not TritonDecodeGraphs.supported(exactrl.load_model(qwen3_dir, kernels="fast", backend="triton"))
    assert not TritonDecodeGraphs.supported(exactrl.load_model(qwen3_dir))  # native: engine/graph.py's
    make_hf_model(tmp_path, "qwen3_moe")
    moe = exactrl.load_model(tmp_path, kernels="exact", backend="triton")
    assert not TritonDecodeGraphs.supported(moe) and Engine(moe)._graphs is None
