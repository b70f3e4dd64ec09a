"""Model configuration read from (and written back to) a Hugging Face config.json.

One decoder covers these families; they differ only in these switches (the mixture-of-experts ones,
qwen3_moe, qwen2_moe, mixtral and olmoe, in `model/families.py`):
  qwen3: per-head RMSNorm on q and k (`qk_norm`), optional biases (`attention_bias`)
  qwen2: biases on q/k/v, none on o
  llama: `attention_bias` on q/k/v/o, `mlp_bias`
  mistral: no biases; `sliding_window` on every layer (transformers' default 4096 when the key is absent)
Qwen2/Qwen3 slide where `use_sliding_window` is true, on the layers `layer_types` names "sliding_attention"
(else, transformers' rule, layers i >= max_window_layers). RoPE scaling: `model/rope.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from exactrl.model.families import MoESpec, attention_switches, gemma_fields, gemma_windows, moe_spec, moe_windows
from exactrl.model.rope import check_rope

SUPPORTED = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# transformers' own defaults, for a config.json without max_position_embeddings
DEFAULT_CONTEXT = {
    "qwen3": 32768,
    "qwen2": 32768,
    "llama": 2048,
    "mistral": 131072,
    "qwen3_moe": 32768,
    "qwen2_moe": 32768,
    "mixtral": 131072,
    "olmoe": 4096,
    "gemma2": 8192,
    "gemma3_text": 131072,
}
LAYER_TYPES = ("full_attention", "sliding_attention")


def _int(cfg: dict, key: str, default, least: int):
    v = cfg.get(key, default)
    if type(v) is not int or not least <= v < 2**31:
        raise ValueError(f"config.json: {key} must be an integer in [{least}, 2**31), got {v!r}")
    return v


def _window(cfg: dict) -> int:
    return _int(cfg, "sliding_window", 4096, 1)


def layer_windows(cfg: dict) -> tuple[int, ...]:
    """Keys each layer attends to (a query at p sees keys in (p - window, p]), 0 for full attention, as
    transformers reads the config: Mistral slides every layer by `sliding_window` (absent: 4096, null: none);
    Qwen2/Qwen3 with use_sliding_window=true slide the layers named "sliding_attention" in layer_types, else
    layers i >= max_window_layers (default 28), by sliding_window (absent: 4096, null: none); Llama never."""
    mt, n = cfg["model_type"], cfg["num_hidden_layers"]
    family = moe_windows(cfg, _window) or gemma_windows(cfg, _window)
    if family is not None:
        return family
    if (
        mt == "llama"
        or (mt != "mistral" and not cfg.get("use_sliding_window"))
        or cfg.get("sliding_window", 4096) is None
    ):
        return (0,) * n
    window = _int(cfg, "sliding_window", 4096, 1)
    if mt == "mistral":  # transformers' Mistral ignores layer_types
        return (window,) * n
    types = cfg.get("layer_types")
    if types is None:
        first = _int(cfg, "max_window_layers", 28, 0)
        return tuple(window if i >= first else 0 for i in range(n))
    if not isinstance(types, list) or len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"config.json: layer_types must list {n} of {LAYER_TYPES} (one per layer), got {types!r}")
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def rope_of(cfg: dict) -> tuple[float, dict]:
    """(rope_theta, the checked RoPE parameters `rope.check_rope` returns) of a config.json. transformers >= 5
    writes rope_parameters; older ones rope_scaling beside a top-level rope_theta. Where both are there and
    differ, transformers applies rope_scaling alone (its rope_theta, else 10000, not rope_parameters'):
    refused, naming the key they disagree on."""
    dicts = {}
    for key in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(key) or {}
        if not isinstance(rope, dict):
            raise ValueError(f"config.json: {key} must be an object, got {rope!r}")
        if "type" in rope and "rope_type" not in rope:  # the older name of the key
            rope = {"rope_type": rope["type"], **{k: v for k, v in rope.items() if k != "type"}}
        dicts[key] = rope
    params, scaling = dicts["rope_parameters"], dicts["rope_scaling"]
    if params and scaling:
        for k in sorted(set(params) | set(scaling)):
            if params.get(k) != scaling.get(k):
                raise ValueError(
                    f"config.json: rope_parameters and rope_scaling give different {k} "
                    f"{[params.get(k), scaling.get(k)]} (transformers applies rope_scaling alone): "
                    f"keep one of them"
                )
    where = "rope_scaling" if scaling else "rope_parameters"
    rope = scaling or params
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < float("inf"):
        raise ValueError(f"config.json: rope_theta must be a positive number, got {theta!r}")
    if cfg.get("partial_rotary_factor") is not None:
        rope = {"partial_rotary_factor": cfg["partial_rotary_factor"], **rope}
    if cfg.get("original_max_position_embeddings") is not None:  # transformers gives it priority (Phi3's place)
        rope = {**rope, "original_max_position_embeddings": cfg["original_max_position_embeddings"]}
    return float(theta), check_rope(rope, where, cfg.get("max_position_embeddings", DEFAULT_CONTEXT[cfg["model_type"]]))


def check_eos_token_id(file: str, cfg: dict) -> None:
    """eos_token_id, if set, is a token id or a list of them (the engine stops on them)."""
    eos = cfg.get("eos_token_id")
    if eos is not None and not all(type(t) is int and t >= 0 for t in (eos if isinstance(eos, list) else [eos])):
        raise ValueError(f"{file}: eos_token_id must be a token id or a list of token ids, got {eos!r}")


@dataclass
class ModelConfig:
    model_type: str  # a key of SUPPORTED
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
    rope: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default"})  # RoPE scaling (`rope.py`)
    windows: tuple[int, ...] = ()  # per layer: keys a query attends to, 0 (or no entry) for all before it
    qk_norm_full: bool = False  # OLMoE: the q/k RMSNorm spans all heads, before the split into heads
    clip_qkv: float | None = None  # OLMoE: q, k, v clamped to [-clip_qkv, clip_qkv]
    moe: MoESpec | None = None  # the routed experts (`model/moe.py`), None for a dense model
    # Gemma (`model/families.py` gemma_fields): (1 + w) norms, scaled embeddings, sandwich norms
    gemma: bool = False
    attn_scale: float | None = None  # attention scores' scale, None for head_dim^-1/2
    act: str = "silu"  # the MLP's gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    rope_local: tuple[float, dict] | None = None  # Gemma 3's (theta, RoPE parameters) of its sliding layers
    attn_softcap: float | None = None  # Gemma 2: attention scores capped to c·tanh(s / c) (attn_logit_softcapping)
    logit_softcap: float | None = None  # Gemma 2: final logits capped to c·tanh(z / c) (final_logit_softcapping)
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
    def from_hf(cfg: dict[str, Any]) -> ModelConfig:
        mt = cfg.get("model_type")
        if not isinstance(mt, str) or mt not in SUPPORTED:
            raise ValueError(
                f"unsupported architecture model_type={mt!r} "
                f"(architectures={cfg.get('architectures')}); supported: {sorted(SUPPORTED)}"
            )
        missing = [k for k in REQUIRED if cfg.get(k) is None]
        if missing:
            raise ValueError(
                f"config.json is missing {', '.join(map(repr, missing))}; a {mt} config needs "
                f"{', '.join(REQUIRED)} (restore the file from the original checkpoint)"
            )
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
        for k in ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "qkv_bias"):
            if cfg.get(k) not in (None, True, False):  # bool("false") is True
                raise ValueError(f"config.json: {k} must be true or false, got {cfg[k]!r}")
        check_eos_token_id("config.json", cfg)
        act = cfg.get("hidden_act", "silu")
        if act != "silu" and mt not in ("gemma2", "gemma3_text"):  # Gemma's is checked by gemma_fields
            raise ValueError(f"unsupported hidden_act={act!r}; only 'silu' is implemented")
        windows = layer_windows(cfg)
        fam = {**attention_switches(mt, cfg), **gemma_fields(cfg, rope_of)}
        theta, rope = fam.pop("rope_global") if "rope_global" in fam else rope_of(cfg)
        heads = cfg["num_attention_heads"]
        # transformers' defaults: 8 for Mistral and Mixtral, else one per head
        kv_heads = cfg.get("num_key_value_heads", 8 if mt in ("mistral", "mixtral") else None) or heads
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        if head_dim % 2 or head_dim == 0:  # RoPE rotates pairs of channels
            raise ValueError(
                f"config.json: head_dim (given, or hidden_size // num_attention_heads) must be even "
                f"and >= 2, got {head_dim}"
            )
        return ModelConfig(
            model_type=mt,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", DEFAULT_CONTEXT[mt]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope=rope,
            moe=moe_spec(cfg),
            **fam,
            windows=windows if any(windows) else (),
            hf=dict(cfg),
        )

    @property
    def context_length(self) -> int:
        """Positions a sequence may reach: max_position_embeddings, stretched by the factor of `dynamic` RoPE
        (its frequencies are defined past max_position_embeddings, up to factor times it; model/rope.py)."""
        if self.rope.get("rope_type") == "dynamic":
            return int(self.max_position_embeddings * self.rope["factor"])
        return self.max_position_embeddings

    @property
    def context_source(self) -> str:
        """Where `context_length` comes from, for messages: "max_position_embeddings", or with the RoPE factor."""
        if self.context_length == self.max_position_embeddings:
            return "max_position_embeddings"
        return f"max_position_embeddings={self.max_position_embeddings} x the dynamic RoPE factor {self.rope['factor']}"

    def window(self, layer: int) -> int:
        """Keys layer `layer` attends to (a query at p: keys p - window + 1 .. p), 0 for all of them."""
        return self.windows[layer] if self.windows else 0

    def to_hf(self) -> dict[str, Any]:
        out = dict(self.hf)
        out.setdefault("architectures", [SUPPORTED[self.model_type]])
        if not out.get("architectures"):
            out["architectures"] = [SUPPORTED[self.model_type]]
        return out
