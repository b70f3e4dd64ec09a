"""A GGUF file's tokenizer as a Hugging Face fast tokenizer, built from the file's metadata alone.

Invariant: the tokenizer encodes and decodes as the Hugging Face tokenizer.json the file was converted from,
which for a SentencePiece vocabulary ranked by its scores is also what llama.cpp does with the file. Shared by both
kinds: the vocabulary is `tokenizer.ggml.tokens` in id order; tokens of type CONTROL (3) are special added
tokens, USER_DEFINED (4) plain added tokens (llama.cpp's converter writes a Hugging Face added token as one of
these two) and UNKNOWN (2) a special one, each matched whole in the raw text; bos is prepended when
`tokenizer.ggml.add_bos_token` is true (eos appended when `add_eos_token` is); the chat template is
`tokenizer.chat_template`.

- Byte-level BPE (`tokenizer.ggml.model` = "gpt2"): the merges are `tokenizer.ggml.merges` in rank order and
  the pre-tokenizer is the one `tokenizer.ggml.pre` names (the splitting rules of PRE_TOKENIZERS, as the
  Hugging Face tokenizers of those families define them).
- SentencePiece (`tokenizer.ggml.model` = "llama": Llama 2, TinyLlama, Mistral v0.1): llama.cpp's rule
  (llm_tokenizer_spm) as a BPE model. Each text between added tokens gets a "▁" prefix (when
  `tokenizer.ggml.add_space_prefix`, default true) and its spaces become "▁"; then, from single characters,
  the adjacent pair whose concatenation is the highest-scored NORMAL token merges first. That is BPE with one
  merge per way of spelling a NORMAL token as two tokens, ranked by the token's `tokenizer.ggml.scores`
  (then by id): `spm_merges`. A file that carries `tokenizer.ggml.merges` (copied from the tokenizer.json)
  uses those instead; one with neither (every NORMAL token scored alike) is refused. A character with no
  token becomes its UTF-8 bytes' `<0xNN>` tokens (byte fallback). Decoding turns "▁" back into spaces, bytes
  into text, and drops the one leading space the prefix added.
  Absent keys take llama.cpp's defaults for this kind: unk 0, bos 1, eos 2, add_bos true, add_eos false.

Read: "gpt2" files whose `tokenizer.ggml.pre` is in PRE_TOKENIZERS, and "llama" files except Gemma's
(general.architecture gemma*: transformers' GGUF reader ranks Gemma's merges by file position, not by score,
and exactrl reads no Gemma weights from GGUF). Other tokenizer models and pre-tokenizers are refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from exactrl.model.gguf import SPM_DEFAULTS, field, open_gguf

# Splitting rules of the Hugging Face tokenizers of these families (their tokenizer.json `pre_tokenizer`).
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = ("gpt-2", "gpt2", "smollm", "qwen2", "llama-bpe")
MODELS = ("gpt2", "llama")  # tokenizer.ggml.model values read: byte-level BPE, SentencePiece
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp's token types (gguf.TokenType)


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


def _token(tokens: list[str], key: str, reader, path, default: int | None = None) -> str | None:
    i = field(reader, f"tokenizer.ggml.{key}")
    if i is None:  # llama.cpp's default id, where the vocabulary has it
        return tokens[default] if default is not None and default < len(tokens) else None
    if not 0 <= int(i) < len(tokens):
        raise ValueError(f"{path}: tokenizer.ggml.{key}={i} is not a token id (the vocabulary has {len(tokens)})")
    return tokens[int(i)]


def _file_merges(reader, path, vocab: dict[str, int]) -> list[tuple[str, str]] | None:
    """`tokenizer.ggml.merges` as (left, right) pairs, None when absent. Each must join two tokens into a token
    (the tokenizers library panics on one that does not)."""
    raw = field(reader, "tokenizer.ggml.merges")
    if raw is None:
        return None
    merges = [tuple(m.split(" ", 1)) for m in raw]
    for n, m in enumerate(merges):
        if len(m) != 2 or m[0] not in vocab or m[1] not in vocab or m[0] + m[1] not in vocab:
            raise ValueError(
                f"{path}: tokenizer.ggml.merges[{n}]={raw[n]!r} is not two tokens (separated by a space) whose "
                f"concatenation is a token"
            )
    return merges


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges that tokenize as llama.cpp's SentencePiece rule: for every NORMAL token, each way of spelling
    it as two tokens (left + right), ranked by the token's score, highest first, then by its id. In
    llama.cpp the adjacent pair whose concatenation is the best-scored token merges first; in BPE the
    lowest-ranked merge present does, so the two agree whenever scores are distinct."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, (t, ty) in enumerate(zip(tokens, types, strict=True)):
        if ty != NORMAL:
            continue
        ranked.extend((-scores[i], i, t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in ids and t[k:] in ids)
    ranked.sort(key=lambda r: (r[0], r[1]))
    return [(left, right) for _, _, left, right in ranked]


def _byte_level(reader, path, tokens: list[str]):
    """The byte-level BPE of a "gpt2" file (module doc)."""
    from tokenizers import Tokenizer, decoders, models

    pre = field(reader, "tokenizer.ggml.pre", "gpt2")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"{path}: tokenizer.ggml.pre={pre!r} is not read; read: {', '.join(PRE_TOKENIZERS)} (or pass the "
            f"model's Hugging Face tokenizer directory)"
        )
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _file_merges(reader, path, vocab) or []
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=None, ignore_merges=pre == "llama-bpe"))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(reader, path, tokens: list[str], types: list[int], unk: str | None):
    """The SentencePiece vocabulary of a "llama" file as a BPE with byte fallback (module doc)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    arch = str(field(reader, "general.architecture", ""))
    if arch.startswith("gemma"):
        raise ValueError(
            f"{path}: the SentencePiece tokenizer of a general.architecture={arch!r} file is not read (transformers "
            f"ranks Gemma's merges by their order in the file, not by score, and Gemma weights are not read from "
            f"GGUF); pass the model's Hugging Face tokenizer directory instead"
        )
    scores = field(reader, "tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ValueError(
            f"{path}: a SentencePiece tokenizer needs tokenizer.ggml.scores, one per token "
            f"({len(tokens)}); it has {'none' if scores is None else len(scores)}"
        )
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _file_merges(reader, path, vocab)
    if merges is None:
        ranks = [s for t, s, ty in zip(tokens, scores, types, strict=True) if ty == NORMAL and len(t) > 1]
        if len(ranks) > 1 and len(set(ranks)) == 1:  # gguf-py's LlamaHfVocab writes -1000 for every token
            raise ValueError(
                f"{path}: every NORMAL token has tokenizer.ggml.scores {ranks[0]} and there is no "
                f"tokenizer.ggml.merges, so the file does not say in which order pieces merge; pass the model's "
                f"Hugging Face tokenizer directory instead"
            )
        merges = spm_merges(tokens, list(scores), types)
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(field(reader, "tokenizer.ggml.add_space_prefix", True))
    escape = normalizers.Replace(" ", "\u2581")
    # Prepend, unlike Metaspace, adds the "▁" to a text that starts with a space too (" a" -> "▁▁a"), as
    # llama.cpp and SentencePiece do; normalizers run on each text between added tokens, so each gets one.
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), escape]) if prefix else escape
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    return tok


