"""Property-based fuzz of the engine's input checks: bad SamplingParams fields and prompts are a ValueError
naming the field, raised before anything is queued, and the engine keeps serving its other requests with
the same bits; valid but extreme parameters sample exactly what the trainer computes, beside other requests.

Each property runs many examples against one engine (per test) that has requests of its own in flight;
the engine's state is compared before and after every rejected call, and its own requests are checked
against the trainer (bitwise) at the end.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from engine_helpers import all_pages_free, mismatches
from fuzzing import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import exactrl
from exactrl import Engine, SamplingParams
from exactrl.kernels.rowwise import MAX_TEMPERATURE

HSET = settings(max_examples=examples(250), deadline=None, suppress_health_check=list(HealthCheck))
V = 211  # conftest TINY vocabulary
MAX_LEN = 64  # the engines' max_model_len

# values of every Python / numpy / torch kind a caller might hand in by mistake
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.binary(max_size=2),
    st.lists(st.integers(-3, V + 3), max_size=3),
    st.tuples(st.integers(0, 5)),
    st.dictionaries(st.text(max_size=1), st.integers(), max_size=1),
    st.integers(-5, 300).map(np.int64),
    st.floats(0, 2, width=32).map(np.float32),
    st.integers(-5, 300).map(torch.tensor),
    st.floats(0, 2).map(torch.tensor),
    st.lists(st.integers(-3, V + 3), max_size=3).map(np.array),
)

FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]


@pytest.fixture(scope="module")
def model(qwen3_dir):
    return exactrl.load_model(qwen3_dir)


def _busy_engine(model):
    """An engine with two requests of its own in flight (one mid-decode)."""
    engine = Engine(model, max_model_len=MAX_LEN, max_num_seqs=8, max_num_batched_tokens=32)
    own = [
        ([5, 6, 7, 8, 9], SamplingParams(max_tokens=30, n=2, seed=1, ignore_eos=True)),
        ([3] * 20, SamplingParams(max_tokens=30, temperature=0.7, top_p=0.9, seed=2, ignore_eos=True)),
    ]
    ids = [engine.add_request(p, sp) for p, sp in own]
    engine.step()
    engine.step()
    return engine, own, ids


def _state(engine):
    sch = engine.scheduler
    return (
        sorted(engine._requests),
        [s.seq_id for s in sch.waiting],
        [s.seq_id for s in sch.running],
        engine.pool.num_free,
        [len(s.tokens) for r in engine._requests.values() for s in r.seqs],
    )


def _finish_and_check(model, engine, own, ids):
    """The engine's own requests run to the end and are exactly the trainer's."""
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.completions for o in engine.step() if o.finished})
    assert not mismatches(model, [(p, c, sp) for (p, sp), i in zip(own, ids) for c in done[i]])
    assert all(len(c.token_ids) == 30 for i in ids for c in done[i])
    assert all_pages_free(engine)


def _valid_prompt(prompt) -> bool:
    """What the engine must accept: a non-empty list/tuple (or 1-D integer tensor) of int ids in [0, V)."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            return False
        prompt = prompt.tolist()
    return (
        isinstance(prompt, (list, tuple))
        and 0 < len(prompt) <= MAX_LEN - 4
        and all(type(t) is int and 0 <= t < V for t in prompt)
    )


def test_every_sampling_params_field_names_itself(model):
    """A junk value in any one field: SamplingParams raises a ValueError naming that field, or accepts a
    value the engine then either rejects by name or samples with, exactly."""
    engine = Engine(model, max_model_len=MAX_LEN, max_num_seqs=8, max_num_batched_tokens=32)

    @HSET
    @given(field=st.sampled_from(FIELDS), value=junk)
    def fuzz(field, value):
        try:
            sp = SamplingParams(**{field: value})
        except ValueError as e:
            assert field in str(e), (field, value, str(e))
            return
        # accepted: each field holds a value of its documented kind
        assert isinstance(sp.temperature, (int, float)) and not isinstance(sp.temperature, bool)
        assert isinstance(sp.ignore_eos, bool)
        assert all(type(t) is int for t in sp.stop_token_ids)
        sp = dataclasses.replace(sp, max_tokens=min(sp.max_tokens, 3), n=min(sp.n, 2))
        try:
            outs = engine.generate([[1, 2, 3]], sp)
        except ValueError as e:
            assert field in str(e), (field, value, str(e))
            return
        assert not mismatches(model, [([1, 2, 3], c, sp) for c in outs[0]])

    fuzz()
    assert all_pages_free(engine)


