"""SentencePiece GGUF tokenizers (tokenizer.ggml.model "llama": Llama 2, TinyLlama, Mistral) read from the file's
metadata alone (exactrl/model/gguf_tokenizer.py). A tiny SentencePiece BPE model trained here with Llama 2's
settings is written into GGUF as llama.cpp's converter writes it (tests/helpers/gguf_files.py); the tokenizer read
back encodes and decodes as SentencePiece itself and as transformers' own SentencePiece conversion of the same
model, special tokens and chat template included."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import make_hf_model

pytest.importorskip("gguf")
pytest.importorskip("sentencepiece")

from gguf_files import add_spm_tokenizer, spm_vocab, train_spm, write_gguf, write_tokenizer_gguf  # noqa: E402

import exactrl  # noqa: E402
from exactrl.model.gguf_tokenizer import spm_merges  # noqa: E402
from exactrl.model.tokenizer import CHAT_TEMPLATE, load_tokenizer  # noqa: E402

CONTROL = ("<|im_start|>", "<|im_end|>")
USER = ("<think>", "</think>")
ADDED = {**dict.fromkeys(CONTROL, True), **dict.fromkeys(USER, False)}  # Hugging Face added tokens: special?
CORPUS = [
    "Hello world! 12345 + 678 = 13023",
    "  two  spaces\n\n\ttab, 'quotes' it's we'll I'M",
    "Ünïcödé façade naïve 中文",
    "the cat sat on the mat, didn't it? aaaa ==== ....",
    "def f(x):\n    return x + 1\n",
    "the quick brown fox jumps over the lazy dog",
]
TEXTS = [  # leading/trailing/runs of spaces, newlines, tabs, digits, unicode, characters with no piece (bytes)
    *CORPUS,
    " leading space",
    "   three leading, trailing ",
    "\nnewline first\n",
    "x",
    " ",
    "",
    "aaaaaaa ======== the the the",
    "x" * 50 + " 9876543210 ok",
    "🎉 € ∑ 𝔘 ok",
]
CHATS = [  # special (CONTROL) and added (USER_DEFINED) tokens amid text: each text after one gets its own "▁"
    "<|im_start|>user\nhi<|im_end|>\n<think>x</think> y",
    "a<think>b</think>c",
    "<s> x</s> y<unk>",
]


@pytest.fixture(scope="module")
def model() -> bytes:
    return train_spm([t for t in CORPUS for _ in range(20)], user_defined=USER, control=CONTROL)


def _sp(model: bytes):
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_proto=model)


def _file(tmp_path, model: bytes, name: str = "t.gguf", **kw):
    write_tokenizer_gguf(tmp_path / name, lambda w: add_spm_tokenizer(w, model, ADDED, **kw))
    return tmp_path / name


def _reference(tmp_path, model: bytes):
    """transformers' own tokenizer of the SentencePiece model file (its SentencePiece-to-BPE conversion, legacy:
    each text between added tokens gets its "▁"), with Llama 2's tokenizer_config: the oracle."""
    from transformers import TokenizersBackend

    out = tmp_path / "hf"
    out.mkdir()
    (out / "tokenizer.model").write_bytes(model)
    sp = _sp(model)
    decoder = {
        str(sp.piece_to_id(t)): {"content": t, "special": s, "normalized": False, "lstrip": False, "rstrip": False}
        for t, s in {"<unk>": True, "<s>": True, "</s>": True, **ADDED}.items()
    }
    config = {
        "legacy": True,
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "added_tokens_decoder": decoder,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return TokenizersBackend.from_pretrained(str(out), legacy=True)


def test_encodes_and_decodes_as_sentencepiece(tmp_path, model):
    """Plain text encodes to SentencePiece's own ids (its BPE merges by score, llama.cpp's rule) and decodes back
    to it; characters with no piece become their bytes' <0xNN> tokens, and decode to the text again."""
    sp, tok = _sp(model), load_tokenizer(_file(tmp_path, model))
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == sp.decode(ids) == text, text
    pieces = tok.hf.convert_ids_to_tokens(tok.encode("🎉 ok"))
    assert pieces[:5] == ["▁", "<0xF0>", "<0x9F>", "<0x8E>", "<0x89>"], pieces
    assert tok.hf.convert_ids_to_tokens(tok.encode(" x")) == ["▁▁", "x"]  # the prefix comes before a space too
    assert not tok.byte_level


def test_matches_transformers_sentencepiece_tokenizer(tmp_path, model):
    """Special and added tokens, bos, chat template, decoding with specials: all as transformers' tokenizer of
    the same SentencePiece model and tokenizer_config."""
    tok, ref = load_tokenizer(_file(tmp_path, model, chat_template=CHAT_TEMPLATE)), _reference(tmp_path, model)
    for text in TEXTS + CHATS:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert tok(text)["input_ids"] == ref(text)["input_ids"] == [1, *ids], text
        assert tok.decode(ids) == ref.decode(ids), text
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), text
    assert tok.hf.convert_ids_to_tokens(tok.encode(CHATS[0]))[:3] == ["<|im_start|>", "▁", "u"]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12+7?"}]
    want = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tok.render_chat(chat) == want
    assert tok.apply_chat_template(chat) == ref.encode(want, add_special_tokens=False)
    vocab = ref.get_vocab()
    assert (tok.eos_token_id, tok.end_of_turn_id, tok.pad_token_id, tok.vocab_size) == (
        vocab["</s>"],
        vocab["<|im_end|>"],
        vocab["</s>"],
        len(ref),
    )