def _post_processor(kind: str, bos: str | None, eos: str | None, vocab: dict[str, int]):
    """bos/eos around each sequence, as `tokenizer.ggml.add_bos_token`/`add_eos_token` say (None: neither)."""
    from tokenizers import processors

    steps = [processors.ByteLevel(trim_offsets=False)] if kind == "gpt2" else []
    if bos is not None or eos is not None:
        single = [*([bos] if bos else []), "$A", *([eos] if eos else [])]
        pair = [*single, *([bos] if bos else []), "$B:1", *([eos] if eos else [])]
        special = [(t, vocab[t]) for t in {bos, eos} - {None}]
        steps.append(processors.TemplateProcessing(single=single, pair=pair, special_tokens=special))
    return processors.Sequence(steps) if steps else None


def gguf_tokenizer_parts(path: str | Path) -> dict[str, Any]:
    """The pieces of the file's tokenizer: a `tokenizers.Tokenizer` and its special tokens and chat template."""
    from tokenizers import AddedToken

    reader = open_gguf(path)
    kind = field(reader, "tokenizer.ggml.model")
    if kind is None:
        raise ValueError(f"{path}: GGUF metadata has no tokenizer (tokenizer.ggml.model); pass a tokenizer directory")
    if kind not in MODELS:
        raise ValueError(
            f"{path}: tokenizer.ggml.model={kind!r} is not read (only 'gpt2', byte-level BPE, and 'llama', "
            f"SentencePiece); pass the model's Hugging Face tokenizer directory instead"
        )
    tokens = field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{path}: GGUF metadata has no tokenizer.ggml.tokens (the vocabulary)")
    tokens = list(tokens)
    types = list(field(reader, "tokenizer.ggml.token_type", [NORMAL] * len(tokens)))
    if len(types) != len(tokens):
        raise ValueError(f"{path}: {len(types)} token types for {len(tokens)} tokens")
    defaults = SPM_DEFAULTS if kind == "llama" else {}
    unk = _token(tokens, "unknown_token_id", reader, path, defaults.get("unknown_token_id"))
    tok = _byte_level(reader, path, tokens) if kind == "gpt2" else _sentencepiece(reader, path, tokens, types, unk)
    added = {CONTROL: True, USER_DEFINED: False, **({UNKNOWN: True} if kind == "llama" else {})}  # type -> special
    tok.add_tokens(
        [AddedToken(t, special=added[ty], normalized=False) for t, ty in zip(tokens, types, strict=True) if ty in added]
    )
    bos = _token(tokens, "bos_token_id", reader, path, defaults.get("bos_token_id"))
    eos = _token(tokens, "eos_token_id", reader, path, defaults.get("eos_token_id"))
    add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token", defaults.get("add_bos_token", False)))
    add_eos = bool(field(reader, "tokenizer.ggml.add_eos_token", defaults.get("add_eos_token", False)))
    vocab = {t: i for i, t in enumerate(tokens)}
    post = _post_processor(kind, bos if add_bos else None, eos if add_eos else None, vocab)
    if post is not None:
        tok.post_processor = post
    return {
        "tokenizer": tok,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": _token(tokens, "padding_token_id", reader, path),
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
