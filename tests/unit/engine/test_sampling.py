"""Sampler units: row-grouped sampling_logprobs, seeded draws, greedy, truncation, distribution."""

from __future__ import annotations

import torch

from exactrl import SamplingParams
from exactrl.engine.cache import PagePool
from exactrl.engine.sampling import SampleRows, draw, row_logprobs, sample, sample_uniform
from exactrl.kernels import sampling_logprobs


def rows_for(params: list[SamplingParams], V: int, uniforms=None) -> SampleRows:
    return SampleRows(
        [float(p.temperature) for p in params],
        [p.top_k for p in params],
        [float(p.top_p) for p in params],
        uniforms if uniforms is not None else [0.5] * len(params),
        [p.branch_flags(V) for p in params],
    )


def test_row_logprobs_mixed_rows_equal_uniform_calls():
    """Each row equals the trainer's call with that row's parameters for every row."""
    torch.manual_seed(0)
    V = 3000
    logits = torch.randn(9, V) * 4
    params = [
        SamplingParams(),
        SamplingParams(top_p=0.9),
        SamplingParams(top_k=20),
        SamplingParams(temperature=0.5, top_k=5, top_p=0.7),
        SamplingParams(temperature=0),
        SamplingParams(top_k=V + 5),
        SamplingParams(top_p=0.3, temperature=2.0),
        SamplingParams(),
        SamplingParams(top_k=1),
    ]
    lp = row_logprobs(logits, rows_for(params, V))
    for i, p in enumerate(params):
        n = 5  # trainer-style: a batch of rows with uniform parameters
        ref = sampling_logprobs(
            logits[i : i + 1].expand(n, V),
            torch.full((n,), float(p.temperature)),
            torch.full((n,), p.top_k),
            torch.full((n,), float(p.top_p)),
        )
        assert torch.equal(lp[i], ref[0]), i


def test_sample_is_draw_of_row_logprobs(monkeypatch):
    """The engine's `sample`: the fused C pass for plain rows (T in {0, 1}, no truncation), the two calls
    otherwise; both the tokens and logprobs of `draw(row_logprobs(...))`."""
    from exactrl.kernels import native

    torch.manual_seed(3)
    V = 2000
    logits = torch.randn(6, V) * 3
    us = [sample_uniform(7, j, 40) for j in range(6)]
    for params in (
        [SamplingParams(), SamplingParams(temperature=0)] * 3,
        [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(top_k=5)] * 2,
    ):
        rows = rows_for(params, V, us)
        tok, lp = sample(logits, rows)
        ref_tok, ref_lp = draw(row_logprobs(logits, rows), rows)
        assert torch.equal(tok, ref_tok) and torch.equal(lp, ref_lp)
    real, fused = native.sample, []
    monkeypatch.setattr(native, "sample", lambda *a: fused.append(1) or real(*a))
    sample(logits[:2], rows_for([SamplingParams(), SamplingParams(temperature=0)], V, us[:2]))
    sample(logits[:2], rows_for([SamplingParams(), SamplingParams(temperature=0.7)], V, us[:2]))
    assert fused == [1]  # only the plain rows took the fused pass


def test_row_logprobs_plain_rows_take_the_short_path_with_the_same_bits(monkeypatch):
    """Rows at T = 0 or 1 without top-k/top-p (the RL default) skip sampling_logprobs' checks: the same
    bits as the full call; one tempered row sends the batch through the full path."""
    import exactrl.engine.sampling as S

    torch.manual_seed(1)
    V = 3000
    logits = torch.randn(6, V) * 4
    params = [
        SamplingParams(),
        SamplingParams(temperature=0),
        SamplingParams(top_k=V),
        SamplingParams(top_p=1.0),
        SamplingParams(),
        SamplingParams(temperature=1.0),
    ]
    full = sampling_logprobs(
        logits,
        torch.tensor([float(p.temperature) for p in params]),
        torch.tensor([p.top_k for p in params]),
        torch.tensor([float(p.top_p) for p in params]),
    )
    calls = []
    monkeypatch.setattr(S, "sampling_logprobs", lambda *a: calls.append(1) or sampling_logprobs(*a))
    assert torch.equal(row_logprobs(logits, rows_for(params, V)), full) and not calls
    row_logprobs(logits, rows_for(params[:5] + [SamplingParams(temperature=0.7)], V))
    assert calls


def test_uniform_is_counter_based():
    a = [sample_uniform(7, j, t) for j in range(3) for t in range(50)]
    assert a == [sample_uniform(7, j, t) for j in range(3) for t in range(50)]
    assert len(set(a)) == len(a) and all(0 <= u < 1 for u in a)
    assert sample_uniform(8, 0, 0) != sample_uniform(7, 0, 0)
    assert 0 <= sample_uniform(-5, 0, 0) < 1


