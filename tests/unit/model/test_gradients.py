"""Hand-written backwards against plain autograd of the same forward.

Only forward values carry the bitwise contract; the gradients of the chunked
LM head (`_HeadLogprobs`) and of exact attention (`_ExactAttention`, whose
backward in C starts from its own forward's output and log-sum-exp) must
still be the gradients of that forward, to fp32 rounding. The references differentiate the unchunked, untiled ops with
autograd (attention: token by token in plain torch ops).
"""

from __future__ import annotations

import pytest
import torch

import exactrl
import exactrl.model.logprobs as LP
from exactrl.kernels import attention as A
from exactrl.kernels import native, sampling_logprobs
from exactrl.model.logprobs import pack_layout, pack_shared, token_logprobs


def _math_attention(q_NHD, k_pages, v_pages, plan, scale, window=0, softcap=0.0):
    """Causal attention token by token in plain differentiable torch ops (no SDPA, no native kernel); a
    sliding `window` > 0: keys pos - window + 1..pos; `softcap` > 0: scores capped to c·tanh(s / c)."""
    lay, B = plan.layout, plan.block_size
    g = q_NHD.shape[1] // k_pages.shape[1]
    outs = []
    for n in range(q_NHD.shape[0]):
        p = int(lay.pos_N[n])
        t = torch.arange(max(0, p + 1 - window) if window else 0, p + 1)
        pages = lay.block_table_SJ[lay.seq_N[n], t // B]
        k = k_pages[pages, :, t % B].float().repeat_interleave(g, dim=1)  # [L, H, D]
        v = v_pages[pages, :, t % B].float().repeat_interleave(g, dim=1)
        s = torch.einsum("hd,lhd->hl", q_NHD[n].float() * scale, k)
        w = (torch.tanh(s / softcap) * softcap if softcap > 0 else s).softmax(-1)
        outs.append(torch.einsum("hl,lhd->hd", w, v))
    return torch.stack(outs).to(q_NHD.dtype)


def _reference_head(model, h, w, tgt, temp, top_k, top_p, ent_coef):
    n = h.shape[0]
    lp_NV = sampling_logprobs(
        model.kernels.linear(h, w).float(), torch.full((n,), temp), torch.full((n,), top_k), torch.full((n,), top_p)
    )
    lp = lp_NV.gather(1, tgt[:, None]).squeeze(1)
    p = lp_NV.exp()
    ent = -(p * lp_NV.masked_fill(p == 0, 0.0)).sum(-1)
    return lp, ent


@pytest.mark.parametrize(
    "temp,top_k,top_p,ent_coef", [(1.0, -1, 1.0, 0.0), (0.7, 20, 1.0, 0.3), (1.3, -1, 0.8, 0.5), (0.0, -1, 1.0, 0.0)]
)
@pytest.mark.parametrize("kernels", ["exact", "fast"])
def test_head_logprobs_values_and_gradients(qwen3_dir, monkeypatch, kernels, temp, top_k, top_p, ent_coef):
    monkeypatch.setattr(LP, "HEAD_CHUNK_ROWS", 7)  # several chunks, a ragged last one
    model = exactrl.load_model(qwen3_dir, kernels=kernels)
    g = torch.Generator().manual_seed(0)
    V, D = model.config.vocab_size, model.config.hidden_size
    h = (torch.randn(30, D, generator=g) * 3).requires_grad_()
    w = model.model.embed_tokens.weight
    tgt = torch.randint(V, (30,), generator=g)
    coef = torch.randn(30, generator=g)
    lp, ent = LP._head_logprobs(model, h, w, tgt, (temp, top_k, top_p), True, ent_coef != 0)
    ((lp.masked_fill(~torch.isfinite(lp), 0) * coef).sum() + ent_coef * ent.sum()).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad, w.grad = None, None
    ref_lp, ref_ent = _reference_head(model, h, w, tgt, temp, top_k, top_p, ent_coef)
    if kernels == "exact":  # forward: the same bits (fast linears depend on the chunk's row count)
        assert torch.equal(lp, ref_lp)
        # the entropy is pointwise.c's sum over the unchunked rows, bit for bit; the torch formula to rounding
        with torch.no_grad():
            ref_NV = sampling_logprobs(
                model.kernels.linear(h, w).float(),
                torch.full((30,), temp),
                torch.full((30,), top_k),
                torch.full((30,), top_p),
            )
        assert torch.equal(ent, native.entropy(ref_NV))
        assert torch.allclose(ent, ref_ent, rtol=1e-6, atol=1e-6)
    else:
        assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    ((ref_lp.masked_fill(~torch.isfinite(ref_lp), 0) * coef).sum() + ent_coef * ref_ent.sum()).backward()
    assert torch.allclose(gh, h.grad, rtol=1e-4, atol=1e-6)
    assert torch.allclose(gw, w.grad, rtol=1e-4, atol=1e-6)
    assert gh.abs().sum() > 0


def test_head_logprobs_cut_off_target_matches_autograd(qwen3_dir):
    """A target outside top-k has logprob -inf; its own logit gets no gradient, the others still do."""
    model = exactrl.load_model(qwen3_dir)
    h = torch.randn(4, model.config.hidden_size, requires_grad=True)
    w = model.model.embed_tokens.weight
    with torch.no_grad():
        tgt = model.logits(h).argmin(-1)
    lp, _ = LP._head_logprobs(model, h, w, tgt, (1.0, 3, 1.0), False, False)
    assert torch.isinf(lp).all()
    (gh,) = torch.autograd.grad(lp.sum(), h)
    ref, _ = _reference_head(model, h, w, tgt, 1.0, 3, 1.0, 0.0)
    (rh,) = torch.autograd.grad(ref.sum(), h)
    assert torch.allclose(gh, rh, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_attention_gradient_is_the_attention_gradient(dtype):
    """The C backward fed the C forward's output and log-sum-exp vs autograd through plain attention math;
    forward values close to it."""
    g = torch.Generator().manual_seed(1)
    lengths, H, Hk, D, B = [37, 5, 64], 6, 2, 16, 8
    lay, pages = pack_layout(lengths, B)
    n = sum(lengths)
    q = torch.randn(n, H, D, generator=g).to(dtype).requires_grad_()
    k = torch.randn(n, Hk, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(n, Hk, D, generator=g).to(dtype).requires_grad_()
    w = torch.randn(n, H, D, generator=g)

    def run(attend):
        kp, vp = A.write_kv(
            torch.zeros(pages, Hk, B, D, dtype=dtype), torch.zeros(pages, Hk, B, D, dtype=dtype), k, v, lay
        )
        o = attend(q, kp, vp, A.plan_exact(lay, B), 0.25)
        return o, torch.autograd.grad((o.float() * w).sum(), (q, k, v))

    o, grads = run(A.exact_attention)
    ref_o, ref_grads = run(_math_attention)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert torch.allclose(o.float(), ref_o.float(), **tol)
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a.float(), b.float(), **tol)
        assert a.float().abs().sum() > 0


# D = 12: the loops past 8-lane blocks; G = 9: the scores past the fixed-G paths
@pytest.mark.parametrize("softcap", [0.0, 1.0])  # 1.0: Gemma 2's score cap, well inside tanh's bend here
@pytest.mark.parametrize("H,Hk,D", [(4, 2, 16), (6, 2, 64), (3, 3, 12), (9, 1, 16)])
def test_attention_backward_over_shared_pages_is_autograd_through_sdpa_and_thread_independent(H, Hk, D, softcap):
    """exact.c's attention backward, over prompts laid out once and shared by their samples (their keys'
    gradients summed from every sequence reading them), partly filled pages, a sequence alone, a row of
    the block table no token uses and the tokens in shuffled order: the gradients of autograd through SDPA
    (`fast_attention`, the other path; with a soft cap, autograd through its tanh) to rounding, and the same
    bits at 1 and 2 threads (each sequence and kv head is summed by one thread, rows in call order)."""
    g = torch.Generator().manual_seed(2)
    seqs = [[1] * 40 + [2] * 9, [1] * 40 + [3] * 20, [5] * 7, [1] * 40 + [4] * 13]
    lay, pages, _, _ = pack_shared(seqs, [40, 40, 3, 40], 8)
    perm = torch.randperm(len(lay.seq_N), generator=g)
    table = torch.cat([lay.block_table_SJ, torch.full((1, lay.block_table_SJ.shape[1]), -1)])  # an idle row
    lay = A.TokenLayout(lay.seq_N[perm], lay.pos_N[perm], table)
    n, B = len(lay.seq_N), 8
    q, k, v = (torch.randn(n, h, D, generator=g).requires_grad_() for h in (H, Hk, Hk))
    w = torch.randn(n, H, D, generator=g)

    def grads(attend, plan):
        kp, vp = A.write_kv(torch.zeros(pages, Hk, B, D), torch.zeros(pages, Hk, B, D), k, v, lay)
        o = attend(q, kp, vp, plan(lay, B), 0.25, 0, softcap)
        return torch.autograd.grad((o * w).sum(), (q, k, v))

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = grads(A.exact_attention, A.plan_exact)
        torch.set_num_threads(2)
        two = grads(A.exact_attention, A.plan_exact)
    finally:
        torch.set_num_threads(threads)
    sdpa = grads(A.fast_attention, A.plan_fast)
    for a, b, c in zip(one, two, sdpa):
        assert torch.equal(a, b)
        assert torch.allclose(a, c, rtol=1e-4, atol=1e-5) and a.abs().sum() > 0


def test_trainer_path_gradients_match_unchunked_autograd(qwen3_dir, monkeypatch):
    """`token_logprobs` end to end: same values, same parameter gradients as plain autograd."""
    model = exactrl.load_model(qwen3_dir)
    seqs = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6], [5] * 40]
    first = [3, 1, 10]
    lps, _ = token_logprobs(model, seqs, first=first)
    torch.cat(lps).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(A, "exact_attention", _math_attention)

    def plain(model, h, w, tgt, dist, with_entropy, entropy_grad):
        return _reference_head(model, h, w, tgt, *dist, 0.0)[0], None

    monkeypatch.setattr(LP, "_head_logprobs", plain)
    ref, _ = token_logprobs(model, seqs, first=first)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(lps, ref))
    torch.cat(ref).sum().backward()
    for n, p in model.named_parameters():
        assert torch.allclose(got[n], p.grad, rtol=1e-3, atol=1e-6), n


