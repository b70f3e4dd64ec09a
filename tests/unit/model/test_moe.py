"""Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral, OLMoE) against
transformers (test-only oracle), the routing rule (ties to the lower expert index, a row's experts its own
whatever the batch), and the load-balancing loss against transformers' `load_balancing_loss_func`."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import make_hf_model, random_sequences

import exactrl
from exactrl.kernels import get_kernels
from exactrl.model.moe import load_balancing_loss, moe_layers, route, selected_experts

V = 211
FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]


def _hf_logprobs(hf, seq):
    logits = hf(torch.tensor([seq])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(seq[1:])[:, None]).squeeze(1)


@pytest.mark.parametrize("arch", FAMILIES)
def test_moe_matches_transformers_fp32(tmp_path, arch):
    over = dict(clip_qkv=0.5) if arch == "olmoe" else {}
    hf = make_hf_model(tmp_path, arch, **over)
    seqs = random_sequences(random.Random(0), 3, 20, 60, V)
    for mode in ("exact", "fast"):
        model = exactrl.load_model(tmp_path, kernels=mode)
        with torch.no_grad():
            ours = exactrl.sequence_logprobs(model, seqs)
            err = max((o - _hf_logprobs(hf, s)).abs().max().item() for o, s in zip(ours, seqs))
        assert err <= 1e-4, (mode, err)
        picked = selected_experts(model)  # of the last forward: every token, every MoE layer
        assert picked.shape == (sum(map(len, seqs)), 2, 2)
        assert len({tuple(r) for r in picked[:, 0].tolist()}) > 1  # the router sends tokens different ways
    assert len(moe_layers(model)) == 2
    assert hasattr(moe_layers(model)[0], "shared_expert") == (arch == "qwen2_moe")


def test_qwen3_moe_dense_layers_and_unnormalised_weights(tmp_path):
    """mlp_only_layers / decoder_sparse_step pick dense layers; norm_topk_prob=false keeps raw probabilities."""
    hf = make_hf_model(tmp_path, "qwen3_moe", mlp_only_layers=[0], norm_topk_prob=False, num_hidden_layers=3)
    model = exactrl.load_model(tmp_path)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["MLP", "SparseMoE", "SparseMoE"]
    seq = random_sequences(random.Random(1), 1, 40, 40, V)[0]
    with torch.no_grad():
        assert (exactrl.sequence_logprobs(model, [seq])[0] - _hf_logprobs(hf, seq)).abs().max() <= 1e-4


def test_moe_round_trips_through_save_model(tmp_path):
    import transformers

    make_hf_model(tmp_path / "src", "mixtral")
    model = exactrl.load_model(tmp_path / "src")
    exactrl.save_model(model, tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    seq = random_sequences(random.Random(3), 1, 30, 30, V)[0]
    with torch.no_grad():
        assert (exactrl.sequence_logprobs(model, [seq])[0] - _hf_logprobs(hf, seq)).abs().max() <= 1e-4


def test_ties_go_to_the_lower_expert_index():
    k = get_kernels("exact")
    z = torch.tensor([[0.0, 1.0, 1.0, 0.5], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 3.0, 0.0]])
    idx, w = route(z, 2, True, k)
    assert idx.tolist() == [[1, 2], [0, 1], [2, 0]]
    assert torch.allclose(w.sum(-1), torch.ones(3))
    idx3, _ = route(z, 3, False, k)
    assert idx3.tolist() == [[1, 2, 3], [0, 1, 2], [2, 0, 1]]


def test_a_rows_experts_do_not_depend_on_the_batch():
    """Router logits with near-ties, routed alone and inside batches of several sizes: the same experts and
    the same weight bits for each row."""
    g = torch.Generator().manual_seed(0)
    k = get_kernels("exact")
    x = torch.randn(67, 48, generator=g)
    w = torch.randn(8, 48, generator=g)
    w[1] = w[0] + 1e-7 * torch.randn(48, generator=g)  # experts 0 and 1 nearly tied on every row
    full_idx, full_w = route(k.linear(x, w), 2, True, k)
    for n in (1, 2, 3, 5, 32):
        for s in range(0, 67 - n, 17):
            idx, wt = route(k.linear(x[s : s + n], w), 2, True, k)
            assert torch.equal(idx, full_idx[s : s + n]) and torch.equal(wt, full_w[s : s + n])


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("normalise", [True, False])
def test_one_call_experts_equal_the_module_path(tmp_path, monkeypatch, arch, normalise):
    """The engine's one native call per layer (native/moe.c) against the module path the trainer runs: the
    same output bits and experts for batches of several sizes, with exact ties and near-ties in the router
    (experts 0 and 1 tied to the bit, expert 2 a hair away)."""
    from exactrl.kernels import native
    from exactrl.kernels.linear import PackedWeights, using_packed

    make_hf_model(tmp_path, arch, **({} if arch == "mixtral" else dict(norm_topk_prob=normalise)))
    layer = moe_layers(exactrl.load_model(tmp_path))[0]
    layer.normalise = normalise
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        w = layer.gate.weight
        w[1] = w[0]
        w[2] = w[0] + 1e-7 * torch.randn(w.shape[1], generator=g)
    x = torch.randn(41, w.shape[1], generator=g)
    calls, real = [], native.moe
    monkeypatch.setattr(native, "moe", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        ref = layer(x)  # no packed cache: the module path
        ref_experts = layer.last_experts
        assert not calls
        assert (ref_experts[:, :2] == torch.tensor([0, 1])).all(-1).any()  # the tie, broken to the lower index
        with using_packed(PackedWeights()):
            for n in (1, 2, 5, 41):
                for s in range(0, 41 - n + 1, 13):
                    out = layer(x[s : s + n])
                    assert torch.equal(out, ref[s : s + n]) and torch.equal(layer.last_experts, ref_experts[s : s + n])
    assert len(calls) > 4
    fast = moe_layers(exactrl.load_model(tmp_path, kernels="fast"))[0]  # the inverse twin: rows' bits move
    with torch.no_grad():
        fast.gate.weight.copy_(w)
        full = fast(x)
        assert any(not torch.equal(fast(x[s : s + n]), full[s : s + n]) for n in (1, 2, 5) for s in range(0, 36, 7))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_load_balancing_loss_matches_transformers(tmp_path, arch):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    hf = make_hf_model(tmp_path, arch)
    model = exactrl.load_model(tmp_path)
    seq = random_sequences(random.Random(4), 1, 50, 50, V)[0]
    exactrl.sequence_logprobs(model, [seq])  # with autograd: the loss must carry a gradient to the routers
    ours = load_balancing_loss(model)
    with torch.no_grad():
        gate_logits = hf(torch.tensor([seq]), output_router_logits=True).router_logits
        want = load_balancing_loss_func(gate_logits, 4, 2)
    assert abs(ours.item() - want.item()) <= 1e-5  # K = 2 when perfectly balanced, more otherwise
    ours.backward()
    router = moe_layers(model)[0].gate.weight
    assert router.grad is not None and router.grad.abs().sum() > 0
    masked = load_balancing_loss(model, torch.arange(50) < 20)
    assert abs(masked.item() - ours.item()) > 1e-6  # the mask changes which tokens count


def test_dense_model_has_no_load_balancing_loss(qwen3_dir):
    model = exactrl.load_model(qwen3_dir)
    exactrl.sequence_logprobs(model, [[1, 2, 3]])
    assert selected_experts(model) is None
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        load_balancing_loss(model)


@pytest.mark.parametrize(
    "arch, edit, words",
    [
        ("qwen3_moe", {"num_experts": None, "num_local_experts": None}, "needs num_experts or num_local_experts"),
        ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9 is more than the 4 experts"),
        ("qwen2_moe", {"moe_intermediate_size": "32"}, "moe_intermediate_size must be an integer"),
        ("mixtral", {"num_local_experts": 0}, "experts must be an integer in"),
        ("olmoe", {"clip_qkv": -1}, "clip_qkv must be a positive number or null"),
        ("qwen3_moe", {"model_type": "deepseek_v3"}, "unsupported architecture model_type='deepseek_v3'"),
    ],
)
def test_malformed_moe_configs_are_named(tmp_path, arch, edit, words):
    make_hf_model(tmp_path, arch)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(ValueError, match=words):
        exactrl.load_model(tmp_path)
