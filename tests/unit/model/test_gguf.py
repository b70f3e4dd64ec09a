"""GGUF files (exactrl/model/gguf.py, gguf_tokenizer.py): tiny models written with the `gguf` package's GGUFWriter
as llama.cpp's converter writes them (tests/helpers/gguf_files.py) and read back. F32 reads bitwise; quantized
types read as gguf's own dequantization, within stated logprob bounds; the Llama q/k permutation is llama.cpp's
(transformers' GGUF reader, the oracle, agrees); tokenizers round-trip; bad files are refused by name."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import make_hf_model, random_sequences

pytest.importorskip("gguf")

from gguf_files import dequantized_reference, write_gguf  # noqa: E402

import exactrl  # noqa: E402
from exactrl.model.gguf import unpermute_qk  # noqa: E402
from exactrl.model.tokenizer import build_tokenizer, load_tokenizer  # noqa: E402

V = 211
TEXTS = [
    "Hello world! 12345 + 678 = 13023",
    "  two  spaces\n\n\ttab, 'quotes' it's we'll I'M",
    "Ünïcödé façade naïve 🎉 中文",
    "<|im_start|>user\nhi<|im_end|>\n<think>x</think>",
    "",
]


def _seqs():
    return random_sequences(random.Random(0), 3, 20, 60, V)


def _lps(model, seqs):
    with torch.no_grad():
        return exactrl.sequence_logprobs(model, seqs)


def _source(tmp_path, arch, **over):
    make_hf_model(tmp_path / "hf", arch, **over)
    return exactrl.load_model(tmp_path / "hf")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_file_reads_bitwise_as_its_source(tmp_path, arch):
    src = _source(tmp_path, arch)
    write_gguf(tmp_path / "m.gguf", src)
    got = exactrl.load_model(tmp_path / "m.gguf")
    ours = dict(got.named_parameters())
    assert set(ours) == {n for n, _ in src.named_parameters()}
    assert all(torch.equal(p, ours[n]) for n, p in src.named_parameters())
    c, g = src.config, got.config
    assert (g.model_type, g.rope_theta, g.rms_norm_eps, g.qkv_bias, g.o_bias, g.qk_norm, g.tie_word_embeddings) == (
        c.model_type,
        c.rope_theta,
        c.rms_norm_eps,
        c.qkv_bias,
        c.o_bias,
        c.qk_norm,
        c.tie_word_embeddings,
    )
    seqs = _seqs()
    assert all(torch.equal(a, b) for a, b in zip(_lps(src, seqs), _lps(got, seqs)))


def test_f32_file_with_fast_kernels_differs_from_exact(tmp_path):
    """The inverse twin of the bitwise check above: the same file under `fast` kernels gives other bits."""
    src = _source(tmp_path, "qwen3")
    write_gguf(tmp_path / "m.gguf", src)
    fast = exactrl.load_model(tmp_path / "m.gguf", kernels="fast")
    seqs = random_sequences(random.Random(3), 3, 60, 120, V)
    a, b = _lps(src, seqs), _lps(fast, seqs)
    assert not all(torch.equal(x, y) for x, y in zip(a, b))
    assert max((x - y).abs().max().item() for x, y in zip(a, b)) < 1e-4


def test_llama_qk_permutation_is_llama_cpps(tmp_path):
    """transformers' GGUF reader (the oracle) reads the written file to its source's logits, so the writer
    permutes as llama.cpp does; exactrl reads it bitwise; a file written without the permutation reads to
    other logprobs (the check has teeth)."""
    from transformers import AutoModelForCausalLM

    hf = make_hf_model(tmp_path / "hf", "llama", attention_bias=False)
    src = exactrl.load_model(tmp_path / "hf")
    write_gguf(tmp_path / "m.gguf", src)
    oracle = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    x = torch.tensor([_seqs()[0]])
    with torch.no_grad():
        assert torch.equal(oracle(x).logits, hf(x).logits)
    seqs = _seqs()
    assert all(torch.equal(a, b) for a, b in zip(_lps(src, seqs), _lps(exactrl.load_model(tmp_path / "m.gguf"), seqs)))
    write_gguf(tmp_path / "plain.gguf", src, permute=False)
    off = _lps(exactrl.load_model(tmp_path / "plain.gguf"), seqs)
    assert max((a - b).abs().max().item() for a, b in zip(_lps(src, seqs), off)) > 1e-4


def test_unpermute_inverts_llama_cpps_permute():
    from gguf_files import llama_cpp_permute

    w = torch.randn(4 * 16, 8)
    for heads in (1, 2, 4):
        back = unpermute_qk(torch.from_numpy(llama_cpp_permute(w.numpy(), heads)), heads)
        assert torch.equal(back, w)
    b = torch.randn(32)  # a bias permutes the same way
    assert torch.equal(unpermute_qk(torch.from_numpy(llama_cpp_permute(b.numpy(), 2)), 2), b)


# max |Δ logprob| against the source model, measured on these tiny models and kept with ~5x margin
BOUNDS = {"F16": 5e-4, "BF16": 3e-3, "Q8_0": 1e-2}


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantized_file_reads_as_ggufs_dequantization(tmp_path, qtype):
    """Every weight equals gguf.quants' dequantization of the stored blocks, bit for bit (q/k put back in
    Hugging Face order); F16, BF16 and Q8_0 keep logprobs within BOUNDS of the float32 source."""
    src = _source(tmp_path, "llama")
    write_gguf(tmp_path / "m.gguf", src, qtype=qtype)
    got = dict(exactrl.load_model(tmp_path / "m.gguf").named_parameters())
    for name, p in src.named_parameters():
        want = dequantized_reference(p.detach(), qtype) if p.ndim == 2 else p.detach()
        assert torch.equal(got[name], want), name
    changed = sum(not torch.equal(got[n], p) for n, p in src.named_parameters() if p.ndim == 2)
    assert changed > 0  # the type did round the weights
    if qtype in BOUNDS:
        seqs = _seqs()
        m = exactrl.load_model(tmp_path / "m.gguf")
        err = max((a - b).abs().max().item() for a, b in zip(_lps(src, seqs), _lps(m, seqs)))
        assert 0 < err <= BOUNDS[qtype], err


@pytest.mark.parametrize("kind, block_bytes, scale_bytes", [("Q4_K", 144, (0, 4)), ("Q6_K", 210, (208, 210))])
def test_k_quant_tensor_reads_as_ggufs_dequantization(tmp_path, kind, block_bytes, scale_bytes):
    """K-quant blocks (gguf-py has no quantizer for them): random blocks with finite fp16 scales, stored raw,
    read as gguf.quants.dequantize reads them."""
    import gguf

    src = _source(tmp_path, "llama", intermediate_size=256)
    rows, cols = 64, 256  # mlp.down_proj: [hidden, intermediate], one 256-wide block per row
    blocks = np.random.default_rng(0).integers(0, 256, (rows, block_bytes), dtype=np.uint8)
    scale = np.full(((scale_bytes[1] - scale_bytes[0]) // 2,), 0.01, np.float16).view(np.uint8)
    blocks[:, scale_bytes[0] : scale_bytes[1]] = scale
    write_gguf(tmp_path / "m.gguf", src, raw={"blk.1.ffn_down.weight": (blocks, kind)})
    got = exactrl.load_model(tmp_path / "m.gguf").model.layers[1].mlp.down_proj.weight
    want = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]).copy())
    assert want.shape == (rows, cols) and torch.equal(got, want)


def test_bfloat16_load_is_the_float32_load_cast(tmp_path):
    src = _source(tmp_path, "qwen2")
    write_gguf(tmp_path / "m.gguf", src, qtype="Q8_0")
    f32 = dict(exactrl.load_model(tmp_path / "m.gguf").named_parameters())
    bf = exactrl.load_model(tmp_path / "m.gguf", dtype="bfloat16")
    assert bf.dtype == torch.bfloat16
    assert all(torch.equal(p, f32[n].to(torch.bfloat16)) for n, p in bf.named_parameters())


# --------------------------------------------------------------------------- tokenizer


def _trained_tokenizer(out, pre: str) -> None:
    """A byte-level BPE with the pre-tokenizer of `pre`'s family, ChatML specials and a chat template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from exactrl.model.tokenizer import CHAT_TEMPLATE

    qwen = (  # Qwen2's tokenizer.json split; Llama 3's takes digits in threes
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+"
    )
    split = {"qwen2": qwen, "llama-bpe": qwen.replace(r"|\p{N}|", r"|\p{N}{1,3}|")}
    tok = Tokenizer(models.BPE())
    bl = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre == "gpt2")
    tok.pre_tokenizer = (
        bl if pre == "gpt2" else pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split[pre]), "isolated"), bl])
    )
    tok.decoder = decoders.ByteLevel()
    corpus = [t * 3 for t in TEXTS] + ["the cat sat on 1234567 mats, didn't it?"] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    if pre == "llama-bpe":
        tok.model.ignore_merges = True
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    ).save_pretrained(str(out))


