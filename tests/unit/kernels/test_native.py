"""The native exact kernels (exactrl/kernels/native): values, invariances, layout checks, build errors.

The model-level invariance suites (test_invariance.py, tests/unit/engine/) run it through every
path; these tests pin the kernel's own contract.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from exactrl.kernels import attention as A
from exactrl.kernels import get_kernels, native


def _paged(k_NHD, v_NHD, B, rng, spare=3):
    """One sequence's keys/values scattered over shuffled pages of a larger store: (k_pages, v_pages, table)."""
    n, Hk, D = k_NHD.shape
    J = -(-n // B)
    pages = list(range(J + spare))
    rng.shuffle(pages)
    table = torch.tensor(pages[:J])
    kp = torch.randn(J + spare, Hk, B, D).to(k_NHD.dtype)  # other pages hold garbage: never read
    vp = torch.randn(J + spare, Hk, B, D).to(k_NHD.dtype)
    for t in range(n):
        kp[table[t // B], :, t % B] = k_NHD[t]
        vp[table[t // B], :, t % B] = v_NHD[t]
    return kp, vp, table[None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 20])  # 20: a head dim that is not a multiple of the 8 lanes
@pytest.mark.parametrize("H,Hk", [(6, 2), (18, 1)])  # 18 query heads per kv head: more than MAX_G in exact.c
def test_matches_causal_softmax_attention(dtype, D, H, Hk):
    g = torch.Generator().manual_seed(0)
    n, B = 45, 8
    q, k, v = (torch.randn(n, h, D, generator=g).to(dtype) for h in (H, Hk, Hk))
    kp, vp, table = _paged(k, v, B, random.Random(0))
    o = native.attention(q, kp, vp, torch.zeros(n, dtype=torch.int64), torch.arange(n), table, D**-0.5)
    ref = F.scaled_dot_product_attention(
        *(x.double().transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, enable_gqa=True
    )[0].transpose(0, 1)
    assert o.dtype == torch.float32
    # bf16 operands widen to fp32 exactly and the reference takes the same rounded values: only fp32's
    # accumulation error is left in either dtype
    assert torch.allclose(o.double(), ref, atol=1e-5)


def _attention_by_its_formula(q_HD, k_LHD, v_LHD, scale):
    """exact.c's documented order of operations, op by op in float32 torch (each op rounds once, as the C
    without contraction): s_t = dot(scale * q, k_t) in 8 lanes then the tree ((0+1)+(2+3))+((4+5)+(6+7)),
    e_t = exp_f(s_t - max s), o = (sum_t e_t v_t) / (sum_t e_t) with t ascending."""
    H, D = q_HD.shape
    G = H // k_LHD.shape[1]
    k, v = k_LHD.repeat_interleave(G, 1), v_LHD.repeat_interleave(G, 1)  # [L, H, D]
    qs = scale * q_HD
    acc = torch.zeros(k.shape[0], H, 8)
    for d0 in range(0, D, 8):
        w = min(8, D - d0)
        acc[..., :w] = acc[..., :w] + qs[None, :, d0 : d0 + w] * k[..., d0 : d0 + w]
    a = acc.unbind(-1)
    s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))  # [L, H]
    e = native.exp(s - s.max(0).values)
    o, l = torch.zeros(H, D), torch.zeros(H)
    for t in range(k.shape[0]):
        o, l = o + e[t][:, None] * v[t], l + e[t]
    return o / l[:, None]


@pytest.mark.parametrize(
    "D,B,H,Hk", [(64, 16, 6, 2), (64, 8, 6, 2), (20, 8, 6, 2), (16, 4, 6, 2), (16, 4, 18, 1)]
)  # 18 query heads per kv head: the sums' generic loop
def test_attention_computes_its_documented_order_bit_for_bit(D, B, H, Hk):
    """Scores of 8 keys at once (fp32, D a multiple of 8, 8 keys left in a page) and one key at a time give
    the bits of the formula in exact.c's header: rows whose keys end anywhere in a page. Some query heads
    are zero, +0 or -0, so every score of their rows ties at a zero maximum (the sign of a zero maximum is
    the one thing the kernel's lane-wise max may take differently from a max in order)."""
    g = torch.Generator().manual_seed(8)
    n = 41
    q, k, v = (torch.randn(n, h, D, generator=g) * 2 for h in (H, Hk, Hk))
    q[::3, 0], q[1::3, 1] = 0.0, -0.0
    kp, vp, table = _paged(k, v, B, random.Random(2))
    o = native.attention(q, kp, vp, torch.zeros(n, dtype=torch.int64), torch.arange(n), table, D**-0.5)
    for t in (0, 6, 7, 8, 15, 16, 23, 24, 31, 40):
        assert torch.equal(o[t], _attention_by_its_formula(q[t], k[: t + 1], v[: t + 1], D**-0.5)), t


def test_sdpa_does_not_compute_the_documented_order():
    """The inverse twin of the test above: the fast kernels' attention (SDPA) is close to the formula but
    not its bits, so that test's bitwise comparison can fail."""
    from exactrl.kernels.attention import TokenLayout, fast_attention, plan_fast

    g = torch.Generator().manual_seed(8)
    n, H, Hk, D, B = 41, 6, 2, 64, 16
    q, k, v = (torch.randn(n, h, D, generator=g) * 2 for h in (H, Hk, Hk))
    kp, vp, table = _paged(k, v, B, random.Random(2))
    lay = TokenLayout(torch.zeros(n, dtype=torch.int64), torch.arange(n), table)
    o = fast_attention(q, kp, vp, plan_fast(lay, B), D**-0.5)
    rows = [_attention_by_its_formula(q[t], k[: t + 1], v[: t + 1], D**-0.5) for t in range(8, n)]
    assert all(torch.allclose(o[t], r, atol=1e-5) for t, r in zip(range(8, n), rows))
    assert not all(torch.equal(o[t], r) for t, r in zip(range(8, n), rows))


def test_a_row_depends_only_on_its_own_keys_whatever_else_is_in_the_call():
    """Decode-style single rows, rows among other sequences' rows, any page placement, 1 or 2 threads."""
    g = torch.Generator().manual_seed(1)
    rng = random.Random(1)
    n, H, Hk, D, B = 70, 4, 2, 32, 16
    q, k, v = (torch.randn(n, h, D, generator=g) for h in (H, Hk, Hk))
    kp, vp, table = _paged(k, v, B, rng)
    seq, pos = torch.zeros(n, dtype=torch.int64), torch.arange(n)
    full = native.attention(q, kp, vp, seq, pos, table, 0.2)
    threads = torch.get_num_threads()
    try:
        for t in range(0, n, 7):
            torch.set_num_threads(rng.choice([1, 2]))
            one = native.attention(q[t : t + 1], kp, vp, seq[:1], pos[t : t + 1], table, 0.2)
            assert torch.equal(one[0], full[t]), t
            # the same row inside a call with another sequence's rows before it (its own pages elsewhere)
            kp2, vp2, table2 = _paged(k, v, B, rng, spare=8)
            qq = torch.cat([torch.randn(5, H, D, generator=g), q[t : t + 1]])
            both = torch.cat([table2, torch.roll(table2, 1, dims=1)])
            out = native.attention(
                qq, kp2, vp2, torch.tensor([1] * 5 + [0]), torch.tensor([3, 9, 0, 60, 11, t]), both, 0.2
            )
            assert torch.equal(out[-1], full[t]), t
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rows_are_invariant_and_close_to_torch(dtype):
    from exactrl.kernels.rowwise import exact_rms_norm, rms_norm

    g = torch.Generator().manual_seed(2)
    x, w = (torch.randn(300, 100, generator=g) * 3).to(dtype), torch.randn(100, generator=g).to(dtype)
    full = exact_rms_norm(x, w, 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert full.dtype == dtype and torch.allclose(full.float(), rms_norm(x, w, 1e-6).float(), rtol=tol, atol=tol)
    threads = torch.get_num_threads()
    try:
        for i, n, t in [(0, 1, 1), (17, 3, 2), (250, 50, 2), (299, 1, 2)]:
            torch.set_num_threads(t)
            assert torch.equal(exact_rms_norm(x[i : i + n], w, 1e-6), full[i : i + n]), (i, n, t)
    finally:
        torch.set_num_threads(threads)


def test_rms_norm_gradient_is_the_torch_expression_gradient():
    from exactrl.kernels.rowwise import exact_rms_norm, rms_norm

    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 4, 24, generator=g, requires_grad=True)
    w = torch.randn(24, generator=g, requires_grad=True)
    c = torch.randn(9, 4, 24, generator=g)
    got = torch.autograd.grad((exact_rms_norm(x, w, 1e-5) * c).sum(), (x, w))
    ref = torch.autograd.grad((rms_norm(x, w, 1e-5) * c).sum(), (x, w))
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6) and a.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 20])
def test_rotary_has_the_bits_of_the_torch_expression(dtype, D):
    """The exact kernels run RoPE in C without autograd and in torch ops with it: the bits must agree."""
    from exactrl.kernels.rowwise import apply_rotary, rotary_tables

    cos, sin = rotary_tables(D, 4096, 1e6)
    g = torch.Generator().manual_seed(4)
    pos = torch.randint(0, 4096, (257,), generator=g)
    x = (torch.randn(257, 5, D, generator=g) * 8).to(dtype)
    assert torch.equal(native.rotary(x, cos[pos], sin[pos]), apply_rotary(x, cos[pos], sin[pos]))
    c, s = cos[pos].to(dtype), sin[pos].to(dtype)  # a bf16 model keeps its tables in bf16
    assert torch.equal(native.rotary(x, c, s), apply_rotary(x, c, s))
    cos2, sin2 = rotary_tables(D, 4096, 1e4)  # Gemma 3's [global | local] tables: each half read in place
    wide_c, wide_s = torch.cat([cos[pos], cos2[pos]], 1), torch.cat([sin[pos], sin2[pos]], 1)
    for half, (c, s) in ((slice(0, D), (cos, sin)), (slice(D, None), (cos2, sin2))):
        got = native.rotary(x, wide_c[:, half], wide_s[:, half])
        assert torch.equal(got, apply_rotary(x, c[pos], s[pos]))
    assert not torch.equal(native.rotary(x, wide_c[:, D:], wide_s[:, D:]), native.rotary(x, cos[pos], sin[pos]))


