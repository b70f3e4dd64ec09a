"""Property tests of a session's trajectories (trajectory.py) over random trees of turns.

Each turn extends an earlier record (a tool result or user turn of fresh token ids, then a generation) or
starts a new conversation. Whatever the tree: the loss mask is 1 exactly on the tokens the model generated
along that branch, every earlier token id is kept unchanged in a trajectory that extends it, and the
logprob and version arrays line up with the tokens.
"""

from __future__ import annotations

import math

import pytest
from fuzzing import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from exactrl.chat.trajectory import Session

EOT = 2


def _lp(pos: int, tok: int) -> float:
    """The behaviour logprob of a generated token: a function of where it is and what it is, as in exact
    mode, so two identical samples carry identical logprobs."""
    return -((tok * 7 + pos) % 50) / 10 - 0.01


@st.composite
def turn_trees(draw) -> list[tuple[int | None, int, list[int]]]:
    """(parent turn or None for a new conversation, new prompt tokens, generated tokens) per turn."""
    turns = []
    for k in range(draw(st.integers(1, 8))):
        parent = draw(st.one_of(st.none(), st.integers(0, k - 1))) if k else None
        gen = draw(st.lists(st.integers(3, 9), min_size=1, max_size=5))  # few values: samples collide
        turns.append((parent, draw(st.integers(0, 3)), gen + ([EOT] if draw(st.booleans()) else [])))
    return turns


@settings(max_examples=examples(200), deadline=None)
@given(turn_trees())
def test_masks_mark_exactly_the_generated_tokens_and_keep_every_earlier_id(turns):
    session, records, fresh = Session(), [], iter(range(100, 10**6))
    for parent, new, gen in turns:
        if parent is None:
            prompt, truth, root = [next(fresh) for _ in range(1 + new)], set(), None
        else:
            tokens, truth, root = records[parent]
            prompt = tokens + [next(fresh) for _ in range(new)]  # fresh ids: no prompt extends a sibling
        root = len(prompt) if root is None else root
        session.record(prompt, gen, [_lp(len(prompt) + i, t) for i, t in enumerate(gen)], [7] * len(gen))
        records.append((prompt + gen, truth | set(range(len(prompt), len(prompt) + len(gen))), root))
    trajs = session.trajectories()
    by_tokens = {tuple(tokens): (gen, root) for tokens, gen, root in records}
    for t in trajs:
        tokens = t.prompt_ids + t.completion_ids
        assert len(t.completion_ids) == len(t.loss_mask) == len(t.behav_logprobs) == len(t.versions)
        gen, root = by_tokens[tuple(tokens)]
        assert len(t.prompt_ids) == root  # the branch's first prompt
        assert [i + root for i, m in enumerate(t.loss_mask) if m] == sorted(gen)
        for i, (tok, m, lp, v) in enumerate(zip(t.completion_ids, t.loss_mask, t.behav_logprobs, t.versions)):
            assert (lp, v) == ((_lp(i + root, tok), 7) if m else (0.0, -1))
        assert t.num_turns == sum(1 for p in gen if p - 1 not in gen)
    # nothing lost: each turn's exact ids open a trajectory that marks its generated tokens
    for tokens, gen, _ in records:
        assert any(
            (t.prompt_ids + t.completion_ids)[: len(tokens)] == tokens
            and all(t.loss_mask[p - len(t.prompt_ids)] == 1 for p in gen)
            for t in trajs
        )
    assert len({tuple(t.prompt_ids + t.completion_ids) for t in trajs}) == len(trajs)


@pytest.mark.parametrize(
    "args, message",
    [
        (([5, -1], [3], [-0.5], [0]), r"prompt holds -1, not a token id"),
        (([5], [3, True], [-0.5, -0.1], [0, 0]), r"generated holds True, not a token id"),
        (([5], [3.0], [-0.5], [0]), r"generated holds 3.0, not a token id"),
        (([5], [3, 4], [-0.5], [0, 0]), r"2 generated tokens but 1 logprobs and 2 versions"),
        (([5], [3], [-0.5], []), r"1 generated tokens but 1 logprobs and 0 versions"),
        (([5], [3], [math.nan], [0]), r"logprobs holds nan, not a finite log-probability"),
        (([5], [3], [-math.inf], [0]), r"logprobs holds -inf"),
        (([5], [3], [0.5], [0]), r"logprobs holds 0.5"),
    ],
)
def test_a_turn_that_cannot_be_trained_on_is_refused_naming_the_field(args, message):
    session = Session()
    session.record([5], [3], [-0.5], [0])
    with pytest.raises(ValueError, match=r"^Session\.record: " + message):
        session.record(*args)
    assert len(session.records) == 1  # the turns recorded before it are kept
