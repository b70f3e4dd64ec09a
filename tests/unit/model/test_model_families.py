"""RoPE scaling (linear, llama3, yarn, dynamic), sliding-window attention and the Mistral family, against
transformers (test-only oracle), and the window in each attention kernel: the exact one's bits fixed by a
row's own position, prefill = decode past the window, its gradient = autograd through SDPA."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import make_hf_model, random_sequences

import exactrl
from exactrl.kernels import attention as A
from exactrl.kernels import native

V = 211
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


def _hf_logprobs(hf, seq):
    logits = hf(torch.tensor([seq])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(seq[1:])[:, None]).squeeze(1)


def _check_against_hf(hf, path, seqs):
    for mode in ("exact", "fast"):
        model = exactrl.load_model(path, kernels=mode)
        with torch.no_grad():
            ours = exactrl.sequence_logprobs(model, seqs)
            err = max((o - _hf_logprobs(hf, s)).abs().max().item() for o, s in zip(ours, seqs))
        assert err <= 1e-4, (mode, err)
    return model


@pytest.mark.parametrize(
    "arch, rope",
    [
        ("llama", LLAMA3),
        ("llama", {"rope_type": "linear", "factor": 4.0}),
        ("llama", YARN),
        ("qwen2", {**YARN, "attention_factor": 0.8, "beta_fast": 16}),
        ("qwen3", {**YARN, "truncate": False}),
        ("mistral", {"rope_type": "linear", "factor": 2.0}),
    ],
)
def test_rope_scaling_matches_transformers(tmp_path, arch, rope):
    from exactrl.model.rope import rope_frequencies

    hf = make_hf_model(tmp_path, arch, rope_parameters={**rope, "rope_theta": 50000.0})
    seqs = random_sequences(random.Random(0), 3, 60, 150, V)  # past original_max_position_embeddings
    model = _check_against_hf(hf, tmp_path, seqs)
    c = model.config
    inv_freq, factor = rope_frequencies(c.head_dim, c.rope_theta, c.rope)
    emb = hf.model.rotary_emb
    assert torch.equal(inv_freq, emb.inv_freq) and factor == emb.attention_scaling  # transformers' bits
    plain = exactrl.kernels.rotary_tables(c.head_dim, 16, c.rope_theta)[0]
    assert not torch.equal(model.rope_cos[:16], plain)  # the scaling changes the tables


def test_rope_scaling_in_either_key_of_an_older_or_newer_config(tmp_path):
    """transformers < 5 wrote rope_scaling (with `type`) beside a top-level rope_theta; both read alike."""
    hf = make_hf_model(tmp_path, "llama", rope_parameters={**LLAMA3, "rope_theta": 50000.0})
    cfg = json.loads((tmp_path / "config.json").read_text())
    new = exactrl.load_model(tmp_path)
    older = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    scaling = {k: v for k, v in LLAMA3.items() if k != "rope_type"} | {"type": "llama3"}
    (tmp_path / "config.json").write_text(json.dumps({**older, "rope_theta": 50000.0, "rope_scaling": scaling}))
    old = exactrl.load_model(tmp_path)
    assert torch.equal(old.rope_cos, new.rope_cos) and old.config.rope == new.config.rope
    seq = random_sequences(random.Random(1), 1, 80, 80, V)[0]
    with torch.no_grad():
        assert (exactrl.sequence_logprobs(old, [seq])[0] - _hf_logprobs(hf, seq)).abs().max() <= 1e-4


def test_dynamic_rope_is_transformers_cached_generation_and_engine_equals_trainer(tmp_path):
    """`dynamic` NTK RoPE with max_position_embeddings L = 32 and factor 8: up to L tokens, transformers'
    full forward; past L, its token-by-token cached forward (each position rotated as the newest token of a
    generation), to 1e-4 in fp32, where plain RoPE and transformers' own full forward are off by more; the
    engine's samples past L score bitwise in the trainer (the fast twin differs); positions end at 8 x L,
    named. q and k are scaled up so that attention is sharp enough for rotations to move the logprobs."""
    rope = {"rope_type": "dynamic", "factor": 8.0, "rope_theta": 10000.0}
    hf = make_hf_model(tmp_path, "llama", max_position_embeddings=32, rope_parameters=rope)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
            layer.self_attn.k_proj.weight.mul_(6)
    hf.save_pretrained(tmp_path)
    seq = random_sequences(random.Random(4), 1, 60, 60, V)[0]
    with torch.no_grad():
        past, rows = None, []
        for t in seq:
            out = hf(torch.tensor([[t]]), past_key_values=past, use_cache=True)
            past, rows = out.past_key_values, rows + [out.logits[0, -1].float()]
        cached = torch.log_softmax(torch.stack(rows), -1)[:-1].gather(1, torch.tensor(seq[1:])[:, None]).squeeze(1)
        model = exactrl.load_model(tmp_path)
        ours = exactrl.sequence_logprobs(model, [seq])[0]
        assert float((ours - cached).abs().max()) <= 1e-4
        assert float((_hf_logprobs(hf, seq) - cached).abs().max()) > 1e-3  # its full forward: another rotation
        short = seq[:31]  # shorter than L: transformers goes back to theta's frequencies (at L, it keeps its last)
        assert (exactrl.sequence_logprobs(model, [short])[0] - _hf_logprobs(hf, short)).abs().max() <= 1e-4
    assert model.config.context_length == 256
    prompts = [seq[:20], seq[:7]]
    for kernels, exact in (("exact", True), ("fast", False)):
        m = exactrl.load_model(tmp_path, kernels=kernels)
        sp = exactrl.SamplingParams(max_tokens=40, n=2, seed=3, ignore_eos=True)
        outs = exactrl.Engine(m, kv_budget_tokens=512).generate(prompts, sp)
        diffs = []
        for p, o in zip(prompts, outs):
            for c in o:
                lp = exactrl.sequence_logprobs(m, [p + c.token_ids])[0][len(p) - 1 :]
                diffs.append(float((lp.detach() - torch.tensor(c.logprobs)).abs().max()))
        assert (max(diffs) == 0.0) == exact, (kernels, diffs)
    with pytest.raises(ValueError, match="the context of 256 tokens .max_position_embeddings=32 x the dynamic RoPE"):
        exactrl.sequence_logprobs(model, [seq * 5])


@pytest.mark.parametrize(
    "rope, words",
    [
        ({"rope_type": "dynamic", "factor": 0.5}, "factor must be >= 1 for dynamic RoPE, got 0.5"),
        ({"rope_type": "longrope", "factor": 2.0}, "rope_type='longrope'; implemented: default, linear, llama3, yarn"),
        ({"rope_type": "linear"}, "rope_parameters.factor must be a positive number, got None"),
        ({**LLAMA3, "high_freq_factor": 1.0}, "low_freq_factor and high_freq_factor must differ"),
        ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ],
)
def test_rope_variants_not_implemented_or_malformed_are_named(tmp_path, rope, words):
    make_hf_model(tmp_path, "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "rope_parameters": rope}))
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        exactrl.load_model(tmp_path)


@pytest.mark.parametrize(
    "arch, over",
    [
        ("mistral", dict(sliding_window=7)),
        ("mistral", dict(sliding_window=None)),
        ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
        ("qwen3", dict(use_sliding_window=True, sliding_window=9, layer_types=["sliding_attention", "full_attention"])),
    ],
)
def test_sliding_window_matches_transformers(tmp_path, arch, over):
    hf = make_hf_model(tmp_path, arch, **over)
    seqs = random_sequences(random.Random(2), 3, 40, 90, V)
    model = _check_against_hf(hf, tmp_path, seqs)
    want = (
        [hf.model.layers[i].self_attn.sliding_window or 0 for i in range(2)]
        if arch != "mistral"
        else [hf.config.sliding_window or 0] * 2
    )
    assert [layer.self_attn.window for layer in model.model.layers] == want


def test_mistral_loads_without_biases_and_round_trips(tmp_path):
    import transformers

    make_hf_model(tmp_path / "src", "mistral", sliding_window=11)
    model = exactrl.load_model(tmp_path / "src")
    c = model.config
    assert (c.model_type, c.qkv_bias, c.o_bias, c.mlp_bias, c.qk_norm, c.windows) == (
        "mistral",
        False,
        False,
        False,
        False,
        (11, 11),
    )
    exactrl.save_model(model, tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(hf).__name__ == "MistralForCausalLM"
    seq = random_sequences(random.Random(3), 1, 50, 50, V)[0]
    with torch.no_grad():
        assert (exactrl.sequence_logprobs(model, [seq])[0] - _hf_logprobs(hf, seq)).abs().max() <= 1e-4


def _layout(lengths, B):
    """Sequences laid out on consecutive pages: (TokenLayout, pages)."""
    J = max(-(-n // B) for n in lengths)
    table, page = torch.full((len(lengths), J), -1), 0
    for s, n in enumerate(lengths):
        for j in range(-(-n // B)):
            table[s, j], page = page, page + 1
    seq = torch.cat([torch.full((n,), s) for s, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])
    return A.TokenLayout(seq, pos, table), page


@pytest.mark.parametrize("window", [1, 5, 8, 13])
def test_exact_window_row_bits_are_those_of_the_row_alone(window):
    """Each query row, computed with all rows of a layout or alone (a decode step), gives the same bits,
    and equals SDPA with transformers' mask (keys in (pos - window, pos]) to rounding."""
    g = torch.Generator().manual_seed(0)
    lengths, H, Hk, D, B = [37, 5, 21], 4, 2, 16, 8
    lay, pages = _layout(lengths, B)
    n = len(lay.seq_N)
    q, k, v = (torch.randn(n, h, D, generator=g) for h in (H, Hk, Hk))
    kp, vp = A.write_kv(torch.zeros(pages, Hk, B, D), torch.zeros(pages, Hk, B, D), k, v, lay)
    full = native.attention(q, kp, vp, lay.seq_N, lay.pos_N, lay.block_table_SJ, 0.25, window=window)
    for i in range(n):
        one = native.attention(
            q[i : i + 1], kp, vp, lay.seq_N[i : i + 1], lay.pos_N[i : i + 1], lay.block_table_SJ, 0.25, window=window
        )
        assert torch.equal(one, full[i : i + 1])
    sdpa = A.fast_attention(q, kp, vp, A.plan_fast(lay, B), 0.25, window)
    assert torch.allclose(full, sdpa, rtol=1e-5, atol=1e-6)
    unwindowed = native.attention(q, kp, vp, lay.seq_N, lay.pos_N, lay.block_table_SJ, 0.25)
    assert not torch.allclose(full, unwindowed)


def test_exact_window_gradient_is_autograd_through_sdpa():
    g = torch.Generator().manual_seed(1)
    lengths, H, Hk, D, B, window = [37, 5, 30], 4, 2, 16, 8, 6
    lay, pages = _layout(lengths, B)
    n = len(lay.seq_N)
    q, k, v = (torch.randn(n, h, D, generator=g).requires_grad_() for h in (H, Hk, Hk))
    w = torch.randn(n, H, D, generator=g)

    def grads(attend, plan):
        kp, vp = A.write_kv(torch.zeros(pages, Hk, B, D), torch.zeros(pages, Hk, B, D), k, v, lay)
        o = attend(q, kp, vp, plan(lay, B), 0.25, window)
        return torch.autograd.grad((o * w).sum(), (q, k, v))

    for a, b in zip(grads(A.exact_attention, A.plan_exact), grads(A.fast_attention, A.plan_fast)):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5) and a.abs().sum() > 0
