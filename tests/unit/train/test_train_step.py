"""train_step on hand-made batches: what its metrics measure, and batches with nothing to learn from."""

from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import make_hf_model

import exactrl
from exactrl.algo.corrections import build_corrections
from exactrl.algo.losses import build_loss
from exactrl.model.logprobs import token_logprobs
from exactrl.train.trainer import StepSettings, TrainBatch, train_step

PROMPTS = [[1, 2, 3], [4, 5, 6]]
COMPLETIONS = [[7, 8, 9, 10], [11, 12, 13, 14]]


def _settings(**kw) -> StepSettings:
    return StepSettings(
        temperature=1.0,
        top_k=kw.pop("top_k", -1),
        top_p=1.0,
        micro_batch_size=kw.pop("micro_batch_size", 8),
        agg_mode="token-mean",
        agg_constant=None,
        grad_clip=1.0,
        **kw,
    )


def _off_policy_batch(model) -> TrainBatch:
    """The trainer's own logprobs as the behaviour policy, but for one token 1.0 nat off and one 0.01 off."""
    with torch.no_grad():
        lps, _ = token_logprobs(model, [p + c for p, c in zip(PROMPTS, COMPLETIONS)], first=[3, 3])
    behav = [lp.tolist() for lp in lps]
    behav[0][0] -= 1.0
    behav[1][1] -= 0.01
    return TrainBatch(PROMPTS, COMPLETIONS, behav, [1.0, -1.0])


