"""What distinguishes the mixture-of-experts and Gemma families from the dense Llama-like ones, read from a
config.json the way transformers reads it: every switch here changes which modules the decoder builds or
an elementwise step between them, never a reduction's order (docs/models.md lists the families).

  qwen3_moe: Qwen3 attention (per-head q/k RMSNorm); routed experts on layers i not in mlp_only_layers with
             (i + 1) % decoder_sparse_step == 0, the others a dense MLP of intermediate_size
  qwen2_moe: Qwen2 attention (q/k/v biases, `qkv_bias`); the same layer rule; a shared expert of
             shared_expert_intermediate_size gated by sigmoid(shared_expert_gate(x))
  mixtral:   Mistral attention; experts on every layer (`block_sparse_moe`, w1/w3/w2), weights always
             normalised over the top k
  olmoe:     q/k RMSNorm over all heads at once (before the split into heads), optional clip_qkv; experts
             on every layer
  gemma2, gemma3_text: `gemma_fields` and `gemma_windows` below
"""

from __future__ import annotations

from dataclasses import dataclass

MOE_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    experts_per_token: int
    intermediate_size: int  # of each routed expert
    norm_topk_prob: bool  # the top-k weights divided by their sum
    shared_intermediate_size: int  # Qwen2-MoE's shared expert, 0 for none
    sparse_layers: tuple[bool, ...]  # per layer: routed experts (True) or a dense MLP


def _pos_int(cfg: dict, key: str, least: int = 1) -> int:
    v = cfg.get(key)
    if type(v) is not int or not least <= v < 2**31:
        raise ValueError(f"config.json: {key} must be an integer in [{least}, 2**31), got {v!r}")
    return v


def moe_spec(cfg: dict) -> MoESpec | None:
    """The experts of a MoE family's config (None for a dense family); a missing or malformed key is named."""
    mt, n = cfg["model_type"], cfg["num_hidden_layers"]
    if mt not in MOE_TYPES:
        return None
    keys = ("num_local_experts",) if mt == "mixtral" else ("num_experts", "num_local_experts")
    given = {k: cfg[k] for k in keys if cfg.get(k) is not None}
    if len(set(map(repr, given.values()))) > 1:
        raise ValueError(f"config.json: num_experts and num_local_experts differ ({given}); keep one of them")
    if not given:
        raise ValueError(f"config.json: a {mt} config needs {' or '.join(keys)} (the number of experts)")
    num = _pos_int({"experts": next(iter(given.values()))}, "experts")
    top_k = _pos_int(cfg, "num_experts_per_tok")
    if top_k > num:
        raise ValueError(f"config.json: num_experts_per_tok={top_k} is more than the {num} experts")
    size = cfg["intermediate_size"] if mt in ("mixtral", "olmoe") else _pos_int(cfg, "moe_intermediate_size")
    if cfg.get("norm_topk_prob") not in (None, True, False):
        raise ValueError(f"config.json: norm_topk_prob must be true or false, got {cfg['norm_topk_prob']!r}")
    shared = _pos_int(cfg, "shared_expert_intermediate_size", 0) if mt == "qwen2_moe" else 0
    sparse = (True,) * n
    if mt in ("qwen3_moe", "qwen2_moe"):
        step = _pos_int({**cfg, "decoder_sparse_step": cfg.get("decoder_sparse_step", 1)}, "decoder_sparse_step")
        dense = cfg.get("mlp_only_layers") or []
        if not isinstance(dense, list) or any(type(i) is not int for i in dense):
            raise ValueError(f"config.json: mlp_only_layers must be a list of layer indices, got {dense!r}")
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(n))
    return MoESpec(num, top_k, size, mt == "mixtral" or bool(cfg.get("norm_topk_prob")), shared, sparse)


def attention_switches(mt: str, cfg: dict) -> dict:
    """ModelConfig's attention fields (qkv_bias, o_bias, mlp_bias, qk_norm, qk_norm_full, clip_qkv) of a family."""
    bias = bool(cfg.get("attention_bias", False))
    out = dict(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=False, qk_norm_full=False, clip_qkv=None)
    if mt in ("qwen2", "qwen2_moe"):
        if cfg.get("qkv_bias") not in (None, True, False):
            raise ValueError(f"config.json: qkv_bias must be true or false, got {cfg['qkv_bias']!r}")
        out.update(qkv_bias=mt == "qwen2" or cfg.get("qkv_bias", True) is not False, o_bias=False)
    elif mt in ("mistral", "mixtral"):
        out.update(qkv_bias=False, o_bias=False)
    elif mt == "llama":
        out["mlp_bias"] = bool(cfg.get("mlp_bias", False))
    out["qk_norm"] = mt in ("qwen3", "qwen3_moe", "olmoe")
    out["qk_norm_full"] = mt == "olmoe"
    clip = cfg.get("clip_qkv") if mt == "olmoe" else None
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
        raise ValueError(f"config.json: clip_qkv must be a positive number or null, got {clip!r}")
    out["clip_qkv"] = None if clip is None else float(clip)
    return out


