"""train_step's memory settings: activation checkpointing (bitwise the same step, less peak memory) and
micro-batches by a token budget (the same step as one sequence per micro-batch, up to fp32 rounding)."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch
from conftest import load_benchmark

import exactrl
import exactrl.model.logprobs as LP
from exactrl.algo.losses import build_loss
from exactrl.train.activation_ckpt import apply_activation_checkpointing
from exactrl.train.config import load_config
from exactrl.train.trainer import StepSettings, TrainBatch, micro_batches, train_step


def _settings(**kw) -> StepSettings:
    return StepSettings(
        **{
            **dict(
                temperature=1.0,
                top_k=-1,
                top_p=1.0,
                micro_batch_size=8,
                agg_mode="token-mean",
                agg_constant=None,
                grad_clip=1e9,
            ),
            **kw,
        }
    )  # no clipping: the raw gradients


def _batch(model, lengths: list[tuple[int, int]], seed: int = 0, shared_prompt: bool = False) -> TrainBatch:
    """Random (prompt, completion) of the given lengths, μ = the model's own logprobs, mixed advantages."""
    rng = random.Random(seed)
    V = model.config.vocab_size
    first = [rng.randrange(V) for _ in range(lengths[0][0])]
    prompts = [first if shared_prompt else [rng.randrange(V) for _ in range(p)] for p, _ in lengths]
    completions = [[rng.randrange(V) for _ in range(c)] for _, c in lengths]
    with torch.no_grad():
        lps = exactrl.sequence_logprobs(model, [p + c for p, c in zip(prompts, completions)])
    behav = [lp[len(p) - 1 :].tolist() for lp, p in zip(lps, prompts)]
    return TrainBatch(prompts, completions, behav, [rng.uniform(-1, 1) for _ in lengths])


