"""Mixture-of-experts feed-forward (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE): a token's experts and its output
are a function of that token's hidden state alone, so the engine (prefill, decode, any batch) and the trainer
pick the same experts and produce the same bits.

Routing, per token (row) x [D], with E experts, k per token:

    z = gate(x)                      router logits [E], through the kernels' linear (the exact one: a row's
                                     bits never depend on the other rows)
    p = softmax(z) in fp32           exact kernels: the kernels' own exp of the row log_softmax (one fixed
                                     order per row)
    S = the k largest p, in descending order; equal p: the LOWER expert index first (a stable sort of the
        row), so a tie is broken by a fixed rule, never by how a top-k kernel scans
    w_j = p_(S_j), or p_(S_j) / (p_(S_1) + ... + p_(S_k)) (added left to right) where the family
        normalises (`norm_topk_prob`; Mixtral always)
    y = Σ_{e in S, ascending e} w_e · expert_e(x)   each expert a gated MLP through the kernels' linear on the
        rows routed to it; the sum starts at 0 and adds experts in ascending index (transformers' order)
    Qwen2-MoE adds a shared expert: y + sigmoid(shared_gate(x)) · shared_expert(x), the gate through the
        kernels (exact: 1 / (1 + exp(-g)) with their own exp)

`fast` kernels use torch's softmax and topk (whose ties and bits may depend on the batch), the inverse twin.
The engine's exact fp32 inference runs the whole rule in one native call (`Kernels.experts`, native/moe.c:
the same bits, tested against this module's path), which its decode graphs can replay.
Every MoE layer keeps its last forward's selection (`last_experts` [N, k], `last_router_logits` [N, E]):
the engine reads the rows it samples from (`mismatch/routing_agreement`), the trainer the router logits of
its forward (`load_balancing_loss`).

Legend: N tokens, D hidden, E experts, K experts per token, F expert intermediate size.
"""

from __future__ import annotations

import torch
from torch import nn

from exactrl.kernels import Kernels


def route(logits_NE: torch.Tensor, k: int, normalise: bool, kernels: Kernels) -> tuple[torch.Tensor, torch.Tensor]:
    """(selected experts [N, K] int64 in descending probability, their fp32 weights [N, K]) of router logits,
    by the rule in the module docstring."""
    z = logits_NE.float()
    p = kernels.softmax(z)
    if kernels.exact:
        order = torch.sort(p.detach(), dim=-1, descending=True, stable=True).indices[:, :k]
    else:
        order = torch.topk(p.detach(), k, dim=-1).indices
    w = p.gather(1, order)
    if normalise:
        total = w[:, 0]
        for j in range(1, k):  # left to right, one elementwise add each: a row's sum is its own
            total = total + w[:, j]
        w = w / total[:, None]
    return order, w