def test_head_logprobs_keeps_nothing_without_grad(qwen3_dir, monkeypatch):
    """Under no_grad (reference model, behaviour recompute) no [chunk, V] tensor is held."""
    monkeypatch.setattr(LP, "HEAD_CHUNK_ROWS", 8)
    model = exactrl.load_model(qwen3_dir)
    kept = []
    orig = LP._HeadLogprobs.forward

    def spy(ctx, *args):
        out = orig(ctx, *args)
        kept.append(len(ctx.chunks))
        return out

    monkeypatch.setattr(LP._HeadLogprobs, "forward", staticmethod(spy))
    with torch.no_grad():
        token_logprobs(model, [[1, 2, 3] * 10])
    token_logprobs(model, [[1, 2, 3] * 10])
    assert kept == [0, 4]  # 29 rows: 4 chunks of 8 kept only when a backward can follow


def _head_step(model, h0, w0, tgt, coef, dist, ent_coef):
    """lp, entropy and the gradients of h and W of one head call with a backward (fresh leaves)."""
    h, w = h0.clone().requires_grad_(), w0.detach().clone().requires_grad_()
    lp, ent = LP._head_logprobs(model, h, w, tgt, dist, True, ent_coef != 0)
    ((lp.masked_fill(~torch.isfinite(lp), 0) * coef).sum() + ent_coef * ent.sum()).backward()
    return lp, ent, h.grad, w.grad


