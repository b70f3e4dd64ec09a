"""Property-based fuzz of `load_model` and `load_tokenizer` on damaged Hugging Face directories.

A copy of a tiny valid checkpoint (and tokenizer) is broken one way or several: config.json fields of the
wrong type or range, missing or extra keys, text that is not a JSON object; safetensors files truncated,
with a damaged header, a tensor missing, extra, renamed, re-shaped or of another dtype; a sharded index
naming files that are absent, outside the directory, or tensors stored twice; tokenizer files missing or
damaged. The property: it loads and the forward runs (giving the valid model's logits when the damage
cannot matter), or it is a ValueError that names the file or the key, never an error from deep inside
torch, safetensors or json.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from fuzzing import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import exactrl
from exactrl.envs import ArithmeticTask
from exactrl.model import build_model, forward_logits, save_model
from exactrl.model.config import ModelConfig
from exactrl.model.tokenizer import build_tokenizer, default_tokenizer_corpus, load_tokenizer

HSET = settings(max_examples=examples(150), deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
SEQS = [[1, 5, 9, 2], [7, 3, 0]]
# keys whose value cannot change the model's logits (ids the engine stops on, bookkeeping)
IRRELEVANT = {
    "bos_token_id",
    "torch_dtype",
    "dtype",
    "architectures",
    "transformers_version",
    "use_cache",
    "initializer_range",
    "attention_dropout",
    "pad_token_id",
    "_name_or_path",
    "foo",
}
BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")
SIZE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
KEYS = sorted(
    {
        *SIZE_KEYS,
        *IRRELEVANT,
        "model_type",
        "rms_norm_eps",
        "rope_theta",
        "rope_parameters",
        "rope_scaling",
        "tie_word_embeddings",
        "attention_bias",
        "mlp_bias",
        "hidden_act",
        "eos_token_id",
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
        "layer_types",
    }
)
VALUES = [
    ...,
    None,
    0,
    1,
    -1,
    2,
    3,
    4,
    7,
    16,
    64,
    10**13,
    2**70,
    -(10**13),
    1.5,
    16.0,
    0.0,
    -0.5,
    1e-6,
    1e6,
    float("nan"),
    float("inf"),
    -float("inf"),
    True,
    False,
    "",
    "64",
    "abc",
    "qwen3",
    "llama",
    "qwen2",
    "gpt2",
    "silu",
    "gelu",
    "true",
    [],
    [1],
    ["qwen3"],
    ["sliding_attention"],
    ["full_attention"] * 2,
    {},
    {"rope_type": "default"},
    {"rope_type": "yarn"},
    {"rope_theta": 0},
    {"rope_type": ["x"]},
    {"rope_theta": "1e6"},
    {"a": {"b": 1}},
]
TEXTS = [
    "",
    " ",
    "{",
    "[]",
    "[1, 2]",
    "null",
    "1",
    '"x"',
    "{}",
    "\x00\xff",
    "[" * 5000 + "]" * 5000,
    '{"a": ' * 5000 + "1" + "}" * 5000,
]


@pytest.fixture(scope="module")
def ref(qwen3_dir):
    """The valid model's logits on SEQS."""
    return [t.clone() for t in forward_logits(exactrl.load_model(qwen3_dir), SEQS)]


def _copy(src: Path) -> tuple[tempfile.TemporaryDirectory, Path]:
    tmp = tempfile.TemporaryDirectory()
    return tmp, Path(shutil.copytree(src, Path(tmp.name) / "m"))


def _loads_or_names(d: Path, names: list[str]):
    """The model at d, after it ran a forward; or None after a ValueError naming d (or a file in it) and
    one of `names` (keys, tensors, files)."""
    try:
        model = exactrl.load_model(d)
    except (ValueError, FileNotFoundError) as e:
        msg = str(e)
        assert str(d) in msg or any(f.name in msg for f in d.iterdir()), msg
        assert not names or any(n in msg for n in names), (names, msg)
        return None
    logits = forward_logits(model, [s for s in SEQS if max(s) < model.config.vocab_size])
    assert all(t.shape[-1] == model.config.vocab_size for t in logits)
    return model


# --------------------------------------------------------------------------- config.json

edits = st.lists(st.tuples(st.sampled_from(KEYS), st.sampled_from(VALUES)), min_size=1, max_size=4)


@HSET
@given(edits=edits, text=st.one_of(st.none(), st.sampled_from(TEXTS)))
def test_a_damaged_config_loads_or_is_named(qwen3_dir, ref, edits, text):
    tmp, d = _copy(qwen3_dir)
    with tmp:
        cfg = json.loads((d / "config.json").read_text())
        for k, v in edits:
            cfg.pop(k, None) if v is ... else cfg.__setitem__(k, v)
        (d / "config.json").write_text(json.dumps(cfg) if text is None else text)
        keys = [k for k, _ in edits] if text is None else KEYS  # a config that is no object lacks every key
        model = _loads_or_names(d, ["config.json", *keys] + ["tensor", "tensors", "lm_head.weight"])
        if model is not None:  # nothing was read as something else: "false" is no false, "x" no token id
            assert all(cfg.get(k) in (None, True, False) for k in BOOLS), cfg
            assert all(type(t) is int and t >= 0 for t in model.config.eos_token_ids), cfg
        if model is not None and text is None and set(keys) <= IRRELEVANT:
            got = forward_logits(model, SEQS)
            assert all(torch.equal(a, b) for a, b in zip(got, ref))


