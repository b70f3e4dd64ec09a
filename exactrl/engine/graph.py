"""Decode graphs: a decode step's kernel calls recorded once, then replayed by one C call, with the same
bits as the eager forward.

Why: a decode step makes a hundred or more small kernel calls, and the Python
and torch around them (module calls, checks, allocations, ctypes) cost a
small model's step a large share of its time (docs/performance.md). vLLM,
SGLang and gpt-fast meet the same cost on GPUs with CUDA graphs; this is
their CPU analogue, for the exact fp32 kernels, which are all native.

How: the first decode step of a bucket of rows runs the model's own
`run_layers` and `logits` with every input in a buffer of the graph, while
`native.graph.recording` notes each kernel call. Later steps of that bucket
write their inputs into the same buffers and replay the calls. The same
kernels with the same arguments: the same bits as the eager forward (tested).
Steps with prefill chunks, and any other kernels or dtype, run eagerly. The
triton backend records its steps as CUDA graphs (engine/cuda_graph.py) on the
same buffers and padding.

- Rows are padded up to a bucket (1, 2, 4, 8, then multiples of 8), so few
  graphs serve every batch. Padding rows read and write only the pool's
  scratch page, and every exact kernel is batch-invariant: they change no bit
  of the real rows.
- While recording, torch ops may only make views and allocations
  (`_NativeOnly`). An add (the residual, a bias) becomes the native add, and
  a product with a number (LoRA's α/r) the native scale (the same IEEE sums
  and products); any other op raises, as its work would be missing from the
  replay.
- A graph points at the weights' packed copies, the norms' weights and the KV
  store. `update_weights` writes the weights and packs them again in place,
  so graphs survive it (`weights_updated`); they are dropped by `clear()`
  (`weights_changed`) and whenever a parameter's storage or version counter
  has moved otherwise.

Legend: N rows of the step (one token per sequence), Nb rows of its bucket, D hidden,
Dh head dim, Hk kv heads, J block-table columns.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.nn.modules import module as nn_module
from torch.overrides import TorchFunctionMode

from exactrl.kernels import TokenLayout, native
from exactrl.kernels.attention import ExactPlan
from exactrl.kernels.native.graph import Graph, recording
from exactrl.model.moe import moe_layers

MAX_GRAPHS = 8  # buckets kept (the least recently used goes): a bucket's graph holds its activations and logits

_READS = {
    "item",
    "tolist",
    "numpy",
    "__array__",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__repr__",
    "__str__",
    "__format__",
    "__setitem__",
}  # value reads a replay would not redo, and writes
_ALLOCATES = {"empty", "empty_like"}


def bucket(n: int) -> int:
    """Rows a step of n decode rows is padded to."""
    return n if n <= 2 else 4 if n <= 4 else 8 if n <= 8 else -(-n // 8) * 8


class GraphCaptureError(RuntimeError):
    """The model's forward did something a replay would not repeat (a torch op other than a view, an
    allocation or an add; a forward hook)."""


class Replay(Protocol):
    """A recorded decode step: `Graph` (native calls), a CUDA graph or the interpreter's tape
    (engine/cuda_graph.py)."""

    def run(self) -> None: ...


@dataclass
class _Captured:
    graph: Replay  # run() repeats the recorded step
    x_ND: torch.Tensor  # the inputs, written before each replay ([Nb, ...]; rows past N are padding)
    cos_ND: torch.Tensor
    sin_ND: torch.Tensor
    seq_N: torch.Tensor
    pos_N: torch.Tensor
    table_NJ: torch.Tensor
    kv_rows_x: torch.Tensor  # [Nb * Hk] rows of the KV store the new keys and values go to
    logits_NV: torch.Tensor  # the output, read right after
    kept: list  # every tensor the recorded calls point at
    moe: list  # each MoE layer with the buffers its recorded call writes: (layer, experts [Nb, K], logits [Nb, E])
    rows_used: int = 0  # rows the last step wrote: those past the next step's N are made padding again


class DecodeGraphs:
    """The engine's recorded decode steps, one per bucket of rows."""

    def __init__(self, model, kv: list[list[torch.Tensor]], scratch_page: int, max_blocks: int):
        self.model, self.kv = model, kv
        self.scratch_page = scratch_page  # a page of `kv` no sequence uses: the padding rows' keys and values
        self.max_blocks = max_blocks  # block-table columns: the most pages a sequence can have
        self._params = list(model.parameters())
        self._modules = list(model.named_modules())
        self._hook_dicts = [d for _, mod in self._modules for d in (mod._forward_hooks, mod._forward_pre_hooks)]
        self._moe = moe_layers(model)
        self._graphs: OrderedDict[tuple[int, int], _Captured] = OrderedDict()
        self._fingerprint: list | None = None
        self.num_captures = 0  # since the start: graphs recorded
        self.num_replays = 0  # and steps replayed

    @staticmethod
    def supported(model) -> bool:
        """Exact fp32 kernels only: every op of their forward is native (bf16's linear is oneDNN's, `fast`'s
        ops are torch's). A mixture of experts records each layer's routed experts as one native call
        (`Kernels.experts`), which routes the step's rows itself."""
        return model.kernels.backend == "native" and model.kernels.exact and model.dtype == torch.float32

    def applies(self) -> bool:
        """Whether a decode step can be recorded or replayed now: every MoE layer runs its experts in one call
        (a LoRA adapter on an expert runs them module by module, which a recording cannot hold; such steps
        run eagerly)."""
        return all(layer.one_call() for layer in self._moe)

    def clear(self) -> None:
        self._graphs.clear()

    def weights_updated(self) -> None:
        """The weights were written in place and the packed copies packed again in place
        (`PackedWeights.refresh`): every pointer of the graphs still holds, so they are kept."""
        self._fingerprint = self._weights()

    def _check_hooks(self) -> None:
        """A replay runs no Python: a forward hook on the model would silently not run. Checked every step
        (a hook can come after the graphs): one look at each module's hook dicts (registering a hook adds it
        to these very dicts)."""
        if any(self._hook_dicts) or nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
            hooked = [n or "the model" for n, mod in self._modules if mod._forward_hooks or mod._forward_pre_hooks]
            raise GraphCaptureError(
                f"forward hooks (on {hooked[:3] or 'every module'}) would not run in a replayed "
                f"decode step: remove them or use Engine(decode_graphs=False)"
            )

    def _weights(self) -> list[tuple[int, int]]:
        return [(p.data_ptr(), p._version) for p in self._params]

    def logits(self, tokens_N: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        """fp32 logits [N, V] of a decode step (each sequence's one new token): `model.logits(model(...))`,
        bit for bit. A view of the graph's output: valid until the next call."""
        m = self.model
        self._check_hooks()
        x_ND, cos_ND, sin_ND, plan = m.layer_inputs(tokens_N, layout)  # checks the layout, as the forward does
        P, Hk, B, _ = self.kv[0][0].shape
        rows_x, max_row = layout._rows(Hk, B)
        if plan.max_page >= P or max_row >= P * Hk * B or layout.block_table_SJ.shape[1] > self.max_blocks:
            raise ValueError("token layout: a page is beyond the KV store")
        fingerprint = self._weights()
        if fingerprint != self._fingerprint:  # weights changed or moved: packed copies and pointers are stale
            self._graphs.clear()
            self._fingerprint = fingerprint
        N, key = tokens_N.shape[0], (bucket(tokens_N.shape[0]), torch.get_num_threads())
        g = self._graphs.get(key)
        fresh = g is None
        if fresh:
            g = self._buffers(key[0])
        elif g.rows_used > N:  # a padding row must not write where a sequence of the last step did
            self._pad(g, N, g.rows_used)
        g.rows_used = N
        g.x_ND[:N].copy_(x_ND)
        g.cos_ND[:N].copy_(cos_ND)
        g.sin_ND[:N].copy_(sin_ND)
        g.seq_N[:N].copy_(layout.seq_N)
        g.pos_N[:N].copy_(layout.pos_N)
        g.table_NJ[:N, : layout.block_table_SJ.shape[1]].copy_(layout.block_table_SJ)
        g.kv_rows_x[: N * Hk].copy_(rows_x)
        if fresh:
            self._capture(g)
            self._graphs[key] = g
            while len(self._graphs) > MAX_GRAPHS:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
            g.graph.run()
            self.num_replays += 1
        for layer, experts_NK, logits_NE in g.moe:  # the step's selection, as an eager forward leaves it
            layer.last_experts, layer.last_router_logits = experts_NK[:N], logits_NE[:N]
        return g.logits_NV[:N]

    def _buffers(self, Nb: int) -> _Captured:
        """A bucket's input buffers, every row padding."""
        c, m = self.model.config, self.model
        Hk = c.num_key_value_heads
        dev = m.device
        g = _Captured(
            None,
            torch.zeros(Nb, c.hidden_size, dtype=m.dtype, device=dev),
            # Dh, or 2 Dh: Gemma 3's [global | local] tables
            torch.empty(Nb, m.rope_cos.shape[1], dtype=m.rope_cos.dtype, device=dev),
            torch.empty(Nb, m.rope_sin.shape[1], dtype=m.rope_sin.dtype, device=dev),
            torch.arange(Nb, device=dev),
            torch.empty(Nb, dtype=torch.int64, device=dev),
            torch.empty(Nb, self.max_blocks, dtype=torch.int64, device=dev),
            torch.empty(Nb * Hk, dtype=torch.int64, device=dev),
            None,
            [],
            [],
        )
        self._pad(g, 0, Nb)
        return g

    def _pad(self, g: _Captured, start: int, end: int) -> None:
        """Makes rows start..end padding: token 0 at position 0 of a sequence of its own, whose one page is
        the scratch page (the row's sequence index is its own, as in every decode step)."""
        m, (_, Hk, B, _) = self.model, self.kv[0][0].shape
        g.x_ND[start:end] = 0.0
        g.cos_ND[start:end], g.sin_ND[start:end] = m.rope_cos[0], m.rope_sin[0]
        g.pos_N[start:end] = 0
        g.table_NJ[start:end] = -1
        g.table_NJ[start:end, 0] = self.scratch_page
        rows_x = ((self.scratch_page * Hk + torch.arange(Hk, device=m.device)) * B).repeat(end - start)
        g.kv_rows_x[start * Hk : end * Hk] = rows_x

    def _capture(self, g: _Captured) -> None:
        """Records the step on g's buffers; g's logits hold its result after."""
        m = self.model
        P, Hk, B, _ = self.kv[0][0].shape
        # validated by `logits` (the step's rows) and built so (the padding rows)
        layout = TokenLayout(g.seq_N, g.pos_N, g.table_NJ, _kv_rows={(Hk, B): (g.kv_rows_x, P * Hk * B - 1)})
        plan = self._plan(g, layout)
        g.graph, g.logits_NV, g.kept = self._record(
            lambda: m.logits(m.run_layers(g.x_ND, g.cos_ND, g.sin_ND, layout, plan, self.kv))
        )
        g.kept += [layout, plan]
        g.moe = [(layer, layer.last_experts, layer.last_router_logits) for layer in moe_layers(m)]
        self.num_captures += 1

    def _plan(self, g: _Captured, layout: TokenLayout):
        """The attention plan of g's buffers, valid for every replay (pages up to the store's last)."""
        return ExactPlan(layout, self.kv[0][0].shape[2], self.kv[0][0].shape[0] - 1)

    def _record(self, step) -> tuple:
        """(a graph whose `run()` repeats `step`, the step's output, what the graph points at): `step` runs
        eagerly while its kernel calls are noted."""
        calls: list = []
        with recording(calls), _NativeOnly() as mode:
            out = step()
        return Graph(calls), out, mode.kept


class _NativeOnly(TorchFunctionMode):
    """While a step is recorded: torch ops may make views and allocations, which a replay need not repeat
    (the tensors are kept, so the recorded pointers stay valid); an add (a residual or a bias) runs as the
    native add and a product with a number as the native scale, which the recording notes; any other op
    raises."""

    def __init__(self):
        super().__init__()
        self.kept: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", repr(func))
        if name in ("add", "__add__") and not kwargs and _native_add(*args):
            out = native.add(*args)
            self.kept.append(out)
            return out
        if name in ("mul", "__mul__") and not kwargs and _native_scale(*args):
            out = native.scale(*args)
            self.kept.append(out)
            return out
        if (
            name in _READS
            or (name.endswith("_") and not name.endswith("__"))
            or name.startswith("__i")
            or "out" in kwargs
        ):
            raise GraphCaptureError(
                f"a decode graph cannot record {name!r}: the forward must make only kernel "
                f"calls, views and allocations (Engine(decode_graphs=False) runs it eagerly)"
            )
        out = func(*args, **kwargs)
        made = _tensors(out)
        if made and name not in _ALLOCATES:
            inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
            if any(t.untyped_storage().data_ptr() not in inputs for t in made):
                raise GraphCaptureError(
                    f"a decode graph cannot record torch's {name!r}, which computes: the "
                    f"forward must make only kernel calls, views and allocations "
                    f"(Engine(decode_graphs=False) runs it eagerly)"
                )
        self.kept += made
        return out


def _native_add(*args) -> bool:
    """Whether `native.add` computes a + b: fp32, contiguous, b of a's shape or of its last dimensions (a bias)."""
    if len(args) != 2 or not all(
        isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.is_contiguous() for t in args
    ):
        return False
    a, b = args
    return b.dim() <= a.dim() and a.shape[a.dim() - b.dim() :] == b.shape


def _native_scale(*args) -> bool:
    """Whether `native.scale` computes a * b: a contiguous fp32 tensor times a Python number (LoRA's α/r)."""
    return (
        len(args) == 2
        and isinstance(args[0], torch.Tensor)
        and args[0].dtype == torch.float32
        and args[0].is_contiguous()
        and type(args[1]) in (float, int)
    )


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []
