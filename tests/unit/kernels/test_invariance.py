"""Bitwise invariance of the exact kernels (docs/design.md §4) and the fast-mode inverse twins.

Every exact-mode property here has a twin asserting that the `fast` kernels
produce a difference in the same scenario — proof that the comparison can fail.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_hf_model, random_sequences
from fuzzing import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import exactrl
from exactrl.debug.parity import full_path, incremental_path, run_parity
from exactrl.kernels import linear as linear_mod
from exactrl.kernels.linear import exact_linear, fast_linear

HSET = settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def models(qwen3_dir):
    return {
        (k, d): exactrl.load_model(qwen3_dir, dtype=d, kernels=k)
        for k in ("exact", "fast")
        for d in ("float32", "bfloat16")
    }


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """Wider model: bf16 SDPA only shows its split-dependent rounding on longer sequences."""
    d = tmp_path_factory.mktemp("wide")
    make_hf_model(d, "qwen3", hidden_size=256, intermediate_size=512, head_dim=64, num_hidden_layers=1)
    return d


# ---------------------------------------------------------------- kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# fp32: the native linear (K = 2048: eight sum blocks; N = 33, 4700: a partial last panel).
# bf16, batched-matmul path: (64, 96), (256, 768), (100, 33), (48, 4700) (column blocks, ragged last);
# oneDNN path (K x N >= ONEDNN_MIN_WEIGHT_BF16): the others (a one-row product of some shapes takes another
# kernel than a tile: `short_rows` pads it)
@pytest.mark.parametrize(
    "K,N", [(64, 96), (256, 768), (100, 33), (48, 4700), (96, 4700), (512, 768), (2048, 768), (64, 1), (7, 2)]
)  # 1 output: a matrix-vector product (a value head)
def test_exact_linear_row_invariant(dtype, K, N):
    g = torch.Generator().manual_seed(K)
    W, X = torch.randn(N, K, generator=g).to(dtype), torch.randn(300, K, generator=g).to(dtype)
    ref = exact_linear(X[:1], W)[0]
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for M in list(range(1, 40)) + [63, 64, 65, 95, 96, 97, 128, 193, 299]:
            assert torch.equal(exact_linear(X[:M], W)[0], ref), (M, threads)
        for p in (1, 5, 15, 16, 17, 40, 95, 96, 100, 200):  # the same row elsewhere in a tile or row block
            assert torch.equal(exact_linear(torch.cat([X[1 : 1 + p], X[:1]]), W)[p], ref)


# (13, 40, 600): a partial panel of columns, three blocks of k's (the last partial); (100, 40, 1024): K a
# multiple of 512, so gemm.c reads x from a copy with padded rows, in two chunks of rows (MC = 96)
@pytest.mark.parametrize("M,N,K", [(13, 40, 600), (100, 40, 1024)])
def test_native_linear_sums_in_the_documented_order(M, N, K):
    """gemm.c's contract: each output is an fma chain over each block of KC = 256 k's from 0, the blocks'
    sums added in order. Emulated here in float64, rounded to fp32 after every step (exact for the
    products; a double rounding of the sum could differ in ~2^-29 of steps, and these fixed operands
    have none)."""
    from exactrl.kernels import native

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    want = None
    for k0 in range(0, K, 256):
        s = torch.zeros(M, N)
        for k in range(k0, min(k0 + 256, K)):
            s = (x[:, k, None].double() * w[None, :, k].double() + s.double()).float()
        want = s if want is None else (want.double() + s.double()).float()
    got = native.linear(x, native.PackedLinearWeight(w))
    assert torch.equal(got, want)
    plain = torch.zeros(M, N)  # one chain over all of K: another order, which must show
    for k in range(K):
        plain = (x[:, k, None].double() * w[None, :, k].double() + plain.double()).float()
    assert not torch.equal(got, plain)


@pytest.mark.parametrize("build", ["avx2", "portable"])
@pytest.mark.parametrize(
    "M,N,K", [(1, 384, 384), (37, 100, 1030), (130, 640, 256), (5, 3, 7), (100, 40, 1024)]
)  # K % 512 == 0: x read from a padded copy
def test_native_linear_other_builds_give_this_machines_bits(build, M, N, K):
    """An AVX2-only CPU runs gemm.c's AVX2 micro-kernel (6 x 16), one without AVX2 its plain-C build:
    the same sums, so the same bits as this machine's own build."""
    from exactrl.kernels import native

    own = native.library().exactrl_gemm_build()
    if (
        own == build.encode()
        or own == b"portable"
        or (build == "avx2" and native.library("avx2").exactrl_gemm_build() != b"avx2")
    ):
        pytest.skip(f"this CPU cannot run both builds ({own.decode()} here): one build against itself could not fail")
    g = torch.Generator().manual_seed(M + N)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    assert torch.equal(
        native.linear(x, native.PackedLinearWeight(w)), native.linear(x, native.PackedLinearWeight(w, build))
    )


