"""The float64 reference of one training step (shared by the step-reference tests): what the configured
objective's gradient and metrics must be, computed from the rollouts with no trainer code."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch
from conftest import make_hf_model

import exactrl
from exactrl.algo.corrections import build_corrections
from exactrl.algo.losses import build_loss
from exactrl.distributed import Ranks
from exactrl.envs.base import Problem
from exactrl.model.logprobs import token_logprobs
from exactrl.rollout.groups import Rollout
from exactrl.train.setup import Policy, _step_settings

F64 = torch.float64
MAX_TOKENS = 8
G_RTOL = 2e-5  # max |Δg| / max |g|, per parameter tensor (fp32 backward in another summation order)


class _Keep(torch.optim.Optimizer):
    """An optimizer that moves nothing: the step's (clipped) gradient stays in `p.grad` to be read."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.0})

    def step(self, closure=None):
        return None


# ------------------------------------------------------------------ the batch
# (prompt length, [(completion length, finish_reason, reward), ...]) per group; max_tokens = 8
GROUPS = [
    (5, [(6, "stop", 1.0), (2, "stop", 0.0), (8, "length", 0.5)]),
    (3, [(0, "stop", 0.0), (4, "stop", 1.0), (8, "length", 1.0)]),  # an empty completion
    (7, [(3, "stop", 0.5), (5, "stop", 0.5), (1, "stop", 0.5)]),  # equal rewards: advantage 0
    (2, [(7, "stop", 0.2), (8, "length", 0.0), (5, "stop", 0.9)]),
]


def make_groups(model, temperature: float) -> list[list[Rollout]]:
    """The groups above with random tokens; μ is the model's untruncated logprob, 0.3 nat off on every third
    token of every other sequence (so bypass ratios, corrections and mismatch figures are not trivial)."""
    rng = random.Random(5)
    groups, k = [], 0
    for plen, samples in GROUPS:
        prompt = [rng.randrange(3, 200) for _ in range(plen)]
        group = []
        for n, finish, reward in samples:
            comp = [rng.randrange(3, 200) for _ in range(n)]
            with torch.no_grad():
                lp = exactrl.sequence_logprobs(model, [prompt + comp], temperature)[0][plen - 1 :]
            behav = [x + (0.3 * (-1) ** t if k % 2 and t % 3 == 0 else 0.0) for t, x in enumerate(lp.tolist())]
            group.append(Rollout(Problem("q", "a"), prompt, comp, behav, [0] * n, finish, "", reward))
            k += 1
        groups.append(group)
    return groups


@pytest.fixture(scope="module")
def ref_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref_model")
    make_hf_model(d, "qwen3", seed=1)
    return d


@pytest.fixture(scope="module")
def models(qwen3_dir, ref_dir):
    return exactrl.load_model(qwen3_dir), exactrl.load_model(ref_dir).requires_grad_(False)


# ------------------------------------------------------------------ the reference
def kl_token(lp, ref, kind):
    """Schulman's estimators of KL(p‖q) from p's samples: k1 = log p − log q, k3 = q/p − 1 − log(q/p)."""
    if kind == "k1":
        return lp - ref
    if kind == "k2":
        return 0.5 * (lp - ref) ** 2
    return torch.exp(ref - lp) - (ref - lp) - 1.0


def grpo_advantages(rewards: list[float], normalize_std: bool = True, eps: float = 1e-6) -> list[float]:
    """(r − mean) / (Bessel std + eps) within the group (without the std: Dr. GRPO); equal rewards: 0."""
    if len(set(rewards)) == 1:
        return [0.0] * len(rewards)
    m = sum(rewards) / len(rewards)
    sd = math.sqrt(sum((r - m) ** 2 for r in rewards) / (len(rewards) - 1))
    return [(r - m) / (sd + eps if normalize_std else 1.0) for r in rewards]


def _whitened(x: list[float], eps: float, centre: bool = True) -> list[float]:
    m = sum(x) / len(x) if centre else 0.0
    sd = math.sqrt(sum((v - sum(x) / len(x)) ** 2 for v in x) / (len(x) - 1))
    return [(v - m) / (sd + eps) for v in x]