def _step(model, batch: TrainBatch, **kw) -> tuple[dict, list[torch.Tensor]]:
    """One real step (AdamW); the metrics and each parameter's gradient as the optimizer saw it."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    m = train_step(model, opt, build_loss("ppo"), batch, _settings(**kw))
    return m, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_gives_the_same_loss_and_gradients_bit_for_bit(qwen3_dir, monkeypatch, dtype, mode):
    """With an entropy bonus (its gradient runs through the head too) and two micro-batches: every metric,
    every parameter's gradient and the weights after the AdamW step are bitwise equal. The head, in chunks of
    16 rows (ragged ones too), recomputes its logprobs in the backward under checkpointing."""
    monkeypatch.setattr(LP, "HEAD_CHUNK_ROWS", 16)
    lengths = [(37, 20), (5, 41), (70, 3), (12, 12)]
    runs = []
    for ckpt in ("none", mode):
        model = apply_activation_checkpointing(exactrl.load_model(qwen3_dir, dtype=dtype), ckpt)
        assert model.head_recompute == (ckpt != "none")
        m, grads = _step(model, _batch(model, lengths), micro_batch_size=2, entropy_coef=0.01)
        runs.append((m, grads, [p.detach().clone() for p in model.parameters()]))
    (m0, g0, w0), (m1, g1, w1) = runs
    assert m0 == m1 and m0["train/train_rollout_logprob_abs_diff"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))
    assert any(bool(g.abs().sum() > 0) for g in g0)


def test_activation_checkpointing_leaves_no_grad_forwards_and_copies_alone(qwen3_dir):
    """Under no_grad (reference model, engine) the layers run unwrapped; a deepcopy checkpoints its own layers."""
    model = apply_activation_checkpointing(exactrl.load_model(qwen3_dir), "full")
    plain = exactrl.load_model(qwen3_dir)
    ids = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    with torch.no_grad():
        for a, b in zip(exactrl.sequence_logprobs(model, ids), exactrl.sequence_logprobs(plain, ids)):
            assert torch.equal(a, b)
    twin = copy.deepcopy(model)
    assert all(layer.forward.__self__ is layer for layer in twin.model.layers)
    with pytest.raises(ValueError, match="activation checkpointing mode must be one of"):
        apply_activation_checkpointing(model, "every-other")


def _memory_bench():
    return load_benchmark("memory")


def test_activation_checkpointing_lowers_the_steps_peak_memory(qwen3_dir):
    """Peak heap bytes in use during a step (benchmarks/memory.py: glibc's count, read after every torch op):
    this fails if checkpointing keeps the activations anyway."""
    bench = _memory_bench()
    peaks = {}
    for mode in ("none", "full", "selective"):
        model = apply_activation_checkpointing(exactrl.load_model(qwen3_dir), mode)
        batch = _batch(model, [(8, 300)] * 4)
        with bench.PeakHeap() as meter:
            _step(model, batch)
        peaks[mode] = meter.peak
    assert peaks["full"] < 0.8 * peaks["none"], peaks
    assert peaks["selective"] < 0.95 * peaks["none"], peaks


def test_bench_memory_quick_prints_the_modes_as_json(capsys):
    _memory_bench().main(["--quick"])
    out = json.loads(capsys.readouterr().out)
    modes = out["modes"]
    assert set(modes) == {"none", "full", "selective"} and modes["none"]["peak_ratio"] == 1.0
    assert len({(r["loss"], r["grad_norm"]) for r in modes.values()}) == 1  # the same step bit for bit
    assert modes["full"]["peak_mb"] < modes["none"]["peak_mb"]
    assert 0 < modes["full"]["act_peak_mb"] < modes["none"]["act_peak_mb"] <= modes["none"]["peak_mb"]


def test_token_budget_packs_consecutive_sequences_and_a_long_one_alone():
    lengths = [10, 30, 25, 100, 5, 5, 60]
    s = _settings(max_tokens_per_micro_batch=64)
    assert micro_batches(list(range(7)), lengths, s) == [[0, 1], [2], [3], [4, 5], [6]]
    assert micro_batches([1, 3, 5], lengths, s) == [[1], [3], [5]]  # a rank's share: its own order
    assert micro_batches(list(range(7)), lengths, _settings(micro_batch_size=3)) == [[0, 1, 2], [3, 4, 5], [6]]
    for bad in (0, -5, 2.5, True, "64"):
        with pytest.raises(ValueError, match="StepSettings.max_tokens_per_micro_batch must be None or an int >= 1"):
            _settings(max_tokens_per_micro_batch=bad)
    for bad in ("0", "-1", "1.5", "lots"):
        with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
            load_config(None, [f"optim.max_tokens_per_micro_batch={bad}"])
    with pytest.raises(ValueError, match="activation_checkpointing"):
        load_config(None, ["optim.activation_checkpointing=some"])


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_token_budget_micro_batches_give_the_per_sequence_step(qwen3_dir, agg_mode):
    """Token-budget micro-batches against one sequence per micro-batch: the loss denominators are the whole
    batch's, so the loss and metrics are bitwise equal (computed over the whole batch) and the gradients
    equal up to the order their fp32 sums are taken in: rtol 1e-5, atol 1e-7 (measured: at most 1.5e-8 apart,
    for gradient entries up to 0.2)."""
    lengths = [(9, 14), (9, 3), (9, 30), (9, 7), (9, 60), (9, 1)]
    runs = []
    for kw in (dict(micro_batch_size=1), dict(max_tokens_per_micro_batch=60)):  # [0, 1] [2, 3] [4] [5]
        model = exactrl.load_model(qwen3_dir)
        runs.append(
            _step(model, _batch(model, lengths, shared_prompt=True), agg_mode=agg_mode, entropy_coef=0.01, **kw)
        )
    (m0, g0), (m1, g1) = runs
    assert m0 == {**m1, "train/grad_norm": m0["train/grad_norm"]}
    assert m1["train/grad_norm"] == pytest.approx(m0["train/grad_norm"], rel=1e-5)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
