"""GGUF files (llama.cpp's format) read into the exactrl decoder.

Invariant: a GGUF file loads to exactly the model that a Hugging Face directory holding the same dequantized
weights loads to. Its metadata becomes a config.json dict (`gguf_config`) that `ModelConfig.from_hf` checks as
it checks any other; its tensors get their Hugging Face names (`hf_name`); every tensor is dequantized by the
`gguf` package's own `gguf.quants.dequantize` to float32 and then cast once to the requested dtype; and the
Llama architecture's q/k rows are put back in Hugging Face order (`unpermute_qk`), undoing the interleaving
llama.cpp's converter applies to them (its `LlamaModel.permute`; transformers' GGUF reader undoes it the same
way). A file that is not read is refused by name: another architecture, a tensor type outside READ_TYPES, a
tensor this decoder has no place for (e.g. Llama 3's `rope_freqs.weight`), RoPE scaling other than linear.
The container itself (header, metadata, tensor infos) is parsed by exactrl's own reader (gguf_reader.py), which
gives the values the `gguf` package's GGUFReader gives, without its per-element cost on large vocabularies.

Architectures read: `llama` (Llama, and Mistral files, which llama.cpp writes as `llama`: GGUF keeps no sliding
window for them, so they attend to the full context as llama.cpp does), `qwen2`, `qwen3`. Gemma files
(`gemma`, `gemma2`, `gemma3`) are refused by their architecture name, and so is their tokenizer
(gguf_tokenizer.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from exactrl.kernels import get_kernels
from exactrl.model.config import SUPPORTED, ModelConfig
from exactrl.model.gguf_reader import GGUFFile, TensorInfo, read_gguf
from exactrl.model.transformer import DEFAULT_BLOCK_SIZE, CausalLM

ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # GGUF general.architecture -> model_type
# The ggml tensor types read, each dequantized by gguf.quants.dequantize (F32 as is, F16/BF16 widened exactly):
READ_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# llama.cpp's values for the tokenizer keys a SentencePiece file (tokenizer.ggml.model "llama") leaves out
SPM_DEFAULTS = {
    "unknown_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "add_bos_token": True,
    "add_eos_token": False,
}

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {  # blk.N.<key> -> model.layers.N.<value>
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{
        f"{g}.{kind}": f"{h}.{kind}"
        for g, h in (
            ("attn_q", "self_attn.q_proj"),
            ("attn_k", "self_attn.k_proj"),
            ("attn_v", "self_attn.v_proj"),
            ("attn_output", "self_attn.o_proj"),
            ("ffn_gate", "mlp.gate_proj"),
            ("ffn_up", "mlp.up_proj"),
            ("ffn_down", "mlp.down_proj"),
        )
        for kind in ("weight", "bias")
    },
}


def require_gguf():
    """The `gguf` package, or an ImportError that says how to install it."""
    try:
        import gguf
    except ImportError:
        raise ImportError("reading GGUF files needs the `gguf` package: pip install 'exactrl[gguf]'") from None
    return gguf


def is_gguf_path(path: str | Path) -> bool:
    """A path that names a GGUF file: it ends in .gguf (any case)."""
    return str(path).lower().endswith(".gguf")


def open_gguf(path: str | Path) -> GGUFFile:
    """The GGUF file at `path`, memory-mapped, its metadata and tensor infos parsed (gguf_reader.py); a file
    that is absent, not GGUF, or damaged is a ValueError naming it and what is wrong."""
    require_gguf()  # its enums and block sizes type the tensors
    return read_gguf(path)


def field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """The value of metadata key `key` (a str, number, bool or list), `default` when absent."""
    return reader.metadata.get(key, default)


def _f32(value: float) -> float:
    """GGUF stores floats as float32: the shortest decimal that is that float32 (1e-05, not 9.9999997e-06)."""
    import numpy as np

    return float(str(np.float32(value)))


def hf_name(name: str) -> str | None:
    """The Hugging Face name of GGUF tensor `name`, None for a tensor this decoder has no place for."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"model.layers.{int(parts[1])}.{_LAYER[parts[2]]}"
    return None


def hf_shape(tensor: TensorInfo) -> tuple[int, ...]:
    """A GGUF tensor's shape in torch order (GGUF lists dimensions innermost first)."""
    return tuple(reversed(tensor.shape))