def test_draw_greedy_topk_and_extremes():
    torch.manual_seed(1)
    V = 100
    logits = torch.randn(4, V)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(top_k=3),
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.5),
    ]
    rows = rows_for(params, V, uniforms=[0.3, 0.0, 1.0 - 2**-53, 0.9999])
    lp = row_logprobs(logits, rows)
    tok, tlp = draw(lp, rows)
    assert tok[0] == logits[0].argmax()
    for i in (1, 2):
        assert tok[i].item() in set(logits[i].topk(3).indices.tolist())
    assert torch.isfinite(tlp).all() and torch.equal(tlp, lp[torch.arange(4), tok])


def test_draw_follows_the_distribution():
    V = 6
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5, -30.0]])
    p = SamplingParams(temperature=0.8)
    n = 20000
    us = [sample_uniform(3, 0, t) for t in range(n)]
    lp = row_logprobs(logits.expand(n, V), rows_for([p] * n, V, us))
    tok, _ = draw(lp, rows_for([p] * n, V, us))
    freq = torch.bincount(tok, minlength=V).double() / n
    assert (freq - lp[0].exp().double()).abs().max() < 0.015
    assert freq[5] == 0


def test_draw_two_levels_across_blocks():
    """Blocks of DRAW_BLOCK tokens: the distribution holds across block edges and a
    masked token is never drawn, even for u -> 1 with the last kept token in an early block."""
    from exactrl.engine.sampling import DRAW_BLOCK

    V = 2 * DRAW_BLOCK + 37  # ragged last block
    logits = torch.full((1, V), -1e9)
    hot = [0, DRAW_BLOCK - 1, DRAW_BLOCK, 2 * DRAW_BLOCK + 36]  # both sides of each edge, and the last id
    logits[0, hot] = torch.tensor([0.0, 1.0, 0.5, -0.5])
    p = SamplingParams()
    n = 20000
    us = [sample_uniform(5, 0, t) for t in range(n)]
    lp = row_logprobs(logits.expand(n, V), rows_for([p] * n, V, us))
    tok, tlp = draw(lp, rows_for([p] * n, V, us))
    freq = torch.bincount(tok, minlength=V).double() / n
    assert set(tok.unique().tolist()) == set(hot)
    assert (freq - lp[0].exp().double()).abs().max() < 0.015
    assert torch.equal(tlp, lp[torch.arange(n), tok])
    # top-k keeps only tokens of the first block: u at the very top must stay inside it
    logits2 = torch.randn(3, V)
    logits2[:, :4] += 50.0
    params = [SamplingParams(top_k=4)] * 3
    rows = rows_for(params, V, uniforms=[0.0, 0.5, 1.0 - 2**-53])
    tok2, tlp2 = draw(row_logprobs(logits2, rows), rows)
    assert all(0 <= t < 4 for t in tok2.tolist()) and torch.isfinite(tlp2).all()


def test_page_pool_refcounts(qwen3_dir):
    import exactrl

    model = exactrl.load_model(qwen3_dir)
    pool = PagePool(model, 4)
    a = pool.allocate(3)
    assert pool.num_free == 1
    pool.share(a[:2])
    assert pool.is_shared(a[0]) and not pool.is_shared(a[2])
    pool.release(a)
    assert pool.num_free == 2 and not pool.is_shared(a[0])
    pool.kv[0][0][a[0]] = 1.0
    (b,) = pool.allocate(1)
    pool.copy([(a[0], b)])
    assert torch.equal(pool.kv[0][0][b], pool.kv[0][0][a[0]])
    pool.release(a[:2] + [b])
    assert pool.num_free == 4


def test_a_rows_distribution_is_the_same_alone_and_in_a_batch():
    """Every reduction of sampling_logprobs is per row (C log-softmax, also under top-p): a lone row, as in
    a decode step of one sequence, gets the bits it gets among 40 rows (a trainer's chunk)."""
    g = torch.Generator().manual_seed(7)
    z = torch.randn(40, 3000, generator=g) * 4
    full = lambda n, v: torch.full((n,), v)  # noqa: E731
    for temp, k, p in [(1.0, -1, 1.0), (0.7, 50, 0.9), (1.3, -1, 0.8)]:
        batch = sampling_logprobs(z, full(40, temp), full(40, k), full(40, p))
        for r in (0, 17, 39):
            assert torch.equal(sampling_logprobs(z[r : r + 1], full(1, temp), full(1, k), full(1, p)), batch[r : r + 1])