@pytest.mark.parametrize("pre", ["smollm", "qwen2", "llama-bpe", "gpt2"])
def test_tokenizer_round_trip(tmp_path, pre):
    """The file's tokenizer encodes, decodes and renders chats as the directory it was written from."""
    import gguf
    from gguf_files import add_tokenizer

    if pre == "smollm":  # exactrl's own: digits split one by one, then GPT-2's regex (SmolLM's rule)
        build_tokenizer(tmp_path / "tok", [t * 3 for t in TEXTS] * 5, vocab_size=400)
    else:
        _trained_tokenizer(tmp_path / "tok", pre)
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    add_tokenizer(w, tmp_path / "tok", pre=pre)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    want, got = load_tokenizer(tmp_path / "tok"), load_tokenizer(tmp_path / "t.gguf")
    for text in TEXTS + ["x" * 50 + " 9876543210 ok"]:
        ids = got.encode(text)
        assert ids == want.encode(text), text
        assert got.decode(ids) == text
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12+7?"}]
    assert got.render_chat(chat) == want.render_chat(chat)
    assert got.apply_chat_template(chat) == want.apply_chat_template(chat)
    assert (got.eos_token_id, got.end_of_turn_id, got.pad_token_id, got.vocab_size) == (
        want.eos_token_id,
        want.end_of_turn_id,
        want.pad_token_id,
        want.vocab_size,
    )
    assert got.hf.convert_ids_to_tokens(got.encode("<|im_start|>")) == ["<|im_start|>"]


