"""Native (C) exact kernels: compiled on first use with the machine's C compiler, loaded with ctypes.

`exact.c`: attention, RMSNorm, RoPE. `gemm.c`: the fp32 exact linear (its
order of sums is in that file's header). `fpmode.h`: every thread of a
parallel region computes in its caller's flush-to-zero / denormal mode.

Why C: the exact attention computes each query row on its own with a fixed
reduction order (`exact.c`). In torch ops that needs many tiny fixed-shape
products and masks; measured on a 2-core AMD EPYC (Zen 1) at the 20M shape,
batch 32, ~16 ms of a 64–68 ms decode step went to them; the C loop, one pass
over each row's keys, takes ~4 ms of the step. RMSNorm likewise: one call
instead of ~7 torch ops (and no padding of small batches), 33 calls a step.

Build: `cc -O3 -march=native -ffp-contract=off -fopenmp -shared` into
`$EXACTRL_CACHE` (default `$XDG_CACHE_HOME/exactrl` or `~/.cache/exactrl`), keyed by the source, the flags,
the compiler's version and the CPU's feature flags, written atomically (a
crash mid-build leaves no half-written library). `-ffp-contract=off` and no
`-ffast-math` keep the source's order of every rounding, so `-march=native`
changes speed, not bits (libm's `expf` aside: glibc may pick a variant per
CPU, so two different CPUs could differ in a rare last bit; one machine
never does). No torch headers: the build takes ~1 s, not a minute.
Needs a C compiler with OpenMP (gcc or clang: `$CC`, default `cc`); without
one, exact kernels fail with an error that says so.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCES = (Path(__file__).with_name("exact.c"), Path(__file__).with_name("gemm.c"))
HEADERS = (Path(__file__).with_name("fpmode.h"),)
# other builds of gemm.c, for the tests: the same sums, so the same bits, as the machine's own build
BUILDS = {"": [], "avx2": ["-mno-avx512f"], "portable": ["-DEXACTRL_PORTABLE"]}
_DTYPES = (torch.float32, torch.bfloat16)  # what the C kernels read
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-shared", "-fPIC"]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:  # not Linux: the compiler's own target description stands in
        return ""


def _cache_dir() -> Path:
    if "EXACTRL_CACHE" in os.environ:
        return Path(os.environ["EXACTRL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "exactrl"


def _compiler() -> str:
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise RuntimeError(f"exactrl's exact kernels are compiled on first use and need a C compiler with OpenMP "
                           f"(gcc or clang), but {cc!r} was not found: install one (apt-get install gcc) or set CC")
    return cc


@functools.cache
def library(build: str = "") -> ctypes.CDLL:
    """The compiled kernels. Another `build` ("avx2": without AVX-512, as on an AVX2-only CPU; "portable":
    gemm.c without vector intrinsics, plain C `fmaf`) is for the tests, which compare its bits."""
    cc = _compiler()
    flags = FLAGS + BUILDS[build]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([*(f.read_text() for f in SOURCES + HEADERS), " ".join(flags), version,
                                     _cpu_flags()]).encode())
    cache = _cache_dir()
    so = cache / f"exact-kernels-{key.hexdigest()[:16]}.so"
    if not so.exists():
        try:
            cache.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        except OSError as e:
            raise RuntimeError(f"cannot write exactrl's compiled kernels to {cache} ({e.strerror}): set "
                               f"EXACTRL_CACHE to a writable directory") from None
        os.close(fd)
        try:
            done = subprocess.run([cc, *flags, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True,
                                  text=True)
            if done.returncode != 0:
                raise RuntimeError(f"compiling exactrl's exact kernels failed ({cc} {' '.join(flags)}):\n"
                                   f"{done.stderr[-2000:]}")
            os.replace(tmp, so)  # atomic: a concurrent or interrupted build never leaves a partial file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(so))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.exactrl_attention.argtypes = [ptr, ptr, ptr, ctypes.c_int, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64,
                                      i64, ctypes.c_float, ptr, ctypes.c_int]
    lib.exactrl_attention.restype = ctypes.c_int
    lib.exactrl_rms_norm.argtypes = [ptr, ptr, ctypes.c_int, i64, i64, ctypes.c_float, ptr, ctypes.c_int]
    lib.exactrl_rms_norm.restype = None
    lib.exactrl_rotary.argtypes = [ptr, ptr, ptr, ctypes.c_int, i64, i64, i64, ptr]
    lib.exactrl_rotary.restype = None
    lib.exactrl_gemm_build.argtypes, lib.exactrl_gemm_build.restype = [], ctypes.c_char_p
    lib.exactrl_gemm_panel_width.argtypes, lib.exactrl_gemm_panel_width.restype = [], i64
    lib.exactrl_pack_weight.argtypes = [ptr, i64, i64, ptr, ctypes.c_int]
    lib.exactrl_pack_weight.restype = None
    lib.exactrl_linear.argtypes = [ptr, ptr, i64, i64, i64, ptr, ctypes.c_int]
    lib.exactrl_linear.restype = None
    return lib


def attention(q_NHD: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, seq_N: torch.Tensor,
              pos_N: torch.Tensor, table_SJ: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    """Causal attention of every query row over its sequence's keys 0..pos (exact.c): [N, H, D] fp32.

    `max_len` must be at least every pos + 1 (the scratch size of a score row).
    """
    N, H, D = q_NHD.shape
    P, Hk, B, Dk = k_pages.shape
    assert Dk == D and H % Hk == 0 and v_pages.shape == k_pages.shape
    assert q_NHD.dtype == k_pages.dtype == v_pages.dtype and q_NHD.dtype in (torch.float32, torch.bfloat16)
    assert seq_N.dtype == pos_N.dtype == table_SJ.dtype == torch.int64
    q, k, v = q_NHD.contiguous(), k_pages.contiguous(), v_pages.contiguous()
    seq, pos, table = seq_N.contiguous(), pos_N.contiguous(), table_SJ.contiguous()
    out = torch.empty(N, H, D, dtype=torch.float32)
    if N == 0:
        return out
    failed = library().exactrl_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), int(q.dtype == torch.bfloat16), seq.data_ptr(), pos.data_ptr(),
        table.data_ptr(), N, H, Hk, D, B, table.shape[1], max_len, scale, out.data_ptr(), torch.get_num_threads())
    if failed:
        raise MemoryError("exact attention could not allocate its per-thread scratch memory")
    return out


def rms_norm(x: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, each row in one fixed order (exact.c), in x's dtype.

    Lean on purpose: 33 calls per decode step of a 20M Qwen3, each ~10 us of work.
    """
    D = x.shape[-1]
    assert x.dtype in _DTYPES and weight_D.dtype == x.dtype and weight_D.shape[0] == D and weight_D.is_contiguous()
    x = x if x.is_contiguous() else x.contiguous()
    out = torch.empty_like(x)
    rows = x.numel() // D if D else 0
    if rows:
        library().exactrl_rms_norm(x.data_ptr(), weight_D.data_ptr(), x.dtype == torch.bfloat16, rows, D, eps,
                                   out.data_ptr(), torch.get_num_threads())
    return out


