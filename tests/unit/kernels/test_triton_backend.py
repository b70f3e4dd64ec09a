"""The triton backend's kernels under Triton's interpreter, on CPU tensors (tests/unit/kernels/test_cuda.py runs
them on a GPU).

Each kernel against a float64 reference; the linear and attention bitwise invariant to the rows around a row
(alone, in a batch, in chunks, shuffled); the engine's logprobs bitwise equal to `sequence_logprobs` through
the backend, and the `fast` twin that differs. The interpreter runs a tl.dot as an fp32 broadcast product
(kernels/triton/ops.py INTERPRETED), so on CPU these check the tiles, masks and loops; the matrix
instructions themselves are checked on a GPU. Kept small: the interpreter is slow.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from interpreter import MARKS, use_interpreter

use_interpreter()

from conftest import make_hf_model  # noqa: E402

import exactrl  # noqa: E402
from exactrl.kernels.triton import attention as tattn  # noqa: E402
from exactrl.kernels.triton import ops  # noqa: E402
from exactrl.model.checkpoint import resolve_device  # noqa: E402

pytestmark = MARKS


def rel(a, ref):
    return ((a.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_linear_matches_float64_and_each_row_is_its_own(dtype, tol):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(150, 80, generator=g).to(dtype)
    x = torch.randn(37, 80, generator=g).to(dtype)
    y = ops.linear(x, w)
    assert rel(y, x.double() @ w.double().T) < tol
    assert torch.equal(torch.cat([ops.linear(x[i : i + 1], w) for i in range(37)]), y)
    other = torch.randn(140, 80, generator=g).to(dtype)
    assert torch.equal(ops.linear(torch.cat([other, x]), w)[140:], y)


def test_fast_linear_depends_on_the_row_count():
    """The twin: torch's CPU GEMM gives the first row other bits at M <= 3 than at M >= 4 (fp32)."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(256, 512, generator=g), torch.randn(64, 512, generator=g)
    full = torch.nn.functional.linear(x, w)
    assert any(not torch.equal(torch.nn.functional.linear(x[:m], w)[0], full[0]) for m in (1, 2, 3))