@pytest.mark.parametrize("D", [64, 20])
def test_rotary_gradient_is_autograds_of_the_torch_expression(D):
    """Training runs RoPE as the C pass both ways (`_Rotary`): the values and the gradient (the rotation
    by -angle) must be torch autograd's."""
    from exactrl.kernels import get_kernels
    from exactrl.kernels.rowwise import apply_rotary, rotary_tables

    cos, sin = rotary_tables(D, 4096, 1e6)
    g = torch.Generator().manual_seed(5)
    pos = torch.randint(0, 4096, (129,), generator=g)
    x = (torch.randn(129, 3, D, generator=g) * 4).requires_grad_()
    w = torch.randn(129, 3, D, generator=g)
    y = get_kernels("exact").rotary(x, cos[pos], sin[pos])
    assert y.grad_fn is not None and "Rotary" in type(y.grad_fn).__name__
    got = torch.autograd.grad((y * w).sum(), x)[0]
    ref = torch.autograd.grad((apply_rotary(x, cos[pos], sin[pos]) * w).sum(), x)[0]
    assert torch.equal(y, apply_rotary(x, cos[pos], sin[pos]))
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got, w, rtol=1e-3, atol=1e-3)  # the gradient rotates: not the identity
    with pytest.raises(ValueError, match="sin table's two halves differ"):
        get_kernels("exact").rotary(x, cos[pos], torch.randn(129, D, generator=g))


