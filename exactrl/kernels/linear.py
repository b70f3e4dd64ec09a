"""Linear layers: `exact_linear` gives every output row the same bits whatever the number of rows, the
row's neighbours and the thread count; `fast_linear` is plain `F.linear`.

The problem: on CPU, `x[:M] @ W` picks a different GEMM kernel (and so a
different reduction order over K) depending on M: with torch 2.13, in fp32,
the first row of the product changes its last bits between M <= 3 and
M >= 4. The exact linear fixes the order in one of two ways, chosen by dtype
alone (so a row of a given weight always takes the same one):

fp32: the native linear (`native/gemm.c`). Every output is summed in an order
fixed by K alone (an fma chain over each block of 256 k's, the blocks' sums
added in order), in a register-blocked C kernel over a packed copy of the
weight. No tiles, no padding, nothing to check at run time; its AVX-512, AVX2
and plain-C builds give the same bits. Having no per-tile calls and no
padding rows, it is also faster than fp32 tiles at decode sizes
(docs/performance.md, "Kernel measurements", has its speeds).

bf16 (and any mixed dtypes): row tiles. The rows are padded to a multiple of
a fixed tile `ROW_TILE` and every tile is computed with a GEMM of ONE fixed
shape (ROW_TILE x K times K x N). Every output element is then produced by
the same small GEMM whatever the number of rows, the row's neighbours, or its
place in the tile; the tests sweep these (also at 1 and 2 threads). Two other
shapes are used only where the running process checked that they give a
tile's bits: fewer rows for a short call (`short_rows`) and BIG_TILE rows for
a long one on the oneDNN path (`big_tile_ok`). A native bf16 kernel could do
without tiles too; bf16 keeps oneDNN because on CPUs with AMX its bf16
products run faster than the native fp32 kernel.

Two implementations of the tile rule, chosen per weight by its shape and dtype alone:

- oneDNN, for bf16 weights of at least ONEDNN_MIN_WEIGHT_BF16 elements
  (where torch's oneDNN has bf16: AVX512 or AVX-NE-CONVERT): the weight is
  re-laid out into oneDNN's blocked format for 32-row products
  (`mkldnn._reorder_linear_weight`) and each 32-row tile is one
  `mkldnn._linear_pointwise` call (or each run of BIG_TILE rows, below).
  oneDNN accumulates in fp32 and rounds once. Its cost is one call per tile;
  the other path upcasts the weight at every call, which for such weights
  costs more, at one tile and at thousands of rows alike.
- otherwise: ONE batched matmul over `(n_tiles, ROW_TILE, K)` with the weight
  broadcast along the batch (stride 0), in fp32 (bf16 operands upcast
  exactly, product rounded to bf16 once). A weight with more than SPLIT_ABOVE
  output features (the vocabulary projection) is multiplied in blocks of
  COL_BLOCK columns, so a block stays in cache while the tiles pass; the
  split is decided by the weight's shape alone, so it is the same for every
  call.

Packed weights (native and oneDNN alike) cost a copy of the weight, so they
are made per call unless a `PackedWeights` cache is active (`using_packed`):
the engine keeps one for its weights, which change only through
`Engine.update_weights`, and clears it there. A cache could not know of every
change by itself (writes through `.data` or a fused optimizer leave the
version counter alone), so no cache outlives its owner's knowledge.

Tile size: 32 rows. Smaller tiles make more, smaller products, which cost
more at training sizes; a decode batch of 32 is one tile.

Fewer rows than a tile (a decode step of fewer than 32 sequences, a short
prompt): padding them to 32 computes up to 32x the rows wanted. Such a call is
padded only to the fewest rows r whose product gives bitwise the rows a whole
tile gives (`short_rows`). Which r do depends on the GEMM and the machine, so
it is checked in the running process, once per weight shape, dtype and thread
count, on random operands (`_rows_like_tile`); an engine runs the checks when
it is created (`Kernels.prepare`), anything else at its first short call.

Many rows on the oneDNN path (a trainer batch, a long prefill): one call per
32-row tile pays oneDNN's per-call cost for every tile, which dominates at
many rows. So whole runs of BIG_TILE rows go through one product of the fixed
shape BIG_TILE x K, the rest through tiles, when that product gives bitwise
the rows its tiles give, for this weight shape, dtype and thread count. That
is checked in the running process once per key, like `short_rows`
(`_big_tile_like_tiles`); when it fails every row stays in tiles. It is not
a given: oneDNN may pick another kernel for BIG_TILE rows than for 32, and
for some bf16 weight shapes on some CPUs it does; those weights stay in tiles.

Backward: only the forward values must be batch-invariant. The gradients use
plain products (a custom autograd function), which avoids materialising the
(n_tiles, K, N) gradient that autograd of the broadcast weight would create:
the input's gradient through the native linear over Wᵀ in fp32 (`input_grad`,
faster than torch's GEMM there) and the weight's too (`weight_grad`).

Legend: M rows, K input features, N output features, P padded rows.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from exactrl.kernels import native

ROW_TILE = 32  # rows per tile; part of the exactness contract — never vary it per call
COL_BLOCK = 512  # output columns per GEMM when a weight has more than SPLIT_ABOVE of them
SPLIT_ABOVE = 4096  # (a rule on the weight's shape only, so it never varies with the rows)
BIG_TILE = 512  # rows of one oneDNN product over many rows, used only where checked equal to its tiles


def pad_rows(x_MK: torch.Tensor, tile: int = ROW_TILE) -> torch.Tensor:
    """Zero-pads the rows of a 2-D tensor up to a (non-zero) multiple of `tile`."""
    m = x_MK.shape[0]
    p = max(-(-m // tile), 1) * tile
    if p == m:
        return x_MK
    return F.pad(x_MK, (0, 0, 0, p - m))


USE_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
# oneDNN's bf16 linear needs AVX512 (bw, vl, dq) or AVX-NE-CONVERT; where it is missing, packing a bf16 weight
# raises, so bf16 weights take the batched-matmul path there. A property of the machine, fixed for the
# process: a weight's path still depends on nothing but its shape and dtype.
ONEDNN_DTYPES = (torch.bfloat16,) if USE_ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported() else ()
ONEDNN_MIN_WEIGHT_BF16 = 1 << 14  # elements (K x N) of a bf16 weight that uses oneDNN; a rule on the shape only


class PackedWeights:
    """Packed copies of weights (`_pack`), for an owner that knows when its weights change and clears it then.

    Entries are keyed by the weight tensor, or by the weights of a stack (`get_stack`), and checked
    against each one's storage, shape, strides, dtype and version counter as a second guard; they go when
    a weight goes.
    """

    def __init__(self):
        self._packed: dict[tuple, tuple] = {}  # ids of the weights -> (weakrefs to them, fingerprints, packed copy)

    def get(self, w_NK: torch.Tensor) -> torch.Tensor | native.PackedLinearWeight:
        return self._get((w_NK,), _pack)

    def get_stack(self, ws: Sequence[torch.Tensor]) -> native.PackedLinearWeight:
        """fp32 weights of one input (a layer's q/k/v projections) packed one after another, for `native.linears`."""
        return self._get(tuple(ws), native.PackedLinearWeight)

    def _get(self, ws: tuple, pack):
        try:
            versions = [w._version for w in ws]
        except RuntimeError:  # an inference-mode tensor has no version counter: not cached
            return pack(ws[0] if len(ws) == 1 else ws)
        fingerprint = _fingerprint(ws, versions)
        key = tuple(id(w) for w in ws)
        entry = self._packed.get(key)
        if entry is None or any(r() is not w for r, w in zip(entry[0], ws)) or entry[1] != fingerprint:
            packed = self._packed
            refs = tuple(weakref.ref(w, lambda _, k=key: packed.pop(k, None)) for w in ws)  # forgotten with a weight
            entry = (refs, fingerprint, pack(ws[0] if len(ws) == 1 else ws))
            packed[key] = entry
        return entry[2]

    def clear(self) -> None:
        self._packed.clear()

    def refresh(self, written: Sequence[torch.Tensor] | None = None) -> None:
        """Packs every entry again from its weights' values now: the fp32 panels in place (so a decode graph
        that points at them stays valid); other entries, and those whose weights are gone or reshaped, go.
        `written`: only the entries of these weights (the others' weights did not change); None: every one."""
        ids = None if written is None else {id(w) for w in written}
        for key, (refs, _, packed) in list(self._packed.items()):
            if ids is not None and ids.isdisjoint(key):
                continue
            ws = tuple(r() for r in refs)
            if (
                isinstance(packed, native.PackedLinearWeight)
                and all(w is not None for w in ws)
                and all(w.dtype == torch.float32 for w in ws)
                and tuple(w.shape for w in ws) == tuple((n, packed.K) for n in packed.Ns)
            ):
                packed.repack(ws)
                self._packed[key] = (refs, _fingerprint(ws, [w._version for w in ws]), packed)
            else:
                del self._packed[key]


def _fingerprint(ws, versions) -> list[tuple]:
    return [(w.data_ptr(), w.shape, w.stride(), w.dtype, v) for w, v in zip(ws, versions)]


_active = threading.local()  # the cache `using_packed` made active on this thread, if any


@contextlib.contextmanager
def using_packed(cache: PackedWeights):
    """Within the block, this thread's exact linears take packed weights from `cache`."""
    previous = getattr(_active, "cache", None)
    _active.cache = cache
    try:
        yield cache
    finally:
        _active.cache = previous


def _pack(w_NK: torch.Tensor) -> torch.Tensor | native.PackedLinearWeight:
    if w_NK.dtype == torch.float32:  # the native fp32 linear's panels (`_uses_native`)
        return native.PackedLinearWeight(w_NK)
    return torch.ops.mkldnn._reorder_linear_weight(w_NK.detach(), ROW_TILE)


def _onednn_product(x_rK: torch.Tensor, w_packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x_rK, w_packed, None, "none", [], "")


def _bmm_product(x_tTK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """ONE batched matmul over (tiles, rows, K), the weight broadcast along the batch, in fp32: [t, rows, N]."""
    n_tiles, rows, k = x_tTK.shape
    n = w_NK.shape[0]
    if n == 1:  # a one-column product is a matrix-vector one, whose kernel changes with the rows: pad to 2
        return _bmm_product(x_tTK, F.pad(w_NK, (0, 0, 0, 1)))[:, :, :1]
    w_KN = w_NK.float().t()
    if n <= SPLIT_ABOVE:
        return torch.bmm(x_tTK, w_KN.unsqueeze(0).expand(n_tiles, k, n))
    y_tTN = torch.empty(n_tiles, rows, n)  # column blocks: a block of the weight stays in cache while tiles pass
    for c in range(0, n, COL_BLOCK):
        w_Kc = w_KN[:, c : c + COL_BLOCK]
        y_tTN[:, :, c : c + COL_BLOCK] = torch.bmm(x_tTK, w_Kc.unsqueeze(0).expand(n_tiles, k, w_Kc.shape[1]))
    return y_tTN


def _uses_native(x_MK: torch.Tensor, w_NK: torch.Tensor) -> bool:
    return x_MK.dtype == w_NK.dtype == torch.float32


def _uses_onednn(x_MK: torch.Tensor, w_NK: torch.Tensor) -> bool:
    return w_NK.numel() >= ONEDNN_MIN_WEIGHT_BF16 and x_MK.dtype == w_NK.dtype and w_NK.dtype in ONEDNN_DTYPES


_SHORT_OK: dict[tuple, list[bool]] = {}  # (path, weight shape, dtype, threads) -> ok[r], r = 0..ROW_TILE
SHORT_CHECK_DRAWS = 2  # random tiles per check: 2 x 32 rows x N outputs compared for r = 1


def short_rows(onednn: bool, w_NK: torch.Tensor, m: int) -> int:
    """Rows to pad a call of m < ROW_TILE rows to: the fewest r >= m whose product gives bitwise the rows
    of a whole tile's, for this weight shape, dtype and thread count (ROW_TILE when none does).

    Which r do is checked once per key in this process (`_rows_like_tile`), never assumed: it depends on the
    GEMM (oneDNN or the batched matmul), the weight's shape and the CPU.
    """
    key = (onednn, tuple(w_NK.shape), w_NK.dtype, torch.get_num_threads())
    ok = _SHORT_OK.get(key)
    if ok is None:
        ok = _SHORT_OK[key] = _rows_like_tile(onednn, w_NK.shape[0], w_NK.shape[1], w_NK.dtype)
    return next(r for r in range(m, ROW_TILE + 1) if ok[r])


def check_short_rows(w_NK: torch.Tensor) -> None:
    """Runs `short_rows`' check for this weight (in its own dtype) now rather than at the first short call
    (nothing to check for an fp32 weight: the native linear has no tiles)."""
    if not _uses_native(w_NK, w_NK):
        short_rows(_uses_onednn(w_NK, w_NK), w_NK, 1)


def _rows_like_tile(onednn: bool, n: int, k: int, dtype: torch.dtype) -> list[bool]:
    """ok[r]: every r-row product equals the rows it computes inside a whole tile, on random operands.

    The GEMM's reduction order depends on the shapes and the machine, never on the values, so a product
    that reduces in another order shows it in the fp32 outputs of random operands. Every window of r rows
    of SHORT_CHECK_DRAWS random tiles is compared, each row with all N outputs of a random weight.
    """
    g = torch.Generator().manual_seed(0)  # its own stream: the global RNG (a run's state) is left alone
    w = _probe_operands(n, k, dtype, g)
    packed = _pack(w) if onednn else None

    def product(x_rK):
        return _onednn_product(x_rK, packed) if onednn else _bmm_product(x_rK.float()[None], w)[0]

    ok = [False] + [True] * ROW_TILE
    for _ in range(SHORT_CHECK_DRAWS):
        x = _probe_operands(ROW_TILE, k, dtype, g, row_signs=True)
        tile = product(x)
        for r in range(1, ROW_TILE):
            ok[r] = ok[r] and all(
                torch.equal(product(x[i : i + r].contiguous()), tile[i : i + r]) for i in range(0, ROW_TILE - r + 1, r)
            )
    return ok


_BIG_OK: dict[tuple, bool] = {}  # (weight shape, dtype, threads) -> BIG_TILE-row products give the tiles' bits


def big_tile_ok(w_NK: torch.Tensor) -> bool:
    """True when one oneDNN product of BIG_TILE rows gives bitwise the rows of its 32-row tiles, for this
    weight shape, dtype and thread count (checked once per key in this process: `_big_tile_like_tiles`)."""
    key = (tuple(w_NK.shape), w_NK.dtype, torch.get_num_threads())
    ok = _BIG_OK.get(key)
    if ok is None:
        ok = _BIG_OK[key] = _big_tile_like_tiles(w_NK.shape[0], w_NK.shape[1], w_NK.dtype)
    return ok


def _big_tile_like_tiles(n: int, k: int, dtype: torch.dtype) -> bool:
    """A BIG_TILE-row oneDNN product equals its tiles' on SHORT_CHECK_DRAWS random operands (every
    output of every row; in bf16 the rounding-midpoint operands of `_probe_operands`)."""
    g = torch.Generator().manual_seed(1)
    packed = _pack(_probe_operands(n, k, dtype, g))
    for _ in range(SHORT_CHECK_DRAWS):
        x = torch.cat([_probe_operands(ROW_TILE, k, dtype, g, row_signs=True) for _ in range(BIG_TILE // ROW_TILE)])
        tiles = torch.cat([_onednn_product(x[i : i + ROW_TILE], packed) for i in range(0, BIG_TILE, ROW_TILE)])
        if not torch.equal(_onednn_product(x, packed), tiles):
            return False
    return True


def _probe_operands(rows: int, k: int, dtype: torch.dtype, g: torch.Generator, row_signs: bool = False):
    """Random operands for `_rows_like_tile` and `_big_tile_like_tiles`; in bf16, built so that rounding
    cannot hide an order change.

    A bf16 output keeps 8 bits of an fp32 sum, so another summation order (which moves the last
    bits of the sum) would rarely show. Here every row's exact dot product is 1 + 2^-8, the midpoint
    of two bf16 neighbours: column 0 gives 1, column 1 gives 2^-8, and the other columns cancel
    exactly in pairs half a row apart (weight columns equal, activation columns negated; products
    of bf16 numbers are exact in fp32). Their fp32 rounding errors are what is left, and the order
    decides their sign, hence which neighbour the output rounds to. So a product that sums K in another
    order changes a large share of its outputs on these operands, where on plain random ones it would
    change almost none.
    """
    t = torch.randn(rows, k, generator=g) * 2.0**-6
    if dtype == torch.bfloat16 and k >= 4:
        h = (k - 2) // 2
        t[:, 2 + h : 2 + 2 * h] = -t[:, 2 : 2 + h] if row_signs else t[:, 2 : 2 + h]
        t[:, 2 + 2 * h :] = 0.0
        t[:, 0], t[:, 1] = 1.0, (1.0 if row_signs else 2.0**-8)
    return t.to(dtype)


def _packed(w_NK: torch.Tensor) -> torch.Tensor | native.PackedLinearWeight:
    """The weight's packed copy: from the cache `using_packed` made active, else packed now."""
    cache = getattr(_active, "cache", None)
    return cache.get(w_NK) if cache is not None else _pack(w_NK)


def fuses_linears(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]) -> bool:
    """Whether `exact_linears` can take these: 2-D fp32 input and weights, no biases, no autograd, and a packed
    cache active (outside one, each call would pack the weights again: nothing to gain)."""
    return (
        x.dim() == 2
        and x.dtype == torch.float32
        and all(w.dtype == torch.float32 for w in weights)
        and all(b is None for b in biases)
        and not torch.is_grad_enabled()
        and getattr(_active, "cache", None) is not None
    )


def exact_linears(x_MK: torch.Tensor, weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """[x W_s^T for each weight] in one native call (`fuses_linears` must hold): each the same bits as
    `exact_linear(x, W_s)`. A layer's q/k/v and gate/up projections: fewer, wider products, each reading x
    once."""
    return native.linears(x_MK, _active.cache.get_stack(weights))


def exact_experts(
    x_ND: torch.Tensor,
    z_NE: torch.Tensor,
    experts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    k: int,
    normalise: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A mixture-of-experts layer's routed experts in one native call (`native.moe`; `fuses_linears` must hold
    for x and every weight): `experts` the (gate, up, down) weights of each expert, packed from the active
    cache. Returns (out, selected experts [N, k], their weights [N, k])."""
    cache = _active.cache
    gate_up = [cache.get_stack((g, u)) for g, u, _ in experts]
    down = [cache.get(d) for _, _, d in experts]
    return native.moe(x_ND, z_NE, gate_up, down, k, normalise)


def _exact_matmul(x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    m, k = x_MK.shape
    if _uses_native(x_MK, w_NK):  # fp32: no tiles, the order is fixed by K alone (native/gemm.c)
        return native.linear(x_MK, _packed(w_NK))
    onednn = _uses_onednn(x_MK, w_NK)
    # fewer rows than a tile (a decode step of few sequences): padded only as far as gives the tile's bits
    rows = short_rows(onednn, w_NK, m) if 0 < m < ROW_TILE else ROW_TILE
    if onednn:
        w = _packed(w_NK)
        x_PK = pad_rows(x_MK.contiguous(), rows)
        if x_PK.shape[0] <= ROW_TILE:  # one product
            return _onednn_product(x_PK, w)[:m]
        p = x_PK.shape[0]
        y_PN = torch.empty(p, w_NK.shape[0], dtype=w_NK.dtype)
        big = (p // BIG_TILE) * BIG_TILE if p >= BIG_TILE and big_tile_ok(w_NK) else 0
        for i in range(0, big, BIG_TILE):  # runs of BIG_TILE rows: checked to give their tiles' bits
            y_PN[i : i + BIG_TILE] = _onednn_product(x_PK[i : i + BIG_TILE], w)
        for i in range(big, p, ROW_TILE):  # one oneDNN product of the fixed shape per tile
            y_PN[i : i + ROW_TILE] = _onednn_product(x_PK[i : i + ROW_TILE], w)
        return y_PN[:m]
    y_tTN = _bmm_product(pad_rows(x_MK.float(), rows).view(-1, rows, k), w_NK)
    return y_tTN.reshape(-1, w_NK.shape[0])[:m].to(x_MK.dtype)


class _ExactLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_NK):  # type: ignore[override]
        ctx.save_for_backward(x_MK, w_NK)
        return _exact_matmul(x_MK, w_NK)

    @staticmethod
    def backward(ctx, g_MN):  # type: ignore[override]
        x_MK, w_NK = ctx.saved_tensors
        gx = input_grad(g_MN, w_NK) if ctx.needs_input_grad[0] else None
        gw = weight_grad(g_MN, x_MK) if ctx.needs_input_grad[1] else None
        return gx, gw


def weight_grad(g_MN: torch.Tensor, x_MK: torch.Tensor) -> torch.Tensor:
    """∂L/∂W = gᵀ x for y = x Wᵀ: [N, K], a sum over the M rows. In fp32 the native linear, with the
    narrower of g and x transposed into rows (a copy of M x min(N, K)) and the wider packed straight from
    its rows (`native.packed_transpose`):

        N <= K:  gᵀ · (xᵀ)ᵀ                 N > K:  (xᵀ · (gᵀ)ᵀ)ᵀ

    The wider operand is packed from its rows rather than from a transposed copy, which would cost more
    than it saves. With the copy and the packing, this runs faster than torch's GEMM on the trainer's
    shapes (many rows, narrow layers). Other dtypes: a plain matmul."""
    if not _uses_native(g_MN, x_MK):
        return g_MN.t() @ x_MK
    (m, n), k = g_MN.shape, x_MK.shape[1]
    if m == 0:
        return g_MN.new_zeros(n, k)
    if n <= k:
        return native.linear(g_MN.t().contiguous(), native.packed_transpose(x_MK))
    return native.linear(x_MK.t().contiguous(), native.packed_transpose(g_MN)).t()


def input_grad(g_MN: torch.Tensor, w_NK: torch.Tensor | native.PackedLinearWeight) -> torch.Tensor:
    """∂L/∂x = g W for y = x Wᵀ. In fp32 the native linear over Wᵀ's panels (`w_NK` may be them already,
    packed once for many calls): gemm.c reads W once per 32-row panel, where torch's GEMM runs these
    products (many rows, K the layer's small output width) well below its peak on some CPUs. The bits do
    not depend on the thread count either. Other dtypes: a plain matmul."""
    if isinstance(w_NK, native.PackedLinearWeight):
        return native.linear(g_MN, w_NK)
    if not _uses_native(g_MN, w_NK):
        return g_MN @ w_NK
    return native.linear(g_MN, transposed_panels(w_NK))


def transposed_panels(w_NK: torch.Tensor) -> native.PackedLinearWeight:
    """Wᵀ packed for the native linear: `input_grad`'s weight, g W = g (Wᵀ)ᵀ."""
    return native.PackedLinearWeight(w_NK.detach().t().contiguous())


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b with a batch-invariant matmul: native in fp32, row tiles otherwise (module docstring)."""
    if x.dim() == 2 and bias is None and not torch.is_grad_enabled() and _uses_native(x, weight):
        return native.linear(x, _packed(weight))  # the engine's calls: none of the reshapes and checks below
    lead = x.shape[:-1]
    x_MK = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        y = _ExactLinear.apply(x_MK, weight)
    else:  # inference (the engine): no autograd node to build
        y = _exact_matmul(x_MK, weight)
    if bias is not None:
        y = y + bias  # elementwise: invariant by construction
    return y.view(*lead, weight.shape[0])


def fast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain `F.linear`: the kernel torch picks depends on the number of rows."""
    return F.linear(x, weight, bias)
