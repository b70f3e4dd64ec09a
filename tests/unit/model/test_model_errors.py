"""A damaged model directory is a one-line ValueError naming the file and the problem (config.json
missing a key or not JSON, a truncated or absent safetensors file); the server names a bad --model
as the model and points a tokenizer-less checkpoint at --tokenizer. Also the transformers-style
calls of `Tokenizer`: tok(text), batch_decode, apply_chat_template(..., tokenize=False)."""

from __future__ import annotations

import json
import re
import shutil

import pytest

import exactrl
from exactrl.envs import ArithmeticTask
from exactrl.model.tokenizer import build_tokenizer, default_tokenizer_corpus, load_tokenizer
from exactrl.server.app import build_state


@pytest.fixture
def damaged(qwen3_dir, tmp_path):
    """A fresh copy of the tiny model to break."""
    return shutil.copytree(qwen3_dir, tmp_path / "m")


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    for k in [k for k, v in changes.items() if v is ...]:
        del cfg[k]
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("value", [..., None])  # key absent, or null
def test_config_missing_a_key(damaged, value):
    _edit_config(damaged, hidden_size=value)
    with pytest.raises(ValueError, match=f"model directory {damaged}: config.json is missing 'hidden_size'"):
        exactrl.load_model(damaged)


@pytest.mark.parametrize(
    "changes, words",
    [
        (dict(num_attention_heads=0, num_key_value_heads=0), "num_attention_heads must be an integer >= 1, got 0"),
        (dict(vocab_size=-5), "vocab_size must be an integer >= 1, got -5"),
        (dict(num_hidden_layers=1.5), "num_hidden_layers must be an integer >= 1, got 1.5"),
        (dict(hidden_size="abc"), "hidden_size must be an integer >= 1, got 'abc'"),
        (dict(max_position_embeddings=0), "max_position_embeddings must be an integer >= 1, got 0"),
        (dict(rms_norm_eps="x"), "rms_norm_eps must be a positive number, got 'x'"),
        (dict(rope_parameters=[1]), "rope_parameters must be an object, got [1]"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": -1}), "rope_theta must be a positive number"),
    ],
)
def test_config_values_of_the_wrong_type_or_range_are_named(damaged, changes, words):
    _edit_config(damaged, **changes)
    with pytest.raises(ValueError, match=re.escape(f"model directory {damaged}: config.json: {words}")):
        exactrl.load_model(damaged)


@pytest.mark.parametrize(
    "changes, words",
    [
        # transformers >= 5 writes rope_parameters; a long-context recipe adds rope_scaling beside it, and
        # transformers then applies rope_scaling alone, dropping rope_parameters' rope_theta
        (
            dict(
                rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
            ),
            "rope_parameters and rope_scaling give different factor [None, 4.0]",
        ),
        (
            dict(rope_parameters=..., rope_scaling={"type": "dynamic", "factor": 0.5}),
            "rope_scaling.factor must be >= 1 for dynamic RoPE",
        ),
        (dict(rope_parameters={"rope_type": "longrope"}), "unsupported rope_parameters.rope_type='longrope'"),
        (
            dict(
                rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                rope_scaling={"rope_type": "default", "rope_theta": 1e4},
            ),
            "give different rope_theta [1000000.0, 10000.0]",
        ),
    ],
)
def test_rope_variants_not_implemented_are_refused_whichever_key_holds_them(damaged, changes, words):
    _edit_config(damaged, **changes)
    with pytest.raises(ValueError, match=re.escape(words)):
        exactrl.load_model(damaged)


def test_config_not_json(damaged):
    (damaged / "config.json").write_text('{"model_type": \n')
    with pytest.raises(ValueError, match=f"{damaged / 'config.json'} is not valid JSON: Expecting value"):
        exactrl.load_model(damaged)
    (damaged / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json must hold a JSON object, got list"):
        exactrl.load_model(damaged)


@pytest.mark.parametrize("keep", [5, 100, -10])  # header length cut, header cut, data cut
def test_truncated_safetensors(damaged, keep):
    f = damaged / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:keep] if keep > 0 else data[: len(data) + keep])
    with pytest.raises(ValueError, match=f"{f} is not a valid safetensors file"):
        exactrl.load_model(damaged)


def test_sharded_index_problems(damaged):
    (damaged / "model.safetensors").rename(damaged / "model-00001-of-00002.safetensors")  # a sharded layout
    index = damaged / "model.safetensors.index.json"
    index.write_text("{")
    with pytest.raises(ValueError, match="index.json is not valid JSON"):
        exactrl.load_model(damaged)
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="no 'weight_map'"):
        exactrl.load_model(damaged)
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ValueError, match=r"shard files that are not in .*model-00002-of-00002"):
        exactrl.load_model(damaged)


def test_saving_over_a_sharded_checkpoint_replaces_it(qwen3_dir, tmp_path):
    import torch
    import transformers

    d = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(qwen3_dir).save_pretrained(d, max_shard_size="50KB")
    assert (d / "model.safetensors.index.json").is_file()
    m = exactrl.load_model(d)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(2.0)
    exactrl.save_model(m, d)
    assert sorted(f.name for f in d.glob("*.safetensors*")) == ["model.safetensors"]
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), exactrl.load_model(d).parameters()))
    shutil.copy(d / "model.safetensors", d / "shard-1.safetensors")  # both layouts present: which one is current?
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "shard-1.safetensors"}}))
    with pytest.raises(ValueError, match="holds both model.safetensors and a sharded checkpoint"):
        exactrl.load_model(d)


def test_legacy_rotary_inv_freq_buffers_are_skipped(qwen3_dir, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    d = tmp_path / "m"
    shutil.copytree(qwen3_dir, d)
    sd = load_file(d / "model.safetensors")
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    ref = exactrl.load_model(qwen3_dir)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), exactrl.load_model(d).parameters()))


def test_server_names_a_bad_model_path(tmp_path):
    with pytest.raises(ValueError, match=f"model directory {tmp_path / 'nope'} does not exist"):
        build_state(str(tmp_path / "nope"))


def test_server_points_a_checkpoint_without_tokenizer_at_the_tokenizer_flag(qwen3_dir):
    with pytest.raises(ValueError, match=f"{qwen3_dir} holds no tokenizer files.*exactrl serve --tokenizer DIR"):
        build_state(str(qwen3_dir))


# --------------------------------------------------------------------------- transformers-style tokenizer calls

MSGS = [{"role": "user", "content": "12+7="}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d, default_tokenizer_corpus([ArithmeticTask()], 100, seed=0), vocab_size=300)
    return load_tokenizer(d)


def test_tokenizer_with_a_broken_config_json_is_named(tok, tmp_path):
    shutil.copytree(tok.path, tmp_path / "t")
    (tmp_path / "t" / "config.json").write_text("{")
    with pytest.raises(ValueError, match=f"cannot load the tokenizer in {tmp_path / 't'}: .*config.json"):
        load_tokenizer(tmp_path / "t")


def test_apply_chat_template_tokenize_false_gives_the_text(tok):
    text = tok.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)
    assert text == tok.render_chat(MSGS) == tok.hf.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(MSGS) == tok.encode(text)  # the default is still token ids
    assert tok.apply_chat_template(MSGS, None, False, False) == tok.render_chat(MSGS, add_generation_prompt=False)


def test_call_and_batch_decode_answer_like_transformers(tok):
    assert tok("12+7=") == {"input_ids": tok.hf("12+7=")["input_ids"]}
    assert tok("12+7=")["input_ids"] == tok.encode("12+7=")  # this tokenizer adds no bos/eos
    with pytest.raises(ValueError, match="one string"):
        tok(["a", "b"])
    seqs = [tok.encode("1+2="), tok.encode("<|im_end|>3")]
    assert tok.batch_decode(seqs) == ["1+2=", "<|im_end|>3"] == tok.hf.batch_decode(seqs)
    assert tok.batch_decode(seqs, skip_special_tokens=True) == ["1+2=", "3"]


