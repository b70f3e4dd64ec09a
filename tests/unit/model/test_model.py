"""The decoder against transformers (test-only oracle) and checkpoint I/O."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import make_hf_model, random_sequences
from safetensors.torch import load_file, save_file

import exactrl
from exactrl.model import forward_logits


def _hf_logprobs(hf, seq):
    logits = hf(torch.tensor([seq])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(seq[1:])[:, None]).squeeze(1)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("tied", [False, True])
def test_matches_transformers_fp32(tmp_path, arch, tied):
    hf = make_hf_model(tmp_path, arch, tie_word_embeddings=tied, num_key_value_heads=1 if tied else 2)
    rng = random.Random(0)
    seqs = random_sequences(rng, 3, 2, 100, 211)
    for mode in ("exact", "fast"):
        model = exactrl.load_model(tmp_path, kernels=mode)
        with torch.no_grad():
            ours = exactrl.sequence_logprobs(model, seqs)
            err = max((o - _hf_logprobs(hf, s)).abs().max().item() for o, s in zip(ours, seqs))
        assert err <= 1e-4, (arch, mode, err)


def test_matches_transformers_bf16(tmp_path):
    hf = make_hf_model(tmp_path, "qwen3").to(torch.bfloat16)
    model = exactrl.load_model(tmp_path, dtype="bfloat16")
    seq = random_sequences(random.Random(1), 1, 40, 40, 211)[0]
    with torch.no_grad():
        err = (exactrl.sequence_logprobs(model, [seq])[0] - _hf_logprobs(hf, seq)).abs().max().item()
    assert err <= 0.1  # bf16: same math, different rounding points than HF


def test_checkpoint_round_trip_and_transformers_loads_ours(tmp_path):
    import transformers

    make_hf_model(tmp_path / "src", "qwen3")
    model = exactrl.load_model(tmp_path / "src")
    with torch.no_grad():
        for p in model.parameters():  # change weights so the round trip is not a copy of the source
            p.mul_(1.5)
    exactrl.save_model(model, tmp_path / "out")
    again = exactrl.load_model(tmp_path / "out")
    seqs = random_sequences(random.Random(2), 3, 2, 60, 211)
    with torch.no_grad():
        a, b = forward_logits(model, seqs), forward_logits(again, seqs)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
        err = max(
            (o - _hf_logprobs(hf, s)).abs().max().item() for o, s in zip(exactrl.sequence_logprobs(model, seqs), seqs)
        )
    assert err <= 1e-4


def test_sharded_checkpoint(tmp_path):
    make_hf_model(tmp_path / "src", "llama")
    tensors = load_file(tmp_path / "src" / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    out = tmp_path / "sharded"
    out.mkdir()
    (out / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
    weight_map = {}
    for i, part in enumerate([names[:half], names[half:]]):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(out / fname))
        weight_map.update({n: fname for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a, b = exactrl.load_model(tmp_path / "src"), exactrl.load_model(out)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_load_errors_name_the_problem(tmp_path):
    make_hf_model(tmp_path / "m", "qwen3")
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="gpt2"):
        exactrl.load_model(tmp_path / "m")
    cfg_path.write_text(json.dumps(cfg))
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match="up_proj"):
        exactrl.load_model(tmp_path / "m")
    tensors[name] = tensors[name][:, :3].contiguous()
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match="up_proj.*shape"):
        exactrl.load_model(tmp_path / "m")
    with pytest.raises(ValueError, match="does not exist"):
        exactrl.load_model(tmp_path / "nope")
    with pytest.raises(ValueError, match="kernels"):
        exactrl.model.build_model(exactrl.model.read_config(tmp_path / "m"), kernels="turbo")
    cfg_path.unlink()
    cfg_path.mkdir()  # it said "no config.json in model directory", which there was
    with pytest.raises(ValueError, match=r"config.json is a directory, not the model's config file"):
        exactrl.load_model(tmp_path / "m")


def test_sequence_logprobs_input_errors(qwen3_dir):
    model = exactrl.load_model(qwen3_dir)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        exactrl.sequence_logprobs(model, [[1, 2, 5000]])
    with pytest.raises(ValueError, match=r"token_ids\[1\] is empty"):
        exactrl.sequence_logprobs(model, [[1, 2], []])
    with pytest.raises(ValueError, match="top_p"):
        exactrl.sequence_logprobs(model, [[1, 2]], top_p=0.0)


def test_truncated_distribution_is_renormalised(qwen3_dir):
    """With top-k/top-p the logprobs are those of the truncated, renormalised distribution."""
    from exactrl.kernels import sampling_logprobs

    logits = torch.randn(5, 211, generator=torch.Generator().manual_seed(0)) * 3
    n = logits.shape[0]
    for k, p in [(5, 1.0), (-1, 0.6), (20, 0.9)]:
        lp = sampling_logprobs(logits, torch.full((n,), 0.7), torch.full((n,), k), torch.full((n,), p))
        probs = lp.exp()
        assert torch.allclose(probs.sum(-1), torch.ones(n), atol=1e-5)
        kept = (lp > float("-inf")).sum(-1)
        if k > 0:
            assert bool((kept <= k).all())
        full = torch.softmax(logits / 0.7, -1)
        mass = (full * (lp > float("-inf"))).sum(-1)
        assert bool((mass >= min(p, 1.0) - 1e-6).all()) or k > 0
        # the kept set is the top of the distribution: every kept logit beats every dropped one
        for r in range(n):
            keep = lp[r] > float("-inf")
            assert logits[r][keep].min() >= logits[r][~keep].max() if (~keep).any() else True
    model = exactrl.load_model(qwen3_dir)
    seq = [[3, 4, 5, 6, 7, 8] * 8]
    with torch.no_grad():
        full = exactrl.sequence_logprobs(model, seq)[0]
        trunc = exactrl.sequence_logprobs(model, seq, top_k=3)[0]
    finite = trunc > float("-inf")
    assert bool((trunc[finite] >= full[finite]).all())
    assert bool((trunc[~finite] == float("-inf")).all())  # tokens outside the top-3 are impossible


def test_rotary_tables_grow_as_far_as_a_forward_reaches_with_the_bits_of_one_table(tmp_path, monkeypatch):
    """A config may allow 2**31 - 1 positions: the model builds one chunk of rotary tables at load and grows them
    by the positions a forward reaches, each chunk built alone, with the bits of one table built at once."""
    from exactrl.kernels.rowwise import rotary_tables
    from exactrl.model import transformer

    ROPE_CHUNK = 128  # the rule at short lengths: the chunk is read where the tables grow
    monkeypatch.setattr(transformer, "ROPE_CHUNK", ROPE_CHUNK)
    hf = make_hf_model(tmp_path, "qwen3", max_position_embeddings=2**31 - 1)
    model = exactrl.load_model(tmp_path)
    assert model.rope_cos.shape[0] == ROPE_CHUNK
    seq = random_sequences(random.Random(3), 1, 2 * ROPE_CHUNK + 40, 2 * ROPE_CHUNK + 40, 211)[0]
    with torch.no_grad():
        lazy = exactrl.sequence_logprobs(model, [seq])[0]
        err = (lazy - _hf_logprobs(hf, seq)).abs().max().item()
    assert model.rope_cos.shape[0] == 3 * ROPE_CHUNK  # at least doubled, in whole chunks
    cos, sin = rotary_tables(model.config.head_dim, 3 * ROPE_CHUNK, model.config.rope_theta)
    assert torch.equal(model.rope_cos, cos) and torch.equal(model.rope_sin, sin)
    assert err <= 1e-4, err  # the positions past the first chunk rotate as transformers' do
    ahead = exactrl.load_model(tmp_path)
    ahead.rope_reach(7 * ROPE_CHUNK)  # a table grown otherwise holds the same bits
    assert torch.equal(ahead.rope_cos[: 3 * ROPE_CHUNK], cos)
    with torch.no_grad():
        assert torch.equal(exactrl.sequence_logprobs(ahead, [seq])[0], lazy)
    with pytest.raises(ValueError, match="position 2147483647 is beyond max_position_embeddings=2147483647"):
        model.rope_reach(2**31)  # the forward's check, not an allocation of 2**31 rows
