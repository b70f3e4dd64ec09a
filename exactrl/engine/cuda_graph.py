"""Decode graphs of the triton backend: a decode step recorded once per bucket of rows as a CUDA graph, then
replayed, with the same bits as the eager forward.

The buffers, buckets, padding rows and checks are engine/graph.py's
(`DecodeGraphs`); what differs is how a step is recorded:

- On CUDA, `torch.cuda.CUDAGraph`. The step runs once eagerly on a side
  stream first (each Triton kernel compiles then: a capture may not), is
  captured, and is replayed once (a capture records the work without doing
  it). The graph replays the same kernels with the same arguments on the same
  buffers: the bits of the eager forward. Each graph has its own memory pool.
- A graph reads the parameters where they are, so it survives any write in
  place (`update_weights`, an optimizer step on a shared model).
- On CPU, under Triton's interpreter, a `_Tape`: the interpreter's stand-in
  for a CUDA graph, so that the tests run this path without a GPU. It notes
  each kernel launch and each torch op that computes, and replays them
  without re-running the model's Python, as a CUDA graph does: a value the
  forward decided on the host during the recording stays baked in, and a
  host read of a tensor (a sync a capture would refuse) raises.

Exact kernels only (`fast` runs SDPA on a padded plan whose shape follows the
sequences' lengths), and no mixture of experts: its routing gives each
expert a data-dependent number of rows, which a graph cannot hold; those
decode eagerly.

Legend: Nb rows of a bucket.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from exactrl.engine.graph import _READS, DecodeGraphs, GraphCaptureError, _Captured, _tensors
from exactrl.kernels import TokenLayout
from exactrl.model.moe import moe_layers

_METADATA = {"__get__", "size", "stride", "storage_offset", "data_ptr", "untyped_storage", "dim", "numel"}
# a tensor's value read on the host: a sync, which a CUDA capture refuses
_HOST_READS = (_READS - {"__setitem__"}) | {"equal", "allclose", "is_nonzero"}
_ALLOCATES = {"empty", "empty_like", "new_empty"}  # the tape keeps what they return: a replay need not repeat them


class TritonDecodeGraphs(DecodeGraphs):
    """The engine's recorded decode steps on the triton backend, one CUDA graph (or tape) per bucket."""

    @staticmethod
    def supported(model) -> bool:
        """Exact triton kernels of a dense model, on CUDA or (the tape) under the interpreter."""
        k = model.kernels
        return k.backend == "triton" and k.exact and not moe_layers(model)

    def _weights(self) -> list[tuple[int, int]]:
        """The graphs read the parameters themselves (no packed copies): a write in place (an optimizer step of a
        trainer sharing the model) is seen by the next replay, and only a moved storage drops them."""
        return [(p.data_ptr(), 0) for p in self._params]

    def _plan(self, g: _Captured, layout: TokenLayout):
        from exactrl.kernels.triton import TritonPlan

        m, (P, Hk, B, _) = self.model, self.kv[0][0].shape
        Nb = g.seq_N.shape[0]
        first = torch.arange(Nb, device=m.device)  # a decode step's attention tiles: one token each
        return TritonPlan(
            layout,
            g.seq_N,
            g.pos_N,
            g.table_NJ,
            P - 1,  # `logits` checks each step's pages against the store
            m.config.num_attention_heads // Hk,
            B,
            tiles=(first, torch.ones_like(first)),
            _kv_rows={Hk: g.kv_rows_x},
        )

    def _record(self, step) -> tuple:
        if self.model.device.type == "cuda":
            try:
                graph = _CudaGraph(step)
            except torch.OutOfMemoryError as e:
                raise RuntimeError(
                    f"recording a decode graph ran out of GPU memory ({str(e).splitlines()[0]}): each bucket's "
                    f"graph keeps its activations and logits; lower kv_budget_tokens or max_num_seqs, or set "
                    f"decode_graphs off"
                ) from e
            return graph, graph.out, []
        tape = _Tape()
        with tape:
            out = step()
        return tape, out, []


class _CudaGraph:
    """`step` captured as a CUDA graph; `out` holds its result after each `run()`."""

    def __init__(self, step):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # compiles each kernel outside the capture
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # the warm-up's stream, so that what a library sets up per stream is set up before the capture;
        # thread_local: another thread's CUDA work (a trainer beside the engine) may go on during it
        with torch.cuda.graph(self.graph, stream=side, capture_error_mode="thread_local"):
            self.out = step()
        self.run()

    def run(self) -> None:
        self.graph.replay()


class _Tape(TorchFunctionMode):
    """A step's kernel launches and computing torch ops, noted while it runs and replayed in order on the same
    tensors (under Triton's interpreter): what a CUDA graph does, on CPU.

    A torch op that makes a new tensor is replayed into that tensor (`copy_`), an in-place one runs again,
    views and `_ALLOCATES` are kept as made. Reading a tensor's value on the host raises `GraphCaptureError`
    (CUDA refuses such a sync inside a capture)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []  # (kind, fn, args, kwargs, out)
        self._launching = False

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction

        self._kernel_cls, self._run = InterpretedFunction, InterpretedFunction.run
        tape = self

        def noted_run(kernel, *args, grid, warmup, **kwargs):
            tape.ops.append(("launch", kernel, args, dict(kwargs, grid=grid, warmup=warmup), None))
            tape._launching = True  # the interpreter's own torch calls are the launch's, not the step's
            try:
                return tape._run(kernel, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                tape._launching = False

        InterpretedFunction.run = noted_run
        return super().__enter__()

    def __exit__(self, *exc):
        self._kernel_cls.run = self._run
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", repr(func))
        if self._launching or name in _METADATA:
            return func(*args, **kwargs)
        if name in _HOST_READS:
            raise GraphCaptureError(
                f"a CUDA graph cannot record {name!r}: it reads a tensor's value on the host "
                f"(Engine(decode_graphs=False) runs the step eagerly)"
            )
        out = func(*args, **kwargs)
        made = _tensors(out)
        if _in_place(name) or "out" in kwargs:
            self.ops.append(("again", func, args, kwargs, None))
        elif made and name not in _ALLOCATES:
            inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
            if any(t.untyped_storage().data_ptr() not in inputs for t in made):  # computed, not a view
                self.ops.append(("into", func, args, kwargs, out))
        return out

    def run(self) -> None:
        for kind, fn, args, kwargs, out in self.ops:
            if kind == "launch":
                self._run(fn, *args, **kwargs)
            elif kind == "again":
                fn(*args, **kwargs)
            else:
                for dst, src in zip(_tensors(out), _tensors(fn(*args, **kwargs))):
                    dst.copy_(src)


def _in_place(name: str) -> bool:
    """Whether a torch op of this name writes its first argument (`add_`, `__iadd__`, `__setitem__`)."""
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i") or name == "__setitem__"