def test_merges_in_the_file_rank_instead_of_scores(tmp_path, model):
    """A file that carries tokenizer.ggml.merges (older converters copied tokenizer.json's) is tokenized by them:
    the score-ranked merges written out read as the scores do, the same merges in reverse order read otherwise."""
    sp = _sp(model)
    merges = [f"{a} {b}" for a, b in spm_merges(*spm_vocab(model, ADDED))]
    same = load_tokenizer(_file(tmp_path, model, "same.gguf", merges=merges))
    reverse = load_tokenizer(_file(tmp_path, model, "reverse.gguf", merges=merges[::-1]))
    assert all(same.encode(t) == sp.encode(t) for t in TEXTS)
    assert any(reverse.encode(t) != sp.encode(t) for t in TEXTS)
    assert all(reverse.decode(reverse.encode(t)) == t for t in TEXTS)  # another split of the same text


def test_a_merge_of_no_token_or_a_special_id_past_the_vocabulary_is_refused_by_name(tmp_path, model):
    with pytest.raises(ValueError, match=r"tokenizer.ggml.merges\[1\]='e x' is not two tokens"):
        load_tokenizer(_file(tmp_path, model, merges=["\u2581 t", "e x"]))
    n = _sp(model).get_piece_size()
    path = tmp_path / "pad.gguf"
    write_tokenizer_gguf(path, lambda w: (add_spm_tokenizer(w, model, ADDED), w.add_pad_token_id(n)))
    with pytest.raises(ValueError, match=f"pad.gguf: tokenizer.ggml.padding_token_id={n} is not a token id"):
        load_tokenizer(path)


def test_equal_scores_without_merges_are_refused_by_name(tmp_path, model):
    """gguf-py's LlamaHfVocab scores every token -1000: with no merges either, the file does not say in which
    order pieces merge (llama.cpp then merges the leftmost pair first, not Llama's order); with merges it reads."""
    tokens, _, types = spm_vocab(model, ADDED)

    def vocab(w, merges=None):
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores([-1000.0] * len(tokens))
        w.add_token_types(types)
        if merges:
            w.add_token_merges(merges)

    write_tokenizer_gguf(tmp_path / "flat.gguf", vocab)
    with pytest.raises(ValueError, match="every NORMAL token has tokenizer.ggml.scores -1000.0 and there is no"):
        load_tokenizer(tmp_path / "flat.gguf")
    merges = [f"{a} {b}" for a, b in spm_merges(*spm_vocab(model, ADDED))]
    write_tokenizer_gguf(tmp_path / "merges.gguf", lambda w: vocab(w, merges))
    tok, sp = load_tokenizer(tmp_path / "merges.gguf"), _sp(model)
    assert all(tok.encode(t) == sp.encode(t) for t in TEXTS)


def test_without_space_prefix_and_with_spaces_as_added_tokens(tmp_path):
    """tokenizer.ggml.add_space_prefix false (a model trained without SentencePiece's dummy prefix) adds no "▁"
    and strips none when decoding; added tokens of spaces, which the converter writes with real spaces (Gemma's
    way), match runs of spaces as SentencePiece's user-defined "▁▁" pieces do."""
    runs = {"\u2581\u2581": False, "\u2581\u2581\u2581\u2581": False}
    model = train_spm([t for t in CORPUS for _ in range(20)], prefix=False, user_defined=runs)
    sp = _sp(model)
    write_tokenizer_gguf(tmp_path / "t.gguf", lambda w: add_spm_tokenizer(w, model, runs, prefix=False))
    tok = load_tokenizer(tmp_path / "t.gguf")
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == text, text
    assert tok.hf.convert_ids_to_tokens(tok.encode("a     b")) == ["a", "    ", "\u2581", "b"]
    assert tok.encode(" x")[0] != tok.encode("x")[0]