def test_native_linear_columns_do_not_depend_on_the_other_columns():
    """A column's bits are the same whatever the weight's other rows (the engine could stack q, k, v) and
    whichever panel, full or partial, it falls in."""
    from exactrl.kernels import native

    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(50, 300, generator=g), torch.randn(200, 300, generator=g)
    y = native.linear(x, native.PackedLinearWeight(w))
    for a, b in ((0, 1), (0, 17), (5, 37), (31, 64), (100, 200)):
        assert torch.equal(native.linear(x, native.PackedLinearWeight(w[a:b].contiguous())), y[:, a:b]), (a, b)


@pytest.mark.parametrize("build", ["", "avx2", "portable"])
def test_native_linears_give_each_weights_bits_in_one_call(build):
    """One call for several weights of one input (the engine's q/k/v and gate/up): each output equals its
    weight's own product, whatever the rows (the prefetching block counts included), partial panels and
    empty weights; on every build."""
    from exactrl.kernels import native

    if build and build.encode() == native.library().exactrl_gemm_build():
        pytest.skip("this machine's own build is the default one")
    g = torch.Generator().manual_seed(6)
    for Ns, K in (((384, 128, 128), 384), ((33, 7, 64), 600), ((0, 20), 16), ((5,), 7)):
        ws = [torch.randn(n, K, generator=g) for n in Ns]
        packed = native.PackedLinearWeight(ws, build)
        for M in (1, 13, 32, 37, 96, 97, 200):
            x = torch.randn(M, K, generator=g)
            ys = native.linears(x, packed)
            assert [tuple(y.shape) for y in ys] == [(M, n) for n in Ns]
            for y, w in zip(ys, ws):
                assert torch.equal(y, native.linear(x, native.PackedLinearWeight(w))), (Ns, M)


def test_fused_projections_only_where_the_packed_cache_is_and_follow_changes():
    """`Kernels.linears` fuses only without autograd and inside `using_packed` (else a module call each, so
    gradients and forward hooks see every projection); its stacked copy follows in-place weight changes."""
    from exactrl.kernels import get_kernels

    kern, g = get_kernels("exact"), torch.Generator().manual_seed(7)
    ws = [torch.nn.Parameter(torch.randn(n, 64, generator=g)) for n in (96, 32, 32)]
    x, none = torch.randn(5, 64, generator=g), [None] * 3
    assert not kern.fuses_linears(x, ws, none)  # no cache active
    cache = linear_mod.PackedWeights()
    with linear_mod.using_packed(cache):
        assert not kern.fuses_linears(x, ws, none)  # autograd on
        with torch.no_grad():
            assert kern.fuses_linears(x, ws, none) and not get_kernels("fast").fuses_linears(x, ws, none)
            assert not kern.fuses_linears(x, ws, [None, torch.zeros(32), None])  # a bias
            assert not kern.fuses_linears(x.to(torch.bfloat16), ws, none)
            before = kern.linears(x, ws)
            assert all(torch.equal(y, exact_linear(x, w)) for y, w in zip(before, ws))
            ws[1].add_(0.5)  # the version counter moves: packed again
            after = kern.linears(x, ws)
            assert torch.equal(after[1], exact_linear(x, ws[1].detach().clone())) and not torch.equal(
                after[1], before[1]
            )
            assert torch.equal(after[0], before[0])


