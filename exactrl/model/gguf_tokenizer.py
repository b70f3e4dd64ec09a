"""A GGUF file's tokenizer as a Hugging Face fast tokenizer, built from the file's metadata alone.

Invariant: the tokenizer encodes and decodes as the Hugging Face tokenizer.json the file was converted from: the
vocabulary is `tokenizer.ggml.tokens` in id order, the merges `tokenizer.ggml.merges` in rank order, tokens of
type CONTROL (3) are special added tokens and USER_DEFINED (4) plain added tokens (llama.cpp's converter writes
a Hugging Face added token as one of these two), the pre-tokenizer is the one `tokenizer.ggml.pre` names (the
splitting rules of PRE_TOKENIZERS, as the Hugging Face tokenizers of those families define them), bos is
prepended when `tokenizer.ggml.add_bos_token` is true, and the chat template is `tokenizer.chat_template`.

Read: byte-level BPE files (`tokenizer.ggml.model` = "gpt2") whose `tokenizer.ggml.pre` is in PRE_TOKENIZERS.
SentencePiece files (model "llama", e.g. TinyLlama or Mistral v0.1) and other pre-tokenizers are refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from exactrl.model.gguf import field, open_gguf

# Splitting rules of the Hugging Face tokenizers of these families (their tokenizer.json `pre_tokenizer`).
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = ("gpt-2", "gpt2", "smollm", "qwen2", "llama-bpe")
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types (gguf.TokenType)


def _pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    if pre in ("gpt-2", "gpt2"):  # GPT-2's own regex, inside ByteLevel
        return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True)
    if pre == "smollm":  # each digit its own piece, then GPT-2's regex
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True),
            ]
        )
    regex = _QWEN2 if pre == "qwen2" else _LLAMA3
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False), byte_level])


def _token(tokens: list[str], key: str, reader) -> str | None:
    i = field(reader, f"tokenizer.ggml.{key}")
    if i is None:
        return None
    if not 0 <= int(i) < len(tokens):
        raise ValueError(f"tokenizer.ggml.{key}={i} is not a token id (the vocabulary has {len(tokens)})")
    return tokens[int(i)]


def gguf_tokenizer_parts(path: str | Path) -> dict[str, Any]:
    """The pieces of the file's tokenizer: a `tokenizers.Tokenizer` and its special tokens and chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    reader = open_gguf(path)
    kind = field(reader, "tokenizer.ggml.model")
    if kind is None:
        raise ValueError(f"{path}: GGUF metadata has no tokenizer (tokenizer.ggml.model); pass a tokenizer directory")
    if kind != "gpt2":
        raise ValueError(
            f"{path}: tokenizer.ggml.model={kind!r} is not read (only 'gpt2', byte-level BPE); pass the model's "
            f"Hugging Face tokenizer directory instead"
        )
    pre = field(reader, "tokenizer.ggml.pre", "gpt2")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"{path}: tokenizer.ggml.pre={pre!r} is not read; read: {', '.join(PRE_TOKENIZERS)} (or pass the "
            f"model's Hugging Face tokenizer directory)"
        )
    tokens = list(field(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges", [])]
    types = list(field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    if len(types) != len(tokens):
        raise ValueError(f"{path}: {len(types)} token types for {len(tokens)} tokens")
    unk = _token(tokens, "unknown_token_id", reader)
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=None, ignore_merges=pre == "llama-bpe"))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens(
        [
            AddedToken(t, special=ty == CONTROL, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty in (CONTROL, USER_DEFINED)
        ]
    )
    bos = _token(tokens, "bos_token_id", reader)
    eos = _token(tokens, "eos_token_id", reader)
    add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(field(reader, "tokenizer.ggml.add_eos_token", False)) and eos is not None
    steps = [processors.ByteLevel(trim_offsets=False)]
    if add_bos or add_eos:
        single = [*([bos] if add_bos else []), "$A", *([eos] if add_eos else [])]
        pair = [*single, *([bos] if add_bos else []), "$B:1", *([eos] if add_eos else [])]
        special = [(t, vocab[t]) for t in {bos if add_bos else None, eos if add_eos else None} - {None}]
        steps.append(processors.TemplateProcessing(single=single, pair=pair, special_tokens=special))
    tok.post_processor = processors.Sequence(steps)
    return {
        "tokenizer": tok,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": _token(tokens, "padding_token_id", reader),
        "chat_template": field(reader, "tokenizer.chat_template"),
    }


def gguf_hf_tokenizer(path: str | Path):
    """A transformers fast tokenizer (PreTrainedTokenizerFast) of the file's tokenizer."""
    from transformers import PreTrainedTokenizerFast

    parts = gguf_tokenizer_parts(path)
    return PreTrainedTokenizerFast(
        tokenizer_object=parts.pop("tokenizer"),
        clean_up_tokenization_spaces=False,
        **{k: v for k, v in parts.items() if v is not None},
    )
