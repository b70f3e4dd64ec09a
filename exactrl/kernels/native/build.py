"""The native kernels' shared library: compiled on first use, cached under a key of everything that could
change its code (source, flags, compiler, CPU features), loaded with ctypes.

Build: `cc -O3 -march=native -ffp-contract=off -fopenmp -shared` into
`$EXACTRL_CACHE` (default `$XDG_CACHE_HOME/exactrl` or `~/.cache/exactrl`), keyed by the source, the flags,
the compiler's version and the CPU's feature flags, written atomically (a
crash mid-build leaves no half-written library). `-ffp-contract=off` and no
`-ffast-math` keep the source's order of every rounding, so `-march=native`
changes speed, not bits. The kernels' exp is their own (`exp_f.h`), not
libm's, whose variant glibc picks per CPU: the same bits on every CPU
(the tests compare the AVX-512, AVX2 and unvectorised builds). No torch headers: the build takes seconds, not a minute.
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
import threading
from pathlib import Path

SOURCES = tuple(Path(__file__).with_name(f) for f in ("exact.c", "gemm.c", "pointwise.c", "moe.c", "graph.c"))
HEADERS = (Path(__file__).with_name("fpmode.h"), Path(__file__).with_name("exp_f.h"))
# other builds, for the tests: the same sums, so the same bits, as the machine's own build ("portable":
# gemm.c's plain-C kernel and no vectorising at all)
BUILDS = {"": [], "avx2": ["-mno-avx512f"], "portable": ["-DEXACTRL_PORTABLE", "-fno-tree-vectorize"]}
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-shared", "-fPIC"]


class KernelBuildError(OSError):
    """The exact kernels cannot be built here (no C compiler, an unwritable cache, a failed compile): a
    problem of the machine's set-up, which the CLI reports in one line as it does other OSErrors."""


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
        raise KernelBuildError(
            f"exactrl's exact kernels are compiled on first use and need a C compiler with "
            f"OpenMP (gcc or clang), but {cc!r} was not found: install one (apt-get install gcc) "
            f"or set CC"
        )
    return cc


def library(build: str = "") -> ctypes.CDLL:
    """The compiled kernels. Another `build` ("avx2": without AVX-512, as on an AVX2-only CPU; "portable":
    gemm.c without vector intrinsics, plain C `fmaf`, nothing vectorised) is for the tests, which compare
    its bits. While `graph.recording` is active on this thread, calls through it are also noted."""
    calls = getattr(_recording, "calls", None)
    return _library(build) if calls is None else _Recorder(_library(build), build, calls)


_recording = threading.local()  # .calls: the list `graph.recording` notes this thread's kernel calls in


class _Recorder:
    """`library()` while a recording is active: each kernel call is made and noted as
    (build, function name, argument types, arguments)."""

    def __init__(self, lib: ctypes.CDLL, build: str, calls: list):
        self._lib, self._build, self._calls = lib, build, calls

    def __getattr__(self, name: str):
        fn = getattr(self._lib, name)

        def call(*args):
            self._calls.append((self._build, name, fn.argtypes, args))
            return fn(*args)

        return call