def test_native_kernels_compute_in_the_callers_denormal_mode():
    """Flush-to-zero is a per-thread setting; with it set on the calling thread only, subnormal results must
    still come out the same in the columns the main thread computes and those another thread computes."""
    from exactrl.kernels import native

    if torch.get_num_threads() < 2 or not torch.set_flush_denormal(True):
        pytest.skip("needs 2 threads and a CPU whose flush-to-zero torch can set")
    try:
        w = torch.full((64, 16), 2.0**-70)
        x = torch.full((64, 16), 2.0**-70)  # each product 2^-140: subnormal in fp32
        y = native.linear(x, native.PackedLinearWeight(torch.cat([w, w])))  # 4 panels: 2 per thread
        assert torch.equal(y[:, :64], y[:, 64:])
        assert bool((y == 0).all())  # flushed, as the caller asked, in every thread
    finally:
        torch.set_flush_denormal(False)
    y = native.linear(x, native.PackedLinearWeight(torch.cat([w, w])))
    assert bool((y > 0).all())  # and kept once the caller no longer flushes


def test_short_row_check_catches_a_product_that_reduces_in_another_order(monkeypatch):
    """Twin of the sweep above for `short_rows`: a short product that sums K in two parts (another order,
    rounded to the output dtype as the real one is) is caught for every r, so it is padded to a tile."""

    def split_k(x_rK, w_NK):  # stands in for a kernel that takes another path for short calls
        x, w = x_rK.float(), w_NK.float()
        if x.shape[0] == linear_mod.ROW_TILE:
            return (x @ w.t()).to(x_rK.dtype)
        h = x.shape[1] // 3
        return (x[:, :h] @ w[:, :h].t() + x[:, h:] @ w[:, h:].t()).to(x_rK.dtype)

    monkeypatch.setattr(linear_mod, "_pack", lambda w: w)
    monkeypatch.setattr(linear_mod, "_onednn_product", split_k)
    ok = linear_mod._rows_like_tile(True, 96, 256, torch.bfloat16)
    assert ok[linear_mod.ROW_TILE] and not any(ok[1 : linear_mod.ROW_TILE])
    monkeypatch.setattr(linear_mod, "_SHORT_OK", {})
    w = torch.randn(96, 256).to(torch.bfloat16)
    assert linear_mod.short_rows(True, w, 1) == linear_mod.ROW_TILE


@pytest.mark.parametrize("K,N", [(512, 768), (384, 1024), (768, 2048), (384, 8192)])
def test_exact_linear_row_invariant_over_big_tiles(K, N):
    """Calls of many rows on the oneDNN path (bf16) run whole BIG_TILE-row products where checked equal to
    their tiles: a row gives the bits of a one-tile call in runs of big tiles, tiles, or both, and anywhere
    in them."""
    dtype = torch.bfloat16
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(K)).to(dtype)
    if not linear_mod._uses_onednn(w, w):
        pytest.skip(f"{dtype} {N}x{K} takes the batched-matmul path here (one call whatever the rows)")
    if not linear_mod.big_tile_ok(w):
        pytest.skip(
            f"this CPU's oneDNN {dtype} {linear_mod.BIG_TILE}-row product of {N}x{K} differs from its "
            f"tiles: kept in tiles"
        )
    B = linear_mod.BIG_TILE
    X = torch.randn(3 * B, K, generator=torch.Generator().manual_seed(N)).to(dtype)
    with torch.no_grad():
        ref = torch.cat([exact_linear(X[i : i + linear_mod.ROW_TILE], w) for i in range(0, 3 * B, linear_mod.ROW_TILE)])
        for M in (B - 1, B, B + 1, B + 40, 2 * B + 13, 3 * B):
            assert torch.equal(exact_linear(X[:M], w), ref[:M]), M
        for p in (1, 31, B - 5):  # the same rows at other places in the big tile
            assert torch.equal(exact_linear(torch.cat([X[-p:], X[:B]]), w)[p:], ref[:B]), p