def moe_windows(cfg: dict, window_of) -> tuple[int, ...] | None:
    """Per-layer sliding windows of a MoE family as transformers reads them (None for a dense family):
    Mixtral and OLMoE slide every layer by sliding_window where it is set (absent or null: none); Qwen3-MoE
    every layer when use_sliding_window is true; Qwen2-MoE, when it is true, the layers layer_types names
    "sliding_attention" (absent: the odd-numbered layers 1, 3, ... below max_window_layers).
    `window_of(cfg)` reads and checks sliding_window."""
    mt, n = cfg["model_type"], cfg["num_hidden_layers"]
    if mt not in MOE_TYPES:
        return None
    if mt in ("mixtral", "olmoe"):
        return (window_of(cfg),) * n if cfg.get("sliding_window") is not None else (0,) * n
    if not cfg.get("use_sliding_window") or cfg.get("sliding_window", 4096) is None:
        return (0,) * n
    w = window_of(cfg)
    if mt == "qwen3_moe":
        return (w,) * n
    types = cfg.get("layer_types")
    if types is None:
        first = cfg.get("max_window_layers", 28)
        return tuple(w if (i + 1) % 2 and i < first else 0 for i in range(n))
    if not isinstance(types, list) or len(types) != n:
        raise ValueError(f"config.json: layer_types must list {n} layer types (one per layer), got {types!r}")
    return tuple(w if t == "sliding_attention" else 0 for t in types)


GEMMA_TYPES = ("gemma2", "gemma3_text")
GEMMA_ACTS = ("gelu_pytorch_tanh", "gelu_tanh")  # transformers' names of gelu's tanh approximation


def gemma_fields(cfg: dict, rope_of) -> dict:
    """ModelConfig's Gemma fields (empty for another family), as transformers reads Gemma 2 / Gemma 3 text:
    RMSNorm scaled by (1 + weight), embeddings times sqrt(hidden_size) in the model dtype, a norm after
    attention and around the MLP, GeGLU (gelu, tanh approximation), scores scaled by
    query_pre_attn_scalar^-1/2, and Gemma 3's local RoPE (rope_parameters["sliding_attention"], the older
    rope_local_base_freq) on its sliding layers, and soft-capping: attention scores and final logits
    capped to c·tanh(x / c) (attn_logit_softcapping, final_logit_softcapping; absent, transformers'
    defaults: 50 and 30 for Gemma 2, off for Gemma 3; null turns a cap off).
    `rope_of(cfg)` reads a flat RoPE config into (theta, checked parameters)."""
    mt = cfg["model_type"]
    if mt not in GEMMA_TYPES:
        return {}
    on = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0} if mt == "gemma2" else {}
    caps = {}
    for key, field in (("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "logit_softcap")):
        cap = cfg.get(key, on.get(key))
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < 1e30):
            raise ValueError(f"config.json: {key} must be a positive number or null, got {cap!r}")
        caps[field] = None if cap is None else float(cap)
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GEMMA_ACTS:
        raise ValueError(f"config.json: hidden_activation={act!r} is not implemented for {mt}; only {GEMMA_ACTS}")
    scalar = cfg.get("query_pre_attn_scalar", 256)
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or not scalar > 0:
        raise ValueError(f"config.json: query_pre_attn_scalar must be a positive number, got {scalar!r}")
    out = dict(gemma=True, attn_scale=float(scalar) ** -0.5, act="gelu_tanh", qk_norm=mt == "gemma3_text", **caps)
    params = cfg.get("rope_parameters")
    if mt == "gemma3_text":
        if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
            full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        else:  # an older flat config: rope_theta and rope_scaling for the global layers, rope_local_base_freq
            full, local = {**(params or {}), **(cfg.get("rope_scaling") or {})}, {}
        full = {"rope_theta": cfg.get("rope_theta", 1e6), **full}
        local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0), **local}
        flat = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
        out["rope_global"] = rope_of({**flat, "rope_parameters": full})
        out["rope_local"] = rope_of({**flat, "rope_parameters": local})
    return out


def gemma_windows(cfg: dict, window_of) -> tuple[int, ...] | None:
    """Per-layer windows of a Gemma config (None for another family): the layers layer_types names
    "sliding_attention" slide by sliding_window; without layer_types, Gemma 2 slides the even layers
    0, 2, ... and Gemma 3 every layer but each sliding_window_pattern-th (default 6), as transformers does."""
    mt, n = cfg["model_type"], cfg["num_hidden_layers"]
    if mt not in GEMMA_TYPES:
        return None
    types = cfg.get("layer_types")
    if types is None:
        every = 2 if mt == "gemma2" else cfg.get("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    kinds = ("sliding_attention", "full_attention")
    if not isinstance(types, list) or len(types) != n or any(t not in kinds for t in types):
        raise ValueError(f"config.json: layer_types must list {n} layer types (one per layer), got {types!r}")
    if cfg.get("sliding_window", 4096) is None:
        if mt == "gemma3_text" and "sliding_attention" in types:  # its local RoPE follows the layer type
            raise ValueError("config.json: sliding_window=null with sliding layers in layer_types: set a window")
        return (0,) * n
    w = window_of(cfg)
    return tuple(w if t == "sliding_attention" else 0 for t in types)