@pytest.mark.parametrize(
    "dist,ent_coef", [((1.0, -1, 1.0), 0.0), ((1.0, -1, 1.0), 0.3), ((0.7, 20, 1.0), 0.3), ((1.3, -1, 0.8), 0.0)]
)
@pytest.mark.parametrize("kernels", ["exact", "fast"])
def test_head_recompute_gives_the_kept_chunks_bits(qwen3_dir, monkeypatch, kernels, dist, ent_coef):
    """`model.head_recompute`: the backward projects each row chunk again instead of keeping its [chunk, V]
    logprobs, and lp, the entropy and both gradients are bitwise those of the kept chunks (either kernels:
    the recomputation is the forward's own call on the same rows)."""
    monkeypatch.setattr(LP, "HEAD_CHUNK_ROWS", 7)  # several chunks, a ragged last one
    model = exactrl.load_model(qwen3_dir, kernels=kernels)
    g = torch.Generator().manual_seed(1)
    V, D = model.config.vocab_size, model.config.hidden_size
    h0, tgt = torch.randn(30, D, generator=g) * 3, torch.randint(V, (30,), generator=g)
    coef, w0 = torch.randn(30, generator=g), model.model.embed_tokens.weight
    kept = []
    orig = LP._HeadLogprobs.forward

    def spy(ctx, *args):
        out = orig(ctx, *args)
        kept.append(len(ctx.chunks))
        return out

    monkeypatch.setattr(LP._HeadLogprobs, "forward", staticmethod(spy))
    runs = []
    for recompute in (False, True):
        model.head_recompute = recompute
        runs.append(_head_step(model, h0, w0, tgt, coef, dist, ent_coef))
    assert kept == [5, 0]  # 30 rows: 5 chunks kept, or none
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert runs[0][2].abs().sum() > 0 and runs[0][3].abs().sum() > 0