def test_big_tile_check_catches_a_product_that_reduces_in_another_order(monkeypatch):
    """Twin of the sweep above: a BIG_TILE-row product that sums K in two parts is refused by the check,
    and such a weight's calls stay in tiles, so their rows keep a tile's bits."""

    def split_k(x_rK, w_NK):  # stands in for a kernel that splits K for many rows
        x, w = x_rK.float(), w_NK.float()
        if x.shape[0] <= linear_mod.ROW_TILE:
            return (x @ w.t()).to(x_rK.dtype)
        h = x.shape[1] // 3
        return (x[:, :h] @ w[:, :h].t() + x[:, h:] @ w[:, h:].t()).to(x_rK.dtype)

    monkeypatch.setattr(linear_mod, "_pack", lambda w: w)
    monkeypatch.setattr(linear_mod, "_onednn_product", split_k)
    monkeypatch.setattr(linear_mod, "ONEDNN_DTYPES", (torch.bfloat16,))
    monkeypatch.setattr(linear_mod, "_BIG_OK", {})
    dtype = torch.bfloat16
    monkeypatch.setattr(linear_mod, "_SHORT_OK", {})
    assert not linear_mod._big_tile_like_tiles(768, 512, dtype)
    w = torch.randn(768, 512).to(dtype)
    x = torch.randn(linear_mod.BIG_TILE + 32, 512).to(dtype)
    y = exact_linear(x, w)
    assert not linear_mod.big_tile_ok(w)
    assert torch.equal(y, torch.cat([split_k(x[i : i + 32], w) for i in range(0, x.shape[0], 32)]))
    monkeypatch.setattr(linear_mod, "_BIG_OK", {(tuple(w.shape), dtype, torch.get_num_threads()): True})
    assert not torch.equal(exact_linear(x, w), y)  # forced through the big product, the rows do change


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights_cache_is_used_only_where_activated_and_follows_changes(dtype):
    """Outside `using_packed` every call packs afresh (always current); inside, the cache's owner clears it
    on the changes it makes, and storage, shape, stride, dtype and version changes are caught as well.
    fp32 weights are packed for the native linear, bf16 ones for oneDNN."""
    if dtype == torch.bfloat16 and dtype not in linear_mod.ONEDNN_DTYPES:
        pytest.skip("this CPU has no oneDNN bf16 linear: nothing is packed")
    g = torch.Generator().manual_seed(1)
    N, K = 512, 512  # a weight on the packed path
    w = torch.nn.Parameter(torch.randn(N, K, generator=g).to(dtype))
    x = torch.randn(7, K, generator=g).to(dtype)

    def fresh():  # the same kernel on a new tensor with the current values: nothing cached for it
        return exact_linear(x, w.detach().clone())

    before = exact_linear(x, w)
    w.data.add_(0.25)  # a write the version counter does not see (as a fused optimizer's)
    assert torch.equal(exact_linear(x, w), fresh()) and not torch.equal(exact_linear(x, w), before)
    cache = linear_mod.PackedWeights()
    with linear_mod.using_packed(cache):
        cached = exact_linear(x, w)
        assert torch.equal(cached, fresh())
        with torch.no_grad():
            w.add_(0.25)  # in place: the version counter moves
        assert torch.equal(exact_linear(x, w), fresh()) and not torch.equal(exact_linear(x, w), cached)
        w.data = torch.randn(N, K, generator=g).to(dtype)  # new storage
        assert torch.equal(exact_linear(x, w), fresh())
        w.data.mul_(2)  # unseen by any fingerprint: the owner must clear
        cache.clear()
        assert torch.equal(exact_linear(x, w), fresh())
        with torch.inference_mode():  # an inference tensor has no version counter: never cached
            wi = w.detach().clone()
            assert torch.equal(exact_linear(x, wi), fresh())


def test_fast_linear_is_not_row_invariant():
    g = torch.Generator().manual_seed(0)
    W, X = torch.randn(768, 256, generator=g), torch.randn(300, 256, generator=g)
    ref = fast_linear(X[:1], W)[0]
    assert any(not torch.equal(fast_linear(X[:M], W)[0], ref) for M in range(2, 300))


def test_exact_linear_gradients_match_plain_autograd():
    g = torch.Generator().manual_seed(1)
    W = torch.randn(24, 40, generator=g, requires_grad=True)
    X = torch.randn(37, 40, generator=g, requires_grad=True)
    exact_linear(X, W).pow(2).sum().backward()
    gx, gw = X.grad.clone(), W.grad.clone()
    X.grad = W.grad = None
    (X @ W.t()).pow(2).sum().backward()
    assert torch.allclose(gx, X.grad, atol=1e-5) and torch.allclose(gw, W.grad, atol=1e-4)


# ---------------------------------------------------------------- batch invariance (trainer path)


