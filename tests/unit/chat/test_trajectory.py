"""Session recording: generated tokens keep mask 1 across turns; branches, split and truncate."""

from __future__ import annotations

from exactrl.chat.trajectory import Session


def test_multi_turn_masks_and_logprobs():
    s = Session()
    s.record([1, 2, 3], [10, 11], [-0.1, -0.2], [0, 0])
    s.record([1, 2, 3, 10, 11, 4, 5], [12], [-0.3], [1])  # tool/user tokens 4, 5 in between
    (t,) = s.trajectories()
    assert t.prompt_ids == [1, 2, 3] and t.completion_ids == [10, 11, 4, 5, 12]
    assert t.loss_mask == [1, 1, 0, 0, 1] and t.behav_logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert t.versions == [0, 0, -1, -1, 1] and t.num_turns == 2 and t.sampling == [[1.0, -1, 1.0]]


def test_branches_are_separate_trajectories():
    s = Session()
    s.record([1, 2], [10], [-0.1], [0])
    s.record([1, 2], [11], [-0.2], [0])  # n = 2
    s.record([1, 2, 10, 3], [12], [-0.3], [0])  # continues the first branch
    ts = s.trajectories()
    assert [t.completion_ids for t in ts] == [[11], [10, 3, 12]]
    assert [t.loss_mask for t in ts] == [[1], [1, 0, 1]]


def test_split_and_truncate():
    s = Session()
    s.record([1, 2], [10, 11], [-0.1, -0.2], [0, 0])
    s.record([1, 2, 9, 3], [12], [-0.3], [0], kind="split")  # fresh segment: inherits nothing
    ts = s.trajectories()
    assert len(ts) == 2 and ts[1].prompt_ids == [1, 2, 9, 3] and ts[1].loss_mask == [1]
    s = Session()
    s.record([1, 2], [10, 11], [-0.1, -0.2], [0, 0])
    s.record([1, 2, 10, 7, 3], [12], [-0.3], [0], kind="truncate", cut_history=[1, 2, 10, 11])  # 11 is gone
    (t,) = s.trajectories()
    assert t.completion_ids == [10, 7, 3, 12] and t.loss_mask == [1, 0, 0, 1]


E = 99  # an end-of-turn token


def test_truncate_retires_every_record_of_the_branch_it_cut():
    """Turn 1 edited after turn 2: both records of the old branch hold tokens no context holds any more
    (retiring only turn 1's would leave turn 2's in training, token 10 trained twice)."""
    s = Session()
    s.record([1, 2], [10, 11, E], [-0.1, -0.2, -0.3], [0] * 3)
    s.record([1, 2, 10, 11, E, 4], [12, 13, E], [-0.4, -0.5, -0.6], [0] * 3)
    s.record([1, 2], [20, E], [-0.9, -0.9], [0] * 2)  # a sibling of turn 1 (n = 2): not on the cut branch
    s.record(
        [1, 2, 10, 7, 4], [14, E], [-0.7, -0.8], [0, 0], kind="truncate", cut_history=[1, 2, 10, 11, E, 4, 12, 13, E]
    )
    ts = s.trajectories()
    assert [t.completion_ids for t in ts] == [[20, E], [10, 7, 4, 14, E]]
    assert ts[1].loss_mask == [1, 0, 0, 1, 1]


def test_a_prompt_sharing_part_of_a_live_branch_does_not_train_its_tokens_twice():
    """A client re-rendered turn 1 (token 12 re-tokenized as 40 41) and sent no token fields: turn 1 stays a
    trajectory of its own, so the new one inherits only what it extends whole (here nothing)."""
    s = Session()
    s.record([1, 2], [10, 11, 12, E], [-0.1] * 4, [0] * 4)
    s.record([1, 2, 10, 11, 40, 41, E, 5], [13, E], [-0.5, -0.6], [0, 0], kind="fresh")
    ts = s.trajectories()
    assert sum(sum(t.loss_mask) for t in ts) == 6  # each generated token once
    assert ts[1].prompt_ids == [1, 2, 10, 11, 40, 41, E, 5] and ts[1].loss_mask == [1, 1]
    # n = 2 at turn 2: the second sample shares part of the first's branch and extends turn 1 whole
    s = Session()
    s.record([1, 2], [10, E], [-0.1] * 2, [0] * 2)
    s.record([1, 2, 10, E, 3], [11, E], [-0.2] * 2, [0] * 2)
    s.record([1, 2, 10, E, 3], [12, E], [-0.3] * 2, [0] * 2)
    assert [t.loss_mask for t in s.trajectories()] == [[1, 1, 0, 1, 1]] * 2


def test_truncate_without_its_history_is_refused():
    import pytest

    with pytest.raises(ValueError, match="cut_history"):
        Session().record([1], [2], [-0.1], [0], kind="truncate")


def test_an_identical_record_is_one_trajectory_whatever_its_other_fields():
    # a greedy n>1 or a retried request: the same prompt and sample recorded twice is trained once,
    # whether the copies differ in a field other than the tokens (versions) or in none
    for versions in ([0, 0], [1, 1]):
        s = Session()
        s.record([1, 2, 3], [4, 5], [-0.1, -0.2], [0, 0])
        s.record([1, 2, 3], [4, 5], [-0.1, -0.2], versions)
        assert len(s.trajectories()) == 1, versions
    # a copy a truncate retired hides no live one: the regeneration after the cut is trained
    s = Session()
    s.record([1, 2], [3], [-0.1], [0])
    s.record([1, 2], [3], [-0.1], [0], kind="truncate", cut_history=[1, 2, 3, 4, 5])
    assert [r.retired for r in s.records] == [True, False] and len(s.trajectories()) == 1