def _step(model_dir, corrections=None, **kw) -> dict:
    model = exactrl.load_model(model_dir)
    batch = _off_policy_batch(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    s = _settings(corrections=build_corrections(corrections) if corrections else None, **kw)
    return train_step(model, opt, build_loss("ppo"), batch, s)


@pytest.mark.parametrize(
    "correction",
    [{"name": "token_mask_is", "upper": 2.0, "lower": 0.5}, {"name": "sequence_mask_is", "upper": 2.0, "lower": 0.5}],
)
def test_a_masking_correction_does_not_hide_the_mismatch_it_removes(qwen3_dir, correction):
    plain, masked = _step(qwen3_dir), _step(qwen3_dir, [correction])
    for key in (
        "train/train_rollout_logprob_abs_diff",
        "train/train_rollout_logprob_abs_diff_max",
        "mismatch/k3",
        "mismatch/chi2_token",
    ):
        assert masked[key] == plain[key], key
    assert plain["train/train_rollout_logprob_abs_diff_max"] == pytest.approx(1.0, abs=1e-5)
    assert plain["mismatch/token_mask_frac"] == 0.0
    # the tokens the correction dropped are reported as dropped (1 of 8 tokens, or all 4 of sequence 0)
    expected = 1 / 8 if correction["name"] == "token_mask_is" else 4 / 8
    assert masked["mismatch/token_mask_frac"] == pytest.approx(expected)
    assert masked[f"correction/{correction['name']}/mask_frac"] == pytest.approx(expected)


def test_truncation_is_reported_as_clipped_weights(qwen3_dir):
    m = _step(qwen3_dir, [{"name": "token_tis", "upper": 2.0}])
    # rho = exp(1.0) = 2.7 on one token of 8 is truncated to 2; the other tokens keep their ratio
    assert m["mismatch/token_clip_frac"] == pytest.approx(1 / 8)
    assert m["mismatch/is_weight_max"] == pytest.approx(2.0)
    assert m["mismatch/seq_clip_frac"] == pytest.approx(1 / 2)  # sequence 0 holds that token
    assert _step(qwen3_dir)["mismatch/token_clip_frac"] == _step(qwen3_dir)["mismatch/seq_clip_frac"] == 0.0


def test_a_truncated_sequence_weight_is_reported_as_a_clipped_sequence(qwen3_dir):
    # sequence 0's ratio Π ρ_t = e is truncated to 2, sequence 1's e^0.01 is kept
    m = _step(qwen3_dir, [{"name": "sequence_tis", "upper": 2.0}])
    assert m["mismatch/seq_clip_frac"] == m["correction/sequence_tis/clip_frac"] == pytest.approx(1 / 2)
    assert _step(qwen3_dir, [{"name": "sequence_tis", "upper": 3.0}])["mismatch/seq_clip_frac"] == 0.0
    both = _step(qwen3_dir, [{"name": "sequence_tis", "upper": 2.0}, {"name": "token_mask_is", "upper": 3.0}])
    assert both["mismatch/seq_clip_frac"] == pytest.approx(1 / 2)  # a mask beside it changes nothing here


@pytest.mark.parametrize(
    "correction", [{"name": "token_mask_is", "upper": 2.0}, {"name": "sequence_tis", "upper": 2.0}]
)
def test_only_truncated_token_ratios_count_as_clipped(qwen3_dir, correction):
    """A masking correction applies weight 1 and a sequence-level one its sequence's weight: neither is a
    token's own ratio, so neither marks tokens as truncated (not every ρ_t ≠ 1 counts)."""
    m = _step(qwen3_dir, [correction])
    assert m["mismatch/token_clip_frac"] == 0.0
    if correction["name"] == "token_mask_is":  # with token_tis its weights stay token ratios: truncation shows
        both = _step(qwen3_dir, [{**correction, "upper": 3.0}, {"name": "token_tis", "upper": 2.0}])
        assert both["mismatch/token_clip_frac"] == pytest.approx(1 / 8)  # ρ = e on 1 of 8 tokens, kept by 3.0


@pytest.mark.parametrize("completions", [[[], []], [[], [7]]])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_micro_batches_with_no_completion_tokens_are_skipped(qwen3_dir, completions, entropy_coef):
    model = exactrl.load_model(qwen3_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = TrainBatch([[1, 2, 3], [4, 5]], completions, [[0.0] * len(c) for c in completions], [1.0, -1.0])
    m = train_step(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        build_loss("ppo"),
        batch,
        _settings(micro_batch_size=1, entropy_coef=entropy_coef),
    )
    assert math.isfinite(m["train/loss"])
    changed = any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert changed == any(completions)  # a step with no token at all leaves the weights alone


def test_shared_prompts_same_step(qwen3_dir):
    """A GRPO batch (groups of one prompt) trained with `share_prompts` on and off: the same logprob bits (the
    metrics that compare them with μ are equal), and weights equal up to rounding after the step."""
    import random

    rng = random.Random(2)
    prompts = [[rng.randrange(100) for _ in range(40)] for _ in range(2)]
    seqs = [(p, [rng.randrange(100) for _ in range(rng.randint(1, 9))]) for p in prompts for _ in range(3)]
    results = {}
    for share in (False, True):
        model = exactrl.load_model(qwen3_dir)
        with torch.no_grad():
            lps, _ = token_logprobs(model, [p + c for p, c in seqs], first=[40] * len(seqs))
        batch = TrainBatch(
            [p for p, _ in seqs], [c for _, c in seqs], [lp.tolist() for lp in lps], [1.0, -0.5, -0.5, 0.3, 0.3, -0.6]
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        m = train_step(model, opt, build_loss("ppo"), batch, _settings(share_prompts=share, micro_batch_size=3))
        results[share] = m, [p.detach().clone() for p in model.parameters()]
    (m0, w0), (m1, w1) = results[False], results[True]
    assert m0["train/train_rollout_logprob_abs_diff"] == m1["train/train_rollout_logprob_abs_diff"] == 0.0
    assert m0["train/loss"] == m1["train/loss"] and m0["train/entropy"] == m1["train/entropy"]
    assert m1["train/grad_norm"] == pytest.approx(m0["train/grad_norm"], rel=1e-4)
    for a, b in zip(w0, w1):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)


def test_kl_to_the_reference_stays_finite_when_sampling_truncates(qwen3_dir, tmp_path):
    """With top-k = 1 the policy's sampled tokens are its argmax; another model's top-1 is mostly another
    token. π_ref is taken untruncated (algo/kl.py), so its logprobs, and the KL, stay finite."""
    make_hf_model(tmp_path, "qwen3", seed=1)
    model, ref = exactrl.load_model(qwen3_dir), exactrl.load_model(tmp_path).requires_grad_(False)
    outs = exactrl.Engine(model).generate(PROMPTS, exactrl.SamplingParams(temperature=0, max_tokens=6))
    completions = [o[0].token_ids for o in outs]
    with torch.no_grad():
        ref_top1, _ = token_logprobs(ref, [p + c for p, c in zip(PROMPTS, completions)], top_k=1, first=[3, 3])
    assert any(not torch.isfinite(lp).all() for lp in ref_top1)  # the reference's own top-1 cuts them off
    batch = TrainBatch(PROMPTS, completions, [[0.0] * len(c) for c in completions], [1.0, -1.0])
    for kind in ("k1", "k2", "k3"):
        m = train_step(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-6),
            build_loss("ppo"),
            batch,
            _settings(top_k=1, kl_coef=0.1, kl_kind=kind),
            ref_model=ref,
        )
        assert math.isfinite(m["train/kl_ref"]) and m["train/kl_ref"] > 0, (kind, m["train/kl_ref"])


def test_cut_completions_left_out_of_the_loss_still_count_in_the_mismatch(qwen3_dir):
    """`overlong.mask_truncated` zeroes a cut completion's loss mask, not its having been sampled: the
    train/rollout difference is measured on it all the same (it does not read 0.0 on a fully cut batch)."""
    model = exactrl.load_model(qwen3_dir)
    batch = _off_policy_batch(model)
    gen = [[1] * len(c) for c in COMPLETIONS]
    cut = TrainBatch(
        batch.prompt_ids,
        batch.completion_ids,
        batch.behav_logprobs,
        batch.advantages,
        loss_mask=[[0] * len(c) for c in COMPLETIONS],
        generated_mask=gen,
    )
    m = train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-6), build_loss("ppo"), cut, _settings())
    plain = _step(qwen3_dir)
    for key in (
        "train/train_rollout_logprob_abs_diff",
        "train/train_rollout_logprob_abs_diff_max",
        "mismatch/k3",
        "train/entropy",
        "mismatch/is_weight_max",
        "mismatch/chi2_token",
    ):  # no weights: ρ on every token
        assert m[key] == plain[key] and m[key] > 0, key
    assert m["mismatch/ess"] == plain["mismatch/ess"] < 1
    assert m["mismatch/token_mask_frac"] == m["mismatch/seq_mask_frac"] == 0.0  # no correction removed them