# --------------------------------------------------------------------------- convert


def test_convert_writes_a_directory_that_loads_to_the_same_model(tmp_path):
    from exactrl.cli import main

    src = _source(tmp_path, "qwen3", vocab_size=300)
    build_tokenizer(tmp_path / "tok", [t * 3 for t in TEXTS] * 5, vocab_size=300)
    write_gguf(tmp_path / "m.gguf", src, tokenizer_dir=tmp_path / "tok", qtype="Q8_0")
    assert main(["convert", str(tmp_path / "m.gguf"), str(tmp_path / "out")]) == 0
    seqs = _seqs()
    a = _lps(exactrl.load_model(tmp_path / "m.gguf"), seqs)
    b = _lps(exactrl.load_model(tmp_path / "out"), seqs)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    tok = load_tokenizer(tmp_path / "out")
    assert tok.encode(TEXTS[3]) == load_tokenizer(tmp_path / "tok").encode(TEXTS[3])
    assert tok.hf.chat_template == load_tokenizer(tmp_path / "tok").hf.chat_template
    with pytest.raises(ValueError, match="is not empty"):
        exactrl.model.gguf.convert_gguf(tmp_path / "m.gguf", tmp_path / "out")


# --------------------------------------------------------------------------- bad files


def test_not_a_gguf_file_is_named(tmp_path):
    (tmp_path / "x.gguf").write_text("{}")
    with pytest.raises(ValueError, match=r"x.gguf is not a GGUF file: it starts with b'\{\}'"):
        exactrl.load_model(tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="does not exist"):
        exactrl.load_model(tmp_path / "absent.gguf")
    src = _source(tmp_path, "qwen2")
    write_gguf(tmp_path / "m.gguf", src)
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:200])
    with pytest.raises(ValueError, match="cut.gguf is not a readable GGUF file"):
        exactrl.load_model(tmp_path / "cut.gguf")