def advantages(rewards: list[float], sizes: list[int], name: str, kw: dict) -> list[float]:
    """advantages.py's estimators from their docstrings, group by group (sizes) or over the whole batch."""
    groups, at = [], 0
    for n in sizes:
        groups.append(rewards[at : at + n])
        at += n
    if name == "grpo":
        return sum((grpo_advantages(g, **kw) for g in groups), [])
    if name == "dr_grpo":
        return sum((grpo_advantages(g, normalize_std=False) for g in groups), [])
    if name == "rloo":  # r_i − the mean of the others
        return [0.0 if len(set(g)) == 1 else r - (sum(g) - r) / (len(g) - 1) for g in groups for r in g]
    if name == "reinforce_pp":  # whitened over the batch, no group baseline
        return _whitened(rewards, kw.get("eps", 1e-6))
    assert name == "reinforce_pp_baseline", name  # the group mean off, then divided by the batch std
    centred = sum((grpo_advantages(g, normalize_std=False) for g in groups), [])
    return _whitened(centred, kw.get("eps", 1e-6), centre=False)


def _forward(model, ref_model, r, rs, ref=False):
    """log π_θ (the sampling distribution) or log π_ref (its temperature, untruncated) of r's completion."""
    seq, p = r.prompt_ids + r.completion_ids, len(r.prompt_ids)
    if ref:
        with torch.no_grad():
            return exactrl.sequence_logprobs(ref_model, [seq], rs.temperature)[0][p - 1 :].to(F64)
    return exactrl.sequence_logprobs(model, [seq], rs.temperature, rs.top_k, rs.top_p)[0][p - 1 :].to(F64)


def reference(model, ref_model, groups, cfg) -> tuple[list[torch.Tensor], dict[str, float]]:
    """The step's clipped gradient and metrics from the config's meaning, one sequence at a time."""
    a, rs = cfg.algorithm, cfg.rollout
    flat = [r for g in groups for r in g]

    def forward(r, ref=False):
        return _forward(model, ref_model, r, rs, ref)

    # rewards -> shaped rewards -> advantages
    rewards, kl_sums, penalties = [], [], []
    for r in flat:
        x, n = r.reward, len(r.completion_ids)
        if a.kl.coef and a.kl.where == "reward":  # β Σ_t k(μ, π_ref) over the completion
            kl_sums.append(
                float(kl_token(torch.tensor(r.behav_logprobs, dtype=F64), forward(r, True), a.kl.kind).sum())
                if n
                else 0.0
            )
            x -= a.kl.coef * kl_sums[-1]
        L, Lb = rs.max_tokens, a.overlong.buffer_len
        penalties.append(a.overlong.penalty_factor * (L - Lb - n) / Lb if Lb and n > L - Lb else 0.0)  # DAPO eq. 13
        rewards.append(x + penalties[-1])
    adv = advantages(rewards, [len(g) for g in groups], a.advantage, a.advantage_kwargs)
    rows = [
        SimpleNamespace(
            prompt_ids=r.prompt_ids,
            completion_ids=r.completion_ids,
            behav_logprobs=r.behav_logprobs,
            A=A,
            generated=[1] * len(r.completion_ids),
            trained=[int(not (a.overlong.mask_truncated and r.finish_reason == "length"))] * len(r.completion_ids),
        )
        for r, A in zip(flat, adv)
    ]
    grads, metrics = reference_rows(model, ref_model, rows, cfg)
    if kl_sums:  # over every sequence, an empty one's 0 included
        metrics |= {
            "rollout/kl_ref_per_seq": sum(kl_sums) / len(kl_sums),
            "rollout/kl_penalty_mean": a.kl.coef * sum(kl_sums) / len(kl_sums),
        }
    if a.overlong.buffer_len:
        metrics |= {
            "rollout/overlong_penalty_mean": sum(penalties) / len(penalties),
            "rollout/overlong_penalised_frac": sum(x < 0 for x in penalties) / len(penalties),
        }
    return grads, metrics