def rotary(x_NHD: torch.Tensor, cos_ND: torch.Tensor, sin_ND: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE with the same roundings, hence the same bits, as `rowwise.apply_rotary`'s torch ops."""
    N, H, D = x_NHD.shape
    assert x_NHD.dtype in _DTYPES and cos_ND.shape == sin_ND.shape == (N, D) and D % 2 == 0
    # tables in fp32 or already in x's dtype (a bf16 model's buffers): rounding them to x's dtype is the same
    c, s = cos_ND.float(), sin_ND.float()
    x, c, s = (t if t.is_contiguous() else t.contiguous() for t in (x_NHD, c, s))
    out = torch.empty_like(x)
    if N:
        library().exactrl_rotary(x.data_ptr(), c.data_ptr(), s.data_ptr(), x.dtype == torch.bfloat16, N, H, D,
                                 out.data_ptr())
    return out


class PackedLinearWeight:
    """An fp32 weight [N, K] laid out for `linear` (gemm.c's panels). Holds its own copy: a later change
    to the weight is not seen, so whoever keeps one must drop it when the weight changes."""

    def __init__(self, w_NK: torch.Tensor, build: str = ""):
        assert w_NK.dim() == 2 and w_NK.dtype == torch.float32, (w_NK.shape, w_NK.dtype)
        self.lib = library(build) if build else library()  # one cache entry for the usual build
        self.N, self.K = w_NK.shape
        nr = self.lib.exactrl_gemm_panel_width()
        w = w_NK.detach().contiguous()
        self.panels = torch.empty(-(-self.N // nr) * nr * self.K, dtype=torch.float32)
        self.lib.exactrl_pack_weight(w.data_ptr(), self.N, self.K, self.panels.data_ptr(), torch.get_num_threads())


def linear(x_MK: torch.Tensor, w: PackedLinearWeight) -> torch.Tensor:
    """y = x . W^T in fp32, each output summed in an order fixed by K alone (gemm.c): [M, N]."""
    M, K = x_MK.shape
    assert x_MK.dtype == torch.float32 and K == w.K, (x_MK.dtype, x_MK.shape, w.K)
    x = x_MK if x_MK.is_contiguous() else x_MK.contiguous()
    y = torch.empty(M, w.N, dtype=torch.float32)
    if M and w.N:
        w.lib.exactrl_linear(x.data_ptr(), w.panels.data_ptr(), M, w.N, K, y.data_ptr(), torch.get_num_threads())
    return y