@pytest.mark.parametrize("filler", [math.nan, math.inf, 0.0])
def test_a_token_the_engine_did_not_sample_may_carry_any_behaviour_logprob(qwen3_dir, filler):
    """A tool's output in an agent's completion has no μ (the engine did not sample it): whatever the
    producer puts there (NaN, inf) is never read, and the step is the one with 0.0 there. At a sampled
    token a NaN is refused before the step, naming the token."""
    sampled = [[1, 1, 0, 1], [1, 1, 1, 1]]  # token 2 of sequence 0 came from a tool

    def step(value, gen):
        model = exactrl.load_model(qwen3_dir)
        batch = _off_policy_batch(model)
        behav = [list(lp) for lp in batch.behav_logprobs]
        behav[0][2] = value
        b = TrainBatch(
            batch.prompt_ids, batch.completion_ids, behav, batch.advantages, loss_mask=gen, generated_mask=gen
        )
        m = train_step(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-3),
            build_loss("ppo"),
            b,
            _settings(corrections=build_corrections([{"name": "token_tis", "upper": 2.0}])),
        )
        return m, torch.cat([p.detach().flatten() for p in model.parameters()])

    (m, w), (m0, w0) = step(filler, sampled), step(-123.0, sampled)
    assert m == m0 and torch.equal(w, w0) and m["train/train_rollout_logprob_abs_diff_max"] > 0
    with pytest.raises(ValueError, match=re.escape("TrainBatch.behav_logprobs[0][2] is nan")):
        step(math.nan, [[1] * 4, [1] * 4])


def test_weight_figures_cover_the_tokens_the_correction_weighed_when_cut_completions_are_left_out(qwen3_dir):
    """With overlong.mask_truncated the corrections weigh the loss mask's tokens only; the cut completion's
    tokens (here the second, every token 0.01 nat off) must not read as clipped or pull is_weight_* to 1."""
    model = exactrl.load_model(qwen3_dir)
    batch = _off_policy_batch(model)
    behav = [batch.behav_logprobs[0], [lp - 0.01 for lp in batch.behav_logprobs[1]]]
    cut = TrainBatch(
        batch.prompt_ids,
        batch.completion_ids,
        behav,
        batch.advantages,
        loss_mask=[[1] * len(COMPLETIONS[0]), [0] * len(COMPLETIONS[1])],
        generated_mask=[[1] * len(c) for c in COMPLETIONS],
    )
    s = _settings(corrections=build_corrections([{"name": "token_tis", "upper": 2.0}]))
    m = train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-6), build_loss("ppo"), cut, s)
    assert (
        m["mismatch/token_clip_frac"] == m["correction/token_tis/clip_frac"] == pytest.approx(1 / len(COMPLETIONS[0]))
    )
    n = len(COMPLETIONS[0])  # the first: one token truncated from e to 2, the others at 1
    assert m["mismatch/is_weight_mean"] == pytest.approx((n - 1 + 2.0) / n, rel=1e-6)
    assert m["mismatch/is_weight_max"] == pytest.approx(2.0) and m["mismatch/is_weight_min"] == 1.0
    assert m["mismatch/token_mask_frac"] == 0.0  # the correction removed nothing


