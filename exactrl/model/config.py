"""Model configuration read from (and written back to) a Hugging Face config.json.

One decoder covers three families; they differ only in these switches:
  qwen3: per-head RMSNorm on q and k (`qk_norm`), optional biases (`attention_bias`)
  qwen2: biases on q/k/v, none on o
  llama: `attention_bias` on q/k/v/o, `mlp_bias`
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# transformers' own defaults, for a config.json without max_position_embeddings
DEFAULT_CONTEXT = {"qwen3": 32768, "qwen2": 32768, "llama": 2048}


def _slides(cfg: dict) -> bool:
    """Whether a Qwen2/Qwen3 config with use_sliding_window=true has a layer that slides: those named
    "sliding_attention" in layer_types, else (transformers' rule) layers i >= max_window_layers (default 28)
    when sliding_window is set (absent: transformers' 4096). Windows on no layer are full attention, which
    loads."""
    types = cfg.get("layer_types")
    if isinstance(types, list):
        return "sliding_attention" in types
    return cfg.get("sliding_window", 4096) is not None and cfg.get("max_window_layers", 28) < cfg["num_hidden_layers"]


def check_eos_token_id(file: str, cfg: dict) -> None:
    """eos_token_id, if set, is a token id or a list of them (the engine stops on them)."""
    eos = cfg.get("eos_token_id")
    if eos is not None and not all(type(t) is int and t >= 0 for t in (eos if isinstance(eos, list) else [eos])):
        raise ValueError(f"{file}: eos_token_id must be a token id or a list of token ids, got {eos!r}")


@dataclass
class ModelConfig:
    model_type: str  # "qwen3" | "qwen2" | "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q/k/v projections
    o_bias: bool  # bias on the output projection
    mlp_bias: bool
    qk_norm: bool  # Qwen3's RMSNorm over head_dim on q and k, before RoPE
    hf: dict[str, Any] = field(default_factory=dict)  # the original config.json, kept for saving
    generation: dict[str, Any] = field(default_factory=dict)  # generation_config.json if any, kept for saving

    @property
    def eos_token_ids(self) -> list[int]:
        """End-of-sequence ids of config.json and generation_config.json together (chat checkpoints such as
        Qwen2.5-Instruct or Llama 3 list their end-of-turn ids in the second only)."""
        out: list[int] = []
        for where in (self.hf, self.generation):
            eos = where.get("eos_token_id")
            for t in [] if eos is None else eos if isinstance(eos, list) else [eos]:
                if t not in out:
                    out.append(t)
        return out

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> "ModelConfig":
        mt = cfg.get("model_type")
        if not isinstance(mt, str) or mt not in SUPPORTED:
            raise ValueError(f"unsupported architecture model_type={mt!r} "
                             f"(architectures={cfg.get('architectures')}); supported: {sorted(SUPPORTED)}")
        missing = [k for k in REQUIRED if cfg.get(k) is None]
        if missing:
            raise ValueError(f"config.json is missing {', '.join(map(repr, missing))}; a {mt} config needs "
                             f"{', '.join(REQUIRED)} (restore the file from the original checkpoint)")
        for k in (*REQUIRED, "num_key_value_heads", "head_dim", "max_position_embeddings"):
            v = cfg.get(k)
            if v is not None and (type(v) is not int or v < 1):
                raise ValueError(f"config.json: {k} must be an integer >= 1, got {v!r}")
            if v is not None and v >= 2**31:  # beyond any tensor size torch can hold once multiplied
                raise ValueError(f"config.json: {k}={v} is too large (at most 2**31 - 1)")
        for k in ("rms_norm_eps", "rope_theta"):
            v = cfg.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf")):
                raise ValueError(f"config.json: {k} must be a positive number, got {v!r}")
        for k in ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"):
            if cfg.get(k) not in (None, True, False):  # bool("false") is True
                raise ValueError(f"config.json: {k} must be true or false, got {cfg[k]!r}")
        check_eos_token_id("config.json", cfg)
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act={act!r}; only 'silu' is implemented")
        if cfg.get("use_sliding_window") and _slides(cfg):
            raise ValueError("use_sliding_window=true is not supported (full attention only)")
        # both keys may be there (transformers >= 5 writes rope_parameters; a long-context recipe adds
        # rope_scaling beside it, and transformers applies it): each is checked
        thetas = []
        for key in ("rope_parameters", "rope_scaling"):
            rope = cfg.get(key) or {}
            if not isinstance(rope, dict):
                raise ValueError(f"config.json: {key} must be an object, got {rope!r}")
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type != "default":
                raise ValueError(f"unsupported {key}.rope_type={rope_type!r}; only 'default' RoPE is implemented")
            thetas += [rope["rope_theta"]] if "rope_theta" in rope else []
        if len(set(thetas)) > 1:
            raise ValueError(f"config.json: rope_parameters and rope_scaling give different rope_theta {thetas}")
        theta = thetas[0] if thetas else cfg.get("rope_theta", 10000.0)
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < float("inf"):
            raise ValueError(f"config.json: rope_theta must be a positive number, got {theta!r}")
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        if head_dim % 2 or head_dim == 0:  # RoPE rotates pairs of channels
            raise ValueError(f"config.json: head_dim (given, or hidden_size // num_attention_heads) must be even "
                             f"and >= 2, got {head_dim}")
        attn_bias = bool(cfg.get("attention_bias", False))
        return ModelConfig(
            model_type=mt, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", DEFAULT_CONTEXT[mt]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if mt == "qwen2" else attn_bias,
            o_bias=False if mt == "qwen2" else attn_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)) if mt == "llama" else False,
            qk_norm=mt == "qwen3", hf=dict(cfg))

    def to_hf(self) -> dict[str, Any]:
        out = dict(self.hf)
        out.setdefault("architectures", [SUPPORTED[self.model_type]])
        if not out.get("architectures"):
            out["architectures"] = [SUPPORTED[self.model_type]]
        return out
