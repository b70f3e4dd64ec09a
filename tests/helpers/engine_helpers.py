"""Shared checks for the engine tests: engine logprobs vs the trainer path, bitwise."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_hf_model

import exactrl
from exactrl import SamplingParams
from exactrl.model import transformer


def trainer_logprobs(model, prompt: list[int], tokens: list[int], params: SamplingParams) -> torch.Tensor:
    """The trainer's logprobs of `tokens` after `prompt` (docs/design.md §3 `sequence_logprobs`)."""
    lps = exactrl.sequence_logprobs(
        model, [list(prompt) + list(tokens)], params.temperature, params.top_k, params.top_p
    )
    return lps[0][len(prompt) - 1 :]


def mismatches(model, items) -> list[tuple]:
    """items: (prompt, Completion, SamplingParams); returns the ones whose logprobs differ bitwise.

    Completions with the same parameters are checked in one batched trainer
    call (the trainer is batch-invariant too, tested elsewhere).
    """
    groups: dict[tuple, list] = {}
    for prompt, comp, params in items:
        groups.setdefault((params.temperature, params.top_k, params.top_p), []).append((prompt, comp))
    bad = []
    for (t, k, p), group in groups.items():
        seqs = [list(pr) + list(c.token_ids) for pr, c in group]
        lps = exactrl.sequence_logprobs(model, seqs, t, k, p)
        for (pr, c), lp in zip(group, lps):
            got = torch.tensor(c.logprobs, dtype=torch.float32)
            want = lp[len(pr) - 1 :]
            if not torch.equal(got, want):
                bad.append((pr, c, (got - want).abs().max().item()))
    return bad


def check_finish(comp, params: SamplingParams, stop_ids: set[int]) -> None:
    """finish_reason is consistent with the tokens, stop ids and max_tokens."""
    toks = comp.token_ids
    assert 1 <= len(toks) <= params.max_tokens
    assert len(comp.logprobs) == len(toks) == len(comp.versions)
    assert not any(t in stop_ids for t in toks[:-1]), "generation continued past a stop token"
    if toks[-1] in stop_ids:
        assert comp.finish_reason == "stop"
    else:
        assert comp.finish_reason == "length" and len(toks) == params.max_tokens


def all_pages_free(engine) -> bool:
    return engine.pool.num_free == engine.pool.num_pages and not engine.has_unfinished()


SMALL_ROPE_CHUNK = 128  # the rotary tables' chunk in the tests that cross chunks: the rule, at short lengths


@pytest.fixture
def small_rope_chunk(monkeypatch) -> int:
    """transformer.ROPE_CHUNK set to SMALL_ROPE_CHUNK for one test (read where the tables grow)."""
    monkeypatch.setattr(transformer, "ROPE_CHUNK", SMALL_ROPE_CHUNK)
    return SMALL_ROPE_CHUNK


@pytest.fixture
def long_context_dir(small_rope_chunk, tmp_path):
    d = tmp_path / "long_context"
    make_hf_model(d, "qwen3", max_position_embeddings=3 * small_rope_chunk)
    return d


def long_prompts():
    """Prompts whose prefill, or whose decode steps, cross the rotary tables' first and second chunks."""
    rng = random.Random(5)
    c = SMALL_ROPE_CHUNK
    return [[rng.randrange(211) for _ in range(n)] for n in (c - 3, 2 * c + 7, 9)]
