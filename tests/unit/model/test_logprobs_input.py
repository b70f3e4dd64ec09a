"""`sequence_logprobs` takes the same token ids the engine takes, and names what is wrong otherwise."""

from __future__ import annotations

import pytest
import torch

import exactrl


@pytest.fixture(scope="module")
def model(qwen3_dir):
    return exactrl.load_model(qwen3_dir)


@pytest.mark.parametrize(
    "token_ids, match",
    [
        ([[1.5, 2, 3]], r"token_ids\[0\] holds 1.5"),  # not truncated to 1 silently
        ([[True, 2, 3]], r"token_ids\[0\] holds True"),
        ([1, 2, 3], r"token_ids\[0\] is 1, not a list of token ids \(for one sequence pass \[\[\.\.\.\]\]\)"),
        ("123", "token_ids must be a list of sequences"),
        (torch.tensor([1, 2, 3]), "must be 2-D"),
        ([[1, 2], []], r"token_ids\[1\] is empty"),
    ],
)
def test_bad_token_ids_are_named(model, token_ids, match):
    with pytest.raises(ValueError, match=match):
        exactrl.sequence_logprobs(model, token_ids)


def test_tensors_are_accepted_and_equal_lists(model):
    want = exactrl.sequence_logprobs(model, [[1, 2, 3, 4]])[0]
    assert torch.equal(exactrl.sequence_logprobs(model, torch.tensor([[1, 2, 3, 4]]))[0], want)
    assert torch.equal(exactrl.sequence_logprobs(model, [torch.tensor([1, 2, 3, 4])])[0], want)


@pytest.mark.parametrize("t", [float("nan"), float("inf"), 1e-39, -1.0, "1"])
def test_temperatures_outside_the_distributions_domain_are_refused(model, t):
    with pytest.raises(ValueError, match="temperature"):
        exactrl.sequence_logprobs(model, [[1, 2, 3]], temperature=t)
