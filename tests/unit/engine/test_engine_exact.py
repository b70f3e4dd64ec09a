"""The heart: engine logprobs == trainer logprobs, bitwise, in exact mode (docs/design.md §1).

Every completion of every workload is compared with `sequence_logprobs` over
prompt + completion with `torch.equal`. Workloads vary arrival order and
staggering, batch size, prompt length (one token, page boundaries, several
pages, chunked prefill), n, stop ids, temperature / top-k / top-p, a KV budget
small enough to force preemption, dtype, and weights after `update_weights`.
The fast-mode twins live in test_engine_fast_twin.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_hf_model
from engine_helpers import all_pages_free, check_finish, long_context_dir, long_prompts, mismatches, small_rope_chunk  # noqa: F401
from fuzzing import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import exactrl
from exactrl import Engine, SamplingParams

HSET = settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
V = 211  # conftest TINY vocabulary


@pytest.fixture(scope="module")
def models(qwen3_dir):
    return {d: exactrl.load_model(qwen3_dir, dtype=d, kernels="exact") for d in ("float32", "bfloat16")}


def check_page_refs(engine: Engine) -> None:
    """Every page's refcount is the number of live sequences holding it."""
    refs = [0] * engine.pool.num_pages
    for req in engine._requests.values():
        for seq in req.seqs:
            for p in seq.pages:
                refs[p] += 1
    assert refs == engine.pool._refs
    assert engine.pool.num_free == refs.count(0)


def run_workload(
    engine: Engine, requests: list[tuple[list[int], SamplingParams, int]], aborts: dict[int, int] | None = None
):
    """Adds request k at step arrive_k (staggered), aborts request k at step aborts[k], steps until done.

    Returns [(prompt, params, completions)] in request order (None for aborted
    requests), read from `step()`'s outputs; checks page refcounts every step.
    """
    aborts = dict(aborts or {})
    pending = sorted(range(len(requests)), key=lambda k: requests[k][2])
    ids: dict[str, int] = {}
    done: dict[int, list] = {}
    step = 0
    while pending or engine.has_unfinished():
        while pending and requests[pending[0]][2] <= step:
            k = pending.pop(0)
            ids[engine.add_request(requests[k][0], requests[k][1])] = k
        for rid, k in ids.items():
            if aborts.get(k) == step:
                engine.abort(rid)
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out.completions
        check_page_refs(engine)
        step += 1
        assert step < 10_000
    return [(p, sp, done.get(k)) for k, (p, sp, _) in enumerate(requests) if k not in aborts or k in done]


def assert_exact(model, engine, results):
    items = [(p, c, sp) for p, sp, comps in results for c in comps]
    for p, sp, comps in results:
        assert [c.index for c in comps] == list(range(sp.n))
        for c in comps:
            assert c.prompt_token_ids == p
            check_finish(c, sp, set(sp.stop_token_ids) | (set() if sp.ignore_eos else engine.stop_token_ids))
    bad = mismatches(model, items)
    assert not bad, f"{len(bad)}/{len(items)} completions differ; first max|Δ|={bad[0][2]:.3e}"
    assert all_pages_free(engine)


