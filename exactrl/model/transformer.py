"""The one decoder-only transformer (Qwen3 / Qwen2 / Llama / Mistral and the mixture-of-experts families of
`model/families.py`), trainer and engine alike.

Inference is a mode of this model, not a second implementation: `forward`
takes the tokens of any mix of sequences (a trainer batch, prefill chunks,
decode steps), their `TokenLayout`, and a paged KV store to read and write.
The engine passes its persistent cache; the trainer a scratch one. Module
names follow Hugging Face's so a checkpoint's tensor names map one to one.
Every op whose result could depend on the batch goes through `self.kernels`.

Legend: N tokens, D hidden, H heads, Hk kv heads, Dh head dim, V vocabulary.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from exactrl.kernels import Kernels, TokenLayout, rotary_tables
from exactrl.model.config import ModelConfig
from exactrl.model.rope import dynamic_tables, rope_frequencies

DEFAULT_BLOCK_SIZE = 32  # keys per attention block = KV page size
# RoPE's cos/sin are built as far as a forward reaches, in chunks of this many positions, each computed alone
# with the same shape whatever the growth before it: a model whose config allows 10^9 positions took 80 s and
# 13 GB to build a table for 10^8 of them (10^9 did not fit), and a 128k context holds 134 MB per model copy
ROPE_CHUNK = 4096


class Linear(nn.Module):
    def __init__(self, kernels: Kernels, d_in: int, d_out: int, bias: bool):
        super().__init__()
        self.kernels = kernels
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None
        # a LoRA adapter (model/lora.py `add_lora`): lora_A [r, d_in] and lora_B [d_out, r] Linears, and α/r
        self.lora_A: Linear | None = None
        self.lora_B: Linear | None = None
        self.lora_scale = 0.0

    def forward(self, x):
        return self.adapted(x, self.kernels.linear(x, self.weight, self.bias))

    def adapted(self, x, y):
        """y = W x + b, plus the LoRA term where an adapter is attached: y + B(A x)·α/r, each product through
        the kernels' linear, then the scale, then the sum, in this order on every path (docs/design.md §5)."""
        if self.lora_A is None:
            return y
        return y + self.lora_B(self.lora_A(x)) * self.lora_scale


def project(x, *linears: Linear) -> list[torch.Tensor]:
    """x through several Linears that share it (q/k/v, gate/up): one product where the kernels can
    (the engine: the same bits, fewer calls), else a module call each (autograd, forward hooks)."""
    kernels, weights = linears[0].kernels, [m.weight for m in linears]
    if kernels.fuses_linears(x, weights, [m.bias for m in linears]):
        return [m.adapted(x, y) for m, y in zip(linears, kernels.linears(x, weights))]
    return [m(x) for m in linears]