def reference_rows(model, ref_model, rows, cfg) -> tuple[list[torch.Tensor], dict[str, float]]:
    """The step on rows (prompt_ids, completion_ids, behav_logprobs, advantage A, and per completion token
    `generated`: sampled by the engine, `trained`: the loss mask), from the config's meaning."""
    a, rs = cfg.algorithm, cfg.rollout
    kw = a.loss_kwargs
    temp, top_k, top_p = rs.temperature, rs.top_k, rs.top_p

    def forward(r, ref=False):
        return _forward(model, ref_model, r, rs, ref)

    # per-sequence pieces
    seqs = []
    for r in rows:
        lp, A = forward(r), r.A
        n = len(r.completion_ids)
        sampled = torch.tensor(r.trained, dtype=F64).reshape(n)  # the loss mask, as sampled
        gen = torch.tensor(r.generated, dtype=F64).reshape(n)
        live = sampled * torch.isfinite(lp)  # a token the trainer's top-k/top-p cuts cannot be trained
        mu = torch.where(gen > 0, torch.tensor(r.behav_logprobs, dtype=torch.float32).to(F64), 0.0)
        old = lp.detach()
        lr_tok = torch.where(live > 0, old - mu, 0.0)
        w, keep = torch.ones(n, dtype=F64), live.clone()
        for c in a.corrections:
            if c["name"] == "token_tis":
                w = w * torch.exp(lr_tok).clamp(max=c["upper"])
            elif c["name"] == "token_mask_is":
                keep = keep * (lr_tok.exp() >= c.get("lower", 0)) * (lr_tok.exp() <= c["upper"])
            elif c["name"] == "sequence_mask_is":
                if not c.get("lower", 0) <= math.exp(float(lr_tok.sum())) <= c["upper"]:
                    keep = keep * 0
            else:
                raise AssertionError(c)
        ent = None
        if a.entropy_coef:
            _, (ent,) = token_logprobs(
                model,
                [r.prompt_ids + r.completion_ids],
                temp,
                top_k,
                top_p,
                with_entropy=True,
                first=[len(r.prompt_ids)],
                entropy_grad=True,
            )
            ent = ent.to(F64)
        seqs.append(
            SimpleNamespace(
                lp=lp,
                old=old,
                mu=mu,
                A=A,
                sampled=sampled,
                gen=gen,
                keep=keep,
                w=w,
                ent=ent,
                ref=forward(r, True) if a.kl.coef and a.kl.where == "loss" else None,
            )
        )

    n_tokens = sum(float(s.sampled.sum()) for s in seqs)  # LossNorm.total_tokens: the loss mask, whole batch
    B = len(seqs)

    def agg(values_of) -> torch.Tensor:
        """aggregation.py's table, with n_b the sequence's loss-mask tokens and both totals the batch's."""
        total = torch.zeros((), dtype=F64)
        for s in seqs:
            if not s.keep.any():
                continue
            v = torch.where(s.keep > 0, values_of(s), 0.0).sum()
            total = total + (v / s.sampled.sum() if a.agg_mode == "seq-mean-token-mean" else v)
        return (
            total
            / {
                "token-mean": max(n_tokens, 1),
                "seq-mean-token-mean": B,
                "seq-mean-token-sum": B,
                "constant-normalised": rs.max_tokens * B,
            }[a.agg_mode]
        )

    flags = {"low": [], "high": [], "ratio": [], "dual": [], "weight": [], "gate": []}

    def policy_loss(s):
        base = s.mu if a.bypass else s.old  # bypass: ratio against μ
        lp = torch.where(s.keep > 0, s.lp, 0.0)
        base = torch.where(s.keep > 0, base, 0.0)
        A = torch.full_like(lp, s.A)
        if a.loss == "ppo":
            el, eh = kw.get("eps_low", 0.2), kw.get("eps_high", 0.2)
            r = torch.exp(lp - base)
            loss = torch.maximum(-A * r, -A * r.clamp(1 - el, 1 + eh))
            if kw.get("dual_clip"):
                loss = torch.where(A < 0, torch.minimum(loss, -kw["dual_clip"] * A), loss)
                flags["dual"] += ((A < 0) & (r > kw["dual_clip"]))[s.keep > 0].tolist()
            low, high = (A < 0) & (r < 1 - el), (A > 0) & (r > 1 + eh)
        elif a.loss == "gspo":
            el, eh = kw.get("eps_low", 3e-4), kw.get("eps_high", 4e-4)
            m = s.keep > 0
            s_i = torch.exp(((lp - base) * m).sum() / m.sum().clamp(min=1)).detach()
            r = s_i * torch.exp(lp - lp.detach())  # value s_i, gradient s_i ∇log π_θ(y_t)
            loss = torch.maximum(-A * r, -A * r.clamp(1 - el, 1 + eh))
            low, high = (A < 0) & (r < 1 - el), (A > 0) & (r > 1 + eh)
        elif a.loss == "cispo":
            el, eh = kw.get("eps_low_is", 1.0), kw.get("eps_high_is", 0.28)
            r = torch.exp(lp - base).detach()
            loss = -r.clamp(1 - el, 1 + eh) * A * lp
            low, high = r < 1 - el, r > 1 + eh
        elif a.loss == "reinforce":  # −A log π_θ; the ratio only measured
            r, loss = torch.exp(lp - base), -A * lp
            low = high = None
        elif a.loss == "sapo":  # −(4/τ) σ(τ (r − 1)) A, τ_pos where A > 0, τ_neg elsewhere
            r = torch.exp(lp - base)
            tau = torch.where(A > 0, kw.get("tau_pos", 1.0), kw.get("tau_neg", 1.05))
            sig = torch.sigmoid(tau * (r - 1))
            loss = -(4 / tau) * sig * A
            flags["gate"] += (4 * sig * (1 - sig)).detach()[s.keep > 0].tolist()
            low = high = None
        else:  # TOPR: A < 0 weighted by sg[clip(ρ, 0, upper)], ρ the sequence's (or the token's) ratio
            assert a.loss == "topr", a.loss
            upper, m = kw.get("upper", 1.0), s.keep > 0
            log_rho = (lp - base).detach()
            r = torch.exp(log_rho[m].sum() if kw.get("level", "sequence") == "sequence" else log_rho).expand_as(lp)
            loss = -torch.where(A < 0, r.clamp(0, upper), 1.0) * A * lp
            low, high = None, (A < 0) & (r > upper)
        m = s.keep > 0
        if low is not None:
            flags["low"] += low[m].tolist()
        if high is not None:
            flags["high"] += high[m].tolist()
        flags["ratio"] += r.detach()[m].tolist()
        flags["weight"] += s.w[m].tolist()
        return loss * s.w

    obj = agg(policy_loss)
    if a.entropy_coef:
        obj = obj - a.entropy_coef * agg(lambda s: s.ent)
    if a.kl.coef and a.kl.where == "loss":
        obj = obj + a.kl.coef * agg(lambda s: kl_token(torch.where(s.keep > 0, s.lp, s.ref), s.ref, a.kl.kind))
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(obj, params, allow_unused=True)
    grads = [torch.zeros_like(p, dtype=F64) if g is None else g.to(F64) for p, g in zip(params, grads)]
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
    coef = min(1.0, cfg.optim.grad_clip / (norm + 1e-6))  # torch's clip_grad_norm_ (its 1e-6)

    def mean(x):
        return sum(x) / max(len(x), 1)

    metrics = {
        "train/loss": float(obj.detach()),
        "train/grad_norm": norm,
        "loss/ratio_mean": mean(flags["ratio"]),
        "loss/weight_mean": mean(flags["weight"]),
    }
    if a.loss in ("ppo", "gspo", "cispo", "topr"):  # TOPR's clip is its negatives' truncation: high only
        metrics["loss/clip_frac_high"] = mean(flags["high"])
    if a.loss in ("ppo", "gspo", "cispo"):
        metrics["loss/clip_frac_low"] = mean(flags["low"])
    if a.loss == "sapo":
        metrics["loss/gate_mean"] = mean(flags["gate"])
    if kw.get("dual_clip"):
        metrics["loss/dual_clip_frac"] = mean(flags["dual"])
    # docs/design.md §3: per sequence the mean |π_old − μ| over its sampled tokens (those π_old covers; cut ones
    # are counted apart), then the mean over the sequences that have any; trained on or not (mask_truncated)
    diffs = [(s.old - s.mu).abs()[torch.isfinite(s.old) & (s.gen > 0)] for s in seqs]
    metrics["train/train_rollout_logprob_abs_diff"] = mean([float(d.mean()) for d in diffs if len(d)])
    metrics["train/train_rollout_logprob_abs_diff_max"] = max(float(d.max()) for d in diffs if len(d))
    metrics["mismatch/out_of_support_frac"] = mean(sum((torch.isinf(s.old)[s.gen > 0].tolist() for s in seqs), []))
    if a.entropy_coef:  # the policy's entropy over every sampled token, trained on or not
        metrics["train/entropy"] = mean(sum((s.ent[s.gen > 0].tolist() for s in seqs), []))
    if a.kl.coef and a.kl.where == "loss":  # the estimator's token mean over the trained tokens
        kls = [kl_token(s.lp, s.ref, a.kl.kind).detach()[s.keep > 0].tolist() for s in seqs]
        metrics["train/kl_ref"] = mean(sum(kls, []))
    return [g * coef for g in grads], metrics