def test_entropy_is_the_mean_over_the_sampled_tokens_whatever_a_correction_masks(qwen3_dir):
    plain, masked = _step(qwen3_dir), _step(qwen3_dir, [{"name": "token_mask_is", "upper": 2.0}])
    assert masked["mismatch/token_mask_frac"] == pytest.approx(1 / 8)
    assert masked["train/entropy"] == plain["train/entropy"]


@pytest.mark.parametrize(
    "correction",
    [
        {"name": "token_tis", "upper": 2.0},
        {"name": "token_mask_is", "upper": 2.0},
        {"name": "sequence_mask_is", "upper": 2.0},
    ],
)
def test_loss_and_correction_metrics_do_not_depend_on_micro_batch_size(qwen3_dir, correction):
    """One token of 8 is 1 nat off: its share is 1/8 however the batch is cut into micro-batches
    (not each micro-batch's mean weighted by its sequences: 1/4 with one sequence each)."""
    whole = _step(qwen3_dir, [correction], entropy_coef=0.01)
    split = _step(qwen3_dir, [correction], micro_batch_size=1, entropy_coef=0.01)
    assert split["train/loss"] == whole["train/loss"]  # not the micro-batches' losses summed
    keys = [k for k in whole if k.startswith(("loss/", "correction/", "mismatch/"))]
    assert any(k.startswith("correction/") for k in keys) and "loss/ratio_mean" in keys
    for k in keys:
        assert split[k] == pytest.approx(whole[k], rel=1e-12, abs=1e-15), k
    if correction["name"] == "token_tis":
        assert whole["correction/token_tis/clip_frac"] == pytest.approx(1 / 8)
        # ρ = e^1 truncated to 2, one token at e^0.01, the other six at 1
        assert whole["loss/weight_mean"] == pytest.approx((6 + math.exp(0.01) + 2.0) / 8, rel=1e-5)


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_kl_ref_is_the_token_mean_of_the_estimator_in_every_aggregation(qwen3_dir, tmp_path, agg_mode):
    make_hf_model(tmp_path, "qwen3", seed=1)
    model, ref = exactrl.load_model(qwen3_dir), exactrl.load_model(tmp_path).requires_grad_(False)
    batch = _off_policy_batch(model)
    seqs = [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    with torch.no_grad():
        pi, _ = token_logprobs(model, seqs, first=[3, 3])
        pr, _ = token_logprobs(ref, seqs, first=[3, 3])
    d = torch.cat(pr) - torch.cat(pi)
    k3 = (d.double().exp() - 1 - d.double()).mean().item()
    s = _settings(kl_coef=0.1, kl_kind="k3")
    s.agg_mode = agg_mode
    m = train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-6), build_loss("ppo"), batch, s, ref_model=ref)
    assert m["train/kl_ref"] == pytest.approx(k3, rel=1e-5)


