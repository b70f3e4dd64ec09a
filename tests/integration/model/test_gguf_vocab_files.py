"""Real vocabularies: llama.cpp's own tokenizer test files read by exactrl's GGUF tokenizer (gguf_tokenizer.py).

llama.cpp keeps vocabulary-only GGUF files of real models in its models/ folder, each `ggml-vocab-NAME.gguf`
with `.inp` (texts, separated by a marker line) and `.out` (the ids the model's Hugging Face tokenizer gives each
text, `encode(text, add_special_tokens=False)`, one line per text). Every read file must give exactly those ids
and decode them back to the text; files of a kind exactrl does not read must be refused by name.

Set EXACTRL_LLAMA_CPP_MODELS to that folder to run these (skipped otherwise): llama-cpp-python's source archive
carries it, `pip download --no-deps --no-binary :all: llama-cpp-python`, then
`tar xzf llama_cpp_python-*.tar.gz --wildcards '*/models/ggml-vocab-*'` gives `.../vendor/llama.cpp/models`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("gguf")

from exactrl.model.tokenizer import load_tokenizer  # noqa: E402

MODELS = os.environ.get("EXACTRL_LLAMA_CPP_MODELS")
pytestmark = pytest.mark.skipif(not MODELS, reason="EXACTRL_LLAMA_CPP_MODELS (llama.cpp's models/ folder) not set")
MARKER = "\n__ggml_vocab_test__\n"
READ = ("llama-spm", "phi-3", "gpt-2", "llama-bpe", "qwen2")  # SentencePiece: llama-spm (Llama 2), phi-3
REFUSED = {  # (gemma-4's and nomic-bert-moe's files are refused too, after a long read of their 250k tokens)
    "bert-bge": "tokenizer.ggml.model='bert' is not read",
    "falcon": "tokenizer.ggml.pre='falcon' is not read",
}


def _file(name: str) -> Path:
    path = Path(MODELS) / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        pytest.fail(f"{path} is missing: EXACTRL_LLAMA_CPP_MODELS must be llama.cpp's models/ folder")
    return path


@pytest.mark.parametrize("name", READ)
def test_vocab_file_encodes_as_its_hugging_face_tokenizer(name):
    path = _file(name)
    texts = path.with_suffix(".gguf.inp").read_text(encoding="utf-8").split(MARKER)
    want = path.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
    assert len(texts) <= len(want)
    tok = load_tokenizer(path)
    for text, ids in zip(texts, want):
        got = tok.encode(text)
        assert got == [int(i) for i in ids.split()], text
        assert tok.decode(got) == text, text


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_vocab_file_of_a_kind_not_read_is_refused_by_name(name):
    with pytest.raises(ValueError, match=REFUSED[name]):
        load_tokenizer(_file(name))