# ------------------------------------------------------------------ running the step
def components(model, ref_model, cfg, micro_batch_size=None, ranks=Ranks()):
    a = cfg.algorithm
    s = _step_settings(cfg, build_corrections(a.corrections) if a.corrections else None)
    if micro_batch_size is not None:
        s.micro_batch_size = micro_batch_size
    policy = Policy(
        model, ref_model if a.kl.coef else None, _Keep(model.parameters()), build_loss(a.loss, **a.loss_kwargs), s
    )
    return SimpleNamespace(cfg=cfg, policy=policy, ranks=ranks, set_lr=lambda step: 0.0)


def step_grads(model) -> list[torch.Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters() if p.requires_grad]


def assert_grads_close(got, want, rtol=G_RTOL, floor=0.0):
    """max |Δg| <= rtol · max |g| per tensor, + floor · max |g| over every tensor (for a tensor whose
    gradient almost cancels, where fp32 rounding of its larger terms is all that is left)."""
    worst, top = 0.0, max(float(w.abs().max()) for w in want)
    for k, (g, w) in enumerate(zip(got, want)):
        scale = float(w.abs().max())
        err = float((g.to(F64) - w).abs().max())
        assert err <= rtol * scale + floor * top + 1e-12, (k, err, scale, top)
        worst = max(worst, err / scale if scale else err)
    return worst


