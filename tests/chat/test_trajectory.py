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
    s.record([1, 2, 10, 7, 3], [12], [-0.3], [0], kind="truncate")  # cut after 10: token 11 is gone
    (t,) = s.trajectories()
    assert t.completion_ids == [10, 7, 3, 12] and t.loss_mask == [1, 0, 0, 1]