def _batch_case(model, data, dtype_name):
    rng = random.Random(data.draw(st.integers(0, 10**6)))
    V = model.config.vocab_size
    target = random_sequences(rng, 1, 2, 90, V)[0]
    others = random_sequences(rng, rng.randint(1, 6), 1, 120, V)
    batch = others + [target]
    rng.shuffle(batch)
    i = batch.index(target)
    layout = rng.choice(["packed", "padded"])
    threads = rng.choice([1, 2])
    grad = rng.random() < 0.3
    return target, batch, i, layout, threads, grad


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@given(data=st.data())
@HSET
def test_sequence_logprobs_batch_invariant(models, dtype, data):
    model = models[("exact", dtype)]
    target, batch, i, layout, threads, grad = _batch_case(model, data, dtype)
    with torch.no_grad():
        ref = exactrl.sequence_logprobs(model, [target])[0]
    torch.set_num_threads(threads)
    with torch.set_grad_enabled(grad):
        lp = exactrl.sequence_logprobs(model, batch, layout=layout)[i]
    assert lp.requires_grad == grad
    assert torch.equal(lp.detach(), ref), (layout, threads, grad)


def test_fast_batch_twin(models):
    """Fast fp32: a short sequence alone vs inside a batch differs (GEMM choice depends on rows)."""
    model = models[("fast", "float32")]
    rng = random.Random(0)
    found = False
    for _ in range(10):
        target = random_sequences(rng, 1, 2, 3, 211)[0]
        with torch.no_grad():
            ref = exactrl.sequence_logprobs(model, [target])[0]
            lp = exactrl.sequence_logprobs(model, random_sequences(rng, 3, 20, 60, 211) + [target])[-1]
        found |= not torch.equal(lp, ref)
    assert found


def test_bf16_batch_twin_a_row_dependent_linear(models, monkeypatch):
    """Twin of the bf16 case of `test_sequence_logprobs_batch_invariant`. Here torch's own bf16 kernels
    are batch-invariant on the tiny model (measured on Zen 4: no difference in 10 batches of the fp32
    twin above, nor on 256- and 512-wide models, nor with a linear that sums K in fp32 in another order:
    bf16's rounding of the outputs hides so small a change for a few target tokens), so the fast model
    cannot show that the bf16 comparison can fail. A split-K linear that rounds its two partial sums to
    bf16 once a call has more than 8 rows stands in for a batch-dependent kernel: the same comparison of a
    sequence alone and in a batch sees it."""
    from exactrl.kernels import Kernels

    def row_dependent(self, x, weight, bias=None):
        x_MK, w = x.reshape(-1, x.shape[-1]).float(), weight.float()
        h = x_MK.shape[1] // 2
        y = (
            (x_MK @ w.t()).to(x.dtype)
            if x_MK.shape[0] <= 8
            else (x_MK[:, :h] @ w[:, :h].t()).to(x.dtype) + (x_MK[:, h:] @ w[:, h:].t()).to(x.dtype)
        )
        y = y if bias is None else y + bias
        return y.view(*x.shape[:-1], weight.shape[0])

    model = models[("exact", "bfloat16")]
    rng = random.Random(0)
    targets = random_sequences(rng, 5, 2, 3, 211)
    with torch.no_grad():
        alone = [exactrl.sequence_logprobs(model, [t])[0] for t in targets]
        batches = [random_sequences(rng, 3, 20, 60, 211) + [t] for t in targets]
        assert all(torch.equal(exactrl.sequence_logprobs(model, b)[-1], a) for a, b in zip(alone, batches))
        monkeypatch.setattr(Kernels, "linear", row_dependent)
        monkeypatch.setattr(Kernels, "fuses_linears", lambda self, x, weights, biases: False)
        alone = [exactrl.sequence_logprobs(model, [t])[0] for t in targets]
        assert any(not torch.equal(exactrl.sequence_logprobs(model, b)[-1], a) for a, b in zip(alone, batches))


def test_autograd_gradients_flow(models):
    model = models[("exact", "float32")]
    lp = exactrl.sequence_logprobs(model, [[1, 2, 3, 4, 5], [7, 8, 9]], temperature=0.7, top_k=50)
    torch.cat(lp).sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
    model.zero_grad(set_to_none=True)


# ---------------------------------------------------------------- prefill / chunked / decode


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@given(data=st.data())
@HSET
def test_prefill_chunked_decode_identical(models, dtype, data):
    model = models[("exact", dtype)]
    rng = random.Random(data.draw(st.integers(0, 10**6)))
    target = random_sequences(rng, 1, 1, 100, 211)[0]
    chunks = [rng.randint(1, 40) for _ in range(rng.randint(0, 4))]
    with torch.no_grad():
        full = full_path(model, target)
        inc = incremental_path(model, target, chunks, seed=rng.randrange(100))
    assert torch.equal(full, inc), chunks