class RMSNorm(nn.Module):
    """w · x / rms(x); Gemma's (`offset`) scales by (1 + w), its weight stored as w (0 = identity).

    1 + w is a sum of two tensors (`one`, a buffer of ones): the same bits as `1.0 + w`, and an op a decode
    graph replays (engine/graph.py), so a replay reads the weight as it is then."""

    def __init__(self, kernels: Kernels, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.kernels, self.eps, self.offset = kernels, eps, offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        if offset:
            self.register_buffer("one", torch.ones(dim), persistent=False)

    def forward(self, x):
        if not self.offset:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return self.kernels.rms_norm(x, self.one + self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, k: Kernels, window: int = 0):
        super().__init__()
        self.cfg, self.kernels = cfg, k
        self.window = window  # keys a query attends to (a sliding window), 0 for all before it
        self.local_rope = window > 0 and cfg.rope_local is not None  # Gemma 3: its second RoPE table
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else 1.0 / math.sqrt(cfg.head_dim)
        self.softcap = cfg.attn_softcap or 0.0  # Gemma 2's cap on the scores, 0 for none
        H, Hk, Dh, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = Linear(k, D, H * Dh, cfg.qkv_bias)
        self.k_proj = Linear(k, D, Hk * Dh, cfg.qkv_bias)
        self.v_proj = Linear(k, D, Hk * Dh, cfg.qkv_bias)
        self.o_proj = Linear(k, H * Dh, D, cfg.o_bias)
        if cfg.qk_norm:  # per head, or (OLMoE) over all heads of the projection
            full = cfg.qk_norm_full
            self.q_norm = RMSNorm(k, H * Dh if full else Dh, cfg.rms_norm_eps, cfg.gemma)
            self.k_norm = RMSNorm(k, Hk * Dh if full else Dh, cfg.rms_norm_eps, cfg.gemma)

    def forward(self, x_ND, cos_ND, sin_ND, layout, plan, kv_pages):
        c = self.cfg
        n = x_ND.shape[0]
        q, k, v = project(x_ND, self.q_proj, self.k_proj, self.v_proj)
        if c.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        if c.clip_qkv is not None:  # elementwise: invariant
            q, k, v = (self.kernels.clip(t, c.clip_qkv) for t in (q, k, v))
        q = q.view(n, c.num_attention_heads, c.head_dim)
        k, v = k.view(n, c.num_key_value_heads, c.head_dim), v.view(n, c.num_key_value_heads, c.head_dim)
        if c.qk_norm and not c.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos_ND.shape[1] != c.head_dim:  # [global | local] tables (Gemma 3): this layer's half
            half = slice(c.head_dim, None) if self.local_rope else slice(0, c.head_dim)
            cos_ND, sin_ND = cos_ND[:, half], sin_ND[:, half]  # views: the kernels read them in place or copy
        q, k = self.kernels.rotary(q, cos_ND, sin_ND), self.kernels.rotary(k, cos_ND, sin_ND)
        k_pages, v_pages = self.kernels.write_kv(kv_pages[0], kv_pages[1], k, v, layout, plan)
        kv_pages[0], kv_pages[1] = k_pages, v_pages
        o = self.kernels.attention(q, k_pages, v_pages, plan, self.scale, self.window, self.softcap)
        return self.o_proj(o.reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, k: Kernels):
        super().__init__()
        D, F = cfg.hidden_size, cfg.intermediate_size
        self.kernels, self.act = k, cfg.act
        self.gate_proj = Linear(k, D, F, cfg.mlp_bias)
        self.up_proj = Linear(k, D, F, cfg.mlp_bias)
        self.down_proj = Linear(k, F, D, cfg.mlp_bias)

    def forward(self, x):
        gate, up = project(x, self.gate_proj, self.up_proj)
        if self.act == "gelu_tanh":  # GeGLU (Gemma)
            return self.down_proj(self.kernels.geglu(gate, up))
        return self.down_proj(self.kernels.swiglu(gate, up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, k: Kernels, window: int = 0, index: int = 0):
        super().__init__()
        self.self_attn = Attention(cfg, k, window)
        # the feed-forward under transformers' name: `mlp`, or Mixtral's `block_sparse_moe`
        self.ffn_name = "block_sparse_moe" if cfg.model_type == "mixtral" else "mlp"
        if cfg.moe is not None and cfg.moe.sparse_layers[index]:
            from exactrl.model.moe import SparseMoE

            setattr(self, self.ffn_name, SparseMoE(cfg, k))
        else:
            setattr(self, self.ffn_name, MLP(cfg, k))
        self.input_layernorm = RMSNorm(k, cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma)
        self.post_attention_layernorm = RMSNorm(k, cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma)
        self.gemma = cfg.gemma
        if cfg.gemma:  # Gemma normalises each block's input and output: attention's by the two above
            self.pre_feedforward_layernorm = RMSNorm(k, cfg.hidden_size, cfg.rms_norm_eps, True)
            self.post_feedforward_layernorm = RMSNorm(k, cfg.hidden_size, cfg.rms_norm_eps, True)

    def forward(self, x, cos, sin, layout, plan, kv_pages):
        if self.gemma:
            x = x + self.post_attention_layernorm(
                self.self_attn(self.input_layernorm(x), cos, sin, layout, plan, kv_pages)
            )
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layout, plan, kv_pages)
        return x + getattr(self, self.ffn_name)(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, k: Kernels):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, k, cfg.window(i), i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(k, cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma)


class CausalLM(nn.Module):
    """Decoder + LM head. `forward` returns final hidden states; `logits` projects them."""

    def __init__(self, cfg: ModelConfig, kernels: Kernels, block_size: int = DEFAULT_BLOCK_SIZE):
        super().__init__()
        self.config, self.kernels, self.block_size = cfg, kernels, block_size
        self.lora = None  # the LoRA adapters' settings (model/lora.py `LoRASpec`) once `add_lora` attached them
        # the trainer's LM head recomputes its [rows, V] logprobs in the backward instead of keeping them
        # (model/logprobs.py `_HeadLogprobs`); set with activation checkpointing (train/activation_ckpt.py)
        self.head_recompute = False
        self.model = Decoder(cfg, kernels)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(kernels, cfg.hidden_size, cfg.vocab_size, False)
        width = cfg.head_dim * (2 if cfg.rope_local is not None else 1)  # Gemma 3: [global | local] tables
        self.register_buffer("rope_cos", torch.empty(0, width), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0, width), persistent=False)
        self.rope_reach(1)

    def rope_reach(self, positions: int) -> None:
        """Grows the rotary tables to hold at least `positions` positions (at least doubling, in whole
        ROPE_CHUNKs, up to the context length: max_position_embeddings, times the factor of `dynamic` RoPE)."""
        c, have = self.config, self.rope_cos.shape[0]
        if positions > c.context_length:
            why = f"max_position_embeddings={c.max_position_embeddings}"
            if c.context_length != c.max_position_embeddings:
                why = f"the context of {c.context_length} tokens ({why} x the dynamic RoPE factor {c.rope['factor']})"
            raise ValueError(f"position {positions - 1} is beyond {why}")
        if positions <= have:
            return
        assert have % ROPE_CHUNK == 0, have  # only the last chunk is cut, at the context length
        want = min(-(-max(positions, 2 * have) // ROPE_CHUNK) * ROPE_CHUNK, c.context_length)
        ropes = [(c.rope_theta, c.rope)] + ([c.rope_local] if c.rope_local is not None else [])
        freqs = [(theta, rope, *rope_frequencies(c.head_dim, theta, rope)) for theta, rope in ropes]

        def table(theta, rope, inv_freq, scale, start):
            if rope["rope_type"] == "dynamic":  # its frequencies change with the position (model/rope.py)
                return dynamic_tables(c.head_dim, theta, rope, c.max_position_embeddings, start, ROPE_CHUNK)
            return rotary_tables(c.head_dim, ROPE_CHUNK, theta, start, inv_freq, scale)

        parts = []
        for start in range(have, want, ROPE_CHUNK):
            tables = [table(*f, start) for f in freqs]
            parts.append((torch.cat([cos for cos, _ in tables], 1), torch.cat([sin for _, sin in tables], 1)))
        # the model's dtype and device, after a `model.to(...)`, as the first chunk's
        dtype, dev = self.rope_cos.dtype, self.rope_cos.device
        self.rope_cos = torch.cat([self.rope_cos, *(cos.to(dev, dtype) for cos, _ in parts)])[:want]
        self.rope_sin = torch.cat([self.rope_sin, *(sin.to(dev, dtype) for _, sin in parts)])[:want]

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def kv_bytes(self, num_pages: int) -> int:
        """The bytes `new_kv(num_pages)` allocates (a Python int: no overflow before the allocation is tried)."""
        c = self.config
        return (
            2
            * c.num_hidden_layers
            * num_pages
            * c.num_key_value_heads
            * self.block_size
            * c.head_dim
            * self.dtype.itemsize
        )

    def new_kv(self, num_pages: int) -> list[list[torch.Tensor]]:
        """An empty paged KV store: per layer [k_pages, v_pages], each [P, Hk, B, Dh]."""
        c = self.config
        shape = (num_pages, c.num_key_value_heads, self.block_size, c.head_dim)
        return [
            [
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            ]
            for _ in range(c.num_hidden_layers)
        ]

    def forward(self, tokens_N: torch.Tensor, layout: TokenLayout, kv: list[list[torch.Tensor]]) -> torch.Tensor:
        x_ND, cos_ND, sin_ND, plan = self.layer_inputs(tokens_N, layout)
        return self.run_layers(x_ND, cos_ND, sin_ND, layout, plan, kv)

    def layer_inputs(self, tokens_N: torch.Tensor, layout: TokenLayout):
        """(embeddings, rotary cos and sin at each position, attention plan): the layers' inputs, the layout
        checked. Apart from `run_layers` because the engine's decode graphs replay that part only. The
        layout stays where it was built (the host); tokens and positions go to the model's device."""
        c = self.config
        self.rope_reach(int(layout.pos_N.max()) + 1)  # checks the positions against max_position_embeddings
        dev = self.device
        plan = self.kernels.plan_attention(layout, c.num_attention_heads, c.num_key_value_heads, self.block_size, dev)
        pos_N = layout.pos_N.to(dev)
        x_ND = self.model.embed_tokens(tokens_N.to(dev))
        if c.gemma:  # sqrt(hidden_size) rounded to the model dtype first, as transformers multiplies
            x_ND = x_ND * torch.tensor(c.hidden_size**0.5, dtype=x_ND.dtype, device=dev)
        return x_ND, self.rope_cos[pos_N], self.rope_sin[pos_N], plan

    def run_layers(self, x_ND, cos_ND, sin_ND, layout, plan, kv) -> torch.Tensor:
        """The decoder layers and the final norm: final hidden states [N, D]."""
        for layer, pages in zip(self.model.layers, kv):
            x_ND = layer(x_ND, cos_ND, sin_ND, layout, plan, pages)
        return self.model.norm(x_ND)

    @property
    def head_weight(self) -> torch.Tensor:
        """[V, D] weight of the vocabulary projection (the embedding when tied)."""
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def linear_weights(self) -> list[torch.Tensor]:
        """Every weight that goes through `kernels.linear`: the projections and the vocabulary head."""
        tied = [self.head_weight] if self.config.tie_word_embeddings else []  # else `lm_head` is a Linear
        return [m.weight for m in self.modules() if isinstance(m, Linear)] + tied

    def logits(self, hidden_ND: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, V] (computed in the model dtype, then upcast, as HF does), soft-capped where the
        config caps them (Gemma 2: c·tanh(z / c))."""
        z_NV = self.kernels.linear(hidden_ND, self.head_weight).float()
        cap = self.config.logit_softcap
        return z_NV if cap is None else self.kernels.softcap(z_NV, cap)