prompts = st.one_of(
    junk,
    st.lists(st.integers(-3, V + 3), max_size=8),  # empty, negative, >= vocab
    st.lists(st.integers(0, V - 1), min_size=MAX_LEN - 3, max_size=MAX_LEN + 2),  # + max_tokens beyond max_model_len
    st.lists(st.one_of(st.integers(0, V - 1), junk), min_size=1, max_size=4),  # one odd element
    st.tuples(st.integers(0, V - 1), st.integers(0, V - 1)),
    st.lists(st.lists(st.integers(0, 5), max_size=2), min_size=1, max_size=2),  # nested
    st.sampled_from([torch.int64, torch.int32, torch.float32, torch.bool, torch.uint8]).flatmap(
        lambda dt: st.lists(st.integers(0, 1 if dt is torch.bool else V + 3), max_size=4).map(
            lambda xs: torch.tensor(xs, dtype=dt)
        )
    ),
    st.lists(st.integers(0, V - 1), min_size=1, max_size=4).map(lambda xs: torch.tensor([xs])),  # 2-D
    st.lists(st.integers(0, V - 1), min_size=1, max_size=4).map(np.array),
)


def test_a_bad_prompt_is_named_and_the_engine_keeps_serving(model):
    engine, own, ids = _busy_engine(model)
    sp = SamplingParams(max_tokens=4, seed=5)

    @HSET
    @given(prompt=prompts)
    def fuzz(prompt):
        before = _state(engine)
        if _valid_prompt(prompt):
            rid = engine.add_request(prompt, sp)
            assert engine.abort(rid)
        else:
            with pytest.raises(ValueError, match="prompt_token_ids"):
                engine.add_request(prompt, sp)
        assert _state(engine) == before

    fuzz()
    _finish_and_check(model, engine, own, ids)


def test_generate_names_the_bad_prompt_and_queues_none(model):
    """One bad prompt (or params) among good ones: generate raises naming its index, nothing is queued."""
    engine, own, ids = _busy_engine(model)

    @HSET
    @given(
        good=st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=5), min_size=1, max_size=4),
        bad=prompts.filter(lambda p: not _valid_prompt(p)),
        at=st.integers(0, 4),
        bad_params=st.booleans(),
    )
    def fuzz(good, bad, at, bad_params):
        at = min(at, len(good))
        plist = [SamplingParams(max_tokens=4)] * len(good)  # 4: the max_tokens _valid_prompt allows for
        if bad_params:
            plist.insert(at, {"max_tokens": 4})
            ps = list(good)
            ps.insert(at, [1, 2])
            words = f"prompts[{at}]: params must be a SamplingParams"
        else:
            plist.insert(at, SamplingParams(max_tokens=4))
            ps = list(good)
            ps.insert(at, bad)
            words = f"prompts[{at}]: prompt_token_ids"
        before = _state(engine)
        with pytest.raises(ValueError) as e:
            engine.generate(ps, plist)
        assert str(e.value).startswith(words), str(e.value)
        assert _state(engine) == before

    fuzz()
    for wrong, words in (
        (None, "prompts must be a list"),
        (iter([[1]]), "prompts must be a list"),
        ("12", "prompts must be a list"),
        (np.array([[1, 2]]), "prompts must be a list"),
    ):
        with pytest.raises(ValueError, match=words):
            engine.generate(wrong, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="on_step must be a callable"):
        engine.generate([[1, 2]], SamplingParams(max_tokens=2), on_step=5)
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        engine.generate([[1], [2]], [SamplingParams()])
    _finish_and_check(model, engine, own, ids)


extreme_params = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0), st.floats(1e-5, MAX_TEMPERATURE), st.sampled_from([1e-5, MAX_TEMPERATURE])),
    top_p=st.one_of(st.floats(5e-324, 1.0, exclude_min=False), st.sampled_from([5e-324, 1e-40, 1.0])),
    top_k=st.one_of(st.just(-1), st.integers(1, 2**63 - 1), st.sampled_from([1, V - 1, V, 2**63 - 1])),
    seed=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    n=st.integers(1, 3),
    max_tokens=st.integers(1, 4),
    stop_token_ids=st.lists(st.integers(0, V - 1), max_size=3),
    ignore_eos=st.booleans(),
)


def test_extreme_valid_params_sample_exactly_and_leave_their_neighbours_unchanged(model):
    """Every valid edge of SamplingParams (T at both ends, top_p = the smallest double, top_k = 2**63 - 1,
    64-bit seeds) runs in one step with another request: it matches the trainer bitwise, and the other
    request gets the bits it gets alone."""
    engine = Engine(model, max_model_len=MAX_LEN, max_num_seqs=8, max_num_batched_tokens=32)
    other, other_sp = [4, 5, 6, 7], SamplingParams(max_tokens=4, temperature=0.8, seed=9, ignore_eos=True)
    alone = engine.generate([other], other_sp)[0]

    @HSET
    @given(sp=extreme_params, prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=6))
    def fuzz(sp, prompt):
        outs = engine.generate([other, prompt], [other_sp, sp])
        assert outs[0] == alone
        assert not mismatches(model, [(prompt, c, sp) for c in outs[1]])
        assert all(1 <= len(c.token_ids) <= sp.max_tokens for c in outs[1])

    fuzz()
    assert all_pages_free(engine)
    for t in (MAX_TEMPERATURE * 1.0000001, 1e300):  # beyond fp32: no fp32 temperature tensor holds it
        with pytest.raises(ValueError, match="temperature must be 0"):
            SamplingParams(temperature=t)
