"""A session's sorted index (trajectory.py) gives the answers of the definitions it replaced, which compared
every record with every other: the same parent for each turn (so the same masks, logprobs, versions, first
prompts and sampling keys), the same records retired by a truncate, the same trajectories.

Random sessions over a small token alphabet, so that prompts collide, share parts of branches, repeat a
record whole or extend a retired one; with splits, truncates (of a recorded history, or of one beyond it)
and edge cases (empty prompts, empty generations).
"""

from __future__ import annotations

import random

import pytest
from session_reference import Quadratic

from exactrl.chat.trajectory import Session, _common_prefix


def random_turn(rng: random.Random, records: list[list[int]]) -> dict:
    """A turn: a new conversation, or a prompt taken from (part of) a recorded one, plus a generation."""
    alphabet = rng.choice([3, 6, 50])
    fresh = lambda k: [rng.randrange(alphabet) for _ in range(k)]  # noqa: E731
    prompt = fresh(rng.randint(0 if rng.random() < 0.03 else 1, 4))
    if records and rng.random() < 0.85:
        base = rng.choice(records)
        how = rng.random()
        if how < 0.5:  # extends a record whole (a next turn)
            prompt = base + fresh(rng.randint(0, 3))
        elif how < 0.8:  # part of a record, then other tokens (an edited or re-tokenized turn)
            prompt = base[: rng.randint(0, len(base))] + fresh(rng.randint(0, 3))
        else:  # a record's own prompt again (n > 1, a retried request)
            prompt = list(base[: rng.randint(1, len(base))])
    generated = fresh(rng.randint(0 if rng.random() < 0.03 else 1, 3))
    turn = {
        "prompt": prompt,
        "generated": generated,
        "logprobs": [-rng.random() for _ in generated],
        "versions": [rng.randrange(3)] * len(generated),
        "sampling": rng.choice([(1.0, -1, 1.0), (0.7, 5, 0.9)]),
    }
    kind = rng.choices(["spliced", "fresh", "split", "truncate"], [6, 2, 1, 2])[0]
    turn["kind"] = kind
    if kind == "truncate":
        cut = rng.choice(records) if records else prompt
        turn["cut_history"] = cut + (fresh(rng.randint(1, 3)) if rng.random() < 0.3 else [])
    return turn


@pytest.mark.parametrize("seed", range(40))
def test_the_index_answers_as_the_quadratic_definitions(seed):
    rng = random.Random(seed)
    new, old, recorded = Session(), Quadratic(), []
    for _ in range(rng.randint(1, 60)):
        turn = random_turn(rng, recorded)
        new.record(**turn)
        old.record(**turn)
        recorded.append(turn["prompt"] + turn["generated"])
        assert new.records == old.records  # every field, `retired` included: the same parents, the same cuts
        assert [t.to_json() for t in new.trajectories()] == [t.to_json() for t in old.trajectories()]


def test_common_prefix():
    rng = random.Random(0)
    for _ in range(2000):
        a = [rng.randrange(3) for _ in range(rng.randint(0, 40))]
        b = a[: rng.randint(0, len(a))] + [rng.randrange(3) for _ in range(rng.randint(0, 40))]
        want = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
        assert _common_prefix(a, b) == _common_prefix(b, a) == want


def test_a_session_built_from_records_is_indexed():
    s = Session()
    s.record([1, 2], [3], [-0.1], [0])
    s.record([1, 2, 3, 4], [5], [-0.2], [0])
    copy = Session(records=list(s.records))
    assert copy.index == s.index
    copy.record([1, 2, 3, 4, 5, 6], [7], [-0.3], [0])
    (t,) = copy.trajectories()
    assert t.loss_mask == [1, 0, 1, 0, 1]
