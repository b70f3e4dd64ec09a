"""The Python side of gemm.c, the fp32 exact linear whose every output is summed in an order fixed by K
alone: weights packed into its panels, and its calls (`linear`, `linears`). Re-exported by
`exactrl.kernels.native`."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from exactrl.kernels.native import _library, library


class PackedLinearWeight:
    """An fp32 weight [N, K] laid out for `linear` (gemm.c's panels), or several weights [N_s, K] of one
    input laid out one after another for `linears`. Holds its own copy: a later change to a weight is not
    seen, so whoever keeps one must drop it when a weight changes."""

    def __init__(self, w_NK: torch.Tensor | Sequence[torch.Tensor], build: str = ""):
        ws = [w_NK] if isinstance(w_NK, torch.Tensor) else list(w_NK)
        assert ws and all(w.dim() == 2 and w.dtype == torch.float32 and w.shape[1] == ws[0].shape[1] for w in ws), [
            (w.shape, w.dtype) for w in ws
        ]
        self.build, self.lib = build, _library(build)
        self.Ns = tuple(w.shape[0] for w in ws)
        self.N, self.K = sum(self.Ns), ws[0].shape[1]
        nr = self.lib.exactrl_gemm_panel_width()
        self.panels = torch.empty(sum(-(-n // nr) for n in self.Ns) * nr * self.K, dtype=torch.float32)
        self._Ns = (ctypes.c_int64 * len(ws))(*self.Ns)
        self.repack(ws)

    def repack(self, w_NK: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Packs the weights' current values into these panels (the same shapes): whoever holds their address
        (a decode graph) reads the new values."""
        ws = [w_NK] if isinstance(w_NK, torch.Tensor) else list(w_NK)
        assert tuple(w.shape for w in ws) == tuple((n, self.K) for n in self.Ns), [w.shape for w in ws]
        nr, at = self.lib.exactrl_gemm_panel_width(), 0
        for w in ws:  # each weight's panels, its last one zero-padded
            w = w.detach().contiguous()
            self.lib.exactrl_pack_weight(
                w.data_ptr(), w.shape[0], self.K, self.panels[at:].data_ptr(), torch.get_num_threads()
            )
            at += -(-w.shape[0] // nr) * nr * self.K


def packed_transpose(s_KN: torch.Tensor, build: str = "") -> PackedLinearWeight:
    """The panels of sᵀ [N, K] for `linear`, packed straight from s [K, N] (no transposed copy): the same
    panels as PackedLinearWeight(s.t().contiguous())."""
    assert s_KN.dim() == 2 and s_KN.dtype == torch.float32, (s_KN.shape, s_KN.dtype)
    s = s_KN.detach().contiguous()
    w = PackedLinearWeight.__new__(PackedLinearWeight)
    w.build, w.lib = build, _library(build)
    w.K, w.N = s.shape
    w.Ns, w._Ns = (w.N,), (ctypes.c_int64 * 1)(w.N)
    nr = w.lib.exactrl_gemm_panel_width()
    w.panels = torch.empty(-(-w.N // nr) * nr * w.K, dtype=torch.float32)
    w.lib.exactrl_pack_weight_t(s.data_ptr(), w.K, w.N, w.panels.data_ptr(), torch.get_num_threads())
    return w


def linear(x_MK: torch.Tensor, w: PackedLinearWeight) -> torch.Tensor:
    """y = x . W^T in fp32, each output summed in an order fixed by K alone (gemm.c): [M, N]."""
    M, K = x_MK.shape
    assert x_MK.dtype == torch.float32 and K == w.K and len(w.Ns) == 1, (x_MK.dtype, x_MK.shape, w.K, w.Ns)
    x = x_MK if x_MK.is_contiguous() else x_MK.contiguous()
    y = torch.empty(M, w.N, dtype=torch.float32)
    if M and w.N:
        library(w.build).exactrl_linear(
            x.data_ptr(), w.panels.data_ptr(), M, w.N, K, y.data_ptr(), torch.get_num_threads()
        )
    return y


def linears(x_MK: torch.Tensor, w: PackedLinearWeight) -> list[torch.Tensor]:
    """[x . W_s^T for each weight s of w], in one call: each the same bits as `linear` with W_s alone."""
    M, K = x_MK.shape
    assert x_MK.dtype == torch.float32 and K == w.K, (x_MK.dtype, x_MK.shape, w.K)
    x = x_MK if x_MK.is_contiguous() else x_MK.contiguous()
    y = torch.empty(M * w.N, dtype=torch.float32)  # the outputs one after another, each contiguous
    if M:
        library(w.build).exactrl_linear_multi(
            x.data_ptr(), w.panels.data_ptr(), M, K, len(w.Ns), w._Ns, y.data_ptr(), torch.get_num_threads()
        )
    return [part.view(M, n) for part, n in zip(y.split([M * n for n in w.Ns]), w.Ns)]