@HSET
@given(data=st.data())
def test_any_consistent_small_config_runs_or_is_refused(tmp_path_factory, data):
    """A checkpoint saved from a config (so its tensors match it), odd sizes included: it loads and runs,
    or the config is refused by name."""
    heads = data.draw(st.integers(1, 4))
    hf = dict(
        model_type=data.draw(st.sampled_from(["qwen3", "qwen2", "llama"])),
        vocab_size=data.draw(st.integers(1, 40)),
        hidden_size=data.draw(st.integers(1, 12)),
        intermediate_size=data.draw(st.integers(1, 12)),
        num_hidden_layers=data.draw(st.integers(1, 2)),
        num_attention_heads=heads,
        num_key_value_heads=data.draw(st.integers(1, 4)),
        head_dim=data.draw(st.integers(1, 7)),
        max_position_embeddings=data.draw(st.integers(1, 16)),
        rms_norm_eps=data.draw(st.sampled_from([1e-6, 1e-30, 1.0, 1e30])),
        rope_theta=data.draw(st.sampled_from([1e-30, 0.5, 1.0, 1e4, 1e300])),
        tie_word_embeddings=data.draw(st.booleans()),
        attention_bias=data.draw(st.booleans()),
    )
    try:
        cfg = ModelConfig.from_hf(hf)
    except ValueError as e:
        assert any(k in str(e) for k in hf), str(e)
        return
    with tempfile.TemporaryDirectory() as tmp:
        save_model(build_model(cfg, seed=1), tmp)
        seqs = [[i % cfg.vocab_size for i in range(min(5, cfg.max_position_embeddings))]]
        try:
            model = exactrl.load_model(tmp)
        except ValueError as e:
            assert tmp in str(e) and "config.json" in str(e), str(e)
            return
        assert all(torch.isfinite(t).all() or cfg.rms_norm_eps < 1e-20 for t in forward_logits(model, seqs))


# --------------------------------------------------------------------------- safetensors

