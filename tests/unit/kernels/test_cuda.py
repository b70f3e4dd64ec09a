"""The triton backend on a GPU (marked `cuda`: skipped without one; benchmarks/cuda_check.sh runs them).

The same properties as the interpreter tests (tests/unit/kernels/test_triton_backend.py) at the shapes and dtypes that
matter on a GPU: every kernel against a float64 reference, batch invariance at real model widths, engine ==
trainer bitwise, and the fast twins that must differ.
"""

from __future__ import annotations

import pytest
import torch

import exactrl
from exactrl.model import ModelConfig, build_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def rel(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(2048, 1024), (1024, 3072), (151936, 1024)])
def test_linear_matches_float64_and_is_row_invariant(dtype, n, k):
    from exactrl.kernels.triton import ops

    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(dtype)
    x = torch.randn(300, k, device="cuda", generator=g).to(dtype)
    y = ops.linear(x, w)
    assert rel(y, x.double() @ w.double().T) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    for m in (1, 2, 7, 64, 129):
        assert torch.equal(ops.linear(x[:m], w), y[:m])
    big = torch.cat([torch.randn(1000, k, device="cuda", generator=g).to(dtype), x])
    assert torch.equal(ops.linear(big, w)[1000:], y)


def test_fast_linear_differs_with_the_row_count():
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1024, 3072, device="cuda", generator=g, dtype=torch.bfloat16)
    x = torch.randn(4096, 3072, device="cuda", generator=g, dtype=torch.bfloat16)
    full = torch.nn.functional.linear(x, w)
    assert any(not torch.equal(torch.nn.functional.linear(x[:m], w), full[:m]) for m in (1, 2, 3, 8, 17, 64))


def tiny_cfg(**over):
    base = dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    return ModelConfig.from_hf({**base, **over})


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_equals_trainer_on_cuda(dtype):
    model = build_model(tiny_cfg(), dtype=dtype, kernels="exact", device="cuda")
    eng = exactrl.Engine(model, kv_budget_tokens=8192)
    prompts = [[(7 * i + j) % 4096 for j in range(5 + 37 * i)] for i in range(6)]
    outs = eng.generate(prompts, exactrl.SamplingParams(max_tokens=40, n=3, seed=1, top_p=0.9))
    seqs = [p + c.token_ids for p, cs in zip(prompts, outs) for c in cs]
    lps = exactrl.sequence_logprobs(model, seqs, top_p=0.9)
    k = 0
    for p, cs in zip(prompts, outs):
        for c in cs:
            assert torch.equal(torch.tensor(c.logprobs), lps[k][len(p) - 1 :])
            k += 1


def test_fast_engine_differs_from_its_trainer():
    model = build_model(tiny_cfg(), dtype="bfloat16", kernels="fast", device="cuda")
    eng = exactrl.Engine(model, kv_budget_tokens=8192)
    prompts = [[(7 * i + j) % 4096 for j in range(5 + 37 * i)] for i in range(6)]
    outs = eng.generate(prompts, exactrl.SamplingParams(max_tokens=40, n=3, seed=1))
    seqs = [p + c.token_ids for p, cs in zip(prompts, outs) for c in cs]
    lps = exactrl.sequence_logprobs(model, seqs)
    got = torch.cat([torch.tensor(c.logprobs) for cs in outs for c in cs])
    want = torch.cat([lp[len(p) - 1 :] for lp, p in zip(lps, [p for p in prompts for _ in range(3)])])
    assert (got - want).abs().max().item() > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_graphs_replay_the_eager_engine(dtype):
    """Decode steps replayed as CUDA graphs (engine/cuda_graph.py) give the eager engine's tokens and logprobs
    bit for bit, through shrinking buckets and after update_weights, which copies in place and keeps the
    graphs."""
    prompts = [[(11 * i + j) % 4096 for j in range(3 + 29 * i)] for i in range(5)]
    params = [exactrl.SamplingParams(max_tokens=4 + 9 * i, n=2, seed=i, top_k=50, ignore_eos=True) for i in range(5)]
    new = {k: v.detach() for k, v in build_model(tiny_cfg(), dtype=dtype, device="cuda", seed=1).state_dict().items()}
    runs = []
    for graphs in (True, False):
        model = build_model(tiny_cfg(), dtype=dtype, kernels="exact", device="cuda")
        eng = exactrl.Engine(model, kv_budget_tokens=8192, max_num_seqs=16, decode_graphs=graphs)
        first = eng.generate(prompts, params)
        captured = eng._graphs.num_captures if graphs else 0
        eng.update_weights(new)
        second = eng.generate(prompts, params)
        if graphs:
            g = eng._graphs
            assert g.num_captures == captured >= 3 and g.num_replays > 10 * g.num_captures
        runs.append([[(c.token_ids, c.logprobs) for c in o] for o in first + second])
    assert runs[0] == runs[1]


def test_update_weights_copies_on_the_device():
    model = build_model(tiny_cfg(), dtype="bfloat16", kernels="exact", device="cuda")
    eng = exactrl.Engine(build_model(tiny_cfg(), dtype="bfloat16", kernels="exact", device="cuda", seed=1))
    eng.update_weights({k: v.detach() for k, v in model.state_dict().items()})
    for (k, a), b in zip(model.state_dict().items(), eng.model.state_dict().values()):
        assert b.device.type == "cuda" and torch.equal(a, b), k


FAMILIES = {  # tiny random transformers models of the families whose layers differ from Qwen3's
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=128),
    "qwen2_moe": dict(num_experts=8, moe_intermediate_size=128),
    "gemma2": dict(sliding_window=16, attn_logit_softcapping=1.5, final_logit_softcapping=2.0),
    "gemma3": dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
}


def family_engine_vs_trainer(path, kernels: str) -> float:
    """Max |engine logprob - trainer logprob| over forked samples of prompts crossing the sliding window."""
    import random

    model = exactrl.load_model(path, dtype="bfloat16", kernels=kernels, device="cuda", backend="triton")
    rng = random.Random(0)
    prompts = [[rng.randrange(211) for _ in range(rng.randint(3, 60))] for _ in range(4)]
    sp = exactrl.SamplingParams(max_tokens=24, n=2, seed=1, temperature=0.9, ignore_eos=True)
    outs = exactrl.Engine(model, kv_budget_tokens=4096).generate(prompts, sp)
    seqs = [p + c.token_ids for p, cs in zip(prompts, outs) for c in cs]
    lps = exactrl.sequence_logprobs(model, seqs, temperature=0.9)
    got = [torch.tensor(c.logprobs) for cs in outs for c in cs]
    starts = [len(p) - 1 for p in prompts for _ in range(2)]
    return max((g - lp[s:].cpu()).abs().max().item() for g, lp, s in zip(got, lps, starts))


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_families_engine_equals_trainer_on_cuda(tmp_path, arch):
    """MoE routing (router and experts through the Triton linear), Gemma 2's caps and GeGLU, Gemma 3's two
    RoPE tables, sliding windows: engine == trainer bitwise in bf16 on the GPU; the fast twin differs."""
    from conftest import make_hf_model

    make_hf_model(tmp_path, arch, **FAMILIES[arch])
    assert family_engine_vs_trainer(tmp_path, "exact") == 0.0
    assert family_engine_vs_trainer(tmp_path, "fast") > 0.0