def fixed_workload(seed: int = 0):
    rng = random.Random(seed)
    lengths = [1, 5, 31, 32, 33, 64, 70, 100, 2]
    params = [
        SamplingParams(max_tokens=12, seed=1),
        SamplingParams(temperature=0.0, max_tokens=9, n=2),
        SamplingParams(temperature=0.7, top_k=5, max_tokens=20, n=3, seed=7),
        SamplingParams(temperature=1.3, top_p=0.8, max_tokens=15, seed=3),
        SamplingParams(top_k=50, top_p=0.9, max_tokens=33, n=2, seed=11),
        SamplingParams(max_tokens=25, stop_token_ids=[3, 4, 5, 6, 7, 8], n=4, seed=5),
    ]
    return [([rng.randrange(V) for _ in range(n)], params[k % len(params)], k // 3) for k, n in enumerate(lengths)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "config",
    [
        dict(),  # roomy: everything in one batch, whole-prompt prefill
        dict(max_num_batched_tokens=24, max_num_seqs=5),  # chunked prefill, few slots
        dict(kv_budget_tokens=160, max_num_batched_tokens=40),  # 5 pages: preemption
    ],
    ids=["roomy", "chunked", "preempt"],
)
def test_fixed_workload_exact(models, dtype, config):
    engine = Engine(models[dtype], **config)
    results = run_workload(engine, fixed_workload())
    assert_exact(models[dtype], engine, results)
    if "kv_budget_tokens" in config:
        assert engine.scheduler.num_preemptions > 0


def test_long_samples_over_a_tight_budget_do_not_evict_each_other(models):
    """Two samples of 400 tokens over a KV budget of 1.25 of them, prefill chunks of 50: the newer sample is
    preempted once (or a few times) as the older grows, and waits until all of its tokens fit again rather
    than coming back on one chunk's pages to be evicted by the next growth (each return recomputes it from
    its start). The tokens and logprobs are those of a roomy engine, bitwise."""
    model = models["float32"]
    sp = SamplingParams(max_tokens=400, n=2, seed=6, ignore_eos=True)
    tight = Engine(model, kv_budget_tokens=500, max_num_batched_tokens=50)
    got = [(c.token_ids, c.logprobs) for c in tight.generate([[5, 6, 7]], sp)[0]]
    assert 1 <= tight.scheduler.num_preemptions <= 3, tight.scheduler.num_preemptions
    assert got == [(c.token_ids, c.logprobs) for c in Engine(model).generate([[5, 6, 7]], sp)[0]]
    assert all_pages_free(tight)


def test_generate_exact_and_shapes(models):
    model = models["float32"]
    rng = random.Random(1)
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (3, 40, 77)]
    sp = SamplingParams(max_tokens=10, n=2, seed=4)
    outs = Engine(model).generate(prompts, sp)
    assert [len(o) for o in outs] == [2, 2, 2]
    bad = mismatches(model, [(p, c, sp) for p, o in zip(prompts, outs) for c in o])
    assert not bad
    assert all(c.versions == [0] * len(c.token_ids) for o in outs for c in o)


def test_engine_fuses_projections_and_stays_exact(models, monkeypatch):
    """In the engine each layer's q/k/v and gate/up go through one native product (the trainer's
    `sequence_logprobs` a module call each): the logprobs still agree bitwise, so the fusion is real and exact."""
    from exactrl.kernels import native

    calls = []
    real = native.linears
    monkeypatch.setattr(native, "linears", lambda x, w: calls.append(w.Ns) or real(x, w))
    model = models["float32"]
    c = model.config
    rng = random.Random(2)
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (5, 33)]
    sp = SamplingParams(max_tokens=6, seed=3)
    outs = Engine(model).generate(prompts, sp)
    qkv = (c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.num_key_value_heads * c.head_dim)
    assert calls.count(qkv) >= c.num_hidden_layers and (c.intermediate_size,) * 2 in calls
    assert not mismatches(model, [(p, o[0], sp) for p, o in zip(prompts, outs)])


@st.composite
def workloads(draw):
    n_req = draw(st.integers(1, 7))
    reqs = []
    for _ in range(n_req):
        plen = draw(st.sampled_from([1, 2, 15, 31, 32, 33, 47, 64, 65, 90]))
        prompt = draw(st.lists(st.integers(0, V - 1), min_size=plen, max_size=plen))
        sp = SamplingParams(
            temperature=draw(st.sampled_from([0.0, 0.6, 1.0, 1.4])),
            top_k=draw(st.sampled_from([-1, -1, 1, 7, 60, 500])),
            top_p=draw(st.sampled_from([1.0, 1.0, 0.95, 0.5])),
            max_tokens=draw(st.integers(1, 24)),
            n=draw(st.integers(1, 3)),
            seed=draw(st.integers(0, 2**40)),
            stop_token_ids=draw(st.lists(st.integers(0, V - 1), max_size=6)),
        )
        reqs.append((prompt, sp, draw(st.integers(0, 6))))
    aborts = draw(st.dictionaries(st.integers(0, n_req - 1), st.integers(0, 12), max_size=2))
    config = dict(
        kv_budget_tokens=draw(st.sampled_from([128, 192, 320, 4096])),
        max_num_batched_tokens=draw(st.sampled_from([7, 32, 100, 2048])),
        max_num_seqs=draw(st.sampled_from([3, 4, 16, 64])),
    )
    return reqs, aborts, config