def gguf_config(reader: GGUFFile, path: str | Path) -> dict[str, Any]:
    """A config.json dict from the file's metadata (`{arch}.*` keys and the tokenizer's special ids)."""
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture general.architecture={arch!r} is not read; read: {sorted(ARCHITECTURES)}"
        )
    mt = ARCHITECTURES[arch]
    names = reader.tensors
    if "token_embd.weight" not in names:
        raise ValueError(f"{path}: no tensor token_embd.weight (the token embedding)")

    def need(key: str) -> Any:
        v = field(reader, f"{arch}.{key}")
        if v is None:
            raise ValueError(f"{path}: GGUF metadata has no {arch}.{key}, which a {arch} model needs")
        return v

    heads = need("attention.head_count")
    hidden = need("embedding_length")
    head_dim = field(reader, f"{arch}.attention.key_length", hidden // heads if heads else 0)
    value_dim = field(reader, f"{arch}.attention.value_length", head_dim)
    rot = field(reader, f"{arch}.rope.dimension_count", head_dim)
    if value_dim != head_dim or rot != head_dim:
        raise ValueError(
            f"{path}: {arch}.attention.key_length={head_dim}, value_length={value_dim} and rope.dimension_count="
            f"{rot} differ; only equal head sizes with RoPE on every channel are read"
        )
    cfg: dict[str, Any] = {
        "model_type": mt,
        "architectures": [SUPPORTED[mt]],
        "vocab_size": hf_shape(names["token_embd.weight"])[0],
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": field(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": need("context_length"),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
    }
    if mt == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in names or "blk.0.attn_output.bias" in names
        cfg["mlp_bias"] = "blk.0.ffn_up.bias" in names
    scaling = field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": _f32(need("rope.scaling.factor"))}
    elif scaling != "none":
        raise ValueError(f"{path}: {arch}.rope.scaling.type={scaling!r} is not read; read: 'none', 'linear'")
    defaults = SPM_DEFAULTS if field(reader, "tokenizer.ggml.model") == "llama" else {}
    for key in ("bos_token_id", "eos_token_id"):
        v = field(reader, f"tokenizer.ggml.{key}", defaults.get(key))
        if v is not None:
            cfg[key] = int(v)
    return cfg


def unpermute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Hugging Face row order of a Llama-architecture GGUF q or k projection (weight [heads*d, D] or bias
    [heads*d]). llama.cpp's converter writes each head's rows as `reshape(heads, 2, d/2, ...).swapaxes(1, 2)`
    (rotary pairs interleaved, for its rope kernel); this is the inverse, `reshape(heads, d/2, 2, ...)
    .swapaxes(1, 2)`, as transformers' GGUF reader applies it."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantized(reader: GGUFFile, tensor: TensorInfo, arch: str, cfg: dict[str, Any]) -> torch.Tensor:
    """One tensor as float32 in torch order and Hugging Face row order."""
    gguf = require_gguf()
    data = gguf.quants.dequantize(reader.tensor_data(tensor), tensor.tensor_type)
    w = torch.from_numpy(data.astype("float32", copy=False).reshape(hf_shape(tensor)).copy())
    if arch == "llama" and tensor.name.split(".")[-2] in ("attn_q", "attn_k"):
        heads = cfg["num_attention_heads"] if ".attn_q." in tensor.name else cfg["num_key_value_heads"]
        w = unpermute_qk(w, heads)
    return w


def check_tensors(reader: GGUFFile, path: str | Path, cfg: ModelConfig) -> dict[str, TensorInfo]:
    """GGUF tensors by Hugging Face name, checked against the model's parameters (built on the meta device,
    which allocates nothing): each is of a READ_TYPES type, has a place and its shape, none is missing."""
    with torch.device("meta"):
        params = {n: tuple(p.shape) for n, p in CausalLM(cfg, get_kernels("exact", "native")).named_parameters()}
    out: dict[str, TensorInfo] = {}
    for t in reader.tensors.values():
        kind = t.tensor_type.name
        if kind not in READ_TYPES:
            raise ValueError(
                f"{path}: tensor {t.name!r} is stored as {kind}, which is not read; read types: {', '.join(READ_TYPES)}"
            )
        name = hf_name(t.name)
        if t.name == "rope_freqs.weight":
            raise ValueError(
                f"{path}: tensor 'rope_freqs.weight' (Llama 3 RoPE scaling factors) is not read; load the model's "
                f"Hugging Face directory instead"
            )
        if name is None or name not in params:
            raise ValueError(f"{path}: unexpected tensor {t.name!r} for a {cfg.model_type} model")
        if hf_shape(t) != params[name]:
            raise ValueError(
                f"{path}: tensor {t.name!r} has shape {hf_shape(t)}, expected {params[name]} from the file's metadata"
            )
        out[name] = t
    missing = sorted(set(params) - set(out))
    if missing:
        raise ValueError(f"{path}: missing tensors (Hugging Face names): {missing[:5]}")
    return out


def read_gguf_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a GGUF file (metadata only; no tensor is read)."""
    reader = open_gguf(path)
    return _model_config(reader, path)


def _model_config(reader: GGUFFile, path: str | Path) -> ModelConfig:
    hf = gguf_config(reader, path)
    try:
        return ModelConfig.from_hf(hf)
    except ValueError as e:  # from_hf names the config key, not the file
        raise ValueError(f"GGUF file {path}: {e}") from None


def load_gguf_model(
    path: str | Path,
    dtype="float32",
    kernels: str = "exact",
    block_size: int = DEFAULT_BLOCK_SIZE,
    device: str | torch.device = "cpu",
    backend: str | None = None,
) -> CausalLM:
    """`load_model` for a GGUF file: the config from its metadata, the weights dequantized (module doc)."""
    from exactrl.model.checkpoint import build_model

    reader = open_gguf(path)
    cfg = _model_config(reader, path)
    tensors = check_tensors(reader, path, cfg)
    model = build_model(cfg, dtype, kernels, seed=None, block_size=block_size, device=device, backend=backend)
    params = dict(model.named_parameters())
    arch = field(reader, "general.architecture")
    with torch.no_grad():
        for name, t in tensors.items():
            w = dequantized(reader, t, arch, cfg.hf)
            if not torch.isfinite(w).all():
                raise ValueError(f"{path}: tensor {t.name!r} holds NaN or infinite values; re-copy the file")
            params[name].copy_(w.to(params[name].dtype))
    return model


def convert_gguf(path: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Writes a GGUF file as a Hugging Face model directory (config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json with the chat template) that `load_model` and transformers read. `out_dir` must be
    new or empty: files of another model beside these would mix with them."""
    from exactrl.model.checkpoint import save_model
    from exactrl.model.gguf_tokenizer import gguf_hf_tokenizer

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"output directory {out} " + ("is a file" if not out.is_dir() else "is not empty"))
    model = load_gguf_model(path, dtype=dtype, kernels="fast")
    tokenizer = gguf_hf_tokenizer(path)
    save_model(model, out)
    tokenizer.save_pretrained(str(out))
    return out