def test_row_kernels_match_float64():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(5, 3000, generator=g)
    z[1, :100] = float("-inf")  # a cut-off tail, as top-k leaves it
    lp, ent = ops.log_softmax(z, with_entropy=True)
    ref = torch.log_softmax(z.double(), -1)
    assert (lp[torch.isfinite(ref)] - ref[torch.isfinite(ref)]).abs().max() < 1e-5
    assert torch.isneginf(lp[1, :100]).all()
    p = ref.exp()
    assert (ent.double() + torch.where(p > 0, p * ref, 0.0).sum(-1)).abs().max() < 1e-5
    assert torch.equal(ops.entropy(lp), ent)
    x = torch.rand(3, 700, generator=g)
    assert (ops.cumsum(x) - x.double().cumsum(-1)).abs().max() < 1e-3
    h, wn = torch.randn(9, 64, generator=g), torch.randn(64, generator=g)
    want = wn.double() * h.double() / (h.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    assert rel(ops.rms_norm(h, wn, 1e-6), want) < 1e-6
    a, b = torch.randn(300, generator=g), torch.randn(300, generator=g)
    assert rel(ops.swiglu(a, b), torch.nn.functional.silu(a.double()) * b.double()) < 1e-6
    q = torch.randn(4, 3, 16, generator=g)
    cos, sin = exactrl.kernels.rotary_tables(16, 4, 10000.0)
    assert rel(ops.rotary(q, cos, sin), exactrl.kernels.apply_rotary(q.double(), cos.double(), sin.double())) < 1e-6


def test_draw_is_a_function_of_the_row_alone():
    g = torch.Generator().manual_seed(2)
    lp = torch.log_softmax(torch.randn(6, 500, generator=g), -1)
    keys, greedy = torch.arange(6) * 7919, torch.tensor([0, 0, 0, 0, 0, 1])
    tok, out = ops.draw(lp, keys, greedy)
    assert tok[5] == lp[5].argmax() and torch.equal(out, lp[torch.arange(6), tok])
    for i in range(6):
        t, o = ops.draw(lp[i : i + 1], keys[i : i + 1], greedy[i : i + 1])
        assert t.item() == tok[i] and o.item() == out[i]
    bad = lp[:1].clone()
    bad[0, 3] = float("nan")
    assert ops.draw(bad, keys[:1], greedy[:1])[0].item() == -1


def test_draw_samples_the_distribution():
    """Pearson's χ² of 600 draws against p, under 18.4 (the 1e-4 tail with 2 degrees of freedom): one row
    per draw, each its own key, as the engine draws."""
    n, p = 600, torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    lp = p.float().log().expand(n, 3).contiguous()
    tok, _ = ops.draw(lp, torch.arange(n) * 2654435761, torch.zeros(n, dtype=torch.int32))
    counts = torch.bincount(tok, minlength=3).double()
    assert float(((counts - n * p) ** 2 / (n * p)).sum()) < 18.4, counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_matches_float64_and_prefill_chunks_decode_agree(dtype):
    g = torch.Generator().manual_seed(3)
    H, Hk, D, B, P = 4, 2, 16, 16, 12
    kp, vp = torch.randn(P, Hk, B, D, generator=g).to(dtype), torch.randn(P, Hk, B, D, generator=g).to(dtype)
    lens = [36, 5, 21]
    table = torch.full((3, 4), -1, dtype=torch.int64)
    perm, c = torch.randperm(P, generator=g), 0
    for s, n in enumerate(lens):
        table[s, : -(-n // B)] = perm[c : c - (-n // B)]
        c -= -n // B
    seq = torch.cat([torch.full((n,), s) for s, n in enumerate(lens)])
    pos = torch.cat([torch.arange(n) for n in lens])
    q = torch.randn(len(seq), H, D, generator=g).to(dtype)

    def att(idx):
        return tattn.attention(
            q[idx], kp, vp, tattn.attention_tiles(seq[idx], H // Hk), seq[idx], pos[idx], table, 1 / math.sqrt(D)
        )[0]

    full = att(torch.arange(len(seq)))
    ref = torch.empty(len(seq), H, D, dtype=torch.float64)
    for i in range(len(seq)):
        s, p = seq[i].item(), pos[i].item()
        keys = torch.cat([kp[table[s, j]] for j in range(p // B + 1)], 1)[:, : p + 1].double()
        vals = torch.cat([vp[table[s, j]] for j in range(p // B + 1)], 1)[:, : p + 1].double()
        for h in range(H):
            w = torch.softmax(keys[h // 2] @ q[i, h].double() / math.sqrt(D), 0)
            ref[i, h] = w @ vals[h // 2]
    assert rel(full, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-6)
    assert torch.equal(torch.cat([att(torch.tensor([i])) for i in range(len(seq))]), full)  # decode-like
    assert torch.equal(torch.cat([att(torch.arange(a, min(a + 5, len(seq)))) for a in range(0, len(seq), 5)]), full)
    shuffled = torch.randperm(len(seq), generator=g)
    assert torch.equal(att(shuffled), full[shuffled])


def test_windowed_attention_pages_before_a_rows_window_leave_it_unchanged():
    """A sliding window of 5 keys, B = 16: one tile holds rows whose windows start on page 0 and page 1, so
    the walk starts at page 0 and page 0 is wholly before some rows' windows (their m still -inf). Each row
    gets the bits it gets alone (a decode step) and SDPA's values under transformers' mask to rounding."""
    g = torch.Generator().manual_seed(4)
    H, Hk, D, B, n, window = 2, 1, 16, 16, 24, 5
    kp, vp = torch.randn(2, Hk, B, D, generator=g), torch.randn(2, Hk, B, D, generator=g)
    table = torch.tensor([[1, 0]])
    seq, pos = torch.zeros(n, dtype=torch.int64), torch.arange(n)
    q = torch.randn(n, H, D, generator=g)

    def att(idx):
        return tattn.attention(
            q[idx], kp, vp, tattn.attention_tiles(seq[idx], H // Hk), seq[idx], pos[idx], table, 0.25, window
        )[0]

    full = att(torch.arange(n))
    assert torch.isfinite(full).all()
    assert torch.equal(torch.cat([att(torch.tensor([i])) for i in (17, 20, 23)]), full[[17, 20, 23]])
    plan = exactrl.kernels.attention.plan_fast(exactrl.kernels.TokenLayout(seq, pos, table), B)
    assert rel(full, exactrl.kernels.attention.fast_attention(q, kp, vp, plan, 0.25, window)) < 1e-5


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_triton")
    make_hf_model(d, "qwen3")
    return d


def engine_vs_trainer(model) -> float:
    rng = random.Random(0)
    prompts = [[rng.randrange(211) for _ in range(rng.randint(3, 40))] for _ in range(3)]
    outs = exactrl.Engine(model, kv_budget_tokens=2048).generate(
        prompts, exactrl.SamplingParams(max_tokens=6, n=2, seed=1, temperature=0.9)
    )
    seqs = [p + c.token_ids for p, cs in zip(prompts, outs) for c in cs]
    lps = exactrl.sequence_logprobs(model, seqs, temperature=0.9)
    got = [torch.tensor(c.logprobs) for cs in outs for c in cs]
    starts = [len(p) - 1 for p in prompts for _ in range(2)]
    return max((g - lp[s:]).abs().max().item() for g, lp, s in zip(got, lps, starts))


def test_engine_equals_trainer_through_the_triton_backend(tiny_dir):
    assert engine_vs_trainer(exactrl.load_model(tiny_dir, kernels="exact", backend="triton")) == 0.0


def test_fast_twin_differs(tiny_dir):
    assert engine_vs_trainer(exactrl.load_model(tiny_dir, kernels="fast", backend="triton")) > 0.0


def test_the_backend_is_refused_by_name_where_it_cannot_run(tiny_dir, monkeypatch):
    with pytest.raises(ValueError, match="native"):
        resolve_device("cuda", "native")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            exactrl.load_model(tiny_dir, device="cuda")
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("tpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        exactrl.load_model(tiny_dir, backend="triton")


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory):
    """Gemma 2 with soft caps a tiny random model reaches (scores and logits in tanh's bend), sliding layers."""
    d = tmp_path_factory.mktemp("gemma2_triton")
    make_hf_model(d, "gemma2", sliding_window=6, attn_logit_softcapping=1.5, final_logit_softcapping=2.0)
    return d


@pytest.mark.slow  # about 20 s under the interpreter
def test_gemma2_soft_caps_through_the_triton_backend(gemma2_dir):
    """GeGLU, capped scores and capped logits in Triton: engine == trainer bitwise, the native backend's
    logprobs to rounding; the fast twin differs."""
    model = exactrl.load_model(gemma2_dir, kernels="exact", backend="triton")
    assert engine_vs_trainer(model) == 0.0
    seqs = [[random.Random(5).randrange(211) for _ in range(30)]]
    with torch.no_grad():
        ours = exactrl.sequence_logprobs(model, seqs)[0]
        native_lp = exactrl.sequence_logprobs(exactrl.load_model(gemma2_dir), seqs)[0]
    assert (ours - native_lp).abs().max() <= 1e-4
    assert engine_vs_trainer(exactrl.load_model(gemma2_dir, kernels="fast", backend="triton")) > 0.0


@pytest.mark.slow  # about 20 s under the interpreter
def test_moe_through_the_triton_backend(tmp_path):
    """Qwen3-MoE: the router's exact linear and each expert's products in Triton; engine == trainer bitwise,
    the fast twin differs."""
    make_hf_model(tmp_path, "qwen3_moe")
    assert engine_vs_trainer(exactrl.load_model(tmp_path, kernels="exact", backend="triton")) == 0.0
    assert engine_vs_trainer(exactrl.load_model(tmp_path, kernels="fast", backend="triton")) > 0.0