def test_unknown_architecture_is_named(tmp_path):
    src = _source(tmp_path, "llama")
    write_gguf(tmp_path / "m.gguf", src, arch="gptneox", permute=False)
    with pytest.raises(ValueError, match=r"general.architecture='gptneox' is not read; read: \['llama'"):
        exactrl.load_model(tmp_path / "m.gguf")


def test_unsupported_tensor_type_is_named(tmp_path):
    src = _source(tmp_path, "llama")
    blocks = np.zeros((64, 128 // 32 * 18), dtype=np.uint8)  # IQ4_NL: 18 bytes per 32 weights
    write_gguf(tmp_path / "m.gguf", src, raw={"blk.0.ffn_down.weight": (blocks, "IQ4_NL")})
    with pytest.raises(ValueError, match=r"tensor 'blk.0.ffn_down.weight' is stored as IQ4_NL, which is not read"):
        exactrl.load_model(tmp_path / "m.gguf")


def test_missing_metadata_and_unknown_tensors_are_named(tmp_path):
    src = _source(tmp_path, "qwen3")
    write_gguf(tmp_path / "a.gguf", src, meta={"qwen3.feed_forward_length": None})
    with pytest.raises(ValueError, match="no qwen3.feed_forward_length"):
        exactrl.load_model(tmp_path / "a.gguf")
    write_gguf(tmp_path / "b.gguf", src, extra_tensors={"rope_freqs.weight": np.ones(8)})
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        exactrl.load_model(tmp_path / "b.gguf")
    write_gguf(tmp_path / "c.gguf", src, extra_tensors={"blk.0.ffn_gate_inp.weight": np.ones((4, 64))})
    with pytest.raises(ValueError, match="unexpected tensor 'blk.0.ffn_gate_inp.weight' for a qwen3 model"):
        exactrl.load_model(tmp_path / "c.gguf")
    write_gguf(tmp_path / "d.gguf", src, meta={"qwen3.rope.scaling.type": "yarn"})
    with pytest.raises(ValueError, match="rope.scaling.type='yarn' is not read"):
        exactrl.load_model(tmp_path / "d.gguf")


def test_tokenizer_refusals_are_named(tmp_path):
    import gguf

    for name, model, arch, scores in (
        ("t5", "t5", "llama", [0.0, 0.0]),
        ("noscores", "llama", "llama", None),
        ("gemma", "llama", "gemma2", [0.0, 0.0]),
    ):
        w = gguf.GGUFWriter(str(tmp_path / f"{name}.gguf"), arch)
        w.add_tokenizer_model(model)
        w.add_token_list(["<unk>", "a"])
        if scores is not None:
            w.add_token_scores(scores)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    with pytest.raises(ValueError, match="tokenizer.ggml.model='t5' is not read"):
        load_tokenizer(tmp_path / "t5.gguf")
    with pytest.raises(ValueError, match=r"SentencePiece tokenizer needs tokenizer.ggml.scores, one per token \(2\)"):
        load_tokenizer(tmp_path / "noscores.gguf")
    with pytest.raises(ValueError, match="tokenizer of a general.architecture='gemma2' file is not read"):
        load_tokenizer(tmp_path / "gemma.gguf")
    src = _source(tmp_path, "qwen3")
    write_gguf(tmp_path / "none.gguf", src)
    with pytest.raises(ValueError, match="has no tokenizer"):
        load_tokenizer(tmp_path / "none.gguf")