def test_layout_without_a_page_for_a_key_is_a_value_error():
    lay = A.TokenLayout(torch.tensor([0, 0]), torch.tensor([5, 40]), torch.tensor([[0, -1]]))
    with pytest.raises(ValueError, match="no page"):
        A.plan_exact(lay, 32)
    lay = A.TokenLayout(torch.tensor([0]), torch.tensor([70]), torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="no page"):
        A.plan_exact(lay, 32)
    plan = A.plan_exact(A.TokenLayout(torch.tensor([0]), torch.tensor([40]), torch.tensor([[0, 9]])), 32)
    pages = torch.zeros(4, 1, 32, 8)
    with pytest.raises(ValueError, match="page 9"):
        A.exact_attention(torch.zeros(1, 1, 8), pages, pages, plan, 1.0)


def test_layout_check_agrees_with_its_torch_statement():
    """exact.c's one-pass layout check against the same rule in torch ops, on random layouts with and
    without missing pages, out-of-table sequences and negative positions."""
    from exactrl.kernels import native

    def reference(seq, pos, table, B):
        S, J = table.shape
        if int(pos.min()) < 0 or int(seq.min()) < 0 or int(seq.max()) >= S:
            return "positions must be"
        last = torch.full((S,), -1, dtype=torch.int64).scatter_reduce(0, seq, pos, "amax")
        need = (torch.arange(J) * B)[None, :] <= last[:, None]
        if int(last.max()) // B >= J or not bool((table[need] >= 0).all()):
            return "no page"
        return int(pos.max()) + 1, int(table[need].max())

    g = torch.Generator().manual_seed(4)
    seen = set()
    for _ in range(300):
        S, J, B, N = (int(torch.randint(1, 6, (1,), generator=g)) for _ in range(4))
        table = torch.randint(-1, 20, (S, J), generator=g) if _ % 3 else torch.randint(0, 20, (S, J), generator=g)
        seq = torch.randint(-1 if _ % 17 == 0 else 0, S + (_ % 13 == 0), (N,), generator=g)
        pos = torch.randint(-1 if _ % 19 == 0 else 0, J * B + (B if _ % 7 == 0 else 0), (N,), generator=g)
        want = reference(seq, pos, table, B)
        if isinstance(want, str):
            with pytest.raises(ValueError, match=want):
                native.check_layout(seq, pos, table, B)
            seen.add(want)
        else:
            assert native.check_layout(seq, pos, table, B) == want
            seen.add("ok")
    assert seen == {"ok", "no page", "positions must be"}  # every outcome was drawn