@functools.cache  # one entry per build, however it is asked for
def _library(build: str) -> ctypes.CDLL:
    cc = _compiler()
    flags = FLAGS + BUILDS[build]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join([*(f.read_text() for f in SOURCES + HEADERS), " ".join(flags), version, _cpu_flags()]).encode()
    )
    cache = _cache_dir()
    so = cache / f"exact-kernels-{key.hexdigest()[:16]}.so"
    if not so.exists():
        try:
            cache.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        except OSError as e:
            raise KernelBuildError(
                f"cannot write exactrl's compiled kernels to {cache} ({e.strerror}): set "
                f"EXACTRL_CACHE to a writable directory"
            ) from None
        os.close(fd)
        try:
            done = subprocess.run([cc, *flags, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True)
            if done.returncode != 0:
                raise KernelBuildError(
                    f"compiling exactrl's exact kernels failed ({cc} {' '.join(flags)}):\n{done.stderr[-2000:]}"
                )
            os.replace(tmp, so)  # atomic: a concurrent or interrupted build never leaves a partial file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(so))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.exactrl_attention.argtypes = (
        [ptr] * 3 + [ctypes.c_int] + [ptr] * 3 + [i64] * 7 + [ctypes.c_float] * 2 + [ptr, ptr, ctypes.c_int]
    )
    lib.exactrl_attention.restype = ctypes.c_int
    lib.exactrl_attention_backward.argtypes = [ptr] * 9 + [i64] * 8 + [ctypes.c_float] * 2 + [ptr] * 3 + [ctypes.c_int]
    lib.exactrl_attention_backward.restype = ctypes.c_int
    lib.exactrl_rms_norm.argtypes = [ptr, ptr, ctypes.c_int, i64, i64, ctypes.c_float, ptr, ctypes.c_int]
    lib.exactrl_rms_norm.restype = None
    lib.exactrl_rotary.argtypes = [ptr, ptr, ptr, ctypes.c_int, i64, i64, i64, ptr, i64]
    lib.exactrl_rotary.restype = None
    lib.exactrl_write_rows.argtypes, lib.exactrl_write_rows.restype = [ptr, ptr, i64, i64, ptr], None
    lib.exactrl_gemm_build.argtypes, lib.exactrl_gemm_build.restype = [], ctypes.c_char_p
    lib.exactrl_gemm_panel_width.argtypes, lib.exactrl_gemm_panel_width.restype = [], i64
    lib.exactrl_pack_weight.argtypes = [ptr, i64, i64, ptr, ctypes.c_int]
    lib.exactrl_pack_weight.restype = None
    lib.exactrl_pack_weight_t.argtypes, lib.exactrl_pack_weight_t.restype = [ptr, i64, i64, ptr, ctypes.c_int], None
    lib.exactrl_linear.argtypes = [ptr, ptr, i64, i64, i64, ptr, ctypes.c_int]
    lib.exactrl_linear.restype = None
    lib.exactrl_linear_multi.argtypes = [ptr, ptr, i64, i64, i64, ptr, ptr, ctypes.c_int]
    lib.exactrl_linear_multi.restype = None
    lib.exactrl_moe.argtypes = [ptr, ptr] + [i64] * 5 + [ctypes.c_int] + [ptr] * 5 + [ctypes.c_int]
    lib.exactrl_moe.restype = ctypes.c_int
    lib.exactrl_check_layout.argtypes = [ptr, ptr, i64, ptr, i64, i64, i64, ptr, ptr]
    lib.exactrl_check_layout.restype = ctypes.c_int
    f32 = ctypes.c_float
    for name, args in [
        ("exactrl_exp", [ptr, i64, ptr]),
        ("exactrl_swiglu", [ptr, ptr, i64, ptr, ctypes.c_int]),
        ("exactrl_log_softmax", [ptr, i64, i64, ptr, ctypes.c_int]),
        ("exactrl_swiglu_backward", [ptr, ptr, ptr, i64, ptr, ptr, ctypes.c_int]),
        ("exactrl_geglu", [ptr, ptr, i64, ptr, ctypes.c_int]),
        ("exactrl_geglu_backward", [ptr, ptr, ptr, i64, ptr, ptr, ctypes.c_int]),
        ("exactrl_softcap", [ptr, i64, f32, ptr, ctypes.c_int]),
        ("exactrl_softcap_backward", [ptr, ptr, i64, f32, ptr, ctypes.c_int]),
        ("exactrl_rms_norm_backward", [ptr, ptr, ptr, i64, i64, f32, ptr, ptr, ctypes.c_int]),
        ("exactrl_draw", [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]),
        ("exactrl_sample", [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]),
        ("exactrl_entropy", [ptr, i64, i64, ptr, ctypes.c_int]),
        ("exactrl_log_softmax_entropy", [ptr, i64, i64, ptr, ptr, ctypes.c_int]),
        ("exactrl_add", [ptr, ptr, i64, i64, ptr]),
        ("exactrl_scale", [ptr, i64, f32, ptr]),
        ("exactrl_sigmoid_gate", [ptr, ptr, i64, i64, ptr]),
        ("exactrl_clamp", [ptr, i64, f32, f32, ptr]),
        ("exactrl_head_grad", [ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, f32, ptr, ctypes.c_int]),
    ]:
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, None
    lib.exactrl_graph_kernels.argtypes, lib.exactrl_graph_kernels.restype = [], ctypes.c_char_p
    lib.exactrl_graph_run.argtypes, lib.exactrl_graph_run.restype = [ptr, i64], i64
    return lib