class GatedMLP(nn.Module):
    """down(act(gate(x)) · up(x)) with the names a family stores: gate/up/down_proj, or Mixtral's w1/w3/w2."""

    def __init__(self, k: Kernels, d: int, f: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        from exactrl.model.transformer import Linear

        super().__init__()
        self.kernels, self.names = k, names
        for name, (d_in, d_out) in zip(names, ((d, f), (d, f), (f, d))):
            setattr(self, name, Linear(k, d_in, d_out, False))

    def forward(self, x):
        from exactrl.model.transformer import project

        gate, up, down = (getattr(self, n) for n in self.names)
        return down(self.kernels.swiglu(*project(x, gate, up)))


class SparseMoE(nn.Module):
    """The routed experts (+ Qwen2-MoE's shared expert) of one decoder layer, by the module docstring's rule."""

    def __init__(self, cfg, k: Kernels):
        from exactrl.model.transformer import Linear

        super().__init__()
        m = cfg.moe
        self.kernels, self.top_k, self.normalise = k, m.experts_per_token, m.norm_topk_prob
        self.weights_fp32 = cfg.model_type == "mixtral"  # transformers' Mixtral scales in fp32, the others in x's dtype
        names = ("w1", "w3", "w2") if cfg.model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        self.gate = Linear(k, cfg.hidden_size, m.num_experts, False)
        self.experts = nn.ModuleList(
            GatedMLP(k, cfg.hidden_size, m.intermediate_size, names) for _ in range(m.num_experts)
        )
        if m.shared_intermediate_size:
            self.shared_expert = GatedMLP(k, cfg.hidden_size, m.shared_intermediate_size)
            self.shared_expert_gate = Linear(k, cfg.hidden_size, 1, False)
        self.last_experts: torch.Tensor | None = None
        self.last_router_logits: torch.Tensor | None = None

    def forward(self, x_ND):
        logits_NE = self.gate(x_ND)
        weights = [tuple(getattr(mlp, n).weight for n in mlp.names) for mlp in self.experts]
        if self.kernels.fuses_experts(x_ND, [w for ws in weights for w in ws]) and self.one_call():
            out, self.last_experts, _ = self.kernels.experts(x_ND, logits_NE, weights, self.top_k, self.normalise)
            self.last_router_logits = logits_NE
        else:
            out = self._routed(x_ND, logits_NE)
        if hasattr(self, "shared_expert"):
            out = out + self.kernels.sigmoid_gate(self.shared_expert_gate(x_ND), self.shared_expert(x_ND))
        return out

    def one_call(self) -> bool:
        """Whether the one-call path may run (given `Kernels.fuses_experts`): no expert has a LoRA adapter or a
        forward hook, which it would not apply."""
        mods = [m for mlp in self.experts for m in (mlp, *(getattr(mlp, n) for n in mlp.names))]
        return not any(m._forward_hooks or m._forward_pre_hooks or getattr(m, "lora_A", None) is not None for m in mods)

    def _routed(self, x_ND, logits_NE):
        """The routed experts' sum, one module call per expert with rows routed to it (autograd, hooks)."""
        idx_NK, w_NK = route(logits_NE, self.top_k, self.normalise, self.kernels)
        self.last_experts, self.last_router_logits = idx_NK, logits_NE
        if not self.weights_fp32:
            w_NK = w_NK.to(x_ND.dtype)
        flat = idx_NK.reshape(-1)
        order = torch.sort(flat, stable=True).indices  # (token, slot) pairs grouped by expert, tokens ascending
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out, start = torch.zeros_like(x_ND), 0
        for e, n in enumerate(counts):  # ascending expert index: each token's terms are added in this order
            if n:
                pairs = order[start : start + n]
                rows = pairs // self.top_k
                y = self.experts[e](x_ND[rows]) * w_NK.reshape(-1)[pairs, None]
                out = out.index_add(0, rows, y.to(x_ND.dtype))  # each row once per expert: one add per element
                start += n
        return out


def moe_layers(model) -> list[SparseMoE]:
    """The model's MoE layers, in layer order (empty for a dense model)."""
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def selected_experts(model, layers: list[SparseMoE] | None = None) -> torch.Tensor | None:
    """[N, L, K] experts every MoE layer selected for each token of the model's last forward (None if dense);
    `layers`: the model's `moe_layers`, where the caller keeps them (a walk over every module otherwise)."""
    layers = moe_layers(model) if layers is None else layers
    if not layers:
        return None
    return torch.stack([m.last_experts for m in layers], dim=1)


def load_balancing_loss(model, mask_N: torch.Tensor | None = None) -> torch.Tensor:
    """Switch-Transformer load-balancing loss of the last forward's router logits, as transformers computes
    it for Mixtral / Qwen-MoE / OLMoE (`load_balancing_loss_func`), over the MoE layers l and the tokens t
    that `mask_N` keeps (all if None):

        p_lt  = softmax(z_lt)                        router probabilities [E]
        f_i   = Σ_l Σ_t [i in topk(p_lt)] / (L·T)    share of routed slots per token (Σ_i f_i = K)
        P_i   = Σ_l Σ_t p_lt,i / (L·T)               mean router probability
        loss  = E · Σ_i f_i · P_i

    f is a count (no gradient); the gradient flows through P to the routers."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError("the load-balancing loss needs a mixture-of-experts model; this one has no MoE layer")
    E = len(layers[0].experts)
    dev = layers[0].last_router_logits.device
    keep = None if mask_N is None else mask_N.to(dev, torch.float32)
    counts = torch.zeros(E, dtype=torch.float32, device=dev)
    prob_sum = torch.zeros(E, dtype=torch.float32, device=dev)
    rows = 0.0
    for m in layers:
        p = torch.softmax(m.last_router_logits.float(), dim=-1)
        one_hot = torch.zeros_like(p).scatter_(1, m.last_experts, 1.0)
        if keep is not None:
            one_hot, p = one_hot * keep[:, None], p * keep[:, None]
        counts = counts + one_hot.sum(0)
        prob_sum = prob_sum + p.sum(0)
        rows = rows + (p.shape[0] if keep is None else keep.sum())
    return E * torch.sum((counts / rows) * (prob_sum / rows))