def test_fast_decode_twin_fp32(models):
    model = models[("fast", "float32")]
    target = random_sequences(random.Random(3), 1, 60, 60, 211)[0]
    with torch.no_grad():
        assert not torch.equal(full_path(model, target), incremental_path(model, target, [1]))


@pytest.mark.parametrize("kernels", ["exact", "fast"])
def test_bf16_long_chunked_prefill(wide_dir, kernels):
    """A long bf16 sequence prefilled whole, in chunks, or decoded token by token: exact gives one result.

    Which of these paths plain torch ops tell apart depends on the CPU's bf16 kernels (on an AVX2-only
    Zen 1, SDPA's kv split shows in the [150, 150] chunking; on an AMX Xeon the chunked prefill matches
    and token-by-token decode does not), so the fast twin asserts that at least one of them differs.
    """
    model = exactrl.load_model(wide_dir, dtype="bfloat16", kernels=kernels)
    target = random_sequences(random.Random(4), 1, 400, 400, 211)[0]
    with torch.no_grad():
        full = full_path(model, target)
        same = [torch.equal(full, incremental_path(model, target, chunks)) for chunks in ([150, 150], [1])]
    if kernels == "exact":
        assert all(same)
    else:
        assert not all(same), "fast bf16 gave identical bits on every path: the twin would not catch a break"


# ---------------------------------------------------------------- parity command


def test_parity_exact_passes_and_fast_names_first_op(models):
    assert all(r.exact for r in run_parity(models[("exact", "float32")], length=50))
    bad = [r for r in run_parity(models[("fast", "float32")], length=50) if not r.exact]
    assert bad and all(r.first_divergent_op and r.first_divergent_op.startswith("model.") for r in bad)


def test_parity_runs_the_head_beside_other_rows_and_names_it(models, monkeypatch):
    """A head whose bits depend on how many rows it gets (here: +1e-6 beyond 3 rows) is caught by the batch
    checks, which give it other rows beside the target's, and named `logits` (no module call to hook)."""
    model = models[("exact", "float32")]
    real = model.kernels.linear
    head = model.embed_tokens.weight if model.config.tie_word_embeddings else model.lm_head.weight

    def row_dependent(x, weight, bias=None):
        out = real(x, weight, bias)
        return out + 1e-6 if weight is head and x.shape[0] > 3 else out

    monkeypatch.setattr(type(model.kernels), "linear", lambda self, x, w, b=None: row_dependent(x, w, b))
    bad = {r.name: r for r in run_parity(model, length=3) if not r.exact}
    assert "batch" in bad and bad["batch"].first_divergent_op == "logits"


def test_parity_fits_every_sequence_in_the_context(tmp_path):
    """The companion sequences of the batch checks once ran past max_position_embeddings (a crash)."""
    from conftest import make_hf_model

    make_hf_model(tmp_path, "qwen3", max_position_embeddings=64)
    model = exactrl.load_model(tmp_path)
    for seed in range(4):
        assert all(r.exact for r in run_parity(model, length=80, seed=seed))


def test_parity_cli_exit_codes(qwen3_dir, capsys):
    from exactrl.cli import main

    assert main(["parity", "--model", str(qwen3_dir), "--length", "40"]) == 0
    assert "BITWISE EXACT" in capsys.readouterr().out
    assert main(["parity", "--model", str(qwen3_dir), "--length", "40", "--kernels", "fast"]) == 1
    out = capsys.readouterr().out
    assert "NOT EXACT" in out and "first divergent op: model." in out


def test_token_logprobs_first_selects_rows_bitwise(models):
    """The trainer projects only completion rows (`first=`): the same bits as slicing the full result."""
    from exactrl.model.logprobs import token_logprobs

    model = models[("exact", "float32")]
    rng = random.Random(3)
    seqs = random_sequences(rng, 5, 2, 70, 211)
    first = [rng.randint(1, len(s)) for s in seqs]
    full = exactrl.sequence_logprobs(model, seqs)
    part, ents = token_logprobs(model, seqs, first=first, with_entropy=True)
    for k, f in enumerate(first):
        assert torch.equal(part[k].detach(), full[k][f - 1 :].detach())
        assert len(ents[k]) == len(seqs[k]) - f
    with pytest.raises(ValueError, match=r"first\[0\]"):
        token_logprobs(model, [[1, 2, 3]], first=[4])
    with pytest.raises(ValueError, match="entries"):
        token_logprobs(model, [[1, 2, 3]], first=[1, 1])