def test_missing_compiler_names_the_problem(monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-exactrl")
    with pytest.raises(native.KernelBuildError, match="C compiler"):
        native._compiler()


def test_unwritable_cache_names_the_setting(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("EXACTRL_CACHE", str(blocker / "cache"))
    native._library.cache_clear()
    try:
        with pytest.raises(native.KernelBuildError, match="EXACTRL_CACHE"):
            native.library()
    finally:
        native._library.cache_clear()


# ---------------------------------------------------------------- pointwise.c


def test_exp_is_within_one_ulp_and_keeps_the_special_values():
    x = torch.linspace(-86.0, 88.72, 400_001)
    want = x.double().exp()
    ulp = want.float().nextafter(torch.tensor(math.inf)).double() - want.float().double()
    assert ((native.exp(x).double() - want).abs() / ulp).max() <= 1.0
    special = torch.tensor([math.nan, math.inf, -math.inf, 89.0, -86.5, 0.0, -0.0])
    got = native.exp(special)
    assert torch.isnan(got[0]) and got[1] == math.inf and got[2] == 0 and got[3] == math.inf
    assert got[4] == 0 and got[5] == 1 and got[6] == 1  # below exp.c's EXP_LO: 0 (the true value < 2^-124)


def test_swiglu_is_silu_times_up_and_its_gradient_is_autograds():
    g = torch.Generator().manual_seed(0)
    gate, up, dy = (torch.randn(37, 300, generator=g) * 6 for _ in range(3))
    gate[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp(-g) overflows / is 0
    want = torch.nn.functional.silu(gate) * up
    assert torch.allclose(native.swiglu(gate, up), want, rtol=1e-6, atol=1e-30)
    gg, uu = gate.clone().requires_grad_(), up.clone().requires_grad_()
    (torch.nn.functional.silu(gg) * uu).backward(dy)
    dg, du = native.swiglu_backward(gate, up, dy)
    assert torch.allclose(dg, gg.grad, rtol=1e-5, atol=1e-5) and torch.allclose(du, uu.grad, rtol=1e-5, atol=1e-5)
    # through the model's kernels: exact fp32 takes the C pass forward and backward, bf16 torch's ops
    k = get_kernels("exact")
    gg2, uu2 = gate.clone().requires_grad_(), up.clone().requires_grad_()
    out = k.swiglu(gg2, uu2)
    assert torch.equal(out, native.swiglu(gate, up))
    out.backward(dy)
    assert torch.equal(gg2.grad, dg) and torch.equal(uu2.grad, du)
    half = k.swiglu(gate.bfloat16(), up.bfloat16())
    assert torch.equal(half, torch.nn.functional.silu(gate.bfloat16()) * up.bfloat16())


def test_draw_and_entropy_of_a_row_do_not_depend_on_the_other_rows_or_the_threads():
    g = torch.Generator().manual_seed(1)
    lp = torch.log_softmax(torch.randn(9, 1000, generator=g) * 4, -1)
    lp[3, 500:] = -math.inf  # a truncated row
    u = torch.rand(9, generator=g, dtype=torch.float64)
    greedy = torch.tensor([False, True] + [False] * 7)
    tok, tlp = native.draw(lp, 64, u, greedy)
    ent = native.entropy(lp)
    assert tok[1] == lp[1].argmax() and torch.equal(tlp, lp[torch.arange(9), tok]) and tok[3] < 500
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for r in range(9):
            one, one_lp = native.draw(lp[r : r + 1], 64, u[r : r + 1], greedy[r : r + 1])
            assert one == tok[r] and one_lp == tlp[r]
            assert torch.equal(native.entropy(lp[r : r + 1]), ent[r : r + 1])
    finally:
        torch.set_num_threads(threads)
    p = lp.double().exp()
    assert torch.allclose(ent.double(), -(p * lp.double().nan_to_num(neginf=0.0)).sum(-1), rtol=1e-5)


def test_log_softmax_rows_do_not_depend_on_the_batch_or_the_threads_and_match_torch():
    g = torch.Generator().manual_seed(4)
    z = torch.randn(33, 5003, generator=g) * 6  # 5003: a row that is not a multiple of the 16 lanes
    z[2, 7:] = -math.inf  # a truncated row keeps its finite entries
    lp = native.log_softmax(z)
    ref = torch.log_softmax(z.double(), -1)
    fin = torch.isfinite(ref)
    # within 1.5 fp32 ulps of the float64 value (plus 2e-6 near 0): an ulp at |lp| in [32, 64) is 3.8e-6
    assert ((lp.double() - ref)[fin].abs() <= 2e-6 + 1.5 * 2.0**-23 * ref[fin].abs()).all()
    assert torch.equal(lp[2, 7:], torch.full((4996,), -math.inf))
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for r in (0, 2, 32):
                assert torch.equal(native.log_softmax(z[r : r + 1]), lp[r : r + 1])
                assert torch.equal(native.log_softmax(torch.cat([z[r : r + 1], z[:5]])[:1]), lp[r : r + 1])
    finally:
        torch.set_num_threads(threads)
    bad = torch.randn(3, 40, generator=g)
    bad[0, 5], bad[1], bad[2, 3] = math.nan, -math.inf, math.inf
    assert torch.isnan(native.log_softmax(bad)).all()  # as torch's: a NaN, no finite entry or an inf ruin the row


def test_sampling_logprobs_gradient_is_torch_log_softmaxs():
    from exactrl.kernels import sampling_logprobs

    g = torch.Generator().manual_seed(5)
    z = (torch.randn(6, 300, generator=g) * 3).requires_grad_()
    zt = z.detach().clone().requires_grad_()
    w = torch.randn(6, 300, generator=g)
    n = z.shape[0]
    lp = sampling_logprobs(z, torch.full((n,), 0.7), torch.full((n,), 50), torch.full((n,), 0.9))
    (lp.nan_to_num(neginf=0.0) * w).sum().backward()
    # the same distribution in torch ops: the kept set is the one sampling_logprobs kept
    keep = torch.isfinite(lp.detach())
    ref = torch.log_softmax((zt / 0.7).masked_fill(~keep, -math.inf), -1)
    assert torch.allclose(lp.detach(), ref.detach(), atol=2e-6)
    (ref.nan_to_num(neginf=0.0) * w).sum().backward()
    assert torch.allclose(z.grad, zt.grad, atol=1e-6)


def test_draw_marks_a_row_it_cannot_draw_from():
    lp = torch.log_softmax(torch.randn(4, 50), -1)
    lp[1], lp[2, 9] = -math.inf, math.nan
    for greedy in (False, True):
        tok, tlp = native.draw(
            lp, 16, torch.full((4,), 0.5, dtype=torch.float64), torch.full((4,), greedy, dtype=torch.bool)
        )
        assert tok[0] >= 0 and tok[3] >= 0 and tok[1] == -1 and torch.isnan(tlp[1])
        assert (tok[2] == -1) == (not greedy)  # greedy takes the max of the rest; the engine's rows are all NaN


@pytest.mark.parametrize("build", ["", "avx2", "portable"])
def test_sample_is_log_softmax_then_draw_bit_for_bit(build):
    """The engine's fused step (`native.sample`) draws the token and logprob of `draw(log_softmax(z))` on
    every build: ordinary, truncated (-inf), NaN and all -inf rows, greedy or not, row lengths that are not
    a multiple of the lanes or the draw's blocks; and its rows do not depend on the others or the threads."""
    g = torch.Generator().manual_seed(6)
    z = torch.randn(12, 3001, generator=g) * 5
    z[3, 100:], z[4, 17], z[5] = -math.inf, math.nan, -math.inf
    u = torch.rand(12, generator=g, dtype=torch.float64)
    u[6] = 1.0 - 2.0**-53  # the last uniform: the draw's upper clamps
    for greedy in (torch.zeros(12, dtype=torch.bool), torch.arange(12) % 3 == 1):
        tok, tlp = native.sample(z, 64, u, greedy, build)
        ref_tok, ref_lp = native.draw(native.log_softmax(z, build), 64, u, greedy, build)
        assert torch.equal(tok, ref_tok) and torch.equal(tlp.nan_to_num(7.0), ref_lp.nan_to_num(7.0))
        assert tok[5] == tok[4] == -1 and 0 <= tok[3] < 100  # log_softmax makes a NaN row all NaN
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            for r in (0, 3, 11):
                one, one_lp = native.sample(z[r : r + 1], 64, u[r : r + 1], greedy[r : r + 1], build)
                assert one == tok[r] and one_lp == tlp[r]
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("build", ["", "avx2", "portable"])
def test_log_softmax_entropy_is_the_two_calls_bit_for_bit(build):
    """The LM head's training forward (`native.log_softmax_entropy`, also in place) gives the bits of
    `log_softmax` then `entropy` on every build: ordinary, truncated (-inf), NaN and all -inf rows, lengths
    that are not a multiple of the lanes; a row alone gives its bits among others."""
    if build.encode() == native.library().exactrl_gemm_build() or (
        build == "avx2" and native.library("avx2").exactrl_gemm_build() != b"avx2"
    ):
        pytest.skip(
            f"this CPU cannot run the {build} build beside another one (its own is "
            f"{native.library().exactrl_gemm_build().decode()})"
        )
    g = torch.Generator().manual_seed(7)
    z = torch.randn(10, 3001, generator=g) * 6
    z[3, 100:], z[4, 17], z[5] = -math.inf, math.nan, -math.inf
    ref_lp = native.log_softmax(z, build)
    ref_ent = native.entropy(ref_lp, build)
    lp, ent = native.log_softmax_entropy(z, build=build)
    assert torch.equal(lp.nan_to_num(7.0), ref_lp.nan_to_num(7.0)) and torch.equal(
        ent.nan_to_num(7.0), ref_ent.nan_to_num(7.0)
    )
    assert ent[0] > 0 and torch.isnan(ent[4]) and torch.isfinite(ent[3])
    zc = z.clone()
    lp_in, ent_in = native.log_softmax_entropy(zc, inplace=True, build=build)
    assert lp_in.data_ptr() == zc.data_ptr() and torch.equal(lp_in.nan_to_num(7.0), lp.nan_to_num(7.0))
    assert torch.equal(ent_in.nan_to_num(7.0), ent.nan_to_num(7.0))
    one_lp, one_ent = native.log_softmax_entropy(z[7:8].clone(), build=build)
    assert torch.equal(one_lp, lp[7:8]) and torch.equal(one_ent, ent[7:8])


def test_write_rows_is_index_copy_and_refuses_a_row_outside_the_store():
    dst, src = torch.zeros(10, 6), torch.randn(3, 6)
    rows = torch.tensor([7, 0, 4])
    native.write_rows(dst, rows, src, 7)
    assert torch.equal(dst, torch.zeros(10, 6).index_copy_(0, rows, src))
    with pytest.raises(ValueError, match="KV row 10 is beyond the store's 10 rows"):
        native.write_rows(dst, torch.tensor([10]), src[:1], 10)


def test_tanh_is_within_2e_7_and_keeps_the_special_values():
    """exp_f.h's tanh_f, read through softcap with cap 1: |tanh_f(x) - tanh(x)| <= 2e-7 over a dense grid
    (both sides of the 1/16 switch, the saturation), odd, and tanh's values at 0, +-inf and NaN."""
    x = torch.cat([torch.linspace(-12, 12, 2_000_001), torch.linspace(-0.07, 0.07, 200_001)])
    got = native.softcap(x, 1.0)
    assert float((got.double() - torch.tanh(x.double())).abs().max()) <= 2e-7
    assert torch.equal(native.softcap(-x, 1.0), -got)
    special = native.softcap(torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e30]), 1.0)
    assert special[:4].tolist() == [0.0, 0.0, 1.0, -1.0] and special[4].isnan() and special[5] == 1.0
    assert torch.signbit(special[1])
    assert torch.allclose(native.softcap(x, 30.0), 30.0 * torch.tanh(x / 30.0), rtol=0, atol=30 * 2e-7)


def test_geglu_and_softcap_gradients_are_autograds():
    """pointwise.c's GeGLU is gelu(tanh approximation) * up (float64) within tanh_f's error, its gradient
    autograd's; the soft cap's gradient is autograd's of cap·tanh(x / cap); through the exact kernels (fp32
    and bf16) the C passes' bits."""
    g = torch.Generator().manual_seed(0)
    gate, up, dy = (torch.randn(37, 300, generator=g) * 4 for _ in range(3))
    gate[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    g64 = gate.double()
    want = 0.5 * g64 * (1 + torch.tanh((2 / math.pi) ** 0.5 * (g64 + 0.044715 * g64**3))) * up.double()
    # tanh_f's absolute error (2e-7) scaled by 0.5·|g·u|, and float32 rounding
    err = (native.geglu(gate, up).double() - want).abs()
    assert bool((err <= 1e-6 * want.abs() + 2e-7 * (g64 * up.double()).abs()).all())
    gg, uu = g64.clone().requires_grad_(), up.double().requires_grad_()
    (torch.nn.functional.gelu(gg, approximate="tanh") * uu).backward(dy.double())
    dg, du = native.geglu_backward(gate, up, dy)
    # the error of 1 ± t and 1 - t² (a few 1e-7 absolute) times the factors around them
    room = 5e-7 * (dy * up).abs().double() * (1 + g64.abs() ** 3)
    assert bool(((dg.double() - gg.grad).abs() <= 1e-5 * gg.grad.abs() + room).all())
    assert bool(((du.double() - uu.grad).abs() <= 1e-5 * uu.grad.abs() + 2e-7 * (dy.double() * g64).abs()).all())
    k = get_kernels("exact")
    gg2, uu2 = gate.clone().requires_grad_(), up.clone().requires_grad_()
    out = k.geglu(gg2, uu2)
    assert torch.equal(out, native.geglu(gate, up))
    out.backward(dy)
    assert torch.equal(gg2.grad, dg) and torch.equal(uu2.grad, du)
    half = k.geglu(gate.bfloat16(), up.bfloat16())
    assert half.dtype == torch.bfloat16 and torch.equal(
        half, native.geglu(gate.bfloat16().float(), up.bfloat16().float()).bfloat16()
    )
    x = gate.clone().requires_grad_()
    (torch.tanh(x / 3.0) * 3.0).backward(dy)
    xx = gate.clone().requires_grad_()
    k.softcap(xx, 3.0).backward(dy)
    assert torch.allclose(xx.grad, x.grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(xx.grad, native.softcap_backward(gate, dy, 3.0))


def test_geglu_rows_do_not_depend_on_the_batch_or_the_threads():
    """A row of the C GeGLU has the same bits alone, in any batch and at 1 or 2 threads (a width that is not a
    multiple of any vector width: torch's gelu computes such a row's last elements in its scalar tail when
    the row is alone, in its vector body inside a batch)."""
    g = torch.Generator().manual_seed(1)
    gate, up = torch.randn(64, 1000, generator=g) * 3, torch.randn(64, 1000, generator=g)
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2):
            torch.set_num_threads(t)
            outs.append(native.geglu(gate, up))
            alone = torch.stack([native.geglu(gate[r : r + 1], up[r : r + 1])[0] for r in range(64)])
            assert torch.equal(outs[-1], alone)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("build", ["avx2", "portable"])
def test_pointwise_kernels_give_the_same_bits_in_every_build(build):
    """pointwise.c's exp is plain arithmetic: vectorised 16 or 8 wide, or not at all, the same bits."""
    if build.encode() == native.library().exactrl_gemm_build() or (
        build == "avx2" and native.library("avx2").exactrl_gemm_build() != b"avx2"
    ):
        pytest.skip(
            f"this CPU cannot run the {build} build beside another one (its own is "
            f"{native.library().exactrl_gemm_build().decode()})"
        )
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 3001, generator=g) * 30
    lp = torch.log_softmax(x, -1)
    u = torch.rand(5, generator=g, dtype=torch.float64)
    tgt = torch.randint(3001, (5,), generator=g)
    g_lp, g_ent = torch.randn(5, generator=g), torch.randn(5, generator=g)
    ent = native.entropy(lp)
    for f in (
        lambda b: native.exp(x, b),
        lambda b: native.swiglu(x, x.flip(0), b),
        lambda b: torch.cat(native.swiglu_backward(x, x.flip(0), x.flip(1), b)),
        lambda b: native.geglu(x, x.flip(0), b),
        lambda b: torch.cat(native.geglu_backward(x, x.flip(0), x.flip(1), b)),
        lambda b: native.softcap(x, 7.0, b),
        lambda b: native.draw(lp, 256, u, torch.zeros(5, dtype=torch.bool), b)[0],
        lambda b: native.log_softmax(x, b),
        lambda b: native.entropy(lp, b),
        lambda b: native.head_grad(lp, g_lp, g_lp, tgt, g_ent, ent, 0.7, b),
        lambda b: native.head_grad(lp.clone(), g_lp, g_lp, tgt, g_ent, ent, 0.7, b, inplace=True),
    ):
        assert torch.equal(f(""), f(build))
    # in place (the trainer's LM head backward writes the gradient over its kept logprobs): the same bits,
    # the target's own entry included (read before the row is overwritten)
    for ge in (g_ent, None):
        ref = native.head_grad(lp, g_lp, g_lp * 0.5, tgt, ge, ent, 0.7)
        own = lp.clone()
        got = native.head_grad(own, g_lp, g_lp * 0.5, tgt, ge, ent, 0.7, inplace=True)
        assert got.data_ptr() == own.data_ptr() and torch.equal(got, ref)


@pytest.mark.parametrize("softcap", [0.0, 2.5])
@pytest.mark.parametrize("build", ["avx2", "portable"])
def test_attention_gives_the_same_bits_in_every_build(build, softcap):
    """exact.c's attention on exp_f and tanh_f (no libm): another vector width, or none, the same bits."""
    if build.encode() == native.library().exactrl_gemm_build() or (
        build == "avx2" and native.library("avx2").exactrl_gemm_build() != b"avx2"
    ):
        pytest.skip(
            f"this CPU cannot run the {build} build beside another one (its own is "
            f"{native.library().exactrl_gemm_build().decode()})"
        )
    g = torch.Generator().manual_seed(3)
    P, Hk, B, D, H = 6, 2, 4, 20, 6
    k, v = torch.randn(P, Hk, B, D, generator=g), torch.randn(P, Hk, B, D, generator=g)
    q = torch.randn(9, H, D, generator=g) * 3
    seq = torch.tensor([0] * 5 + [1] * 4)
    pos = torch.tensor([0, 3, 4, 9, 11, 0, 1, 5, 7])
    table = torch.tensor([[0, 2, 5], [1, 3, 4]])
    outs = []
    for b in ("", build):
        out = torch.empty(9, H, D)
        native.library(b).exactrl_attention(
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            0,
            seq.data_ptr(),
            pos.data_ptr(),
            table.data_ptr(),
            9,
            H,
            Hk,
            D,
            B,
            3,
            0,
            0.125,
            softcap,
            out.data_ptr(),
            None,
            torch.get_num_threads(),
        )
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], native.attention(q, k, v, seq, pos, table, 0.125, softcap=softcap))