def _llama_cpp_spm(text: str, ids: dict[str, int], scores: list[float]) -> list[int]:
    """llama.cpp's SentencePiece merge rule, written out plainly (llm_tokenizer_spm): from single characters,
    merge the adjacent pair whose concatenation is the highest-scored token, the leftmost of equal ones."""
    syms = list(text)
    while True:
        pairs = [(-scores[ids[a + b]], i) for i, (a, b) in enumerate(zip(syms, syms[1:])) if a + b in ids]
        if not pairs:
            return [ids[s] for s in syms]
        _, i = min(pairs)
        syms[i : i + 2] = [syms[i] + syms[i + 1]]


def test_merge_order_is_llama_cpps_score_order(tmp_path):
    """Random vocabularies over a small alphabet whose scores have nothing to do with token ids: every text
    tokenizes as llama.cpp's rule does (so the BPE ranks follow the scores, not the ids)."""
    rng = random.Random(0)
    for v in range(4):
        tokens = ["<unk>", "<s>", "</s>", *"ab\u2581c"]
        while len(tokens) < 40:
            t = "".join(rng.choice("ab\u2581c") for _ in range(rng.randint(2, 5)))
            tokens += [t] if t not in tokens else []
        scores = [0.0, 0.0, 0.0, *(rng.uniform(-100, 0) for _ in tokens[3:])]
        types = [2, 3, 3, *[1] * (len(tokens) - 3)]

        def vocab(w, tokens=tokens, scores=scores, types=types):
            w.add_tokenizer_model("llama")
            w.add_token_list(tokens)
            w.add_token_scores(scores)
            w.add_token_types(types)

        write_tokenizer_gguf(tmp_path / f"{v}.gguf", vocab)
        tok = load_tokenizer(tmp_path / f"{v}.gguf")
        ids = {t: i for i, t in enumerate(tokens)}
        for _ in range(100):
            text = "".join(rng.choice("ab c") for _ in range(rng.randint(1, 16)))
            assert tok.encode(text) == _llama_cpp_spm("\u2581" + text.replace(" ", "\u2581"), ids, scores), text


def test_absent_keys_take_llama_cpps_defaults(tmp_path, model):
    """No bos/eos/unk ids, add_bos_token or add_space_prefix in the file: unk 0, bos 1, eos 2, bos added, "▁"
    prefix (llama.cpp's defaults for a SentencePiece vocabulary)."""
    tok = load_tokenizer(_file(tmp_path, model, ids=False))
    assert (tok.hf.unk_token, tok.hf.bos_token, tok.hf.eos_token) == ("<unk>", "<s>", "</s>")
    assert tok("the cat")["input_ids"] == [1, *_sp(model).encode("the cat")]


def test_agrees_with_transformers_gguf_reader_on_plain_text(tmp_path, model):
    """transformers' GGUF tokenizer reader gives the same ids for text that does not start with a space. (It
    prefixes "▁" only at the start of the whole text and never doubles it, so " x" and text after a special
    token read otherwise there; exactrl follows SentencePiece and llama.cpp, tested above.)"""
    from transformers import AutoTokenizer

    path = _file(tmp_path, model)
    tok, ref = load_tokenizer(path), AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    plain = [t for t in TEXTS if t and not t.startswith(" ")]
    for text in plain:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(tok.encode(text)) == ref.decode(tok.encode(text)), text


def test_model_and_tokenizer_load_from_one_file(tmp_path, model):
    """A Llama-architecture file with a SentencePiece vocabulary (TinyLlama's kind): load_model reads its weights
    bitwise with the tokenizer's bos/eos in its config, load_tokenizer fits it, and `exactrl convert` writes a
    directory whose tokenizer encodes the same."""
    from exactrl.cli import main

    n = _sp(model).get_piece_size()
    make_hf_model(tmp_path / "src", "llama", vocab_size=n)
    src = exactrl.load_model(tmp_path / "src")
    write_gguf(tmp_path / "m.gguf", src, tokenizer=lambda w: add_spm_tokenizer(w, model, ADDED))
    got = exactrl.load_model(tmp_path / "m.gguf")
    assert all(torch.equal(p, dict(got.named_parameters())[k]) for k, p in src.named_parameters())
    assert (got.config.hf["bos_token_id"], got.config.hf["eos_token_id"]) == (1, 2)
    tok = load_tokenizer(tmp_path / "m.gguf")
    tok.check_fits(got.config.vocab_size, "test")
    assert main(["convert", str(tmp_path / "m.gguf"), str(tmp_path / "out")]) == 0
    back = load_tokenizer(tmp_path / "out")
    for text in TEXTS + CHATS:
        assert back.encode(text) == tok.encode(text), text
        assert back(text)["input_ids"] == tok(text)["input_ids"], text
        assert back.decode(tok.encode(text)) == tok.decode(tok.encode(text)), text
