"""`exactrl eval`'s estimators: pass@k unbiased (Chen et al. 2021) and mean@k, checked against brute force."""

from __future__ import annotations

import itertools

import pytest

from exactrl.train.evaluate import ks, pass_at_k, summarise


@pytest.mark.parametrize("n, c, k", [(n, c, k) for n in range(1, 7) for c in range(n + 1) for k in range(1, n + 1)])
def test_pass_at_k_is_the_chance_a_k_subset_holds_a_correct_sample(n, c, k):
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    brute = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)


def test_summarise_reports_pass_at_powers_of_two_up_to_k_and_the_mean_reward():
    assert ks(1) == [1] and ks(4) == [1, 2, 4] and ks(6) == [1, 2, 4, 6] and ks(8) == [1, 2, 4, 8]
    rewards = [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.5, 1.0]]
    got = summarise(rewards, 4)
    assert got["pass@1"] == pytest.approx((0.25 + 0.0 + 0.75) / 3)  # a reward of 0.5 is not correct
    assert got["pass@2"] == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert got["pass@4"] == pytest.approx(2 / 3)
    assert got["mean@4"] == pytest.approx((0.25 + 0.0 + 3.5 / 4) / 3)