@pytest.mark.parametrize("G", [2, 3, 8, 9])  # 2..8: exact.c's register paths for G heads at once; 9: the loop
@pytest.mark.parametrize("D", [64, 20])
def test_a_query_heads_bits_do_not_depend_on_how_many_heads_share_its_kv_head(G, D):
    """exact.c computes the G query heads of a kv head together (their sums side by side): each still has
    the bits it gets alone, with its kv head repeated as a kv head of its own (G = 1)."""
    g = torch.Generator().manual_seed(G * D)
    Hk, P, B = 2, 5, 4
    k, v = torch.randn(P, Hk, B, D, generator=g), torch.randn(P, Hk, B, D, generator=g)
    q = torch.randn(7, Hk * G, D, generator=g) * 3
    seq, pos = torch.tensor([0, 0, 0, 1, 1, 1, 1]), torch.tensor([0, 5, 11, 2, 3, 8, 19])
    table = torch.tensor([[0, 2, 4, -1, -1], [1, 3, 0, 2, 4]])
    together = native.attention(q, k, v, seq, pos, table, 0.2)
    alone = native.attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), seq, pos, table, 0.2)
    assert torch.equal(together, alone)


def test_an_installed_package_ships_every_file_the_kernels_compile_from():
    """pip installs (not editable) copy only package data matching pyproject's globs: every source, and
    every header a source includes, must match them (else the installed package cannot compile its kernels)."""
    import fnmatch
    import re
    from pathlib import Path

    import tomllib

    from exactrl.kernels import native

    root = Path(native.__file__).parents[3]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "exactrl.kernels.native"
    ]
    included = {m for f in native.SOURCES for m in re.findall(r'#include "([^"]+)"', f.read_text())}
    assert included == {h.name for h in native.HEADERS}
    for f in (*native.SOURCES, *native.HEADERS):
        assert any(fnmatch.fnmatch(f.name, g) for g in globs), f.name