@HSET
@given(w=workloads(), dtype=st.sampled_from(["float32", "bfloat16"]))
def test_random_workloads_exact(models, w, dtype):
    reqs, aborts, config = w
    engine = Engine(models[dtype], **config)
    results = run_workload(engine, reqs, aborts)
    assert_exact(models[dtype], engine, results)


def test_seed_same_tokens_whatever_the_batch(models):
    model = models["float32"]
    rng = random.Random(2)
    target = ([rng.randrange(V) for _ in range(37)], SamplingParams(max_tokens=20, n=2, seed=123, top_p=0.9))
    alone = run_workload(Engine(model), [(target[0], target[1], 0)])[0][2]
    others = [
        (
            [rng.randrange(V) for _ in range(rng.randint(1, 80))],
            SamplingParams(max_tokens=rng.randint(1, 30), seed=rng.randrange(99)),
            rng.randint(0, 5),
        )
        for _ in range(9)
    ]
    for config, arrive in [(dict(), 0), (dict(max_num_batched_tokens=16), 3), (dict(kv_budget_tokens=128), 2)]:
        crowd = others[:4] + [(target[0], target[1], arrive)] + others[4:]
        got = run_workload(Engine(model, **config), crowd)[4][2]
        assert [c.token_ids for c in got] == [c.token_ids for c in alone]
        assert [c.logprobs for c in got] == [c.logprobs for c in alone]
    assert alone[0].token_ids != alone[1].token_ids  # samples j differ


def test_a_top_p_that_is_one_in_fp32_is_no_cut_whatever_the_batch(models):
    """top_p = 1 - 1e-9 is 1.0 in fp32: no top-p for the trainer, so none for the engine either, also when
    the row shares a step with a real top-p request (it does not join that group and lose its tail)."""
    model = models["float32"]
    prompt = [5, 17, 42, 99, 3, 8]
    near_one = SamplingParams(temperature=0.02, top_p=1 - 1e-9, max_tokens=8, seed=0)
    assert near_one.branch_flags(V) == (False, False)
    alone = Engine(model).generate([prompt], near_one)[0][0]
    mixed = Engine(model).generate(
        [prompt, [8, 9, 10]], [near_one, SamplingParams(temperature=0.02, top_p=0.5, max_tokens=8)]
    )[0][0]
    ref = exactrl.sequence_logprobs(model, [prompt + alone.token_ids], 0.02, -1, 1 - 1e-9)[0][len(prompt) - 1 :]
    assert mixed.token_ids == alone.token_ids and mixed.logprobs == alone.logprobs == ref.tolist()
    # the kernel itself: a row without top-p keeps its tail beside rows with one
    from exactrl.kernels.rowwise import sampling_logprobs

    z = torch.tensor([[30.0, 0.0, 0.0, -1.0], [1.0, 0.5, 0.0, -1.0]])  # row 0's tail underflows fp32 mass
    one = sampling_logprobs(z[:1], torch.ones(1), torch.tensor([-1]), torch.ones(1))
    both = sampling_logprobs(z, torch.ones(2), torch.tensor([-1, -1]), torch.tensor([1.0, 0.5]))
    assert torch.equal(both[0], one[0]) and bool(torch.isfinite(one[0]).all())


def test_stop_on_model_eos_and_engine_stop_ids(qwen3_dir, tmp_path):
    make_hf_model(tmp_path, "qwen3", eos_token_id=[5, 6])
    model = exactrl.load_model(tmp_path)
    # greedy continuation, to find a token the model does emit
    prompt = [1, 2, 3, 4]
    free = Engine(model).generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0][0]
    tok = free.token_ids[4]
    engine = Engine(model, stop_token_ids=[tok])
    assert {5, 6, tok} <= engine.stop_token_ids
    c = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=30))[0][0]
    first = next(i for i, t in enumerate(free.token_ids) if t in {5, 6, tok})
    assert c.token_ids == free.token_ids[: first + 1] and c.finish_reason == "stop"
    assert c.logprobs == free.logprobs[: first + 1]


