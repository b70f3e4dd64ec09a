"""Gemma 2 and Gemma 3 text against transformers (test-only oracle): (1 + w) norms, scaled embeddings,
sandwich norms, GeGLU, query_pre_attn_scalar, alternating sliding/global layers and Gemma 3's local RoPE;
what is not implemented (logit soft-capping) is refused by name."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import make_hf_model, random_sequences

import exactrl

V = 211
LAYERS = ["sliding_attention", "full_attention"]
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
NO_CAPS = dict(attn_logit_softcapping=None, final_logit_softcapping=None)


def _hf_logprobs(hf, seq):
    logits = hf(torch.tensor([seq])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(seq[1:])[:, None]).squeeze(1)


@pytest.mark.parametrize(
    "arch, over",
    [
        ("gemma3", dict(sliding_window=7, layer_types=LAYERS, query_pre_attn_scalar=20, rope_parameters=GEMMA3_ROPE)),
        ("gemma3", dict(sliding_window=9, tie_word_embeddings=False, attention_bias=True)),
        ("gemma2", dict(sliding_window=5, query_pre_attn_scalar=24, **NO_CAPS)),
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
        ("gemma2", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0: logit soft-capping is not"),
        (
            "gemma2",
            {"final_logit_softcapping": None, "attn_logit_softcapping": None, "hidden_activation": "relu"},
            "hidden_activation='relu' is not implemented",
        ),
        ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0: logit soft-capping"),
        ("gemma3", {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be a positive number"),
        ("gemma3", {"sliding_window": None}, "sliding_window=null with sliding layers"),
        ("gemma3", {"layer_types": ["sliding_attention"]}, "layer_types must list 2 layer types"),
    ],
)
def test_unsupported_gemma_configs_are_named(tmp_path, arch, edit, words):
    make_hf_model(tmp_path, arch, **(NO_CAPS if arch == "gemma2" else {}))
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(ValueError, match=words):
        exactrl.load_model(tmp_path)


def test_gemma2_with_its_default_soft_capping_is_refused(tmp_path):
    make_hf_model(tmp_path, "gemma2")  # transformers' defaults: 50.0 on attention scores, 30.0 on logits
    with pytest.raises(ValueError, match="logit soft-capping is not implemented"):
        exactrl.load_model(tmp_path)
