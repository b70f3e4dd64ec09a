"""The Python side of moe.c: a mixture-of-experts layer's routing and experts in one call. Re-exported by
`exactrl.kernels.native`."""

from __future__ import annotations

import ctypes

import torch

from exactrl.kernels.native import _f32, library


def moe(
    x_ND: torch.Tensor, z_NE: torch.Tensor, gate_up: list, down: list, k: int, normalise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [N, D], experts [N, k] int64, weights [N, k]) of a mixture-of-experts layer's routed experts for
    rows x with router logits z, by moe.c's rule, float32: `gate_up[e]` expert e's gate and up weights packed
    together (`PackedLinearWeight([gate, up])`), `down[e]` its down weight packed."""
    (N, D), E, F = x_ND.shape, z_NE.shape[1], gate_up[0].Ns[0]
    assert z_NE.shape[0] == N and len(gate_up) == len(down) == E and 0 < k <= E, (x_ND.shape, z_NE.shape, k)
    assert all(g.Ns == (F, F) and g.K == D for g in gate_up) and all(d.Ns == (D,) and d.K == F for d in down)
    x, z = _f32(x_ND, z_NE)
    out = torch.empty(N, D, dtype=torch.float32)
    experts, weights = torch.empty(N, k, dtype=torch.int64), torch.empty(N, k, dtype=torch.float32)
    if N:
        addrs = [(ctypes.c_int64 * E)(*(w.panels.data_ptr() for w in ws)) for ws in (gate_up, down)]
        if library().exactrl_moe(
            x.data_ptr(),
            z.data_ptr(),
            N,
            D,
            E,
            k,
            F,
            int(normalise),
            *addrs,
            out.data_ptr(),
            experts.data_ptr(),
            weights.data_ptr(),
            torch.get_num_threads(),
        ):
            raise MemoryError(f"moe: could not allocate the scratch memory of {N} rows")
    return out, experts, weights