def new_weights(model, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        k: (v.float() + 0.05 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in model.state_dict().items()
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exact_after_update_weights(qwen3_dir, dtype):
    model = exactrl.load_model(qwen3_dir, dtype=dtype)
    engine = Engine(model, max_num_batched_tokens=40)
    rng = random.Random(3)
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (5, 33, 60)]
    sp = SamplingParams(max_tokens=16, n=2, seed=9, temperature=0.9)
    before = engine.generate(prompts, sp)
    sd = new_weights(model, 1)
    assert engine.update_weights(sd) == 1 and engine.version == 1
    assert all(torch.equal(p, sd[k]) for k, p in model.state_dict().items())
    after = engine.generate(prompts, sp)
    assert all(c.versions == [1] * len(c.token_ids) for o in after for c in o)
    assert not mismatches(model, [(p, c, sp) for p, o in zip(prompts, after) for c in o])
    assert [c.token_ids for o in before for c in o] != [c.token_ids for o in after for c in o]


def test_update_weights_mid_generation(qwen3_dir):
    """Tokens sampled after an update are exact under the new weights, earlier ones under the old."""
    old = exactrl.load_model(qwen3_dir)
    model = exactrl.load_model(qwen3_dir)
    engine = Engine(model, max_num_batched_tokens=64)
    rng = random.Random(4)
    sp = SamplingParams(max_tokens=20, n=2, seed=1)
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (10, 50, 70)]
    ids = [engine.add_request(p, sp) for p in prompts]
    for _ in range(6):
        engine.step()
    engine.update_weights(new_weights(model, 2))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.completions for o in engine.step() if o.finished})
    for p, rid in zip(prompts, ids):
        for c in done[rid]:
            assert c.versions == sorted(c.versions) and set(c.versions) == {0, 1}
            for m, version in ((old, 0), (model, 1)):
                lp = exactrl.sequence_logprobs(m, [p + c.token_ids])[0][len(p) - 1 :]
                sel = torch.tensor([v == version for v in c.versions])
                assert torch.equal(torch.tensor(c.logprobs)[sel], lp[sel])


