"""Gemma 2 and Gemma 3 text against transformers (test-only oracle): (1 + w) norms, scaled embeddings,
sandwich norms, GeGLU, query_pre_attn_scalar, alternating sliding/global layers, Gemma 3's local RoPE and
Gemma 2's attention and final logit soft-capping; bad values are refused by name."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import make_hf_model, random_sequences

import exactrl
from exactrl.model.logprobs import token_logprobs

V = 211
LAYERS = ["sliding_attention", "full_attention"]
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
NO_CAPS = dict(attn_logit_softcapping=None, final_logit_softcapping=None)
# caps small enough that a tiny random model's scores and logits reach tanh's bend (its defaults, 50 and 30,
# leave them nearly linear)
TIGHT_CAPS = dict(attn_logit_softcapping=1.5, final_logit_softcapping=2.0)


def _hf_logprobs(hf, seq):
    logits = hf(torch.tensor([seq])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(seq[1:])[:, None]).squeeze(1)


@pytest.mark.parametrize(
    "arch, over",
    [
        ("gemma3", dict(sliding_window=7, layer_types=LAYERS, query_pre_attn_scalar=20, rope_parameters=GEMMA3_ROPE)),
        ("gemma3", dict(sliding_window=9, tie_word_embeddings=False, attention_bias=True)),
        ("gemma2", dict(sliding_window=5, query_pre_attn_scalar=24, **NO_CAPS)),
        ("gemma2", dict(sliding_window=5, query_pre_attn_scalar=24, **TIGHT_CAPS)),
        ("gemma2", dict(sliding_window=6)),  # transformers' default caps
    ],
)
def test_gemma_matches_transformers_fp32(tmp_path, arch, over):
    hf = make_hf_model(tmp_path, arch, **over)
    seqs = random_sequences(random.Random(0), 3, 20, 60, V)  # past every window
    for mode in ("exact", "fast"):
        model = exactrl.load_model(tmp_path, kernels=mode)
        with torch.no_grad():
            ours = exactrl.sequence_logprobs(model, seqs)
            err = max((o - _hf_logprobs(hf, s)).abs().max().item() for o, s in zip(ours, seqs))
        assert err <= 1e-4, (mode, err)
    want = [hf.model.layers[i].self_attn.sliding_window or 0 for i in range(2)]
    assert [layer.self_attn.window for layer in model.model.layers] == want and want[0] > 0
    assert [layer.self_attn.local_rope for layer in model.model.layers] == [w > 0 and arch == "gemma3" for w in want]


def test_gemma3_local_rope_is_its_own_table(tmp_path):
    """The sliding layer reads the local table (theta 10000), the global one the scaled global table."""
    make_hf_model(tmp_path, "gemma3", sliding_window=7, layer_types=LAYERS, rope_parameters=GEMMA3_ROPE)
    model = exactrl.load_model(tmp_path)
    D = model.config.head_dim
    local = exactrl.kernels.rotary_tables(D, 16, 10000.0)[0]
    assert torch.equal(model.rope_cos[:16, D:], local) and not torch.equal(model.rope_cos[:16, :D], local)


def test_gemma_round_trips_through_save_model(tmp_path):
    import transformers

    make_hf_model(tmp_path / "src", "gemma3", sliding_window=7)
    model = exactrl.load_model(tmp_path / "src")
    exactrl.save_model(model, tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    seq = random_sequences(random.Random(3), 1, 30, 30, V)[0]
    with torch.no_grad():
        assert (exactrl.sequence_logprobs(model, [seq])[0] - _hf_logprobs(hf, seq)).abs().max() <= 1e-4


def test_built_gemma_starts_from_identity_norms(tmp_path):
    make_hf_model(tmp_path, "gemma3")
    from exactrl.model import build_model, read_config

    model = build_model(read_config(tmp_path), seed=0)
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    assert norms and all(bool((p == 0).all()) for p in norms)  # (1 + 0) · x / rms(x)


@pytest.mark.parametrize(
    "arch, edit, words",
    [
        ("gemma2", {"attn_logit_softcapping": -50.0}, "attn_logit_softcapping must be a positive number or null"),
        ("gemma2", {"final_logit_softcapping": "30"}, "final_logit_softcapping must be a positive number or null"),
        ("gemma2", {"hidden_activation": "relu"}, "hidden_activation='relu' is not implemented"),
        ("gemma3", {"final_logit_softcapping": True}, "final_logit_softcapping must be a positive number"),
        ("gemma3", {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be a positive number"),
        ("gemma3", {"sliding_window": None}, "sliding_window=null with sliding layers"),
        ("gemma3", {"layer_types": ["sliding_attention"]}, "layer_types must list 2 layer types"),
    ],
)
def test_unsupported_gemma_configs_are_named(tmp_path, arch, edit, words):
    make_hf_model(tmp_path, arch)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(ValueError, match=words):
        exactrl.load_model(tmp_path)


def test_gemma2_soft_caps_are_read_with_transformers_defaults(tmp_path):
    make_hf_model(tmp_path / "a", "gemma2")  # absent from the config: 50.0 on attention scores, 30.0 on logits
    cfg = exactrl.load_model(tmp_path / "a").config
    assert (cfg.attn_softcap, cfg.logit_softcap) == (50.0, 30.0)
    make_hf_model(tmp_path / "b", "gemma3")  # Gemma 3: none
    cfg = exactrl.load_model(tmp_path / "b").config
    assert (cfg.attn_softcap, cfg.logit_softcap) == (None, None)


def test_soft_capped_logits_and_their_gradient(tmp_path):
    """model.logits caps: |z| < cap, the caps change the logits, and the trainer's logprob gradient through
    the capped head matches the same loss through torch's own tanh (fp32, within rounding)."""
    make_hf_model(tmp_path, "gemma2", sliding_window=5, **TIGHT_CAPS)
    seqs = random_sequences(random.Random(2), 2, 12, 20, V)
    model = exactrl.load_model(tmp_path)
    model.zero_grad()
    lps = token_logprobs(model, seqs, with_entropy=True)
    (sum(lp.sum() for lp in lps[0]) + sum(e.sum() for e in lps[1])).backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    ref = exactrl.load_model(tmp_path, kernels="fast")  # torch's ops: tanh, log_softmax, autograd
    ref.zero_grad()
    lps_ref = token_logprobs(ref, seqs, with_entropy=True)
    (sum(lp.sum() for lp in lps_ref[0]) + sum(e.sum() for e in lps_ref[1])).backward()
    for n, p in ref.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(ours[n], p.grad, rtol=1e-4, atol=1e-5, msg=n)
    model.zero_grad()
    model.head_recompute = True  # activation checkpointing's head: capped logits computed again, the same bits
    again = token_logprobs(model, seqs, with_entropy=True)
    assert all(torch.equal(a, b) for a, b in zip(again[0], lps[0]))
    (sum(lp.sum() for lp in again[0]) + sum(e.sum() for e in again[1])).backward()
    assert all(torch.equal(p.grad, ours[n]) for n, p in model.named_parameters() if p.grad is not None)
    with torch.no_grad():
        h = torch.randn(5, model.config.hidden_size) * 30
        z = model.logits(h)
        raw = model.kernels.linear(h, model.head_weight).float()
    assert float(z.abs().max()) < 2.0 and not torch.allclose(z, raw)