@pytest.mark.parametrize(
    "masks, words",
    [
        ({"loss_mask": [[1, 1]]}, "TrainBatch.loss_mask must have one entry per sequence, got 1 for 2"),
        ({"loss_mask": [[1, 1], [1]]}, "TrainBatch.loss_mask[1] must be 0/1 for each of its 2 completion tokens"),
        ({"generated_mask": [[1, 2], [1, 1]]}, "TrainBatch.generated_mask[0] must be 0/1"),
        (
            {"loss_mask": [[1, 1], [1, 1]], "generated_mask": [[1, 1], [0, 1]]},
            "TrainBatch.generated_mask[1] is 0 where loss_mask is 1",
        ),
        ({"generated_mask": [[1, 0], [1, 1]]}, "TrainBatch.generated_mask[0] is 0 where loss_mask is 1"),  # None: all 1
    ],
)
def test_a_bad_mask_is_refused_before_any_step(masks, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        TrainBatch([[1], [2]], [[3, 4], [5, 6]], [[0.0, 0.0], [0.0, 0.0]], [1.0, -1.0], **masks)
    ok = TrainBatch(
        [[1], [2]],
        [[3, 4], [5, 6]],
        [[0.0, 0.0], [0.0, 0.0]],
        [1.0, -1.0],
        loss_mask=[[0, 1], [0, 0]],
        generated_mask=[[1, 1], [0, 1]],
    )
    assert len(ok) == 2


def test_a_bad_sequence_is_named_by_its_batch_index_before_any_micro_batch(qwen3_dir):
    with pytest.raises(ValueError, match="TrainBatch is empty"):
        TrainBatch([], [], [], [])
    with pytest.raises(ValueError, match=re.escape("TrainBatch.prompt_ids[1] is empty")):
        TrainBatch([[1], []], [[3], [4]], [[0.0], [0.0]], [1.0, -1.0])
    model = exactrl.load_model(qwen3_dir)
    V = model.config.vocab_size
    before = [p.detach().clone() for p in model.parameters()]
    for prompts, completions, words in (
        ([[1], [2], [3]], [[4], [5], [V]], f"completion_ids[2] holds token id {V}"),
        ([[1], [-1], [3]], [[4], [5], [6]], "prompt_ids[1] holds token id -1"),
    ):
        batch = TrainBatch(prompts, completions, [[0.0]] * 3, [1.0, -1.0, 0.5])
        with pytest.raises(ValueError, match=re.escape(f"TrainBatch.{words}, outside the vocabulary [0, {V})")):
            train_step(
                model,
                torch.optim.AdamW(model.parameters(), lr=1.0),
                build_loss("ppo"),
                batch,
                _settings(micro_batch_size=1),
            )
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize(
    "corrections, kl_kind",
    [
        (None, None),
        ([{"name": "token_mask_is", "upper": 2.0, "lower": 0.5}], None),
        (None, "k2"),
        (None, "k1"),
        (None, "k3"),
    ],
)
def test_a_token_the_trainers_top_k_cuts_leaves_the_loss_and_is_counted(qwen3_dir, corrections, kl_kind):
    """Off-policy (async, an external engine) μ may sample a token that π_old's top-k/top-p cuts: log π_old
    = −inf. It cannot be trained (no ratio, no gradient); the step does not stop with a ValueError: it
    leaves the loss as a correction's mask would, and `mismatch/out_of_support_frac` counts it."""
    model = exactrl.load_model(qwen3_dir)
    engine = exactrl.Engine(model)
    greedy = engine.generate(PROMPTS, exactrl.SamplingParams(temperature=0, max_tokens=3))
    completions = [list(o[0].token_ids) for o in greedy]
    for p, c in zip(PROMPTS, completions):  # a last token outside the top 2: the first candidate that is
        for t in range(5, 200):
            with torch.no_grad():
                (lp,), _ = token_logprobs(model, [p + c + [t]], top_k=2, first=[len(p)])
            if lp[-1] == -math.inf:
                c.append(t)
                break
    with torch.no_grad():  # μ: the untruncated distribution (finite for every token)
        lps, _ = token_logprobs(model, [p + c for p, c in zip(PROMPTS, completions)], first=[3, 3])
        cut, _ = token_logprobs(model, [p + c for p, c in zip(PROMPTS, completions)], top_k=2, first=[3, 3])
    n_cut = int(sum((~torch.isfinite(x)).sum() for x in cut))
    assert 2 <= n_cut < sum(len(c) for c in completions)  # the last tokens, and perhaps a greedy tie
    batch = TrainBatch(PROMPTS, completions, [lp.tolist() for lp in lps], [1.0, -1.0])
    s = _settings(
        top_k=2,
        corrections=build_corrections(corrections) if corrections else None,
        **({"kl_coef": 0.1, "kl_kind": kl_kind} if kl_kind else {}),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    ref = exactrl.load_model(qwen3_dir) if kl_kind else None  # its −inf made k2's gradient NaN
    m = train_step(model, opt, build_loss("ppo"), batch, s, ref_model=ref)
    assert m["mismatch/out_of_support_frac"] == pytest.approx(n_cut / sum(len(c) for c in completions))
    assert all(math.isfinite(v) for v in m.values()), m
    assert math.isfinite(m["train/train_rollout_logprob_abs_diff_max"])  # over the tokens π_old covers
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the others trained
    assert all(torch.isfinite(p).all() for p in model.parameters())