@pytest.mark.parametrize("arch,block_size", [("qwen2", 32), ("llama", 16), ("qwen3", 8)])
def test_other_architectures_and_page_sizes(tmp_path, arch, block_size):
    make_hf_model(tmp_path, arch)
    model = exactrl.load_model(tmp_path, block_size=block_size)
    engine = Engine(model, kv_budget_tokens=12 * block_size, max_num_batched_tokens=3 * block_size - 1)
    results = run_workload(engine, fixed_workload(seed=5)[:6])
    assert_exact(model, engine, results)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exact_on_the_onednn_path_with_its_packed_weights(onednn_dir, dtype):
    """Mixed batches, then `update_weights` (which must drop the engine's packed copies): still bitwise.
    fp32 weights are packed for the native linear, bf16 ones for oneDNN (kernels/linear.py)."""
    from exactrl.kernels import linear

    if dtype == "bfloat16" and torch.bfloat16 not in linear.ONEDNN_DTYPES:
        pytest.skip(f"this CPU has no oneDNN {dtype} linear (needs AVX512 or AVX-NE-CONVERT)")
    model = exactrl.load_model(onednn_dir, dtype=dtype)
    up = model.model.layers[0].mlp.up_proj.weight
    assert model.kernels.exact and (dtype == "float32" or linear._uses_onednn(up, up))
    engine = Engine(model, max_num_batched_tokens=48)
    rng = random.Random(5)
    sp = SamplingParams(max_tokens=12, n=2, seed=3, temperature=0.8, top_k=50)
    reqs = [([rng.randrange(512) for _ in range(n)], sp, arrive) for n, arrive in ((3, 0), (40, 0), (70, 2), (9, 5))]
    done = run_workload(engine, reqs)
    assert not mismatches(model, [(p, c, sp) for p, sp_, outs in done for c in outs])
    before = engine.generate([reqs[0][0]], sp)
    engine.update_weights(new_weights(model, 7))
    after = engine.generate([reqs[0][0]], sp)
    assert not mismatches(model, [(reqs[0][0], c, sp) for c in after[0]])
    assert [c.logprobs for c in before[0]] != [c.logprobs for c in after[0]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernels", ["exact", "fast"])
def test_prefill_and_trainer_batches_beyond_a_big_tile(onednn_dir, dtype, kernels, monkeypatch):
    """A prefill step and a trainer batch of more than BIG_TILE rows (in bf16, whole big oneDNN products
    where the machine passed their check; in fp32, the native linear's row blocks: kernels/linear.py)
    against decode rows: exact is bitwise, fast is not."""
    from exactrl.kernels import linear

    if dtype == "bfloat16" and torch.bfloat16 not in linear.ONEDNN_DTYPES:
        pytest.skip(f"this CPU has no oneDNN {dtype} linear (needs AVX512 or AVX-NE-CONVERT)")
    model = exactrl.load_model(onednn_dir, dtype=dtype, kernels=kernels)
    engine = Engine(model, max_num_batched_tokens=48)
    product, big_calls = linear._onednn_product, []

    def counted(x_rK, w):
        big_calls.append(x_rK.shape[0] == linear.BIG_TILE)
        return product(x_rK, w)

    monkeypatch.setattr(linear, "_onednn_product", counted)
    rng = random.Random(11)
    sp = SamplingParams(max_tokens=10, n=2, seed=4, temperature=0.9)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (150, 170, 200, 90)]  # one 610-token prefill
    outs = engine.generate(prompts, sp)
    bad = mismatches(model, [(p, c, sp) for p, cs in zip(prompts, outs) for c in cs])  # a 1300-row trainer call
    assert (not bad) == (kernels == "exact"), bad[:3]
    if kernels == "exact" and dtype == "bfloat16" and linear.big_tile_ok(model.model.layers[0].self_attn.q_proj.weight):
        assert any(big_calls), "no big product ran: the test would not cover them"


def test_weights_changed_drops_packed_copies_of_weights_written_in_place(onednn_dir):
    """An engine sharing a trainer's model (the asynchronous loop's evaluation engine): a write through
    `.data` (ZeRO's broadcast) leaves the version counter alone, so only `weights_changed` tells it."""
    model = exactrl.load_model(onednn_dir)
    engine = Engine(model, kv_budget_tokens=1024)
    prompt, sp = [[3, 14, 15, 92, 65]], SamplingParams(max_tokens=6, seed=2)
    engine.generate(prompt, sp)  # packs the large weights
    with torch.no_grad():
        for p in model.parameters():
            p.data.add_(0.02 * torch.randn_like(p))  # no version bump
    stale = engine.generate(prompt, sp)
    engine.weights_changed()
    fresh = engine.generate(prompt, sp)
    assert not mismatches(model, [(prompt[0], c, sp) for c in fresh[0]])
    assert mismatches(model, [(prompt[0], c, sp) for c in stale[0]])  # the stale packs were in use
    rid = engine.add_request(prompt[0], sp)
    with pytest.raises(RuntimeError, match="requests running"):
        engine.weights_changed()
    engine.abort(rid)


def test_exact_where_the_rotary_tables_grow(long_context_dir):
    """The engine's copy of the model grows its rotary tables at other steps than the trainer's (during a chunked
    prefill, during recorded decode steps): the logprobs stay the trainer's, bit for bit."""
    engine_model = exactrl.load_model(long_context_dir)
    sp = SamplingParams(max_tokens=8, n=2, seed=3, temperature=0.9, top_k=50)
    outs = Engine(engine_model, kv_budget_tokens=32768, max_num_batched_tokens=48).generate(long_prompts(), sp)
    assert engine_model.rope_cos.shape[0] == 3 * exactrl.load_model(long_context_dir).rope_cos.shape[0]
    trainer = exactrl.load_model(long_context_dir)
    assert not mismatches(trainer, [(p, c, sp) for p, o in zip(long_prompts(), outs) for c in o])
