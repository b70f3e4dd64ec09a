"""Test-only GGUF writer: a tiny exactrl/transformers model and its tokenizer written as llama.cpp's converter
(convert_hf_to_gguf.py) writes them, through the `gguf` package's GGUFWriter. Its Llama q/k permutation is the
converter's own (`LlamaModel.permute`), written here independently of exactrl's inverse."""

from __future__ import annotations

import json

import numpy as np
import torch

GGUF_NAMES = {  # Hugging Face -> GGUF (llama.cpp's tensor_mapping), per layer after "model.layers.N."
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def gguf_name(hf: str) -> str:
    if hf in TOP:
        return TOP[hf]
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    for k, v in GGUF_NAMES.items():
        if rest == k:
            return f"blk.{layer}.{v}"
        if rest.startswith(k + "."):
            return f"blk.{layer}.{v}.{rest[len(k) + 1 :]}"
    raise KeyError(hf)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rotary halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    path,
    model,
    tokenizer_dir=None,
    tokenizer=None,
    qtype: str = "F32",
    arch: str | None = None,
    permute: bool = True,
    raw: dict | None = None,
    meta: dict | None = None,
    extra_tensors: dict | None = None,
) -> None:
    """Writes `model` (an exactrl CausalLM) as a GGUF file. 2-D weights are stored as `qtype` (gguf.quants'
    quantizer), 1-D ones as F32 (llama.cpp's rule); `tokenizer(writer)` writes other tokenizer metadata than
    `tokenizer_dir`'s byte-level BPE (e.g. `add_spm_tokenizer`); `raw` maps a GGUF name to (uint8 bytes, type
    name) stored as given; `meta` overrides metadata keys (a value None removes one); `extra_tensors` adds F32
    tensors."""
    import gguf

    cfg = model.config
    arch = arch or cfg.model_type
    w = gguf.GGUFWriter(str(path), arch)
    keys = {
        f"{arch}.vocab_size": cfg.vocab_size,
        f"{arch}.context_length": cfg.max_position_embeddings,
        f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.block_count": cfg.num_hidden_layers,
        f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{arch}.attention.key_length": cfg.head_dim,
        f"{arch}.attention.value_length": cfg.head_dim,
        f"{arch}.rope.dimension_count": cfg.head_dim,
        f"{arch}.rope.freq_base": cfg.rope_theta,
        f"{arch}.attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
    }
    keys.update(meta or {})
    for k, v in keys.items():
        if v is None:
            continue
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_uint32(k, v)
    if tokenizer_dir is not None:
        add_tokenizer(w, tokenizer_dir)
    if tokenizer is not None:
        tokenizer(w)
    raw = raw or {}
    for name, p in model.named_parameters():
        g = gguf_name(name)
        a = p.detach().float().numpy().copy()
        if permute and cfg.model_type == "llama" and g.split(".")[-2] in ("attn_q", "attn_k"):
            a = llama_cpp_permute(a, cfg.num_attention_heads if ".attn_q." in g else cfg.num_key_value_heads)
        if g in raw:
            data, kind = raw[g]
            w.add_tensor(g, data, raw_dtype=gguf.GGMLQuantizationType[kind])
        elif a.ndim == 2 and qtype != "F32":
            t = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(g, gguf.quants.quantize(a, t), raw_dtype=t)
        else:
            w.add_tensor(g, a)
    for g, a in (extra_tensors or {}).items():
        w.add_tensor(g, np.asarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def add_tokenizer(w, tokenizer_dir, pre: str = "smollm") -> None:
    """A Hugging Face byte-level BPE tokenizer directory as GGUF tokenizer metadata, as llama.cpp's converter
    writes it: special added tokens CONTROL, other added tokens USER_DEFINED."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    model = json.loads(hf.backend_tokenizer.to_str())["model"]
    vocab = {**model["vocab"], **{t.content: i for i, t in hf.added_tokens_decoder.items()}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert len(tokens) == len(hf) and [vocab[t] for t in tokens] == list(range(len(tokens)))
    types = [1] * len(tokens)
    for i, t in hf.added_tokens_decoder.items():
        types[i] = 3 if t.special else 4
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    for key, tok in (("bos", hf.bos_token), ("eos", hf.eos_token), ("pad", hf.pad_token)):
        if tok is not None:
            getattr(w, f"add_{key}_token_id")(hf.convert_tokens_to_ids(tok))
    w.add_add_bos_token(False)
    if hf.chat_template:
        w.add_chat_template(hf.chat_template)


def train_spm(texts, vocab_size: int = 400, prefix: bool = True, user_defined=(), control=()) -> bytes:
    """A tiny SentencePiece BPE model (serialized) with Llama 2's settings: byte fallback, digits one per piece,
    pieces of whitespace only allowed, no normalization or whitespace removal, a "▁" prefix when `prefix`."""
    import io

    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=out,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        add_dummy_prefix=prefix,
        user_defined_symbols=list(user_defined),
        control_symbols=list(control),
        character_coverage=1.0,
        minloglevel=2,
        num_threads=1,
    )
    return out.getvalue()


def spm_vocab(model: bytes, added: dict[str, bool]) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types as llama.cpp's converter (`_create_vocab_sentencepiece`) writes them: each
    piece with its score and type (UNKNOWN 2, CONTROL 3, UNUSED 5, BYTE 6, else NORMAL 1); then each Hugging
    Face added token (`added`: content -> special) becomes CONTROL when special, else USER_DEFINED with its
    "▁" written as a space, and gets score -1000."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model)
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        kind = 2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i) else 6 if sp.is_byte(i) else 1
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(kind)
    for content, special in added.items():
        i = tokens.index(content)
        tokens[i] = content if special else content.replace("\u2581", " ")
        types[i], scores[i] = (3 if special else 4), -1000.0
    return tokens, scores, types


def add_spm_tokenizer(
    w, model: bytes, added: dict[str, bool], chat_template=None, merges=None, ids: bool = True, prefix=None
) -> None:
    """A SentencePiece vocabulary (`train_spm`) as GGUF tokenizer metadata, as llama.cpp's converter writes it
    (model "llama", pre "default", `spm_vocab`); `ids`: also the unk/bos/eos ids and add_bos_token true,
    add_eos_token false (Llama 2's tokenizer_config); `prefix`: tokenizer.ggml.add_space_prefix (None: left
    out, as for Llama); `merges`: a tokenizer.ggml.merges list ("left right")."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model)
    tokens, scores, types = spm_vocab(model, added)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if ids:
        w.add_unk_token_id(sp.unk_id())
        w.add_bos_token_id(sp.bos_id())
        w.add_eos_token_id(sp.eos_id())
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
    if prefix is not None:
        w.add_add_space_prefix(prefix)
    if chat_template:
        w.add_chat_template(chat_template)


def write_tokenizer_gguf(path, tokenizer, arch: str = "llama") -> None:
    """A GGUF file of tokenizer metadata only (llama.cpp's vocab-only files): `tokenizer(writer)` writes it."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    tokenizer(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def dequantized_reference(a: torch.Tensor, qtype: str) -> torch.Tensor:
    """What a weight stored as `qtype` reads back as: gguf's quantize then dequantize, float32."""
    import gguf

    t = gguf.GGMLQuantizationType[qtype]
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(a.float().numpy(), t), t).copy())
