"""Property-based fuzz of the RL API's input checks: TrainBatch / train_step, compute_advantages,
build_loss and build_corrections. Bad input is a ValueError naming the field (and the sequence or token
index), raised before any weight changes; valid input trains.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from fuzzing import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import exactrl
from exactrl.algo.advantages import ADVANTAGES, compute_advantages
from exactrl.algo.corrections import CORRECTIONS, build_corrections
from exactrl.algo.losses import LOSSES, build_loss
from exactrl.train.trainer import StepSettings, TrainBatch, train_step

HSET = settings(max_examples=examples(150), deadline=None, suppress_health_check=list(HealthCheck))
V = 211  # conftest TINY vocabulary
FP32_MAX = torch.finfo(torch.float32).max

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.lists(st.integers(-3, V + 3), max_size=3),
    st.just(10**400),
    st.integers(-5, 300).map(np.int64),
    st.floats(-2, 2, width=32).map(np.float32),
    st.dictionaries(st.text(max_size=1), st.integers(), max_size=1),
)
FIELDS = ("prompt_ids", "completion_ids", "behav_logprobs", "advantages")


@pytest.fixture(scope="module")
def model(qwen3_dir):
    return exactrl.load_model(qwen3_dir)


def _settings(**kw) -> StepSettings:
    return StepSettings(
        temperature=1.0,
        top_k=-1,
        top_p=1.0,
        micro_batch_size=kw.pop("micro_batch_size", 2),
        agg_mode="token-mean",
        agg_constant=None,
        grad_clip=1.0,
        **kw,
    )


@st.composite
def batches(draw):
    """A valid batch as four field lists: B sequences, completions possibly empty."""
    B = draw(st.integers(1, 4))
    prompts = [draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=4)) for _ in range(B)]
    comps = [draw(st.lists(st.integers(0, V - 1), max_size=4)) for _ in range(B)]
    behav = [[draw(st.floats(-20, 0)) for _ in c] for c in comps]
    adv = [draw(st.floats(-5, 5)) for _ in range(B)]
    return {"prompt_ids": prompts, "completion_ids": comps, "behav_logprobs": behav, "advantages": adv}


@st.composite
def broken_batches(draw):
    """A valid batch with one thing broken: (fields, the words the error must hold)."""
    b = draw(batches())
    B = len(b["prompt_ids"])
    k = draw(st.integers(0, B - 1))
    kind = draw(st.sampled_from(["field", "length", "row", "id", "number", "non_finite", "logprob_count"]))
    if kind == "field":  # a whole field is not a list
        name = draw(st.sampled_from(FIELDS))
        b[name] = draw(st.one_of(st.none(), st.integers(), st.floats(), st.text(max_size=2)))
        return b, f"TrainBatch.{name}"
    if kind == "length":  # one field one sequence short or long
        name = draw(st.sampled_from(FIELDS[1:]))
        b[name] = b[name][:-1] if draw(st.booleans()) else b[name] + b[name][-1:]
        return b, "one entry per sequence"
    if kind == "row":  # a sequence's ids or logprobs are not a list
        name = draw(st.sampled_from(["prompt_ids", "completion_ids", "behav_logprobs"]))
        ids_only = (
            [st.lists(st.integers(0, 5), min_size=1, max_size=2).map(np.array)] if name != "behav_logprobs" else []
        )
        b[name][k] = draw(
            st.one_of(st.none(), st.integers(), st.floats(allow_nan=False), st.text(min_size=1, max_size=2), *ids_only)
        )  # (an array of numbers is fine behaviour logprobs)
        return b, f"TrainBatch.{name}[{k}]" if name != "behav_logprobs" else f"{k}"
    if kind == "id":  # one token id of the wrong kind
        name = draw(st.sampled_from(["prompt_ids", "completion_ids"]))
        bad = draw(junk.filter(lambda x: type(x) is not int))
        row = b[name][k] = list(b[name][k])
        row.insert(draw(st.integers(0, len(row))), bad)
        if name == "completion_ids":
            b["behav_logprobs"][k] = list(b["behav_logprobs"][k]) + [-1.0]
        return b, f"TrainBatch.{name}[{k}] holds"
    if kind == "number":  # an advantage that is not a number
        b["advantages"][k] = draw(
            st.one_of(st.none(), st.text(max_size=2), st.lists(st.floats(), min_size=1, max_size=2), st.just(10**400))
        )
        return b, "TrainBatch.advantages"
    if kind == "non_finite":  # NaN, inf, or beyond fp32, in an advantage or a behaviour logprob
        value = draw(st.sampled_from([math.nan, math.inf, -math.inf, 1e39, -1e39, 2 * FP32_MAX]))
        if b["completion_ids"][k] and draw(st.booleans()):
            t = draw(st.integers(0, len(b["completion_ids"][k]) - 1))
            b["behav_logprobs"][k][t] = value
            return b, f"TrainBatch.behav_logprobs[{k}][{t}] is"
        b["advantages"][k] = value
        return b, f"TrainBatch.advantages[{k}] is"
    b["behav_logprobs"][k] = b["behav_logprobs"][k] + [-1.0]  # one logprob more than tokens
    return b, f"sequence {k}:"


def test_a_broken_batch_is_named_before_any_step(model):
    """Every broken batch: a ValueError holding the field's name, from TrainBatch or before train_step's first
    forward, and the weights untouched."""
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)

    @HSET
    @given(case=broken_batches())
    def fuzz(case):
        fields, words = case
        with pytest.raises(ValueError) as e:
            train_step(model, opt, build_loss("ppo"), TrainBatch(**fields), _settings())
        assert words in str(e.value), (fields, str(e.value))

    fuzz()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_ids_outside_the_vocabulary_are_named_by_sequence(model):
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)

    @settings(HSET, max_examples=examples(60))
    @given(b=batches(), bad=st.one_of(st.integers(V, 2**70), st.integers(-(2**70), -1)), data=st.data())
    def fuzz(b, bad, data):
        name = data.draw(st.sampled_from(["prompt_ids", "completion_ids"]))
        k = data.draw(st.integers(0, len(b[name]) - 1))
        b[name][k] = b[name][k] + [bad]
        if name == "completion_ids":
            b["behav_logprobs"][k] = b["behav_logprobs"][k] + [-1.0]
        with pytest.raises(ValueError, match=re.escape(f"TrainBatch.{name}[{k}] holds token id {bad}, outside")):
            train_step(model, opt, build_loss("ppo"), TrainBatch(**b), _settings())

    fuzz()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_valid_batches_of_any_shape_train(qwen3_dir):
    """Empty completions, tuple rows, tensor / numpy advantages, a positive behaviour logprob (μ is only
    measured against): a step runs and its loss and gradient norm are finite."""
    model = exactrl.load_model(qwen3_dir)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    @settings(HSET, max_examples=examples(25))
    @given(
        b=batches(),
        tuples=st.booleans(),
        adv_kind=st.sampled_from([list, torch.tensor, np.array]),
        positive=st.booleans(),
    )
    def fuzz(b, tuples, adv_kind, positive):
        if tuples:
            b["prompt_ids"] = [tuple(p) for p in b["prompt_ids"]]
            b["completion_ids"] = tuple(tuple(c) for c in b["completion_ids"])
        if positive and b["completion_ids"][0]:
            b["behav_logprobs"][0][0] = 0.5
        b["advantages"] = adv_kind(b["advantages"])
        m = train_step(model, opt, build_loss("ppo"), TrainBatch(**b), _settings(micro_batch_size=1))
        assert math.isfinite(m["train/loss"]) and math.isfinite(m["train/grad_norm"])

    fuzz()


def test_step_settings_micro_batch_size():
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="StepSettings.micro_batch_size must be an int >= 1"):
            _settings(micro_batch_size=bad)


@HSET
@given(
    name=st.sampled_from(sorted(ADVANTAGES)),
    rewards=st.one_of(
        junk,
        st.lists(
            st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=3), min_size=1, max_size=3
        )
        .filter(lambda r: len({len(x) for x in r}) == 1)
        .map(torch.tensor),
        st.lists(st.floats(-1, 1), max_size=4).map(torch.tensor),  # 1-D
        st.lists(st.sampled_from([1.7e308, -1.7e308, 1e308, 0.0]), min_size=3, max_size=3).map(
            lambda r: torch.tensor([r], dtype=torch.float64)
        ),  # finite, but the mean or std overflows
        st.integers(0, 3).map(lambda n: torch.zeros(n, 0)),
        st.integers(0, 2).map(lambda n: torch.zeros(2, 2, n)),
        st.lists(st.lists(st.integers(-3, 3), min_size=2, max_size=2), min_size=1, max_size=2).map(torch.tensor),
    ),
    kwargs=st.dictionaries(st.sampled_from(["eps", "normalize_std", "bogus"]), junk, max_size=2),
)
def test_compute_advantages_names_bad_rewards_and_kwargs(name, rewards, kwargs):
    try:
        adv = compute_advantages(name, rewards, **kwargs)
    except ValueError as e:
        assert re.search(r"rewards_PG|eps|normalize_std|bogus", str(e)), str(e)
        return
    assert isinstance(rewards, torch.Tensor) and rewards.dim() == 2 and bool(torch.isfinite(rewards).all())
    assert adv.shape == rewards.shape and bool(torch.isfinite(adv).all())


@HSET
@given(
    name=st.one_of(st.sampled_from(sorted(LOSSES)), st.text(max_size=4)),
    kwargs=st.dictionaries(
        st.sampled_from(
            [
                "eps_low",
                "eps_high",
                "dual_clip",
                "eps_low_is",
                "eps_high_is",
                "tau_pos",
                "tau_neg",
                "upper",
                "level",
                "x",
            ]
        ),
        st.one_of(junk, st.floats(-1, 5), st.sampled_from(["token", "sequence"])),
        max_size=2,
    ),
)
def test_build_loss_names_the_loss_and_the_argument(name, kwargs):
    try:
        loss = build_loss(name, **kwargs)
    except ValueError as e:
        assert repr(name) in str(e), str(e)
        return
    for v in vars(loss).values():  # what was accepted is a finite number or a known word
        assert v is None or isinstance(v, str) or math.isfinite(v)


@HSET
@given(
    specs=st.one_of(
        junk,
        st.lists(
            st.one_of(
                junk,
                st.fixed_dictionaries(
                    {"name": st.one_of(st.sampled_from(sorted(CORRECTIONS)), junk)},
                    optional={
                        "lower": st.one_of(junk, st.floats(-1, 3)),
                        "upper": st.one_of(junk, st.floats(-1, 3)),
                        "threshold": st.one_of(junk, st.floats(-1, 3)),
                        "delta": st.one_of(junk, st.floats(-1, 3)),
                        "kind": st.one_of(junk, st.sampled_from(["k1", "k2", "k3"])),
                    },
                ),
            ),
            max_size=3,
        ),
    )
)
def test_build_corrections_names_the_entry(specs):
    try:
        built = build_corrections(specs)
    except ValueError as e:
        assert re.search(r"correction", str(e)), str(e)
        return
    old = torch.tensor([[-1.0, -2.0]])
    weights, mask, _ = built(old, old - 0.1, torch.ones(1, 2), torch.ones(1, 2))
    assert bool(torch.isfinite(weights).all()) and bool(torch.isfinite(mask).all())
