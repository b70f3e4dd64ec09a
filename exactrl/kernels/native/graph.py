"""Recorded kernel calls, replayed by one C call (`graph.c`): the low level of the engine's decode graphs.

`recording(calls)` notes every kernel call made through `library()` on this
thread while it runs; `Graph(calls)` encodes them as `graph.c`'s ops, and
`Graph.run()` makes the same calls again, with the same arguments, in one C
loop. Pointers are replayed as they were: whoever records must keep every
tensor they point at alive and in place (engine/graph.py does).
"""

from __future__ import annotations

import contextlib
import ctypes

from exactrl.kernels import native


class _Op(ctypes.Structure):  # graph.c's exactrl_op
    _fields_ = [("kind", ctypes.c_int64), ("a", ctypes.c_int64 * 19), ("f", ctypes.c_double * 2)]


@contextlib.contextmanager
def recording(calls: list):
    """Within the block, this thread's kernel calls are made as usual and noted in `calls`."""
    assert getattr(native._recording, "calls", None) is None, "recordings do not nest"
    native._recording.calls = calls
    try:
        yield calls
    finally:
        native._recording.calls = None


class Graph:
    """Recorded kernel calls, encoded once; `run` replays them."""

    def __init__(self, calls: list):
        lib = native.library()
        kinds = {name: i for i, name in enumerate(lib.exactrl_graph_kernels().decode().split(","))}
        self.ops = (_Op * len(calls))()
        self._keep = []  # ctypes arrays passed by pointer (a packed weight's column counts)
        for op, (build, name, argtypes, args) in zip(self.ops, calls):
            if build != "" or name not in kinds:
                raise RuntimeError(
                    f"a graph cannot replay {name!r} (build {build!r}); graph.c replays "
                    f"{sorted(kinds)} of the machine's own build"
                )
            op.kind = kinds[name]
            floats = 0
            for i, (t, v) in enumerate(zip(argtypes, args)):
                if t in (ctypes.c_float, ctypes.c_double):
                    op.f[floats] = v
                    floats += 1
                elif isinstance(v, ctypes.Array):
                    op.a[i] = ctypes.addressof(v)
                    self._keep.append(v)
                else:
                    op.a[i] = 0 if v is None else int(v)
        self.names = [name for _, name, _, _ in calls]

    def run(self) -> None:
        failed = native.library().exactrl_graph_run(ctypes.addressof(self.ops), len(self.ops))
        if failed:
            raise MemoryError(f"graph op {failed - 1} ({self.names[failed - 1]}) could not allocate its scratch memory")
