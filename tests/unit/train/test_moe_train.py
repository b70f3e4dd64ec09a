"""train_step on a mixture-of-experts model: `mismatch/routing_agreement` from the engine's experts (1.0 with
exact kernels, below 1.0 with fast ones on near-tied routers, absent without recorded experts), and the
load-balancing loss under `router_aux_loss_coef` (its value, its gradient, refused on a dense model)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_hf_model

import exactrl
from exactrl import Engine, SamplingParams
from exactrl.algo.losses import build_loss
from exactrl.model.logprobs import forward_hidden
from exactrl.model.moe import load_balancing_loss, moe_layers
from exactrl.train.trainer import StepSettings, TrainBatch, train_step

V = 211


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_moe_train")
    make_hf_model(d, "qwen3_moe")
    return d


def _settings(**kw) -> StepSettings:
    return StepSettings(1.0, -1, 1.0, 8, "token-mean", None, 1.0, **kw)


def _rollout_batch(model, experts: bool = True) -> TrainBatch:
    rng = random.Random(3)
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (5, 17)]
    outs = Engine(model).generate(prompts, SamplingParams(max_tokens=8, n=2, seed=1, ignore_eos=True))
    flat = [(p, c) for p, o in zip(prompts, outs) for c in o]
    return TrainBatch(
        [p for p, _ in flat],
        [c.token_ids for _, c in flat],
        [c.logprobs for _, c in flat],
        [1.0, -1.0, 0.5, -0.5],
        behav_experts=[c.experts for _, c in flat] if experts else None,
    )


def _near_tie(model):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in moe_layers(model):
            m.gate.weight[1] = m.gate.weight[0] + 1e-7 * torch.randn(m.gate.weight.shape[1], generator=g)


def _step(model, batch, **kw) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    return train_step(model, opt, build_loss("ppo"), batch, _settings(**kw))


def test_routing_agreement_is_one_with_exact_kernels(moe_dir):
    model = exactrl.load_model(moe_dir)
    _near_tie(model)
    m = _step(model, _rollout_batch(model))
    assert m["mismatch/routing_agreement"] == 1.0 and m["train/train_rollout_logprob_abs_diff_max"] == 0.0
    assert "mismatch/routing_agreement" not in _step(model, _rollout_batch(model, experts=False))


def test_routing_agreement_below_one_with_fast_kernels(moe_dir):
    model = exactrl.load_model(moe_dir, kernels="fast")
    _near_tie(model)
    m = _step(model, _rollout_batch(model))
    assert 0.0 < m["mismatch/routing_agreement"] < 1.0


def test_router_aux_loss_enters_the_loss_and_reaches_the_routers(moe_dir):
    model = exactrl.load_model(moe_dir)
    batch = _rollout_batch(model)
    grads = {}
    for coef in (0.0, 0.5):
        m = _step(model, batch, router_aux_loss_coef=coef, share_prompts=False)
        grads[coef] = moe_layers(model)[0].gate.weight.grad.clone()
        assert ("train/router_aux_loss" in m) == bool(coef)
    seqs = [p + c for p, c in zip(batch.prompt_ids, batch.completion_ids)]
    forward_hidden(model, seqs)  # one micro-batch, every token once: the term the step added
    want = 0.5 * load_balancing_loss(model).item()
    assert m["train/router_aux_loss"] == pytest.approx(want, rel=1e-6)
    assert not torch.equal(grads[0.0], grads[0.5])


def test_router_aux_loss_on_a_dense_model_is_refused(qwen3_dir):
    model = exactrl.load_model(qwen3_dir)
    batch = TrainBatch([[1, 2]], [[3, 4]], [[-1.0, -1.0]], [1.0])
    with pytest.raises(ValueError, match=r"optim.router_aux_loss_coef=0.1 needs a mixture-of-experts model"):
        _step(model, batch, router_aux_loss_coef=0.1)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_of_experts_changes_no_bit(tmp_path, mode):
    """Mixtral's experts sit under `block_sparse_moe`; recomputed, they route the same way: the same loss
    (with the load-balancing term) and gradients bit for bit."""
    from exactrl.train.activation_ckpt import apply_activation_checkpointing

    make_hf_model(tmp_path, "mixtral")
    runs = []
    for ckpt in ("none", mode):
        model = apply_activation_checkpointing(exactrl.load_model(tmp_path), ckpt)
        m = _step(model, _rollout_batch(model), router_aux_loss_coef=0.1)
        runs.append((m, [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (m0, g0), (m1, g1) = runs
    assert m0 == m1 and len(g0) == len(g1) and all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert m0["train/router_aux_loss"] > 0