@pytest.mark.parametrize("kernels", ["exact", "fast"])
def test_head_chunk_rows_change_no_forward_bit_with_exact_kernels_only(qwen3_dir, monkeypatch, kernels):
    """Why the head may chunk (and recompute) its rows: an exact row's logprob does not depend on how many rows
    share its call. The inverse twin: `fast` linears pick their kernel by the row count, and the bits move."""
    model = exactrl.load_model(qwen3_dir, kernels=kernels)
    g = torch.Generator().manual_seed(2)
    V, D = model.config.vocab_size, model.config.hidden_size
    h, tgt = torch.randn(300, D, generator=g) * 3, torch.randint(V, (300,), generator=g)
    w = model.model.embed_tokens.weight
    outs = []
    for rows in (1, 7, 300):
        monkeypatch.setattr(LP, "HEAD_CHUNK_ROWS", rows)
        with torch.no_grad():
            outs.append(LP._head_logprobs(model, h, w, tgt, (1.0, -1, 1.0), True, False))
    same = all(torch.equal(o[0], outs[0][0]) and torch.equal(o[1], outs[0][1]) for o in outs)
    assert same == (kernels == "exact")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(300, 96), (7, 6, 20), (1, 5)])
def test_exact_rms_norm_gradient_is_the_rms_norm_gradient(dtype, shape):
    """fp32 takes exact.c's hand-written backward, bf16 autograd of the torch expression: both against
    autograd of that expression in float64; each input's gradient alone as well."""
    from exactrl.kernels.rowwise import exact_rms_norm, rms_norm

    g = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(*shape, generator=g).to(dtype).requires_grad_()
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype).requires_grad_()
    gy = torch.randn(*shape, generator=g).to(dtype)
    dx, dw = torch.autograd.grad(exact_rms_norm(x, w, 1e-6), (x, w), gy)
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref_dx, ref_dw = torch.autograd.grad(rms_norm(xd, wd, 1e-6), (xd, wd), gy.double())
    rel = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: its products round, and dw sums rows in bf16
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    for got, ref in ((dx, ref_dx), (dw, ref_dw)):
        assert torch.allclose(got.double(), ref, rtol=rel, atol=rel * ref.abs().max().item())
    assert dw.abs().sum() > 0
    (only_dx,) = torch.autograd.grad(exact_rms_norm(x, w.detach(), 1e-6), (x,), gy)
    assert torch.equal(only_dx, dx)


@pytest.mark.parametrize("N, K", [(5, 7), (40, 33), (33, 40), (130, 64)])  # both orientations, ragged panels
def test_linear_gradients_through_the_native_kernel_are_the_products_and_thread_independent(N, K):
    """`input_grad` (g W) and `weight_grad` (gᵀ x), the exact linear's backward in fp32: the products to fp32
    rounding (against float64), the same bits at 1 and 2 threads, from non-contiguous inputs too; with no
    rows the weight gradient is zeros; the exact linear's autograd gives them."""
    from exactrl.kernels.linear import exact_linear, input_grad, weight_grad

    gen = torch.Generator().manual_seed(N * 100 + K)
    M = 300
    x = torch.randn(M, K, generator=gen)
    g = torch.randn(N, M, generator=gen).t()  # a transposed view: not contiguous
    w = torch.randn(N, K, generator=gen)
    threads = torch.get_num_threads()
    try:
        got = {}
        for t in (1, 2):
            torch.set_num_threads(t)
            got[t] = input_grad(g, w), weight_grad(g, x)
    finally:
        torch.set_num_threads(threads)
    gx, gw = got[1]
    assert all(torch.equal(a, b) for a, b in zip(got[1], got[2]))
    assert gx.shape == (M, K) and gw.shape == (N, K)
    torch.testing.assert_close(gx.double(), g.double() @ w.double(), rtol=0, atol=1e-4)
    torch.testing.assert_close(gw.double(), g.double().t() @ x.double(), rtol=0, atol=1e-3)
    assert torch.equal(weight_grad(g[:0], x[:0]), torch.zeros(N, K))
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    exact_linear(xr, wr).backward(g)
    assert torch.equal(xr.grad, gx) and torch.equal(wr.grad, gw)


def test_panels_packed_from_the_transpose_are_the_transposes_panels():
    for K, N in ((7, 5), (300, 33), (64, 130)):
        s = torch.randn(K, N)
        assert torch.equal(native.packed_transpose(s).panels, native.PackedLinearWeight(s.t().contiguous()).panels)
