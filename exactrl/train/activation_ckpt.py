"""Activation checkpointing of the trainer's decoder layers, applied from outside the model.

`apply_activation_checkpointing(model, mode)` rebinds the `forward` of each
decoder layer (`full`) or of each layer's MLP (`selective`) to one that runs
the original forward under `torch.utils.checkpoint` (non-reentrant): the
forward keeps only the region's inputs, and the backward runs the region
again to rebuild what its own backward reads. The model's files are not
touched and its state dict keeps its names.

- `full`: every decoder layer; a layer keeps its input [N, D] (and the KV
  store as it was before the layer wrote to it) instead of its activations.
- `selective`: the MLP of every layer; it keeps the MLP's input [N, D]
  instead of gate, up, their SwiGLU and down_proj's input (3 x [N, F]), the
  largest tensors of a layer when F ≈ 3D, while attention (whose forward
  also writes the KV store) keeps its activations.

Either mode also sets `model.head_recompute`: the vocabulary head
(model/logprobs.py `_HeadLogprobs`) keeps h [N, D] and per-row results
instead of the log-probabilities [N, V] of the completion tokens, and its
backward projects each row chunk onto the vocabulary again. With V ≫ D
(V = 16k-150k, D = 0.4k-4k) the head's [N, V] tensors outweigh a
checkpointed layer's input many times over.

Exactness: the recomputation runs the same kernels on the same inputs (the
head: on the same row chunks), so every saved tensor it rebuilds is bitwise
the one the forward made, and the loss and every gradient are bitwise those
without checkpointing (tested in fp32 and bf16). A layer's attention replaces its entry of the scratch KV
store (`model.new_kv`; `write_kv` is out of place when the keys require
grad): the checkpointed region takes the store as it was *before* the write
as an input and returns the written one, so a recomputation writes into the
same store the forward did, not into its own result.

Only a forward with gradients on is checkpointed: under `no_grad` (the
reference model, a behaviour recompute, the engine's own copy of the model)
the layers run as they always do.
"""

from __future__ import annotations

import types

import torch
from torch.utils.checkpoint import checkpoint

from exactrl.model.transformer import CausalLM

MODES = ("none", "full", "selective")


def apply_activation_checkpointing(model: CausalLM, mode: str) -> CausalLM:
    """Checkpoints `model`'s decoder layers (`full`) or their MLPs (`selective`); `none` leaves it as it is.
    Bound methods, so a `copy.deepcopy` of the model checkpoints its own layers."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode must be one of {list(MODES)}, got {mode!r}")
    model.head_recompute = mode != "none"
    for layer in model.model.layers:
        if mode == "full":
            layer.forward = types.MethodType(_checkpointed_layer, layer)
        elif mode == "selective":
            ffn = getattr(layer, layer.ffn_name)  # the MLP or the experts (Mixtral's `block_sparse_moe`)
            ffn.forward = types.MethodType(_checkpointed_mlp, ffn)
    return model


def _checkpointed_layer(self, x_ND, cos_ND, sin_ND, layout, plan, kv_pages):
    """DecoderLayer.forward with its activations recomputed in the backward (see the module docstring)."""
    if not torch.is_grad_enabled():
        return type(self).forward(self, x_ND, cos_ND, sin_ND, layout, plan, kv_pages)

    def region(x, k_pages, v_pages):  # a fresh page list per call: the forward's list is written to
        pages = [k_pages, v_pages]
        y = type(self).forward(self, x, cos_ND, sin_ND, layout, plan, pages)
        return y, pages[0], pages[1]

    y_ND, kv_pages[0], kv_pages[1] = checkpoint(region, x_ND, kv_pages[0], kv_pages[1], use_reentrant=False)
    return y_ND


def _checkpointed_mlp(self, x_ND):
    """MLP.forward with gate, up and their SwiGLU recomputed in the backward."""
    if not torch.is_grad_enabled():
        return type(self).forward(self, x_ND)
    return checkpoint(type(self).forward, self, x_ND, use_reentrant=False)