def _grouped(rng: random.Random, vocab: int) -> tuple[list[list[int]], list[int]]:
    """GRPO-like sequences: groups of samples of one prompt (prompts shorter than, equal to and longer than
    whole pages of 8), some completions empty, and a lone prompt."""
    seqs, first = [], []
    for plen, group in ((5, 3), (8, 2), (16, 3), (21, 4), (13, 1)):
        prompt = [rng.randrange(vocab) for _ in range(plen)]
        for _ in range(group):
            seqs.append(prompt + [rng.randrange(vocab) for _ in range(rng.choice([0, 1, 7, 12]))])
            first.append(plen)
    return seqs, first


def test_shared_prompts_same_logprobs_and_gradients(qwen3_dir):
    """`share_prompts` lays each repeated prompt's whole pages out once: logprobs and entropies bit for bit
    those of the plain layout (the exact kernels are row- and page-invariant; the fast kernels' twins of
    that property are the batch-invariance tests above), and the same gradients up to rounding (a shared
    position's gradient arrives summed from the samples that read it)."""
    from exactrl.model.logprobs import pack_shared, token_logprobs

    model = exactrl.load_model(qwen3_dir, block_size=8)
    seqs, first = _grouped(random.Random(5), model.config.vocab_size)
    layout, pages, tokens, _ = pack_shared(seqs, first, 8)
    plain = sum(len(s) for s in seqs)
    # groups of 2, 3 and 4 share 1, 2 and 2 pages of 8: 8 + 2*16 + 3*16 rows fewer
    assert len(tokens) == plain - (8 + 2 * 16 + 3 * 16) and pages < sum(-(-len(s) // 8) for s in seqs)
    out = {}
    for share in (False, True):
        model.zero_grad()
        lps, ents = token_logprobs(model, seqs, first=first, with_entropy=True, entropy_grad=True, share_prompts=share)
        (torch.cat(lps).sum() + 0.1 * torch.cat(ents).sum()).backward()
        out[share] = lps, ents, [p.grad.clone() for p in model.parameters()]
    for a, b in zip(out[False][0] + out[False][1], out[True][0] + out[True][1]):
        assert torch.equal(a.detach(), b.detach())
    for g0, g1 in zip(out[False][2], out[True][2]):
        torch.testing.assert_close(g1, g0, rtol=1e-4, atol=1e-6)


def test_shared_prompts_layout_reads_the_owners_pages(qwen3_dir):
    """Each non-owner's block table starts with its owner's prompt pages; positions resume after them; the
    row map sends a shared position to the owner's row."""
    from exactrl.model.logprobs import pack_shared

    p = list(range(20))
    seqs = [p + [30, 31], p + [40], [1] * 20 + [50], p + [60, 61, 62]]
    layout, pages, tokens, row_of = pack_shared(seqs, [20, 20, 20, 20], 8)
    t = layout.block_table_SJ
    assert t[1, :2].tolist() == t[0, :2].tolist() == t[3, :2].tolist() and t[2, :2].tolist() != t[0, :2].tolist()
    assert t[1, 2] not in t[0].tolist() and t[3, 2] not in (t[0].tolist() + t[1].tolist())
    assert layout.pos_N[layout.seq_N == 1].tolist() == list(range(16, 21))
    assert row_of[1][:16].tolist() == row_of[0][:16].tolist() and row_of[1][16] != row_of[0][16]
    assert tokens[row_of[3]].tolist() == seqs[3] and tokens[row_of[2]].tolist() == seqs[2]
    assert pages == 3 + 1 + 3 + 1


def test_entropy_without_grad_has_the_same_values(models):
    """A metric-only entropy (`entropy_grad=False`) skips autograd but keeps its value bit for bit."""
    from exactrl.model.logprobs import token_logprobs

    model = models[("exact", "float32")]
    seqs = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    _, with_grad = token_logprobs(model, seqs, with_entropy=True, entropy_grad=True)
    _, without = token_logprobs(model, seqs, with_entropy=True, entropy_grad=False)
    assert all(e.requires_grad for e in with_grad) and not any(e.requires_grad for e in without)
    assert all(torch.equal(a.detach(), b) for a, b in zip(with_grad, without))