BASE = [
    "progress=false",
    "tensorboard=false",
    f"rollout.max_tokens={MAX_TOKENS}",
    "rollout.samples_per_prompt=3",
    "optim.grad_clip=1e9",
]
CONFIGS = {
    "token-mean ppo": [],
    "seq-mean-token-mean ppo bypass dual clip": [
        "algorithm.agg_mode=seq-mean-token-mean",
        "algorithm.bypass=true",
        "algorithm.loss_kwargs={eps_low: 0.1, eps_high: 0.15, dual_clip: 1.2}",
    ],
    "seq-mean-token-sum gspo bypass": [
        "algorithm.agg_mode=seq-mean-token-sum",
        "algorithm.loss=gspo",
        "algorithm.bypass=true",
        "algorithm.loss_kwargs={eps_low: 0.03, eps_high: 0.04}",
    ],
    "constant-normalised cispo bypass": [
        "algorithm.agg_mode=constant-normalised",
        "algorithm.loss=cispo",
        "algorithm.bypass=true",
        "algorithm.loss_kwargs={eps_low_is: 0.2, eps_high_is: 0.1}",
    ],
    "token-mean ppo with corrections": [
        "algorithm.corrections=[{name: token_tis, upper: 1.2}, {name: sequence_mask_is, upper: 1.5, lower: 0.9}]"
    ],
    "seq-mean-token-mean kl k3 in the loss, entropy": [
        "algorithm.agg_mode=seq-mean-token-mean",
        "algorithm.kl.coef=0.3",
        "algorithm.kl.kind=k3",
        "algorithm.entropy_coef=0.05",
        "algorithm.corrections=[{name: token_mask_is, upper: 1.2}]",
    ],
    "token-mean kl k1 in the loss, temperature": [
        "algorithm.kl.coef=0.3",
        "algorithm.kl.kind=k1",
        "rollout.temperature=0.7",
    ],
    "kl k1 in the reward, overlong shaping and masking": [
        "algorithm.kl.coef=0.05",
        "algorithm.kl.kind=k1",
        "algorithm.kl.where=reward",
        "algorithm.overlong.buffer_len=4",
        "algorithm.overlong.penalty_factor=0.5",
        "algorithm.overlong.mask_truncated=true",
    ],
    "seq-mean-token-mean mask_truncated, k3 in the loss": [
        "algorithm.agg_mode=seq-mean-token-mean",
        "algorithm.overlong.mask_truncated=true",
        "algorithm.kl.coef=0.2",
    ],
    "top-k cuts sampled tokens, grad clip": [
        "rollout.top_k=100",
        "rollout.temperature=0.9",
        "algorithm.kl.coef=0.2",
        "algorithm.kl.kind=k2",
        "optim.grad_clip=0.05",
    ],
    "gspo seq-mean-token-mean, grad clip": [
        "algorithm.agg_mode=seq-mean-token-mean",
        "algorithm.loss=gspo",
        "algorithm.bypass=true",
        "algorithm.loss_kwargs={eps_low: 0.03, eps_high: 0.04}",
        "optim.grad_clip=0.02",
    ],
    "reinforce bypass, rloo, seq-mean-token-sum": [
        "algorithm.loss=reinforce",
        "algorithm.bypass=true",
        "algorithm.advantage=rloo",
        "algorithm.agg_mode=seq-mean-token-sum",
    ],
    "sapo bypass, dr_grpo, seq-mean-token-mean": [
        "algorithm.loss=sapo",
        "algorithm.bypass=true",
        "algorithm.loss_kwargs={tau_pos: 2.0, tau_neg: 3.0}",
        "algorithm.advantage=dr_grpo",
        "algorithm.agg_mode=seq-mean-token-mean",
    ],
    "sapo, grpo without std, kl k2 in the loss, entropy": [
        "algorithm.loss=sapo",
        "algorithm.advantage_kwargs={normalize_std: false}",
        "algorithm.kl.coef=0.2",
        "algorithm.kl.kind=k2",
        "algorithm.entropy_coef=0.05",
    ],
    "topr bypass, reinforce_pp, kl k1 in the reward, token_mask_is": [
        "algorithm.loss=topr",
        "algorithm.bypass=true",
        "algorithm.loss_kwargs={upper: 0.9}",
        "algorithm.advantage=reinforce_pp",
        "algorithm.kl.coef=0.05",
        "algorithm.kl.kind=k1",
        "algorithm.kl.where=reward",
        "algorithm.corrections=[{name: token_mask_is, upper: 1.2}]",
    ],
    "topr token level bypass, reinforce_pp_baseline, constant-normalised, token_tis": [
        "algorithm.loss=topr",
        "algorithm.bypass=true",
        "algorithm.loss_kwargs={upper: 0.9, level: token}",
        "algorithm.advantage=reinforce_pp_baseline",
        "algorithm.advantage_kwargs={eps: 0.01}",
        "algorithm.agg_mode=constant-normalised",
        "algorithm.corrections=[{name: token_tis, upper: 1.2}]",
    ],
    "topr upper 0.5, grpo eps 0.1, mask_truncated": [
        "algorithm.loss=topr",
        "algorithm.loss_kwargs={upper: 0.5}",
        "algorithm.advantage_kwargs={eps: 0.1}",
        "algorithm.overlong.mask_truncated=true",
    ],
}