def test_sigmoid_gate_is_its_formula_and_differentiates_like_torch():
    """Qwen2-MoE's shared-expert gate: y · 1 / (1 + exp(-g)) with the kernels' exp, the same bits for a row in
    any batch; within an ulp of torch's sigmoid; the gradient autograd's of the torch expression."""
    from exactrl.kernels import get_kernels

    k = get_kernels("exact")
    g = torch.Generator().manual_seed(6)
    gate, y = torch.randn(37, 1, generator=g) * 6, torch.randn(37, 24, generator=g)
    out = k.sigmoid_gate(gate, y)
    assert torch.equal(out, y * (1.0 / (1.0 + native.exp(-gate))))
    assert all(torch.equal(k.sigmoid_gate(gate[i : i + 3], y[i : i + 3]), out[i : i + 3]) for i in range(0, 34, 5))
    assert torch.allclose(out, torch.sigmoid(gate) * y, rtol=1e-6, atol=1e-7)
    a, b = gate.clone().requires_grad_(), y.clone().requires_grad_()
    w = torch.randn(37, 24, generator=g)
    got = torch.autograd.grad((k.sigmoid_gate(a, b) * w).sum(), (a, b))
    ref = torch.autograd.grad((torch.sigmoid(a) * b * w).sum(), (a, b))
    for x, r in zip(got, ref):
        assert torch.allclose(x, r, rtol=1e-5, atol=1e-6) and x.abs().sum() > 0


def test_native_clamp_has_torchs_bits():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1031, generator=g) * 4
    x[:4] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")])
    for c in (0.5, 2.0, 1e-30):
        got, want = native.clamp(x, -c, c), x.clamp(-c, c)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[4:], want[4:])
        assert torch.equal(torch.signbit(got[1:2]), torch.signbit(want[1:2]))