TENSOR_EDITS = [
    "drop",
    "extra",
    "rename",
    "transpose",
    "slice",
    "unsqueeze",
    "scalar",
    "int32",
    "int64",
    "bool",
    "uint8",
    "float16",
    "bfloat16",
    "float64",
    "nan",
    "inf",
]
FLOATS = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _edit_tensors(sd: dict, name: str, how: str) -> None:
    t = sd[name]
    if how == "drop":
        del sd[name]
    elif how == "extra":
        sd[name.replace("weight", "extra")] = t.clone()
    elif how == "rename":
        sd[name + "_x"] = sd.pop(name)
    elif how == "transpose":
        sd[name] = t.T.contiguous() if t.dim() == 2 and t.shape[0] != t.shape[1] else t[:-1].clone()
    elif how == "slice":
        sd[name] = t[1:].clone()
    elif how == "unsqueeze":
        sd[name] = t[None].clone()
    elif how == "scalar":
        sd[name] = t.flatten()[0].clone()
    elif how in ("nan", "inf"):
        sd[name] = t.clone().view(-1).index_fill_(0, torch.tensor([t.numel() // 2]), float(how)).view(t.shape)
    elif how in FLOATS:
        sd[name] = t.to(FLOATS[how])
    else:
        sd[name] = (t * 100).to(getattr(torch, how))


@HSET
@given(picks=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(TENSOR_EDITS)), min_size=1, max_size=3))
def test_damaged_tensors_load_or_are_named(qwen3_dir, ref, picks):
    tmp, d = _copy(qwen3_dir)
    with tmp:
        f = d / "model.safetensors"
        sd = load_file(f)
        touched, hows = [], set()
        for i, how in picks:
            name = sorted(sd)[i % len(sd)]
            if name not in touched:  # one edit per tensor: a second would undo the first
                touched += [name, name + "_x", name.replace("weight", "extra")]
                hows.add(how)
                _edit_tensors(sd, name, how)
        save_file(sd, f, metadata={"format": "pt"})
        model = _loads_or_names(d, touched)
        assert model is None or hows <= set(FLOATS), f"{picks} loaded"  # any other damage is refused
        if model is not None and hows == {"float64"}:
            assert all(torch.equal(a, b) for a, b in zip(forward_logits(model, SEQS), ref))


@HSET
@given(
    cut=st.integers(0, 10**9),
    where=st.integers(0, 10**9),
    junk=st.binary(min_size=1, max_size=8),
    how=st.sampled_from(["truncate", "overwrite", "header_length", "append"]),
)
def test_damaged_safetensors_bytes_are_named(qwen3_dir, ref, cut, where, junk, how):
    tmp, d = _copy(qwen3_dir)
    with tmp:
        f = d / "model.safetensors"
        data = f.read_bytes()
        header = 8 + int.from_bytes(data[:8], "little")
        if how == "truncate":
            data = data[: cut % len(data)]
        elif how == "overwrite":  # inside the header: the tensor data can hold any bytes
            at = where % header
            data = data[:at] + junk + data[at + len(junk) :]
        elif how == "header_length":
            data = (cut % 2**64).to_bytes(8, "little") + data[8:]
        else:
            data = data + junk
        f.write_bytes(data)
        model = _loads_or_names(d, ["model.safetensors"])
        if model is not None:
            assert all(torch.equal(a, b) for a, b in zip(forward_logits(model, SEQS), ref))


# --------------------------------------------------------------------------- sharded checkpoints


@HSET
@given(
    shards=st.integers(1, 3),
    seed=st.integers(0, 10**6),
    how=st.sampled_from(
        [
            "valid",
            "missing_file",
            "drop_entry",
            "int_value",
            "absolute",
            "dotdot",
            "subdir",
            "duplicate",
            "remove_shard",
            "map_list",
            "empty_name",
            "wrong_shard",
        ]
    ),
)
def test_damaged_shard_index_loads_or_is_named(qwen3_dir, ref, shards, seed, how):
    tmp, d = _copy(qwen3_dir)
    with tmp:
        sd = load_file(d / "model.safetensors")
        (d / "model.safetensors").unlink()
        names = sorted(sd)
        rng = random.Random(seed)
        where = {n: f"model-{rng.randrange(shards) + 1:05d}-of-{shards:05d}.safetensors" for n in names}
        for s in sorted(set(where.values())):
            save_file({n: sd[n] for n in names if where[n] == s}, d / s, metadata={"format": "pt"})
        victim = rng.choice(names)
        weight_map = dict(where)
        if how == "missing_file":
            weight_map[victim] = "model-00009-of-00009.safetensors"
        elif how == "drop_entry":
            del weight_map[victim]
        elif how == "int_value":
            weight_map[victim] = 5
        elif how == "absolute":
            weight_map[victim] = str(d / where[victim])
        elif how == "dotdot":
            weight_map[victim] = "../m/" + where[victim]
        elif how == "subdir":
            (d / "sub").mkdir()
            shutil.copy(d / where[victim], d / "sub" / "x.safetensors")
            weight_map[victim] = "sub/x.safetensors"
        elif how == "duplicate":  # the victim stored twice, in a second file too
            save_file({victim: sd[victim] * 2}, d / "extra.safetensors", metadata={"format": "pt"})
            weight_map["extra"] = "extra.safetensors"
        elif how == "remove_shard":
            (d / where[victim]).unlink()
        elif how == "empty_name":
            weight_map[victim] = ""
        elif how == "wrong_shard":  # the map names another shard for the victim: still the same tensors
            weight_map[victim] = rng.choice(sorted(set(where.values())))
        index = {"metadata": {}, "weight_map": [weight_map] if how == "map_list" else weight_map}
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
        model = _loads_or_names(d, ["model.safetensors.index.json", victim, where[victim]])
        ok = how in ("valid", "wrong_shard") or how == "drop_entry" and list(where.values()).count(where[victim]) > 1
        assert (model is not None) == ok, how
        if model is not None:
            assert all(torch.equal(a, b) for a, b in zip(forward_logits(model, SEQS), ref))


# --------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d, default_tokenizer_corpus([ArithmeticTask()], 100, seed=0), vocab_size=300)
    return d


TOK_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"]


@settings(max_examples=examples(120), deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    file=st.sampled_from(TOK_FILES),
    how=st.sampled_from(["delete", "text", "truncate", "edit"]),
    text=st.sampled_from(TEXTS),
    cut=st.integers(0, 10**6),
    key=st.sampled_from(
        [
            "eos_token",
            "pad_token",
            "chat_template",
            "model",
            "added_tokens",
            "tokenizer_class",
            "model_max_length",
            "normalizer",
            "pre_tokenizer",
            "decoder",
            "model_type",
        ]
    ),
    value=st.sampled_from(VALUES[1:]),
)
def test_a_damaged_tokenizer_loads_or_is_named(tok_dir, file, how, text, cut, key, value):
    tmp, d = _copy(tok_dir)
    with tmp:
        f = d / file
        if how == "delete":
            f.unlink(missing_ok=True)
        elif how == "text":
            f.write_text(text)
        elif how == "truncate" and f.is_file():
            data = f.read_bytes()
            f.write_bytes(data[: cut % len(data)])
        elif how == "edit":
            obj = json.loads(f.read_text()) if f.is_file() else {}
            obj[key] = value
            f.write_text(json.dumps(obj))
        try:
            tok = load_tokenizer(d)
        except (ValueError, FileNotFoundError) as e:
            assert str(d) in str(e), str(e)
            return
        text = "<|im_start|>user\n12+7=<|im_end|>"
        assert tok.decode(tok.encode(text)) == text
        assert 0 <= tok.eos_token_id < tok.vocab_size and 0 <= tok.pad_token_id < tok.vocab_size