def test_a_tied_checkpoint_that_also_stores_its_head(damaged):
    """tie_word_embeddings=true with an lm_head.weight stored too: the same matrix loads; a different one
    is refused (transformers 5 would use it, 4.x drop it); the head alone is the embedding, as transformers
    ties it."""
    import torch
    from safetensors.torch import load_file, save_file

    _edit_config(damaged, tie_word_embeddings=True)
    f = damaged / "model.safetensors"
    sd = load_file(f)
    embed = sd["model.embed_tokens.weight"]
    assert not torch.equal(sd["lm_head.weight"], embed)  # the untied model's own head
    with pytest.raises(ValueError, match="tie_word_embeddings=true, but its lm_head.weight differs"):
        exactrl.load_model(damaged)
    save_file(sd | {"lm_head.weight": embed.clone()}, f, metadata={"format": "pt"})
    ref = exactrl.load_model(damaged)
    assert torch.equal(ref.model.embed_tokens.weight, embed)
    save_file(
        {k: v for k, v in sd.items() if k != "model.embed_tokens.weight"} | {"lm_head.weight": embed.clone()},
        f,
        metadata={"format": "pt"},
    )
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), exactrl.load_model(damaged).parameters()))


def test_sliding_window_layers_as_transformers_reads_them(damaged):
    """transformers slides on Qwen layers i >= max_window_layers (or those layer_types names), and only with
    use_sliding_window=true; a layer_types of the wrong length or values is named."""
    from exactrl.model.checkpoint import read_config

    layers = json.loads((damaged / "config.json").read_text())["num_hidden_layers"]
    _edit_config(damaged, use_sliding_window=True, sliding_window=16, max_window_layers=layers, layer_types=...)
    assert read_config(damaged).windows == ()
    _edit_config(damaged, max_window_layers=layers - 1)
    assert read_config(damaged).windows == (0,) * (layers - 1) + (16,)
    _edit_config(damaged, layer_types=["full_attention"] * layers)
    assert read_config(damaged).windows == ()
    _edit_config(damaged, layer_types=["sliding_attention"] + ["full_attention"] * (layers - 1))
    assert read_config(damaged).windows == (16,) + (0,) * (layers - 1)
    exactrl.load_model(damaged)
    _edit_config(damaged, layer_types=["sliding_attention"])
    with pytest.raises(ValueError, match=f"layer_types must list {layers} of"):
        exactrl.load_model(damaged)
    _edit_config(damaged, layer_types=..., sliding_window=0)
    with pytest.raises(ValueError, match=r"sliding_window must be an integer in \[1, 2\*\*31\), got 0"):
        exactrl.load_model(damaged)
    _edit_config(damaged, use_sliding_window=False, max_position_embeddings=...)  # transformers' Qwen default
    assert read_config(damaged).max_position_embeddings == 32768 and read_config(damaged).windows == ()


def test_a_pytorch_bin_checkpoint_is_named(damaged):
    (damaged / "model.safetensors").rename(damaged / "pytorch_model.bin")
    with pytest.raises(ValueError, match="holds a pytorch_model.bin checkpoint; only safetensors are read"):
        exactrl.load_model(damaged)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_weight_finite_as_stored_but_not_in_the_loaded_dtype_is_named(damaged, dtype):
    """fp64 1e300 is a number; cast to the model's dtype it is inf, and every logit would be NaN."""
    from safetensors.torch import load_file, save_file

    w = load_file(damaged / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    w[name] = w[name].double()
    w[name][0, 0] = 1e300
    save_file(w, damaged / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(f"weight {name} holds NaN or infinite values (in ")):
        exactrl.load_model(damaged, dtype=dtype)
    w[name][0, 0] = 1e30  # finite in both
    save_file(w, damaged / "model.safetensors", metadata={"format": "pt"})
    assert exactrl.load_model(damaged, dtype=dtype).state_dict()[name][0, 0] > 1e29
