"""Every loss, correction, advantage, KL estimator, aggregation mode and mismatch metric against a plain
per-token Python reference written from its paper's formula (not from the project's code): value, gradient
and metrics, on small random batches with ragged masks, empty rows, on-policy rows and garbage in padding.

The references use python floats and the `math` module only; gradients are the papers' own gradient
expressions (∂ℓ_t/∂log π_θ(y_t)), so a missing stop-gradient (GSPO's sg[s_i], CISPO's and TOPR's detached
weights) shows up as a cross-token or extra term. Tolerances are fp64-tight unless a test says otherwise.

Legend: B sequences, T tokens; P prompts, G samples per prompt.
"""

import math
import statistics

import pytest
import torch

from exactrl.algo.advantages import compute_advantages
from exactrl.algo.aggregation import aggregate
from exactrl.algo.corrections import build_corrections
from exactrl.algo.diagnostics import logprob_diff_metrics, mismatch_metrics
from exactrl.algo.kl import kl_estimate, kl_reward_penalty
from exactrl.algo.losses import build_loss
from exactrl.algo.types import LossInputs, LossNorm

F64 = torch.float64
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant-normalised"]
CONSTANT = 9.0  # Dr.GRPO's fixed length for `constant-normalised`


def close(actual, expected, rtol=1e-12, atol=1e-14):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64), rtol=rtol, atol=atol
    )


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def clip(x, lo, hi):
    return min(max(x, lo), hi)


# ---------------------------------------------------------------- random batches
def make_batch(seed, B=6, T=7, scale=0.6, token_adv=False):
    """Ragged batch as python lists plus its tensors. Row 0 is empty, row 1 exactly on-policy (ratio 1, the
    trainer's case), row 2 full length; `sampled` ⊇ `mask` (a correction removed some tokens); every
    position outside `mask` holds garbage (NaN / ±inf) that must reach neither value nor gradient."""
    g = torch.Generator().manual_seed(seed)
    lengths = [0, T, T] + torch.randint(1, T + 1, (B - 3,), generator=g).tolist()
    sampled = [[1.0 if t < lengths[b] else 0.0 for t in range(T)] for b in range(B)]
    drop = (torch.rand(B, T, generator=g) < 0.2).tolist()
    mask = [[0.0 if drop[b][t] and b != 1 else sampled[b][t] for t in range(T)] for b in range(B)]
    lp = (-3.0 * torch.rand(B, T, generator=g, dtype=F64) - 0.01).tolist()
    lr = (scale * torch.randn(B, T, generator=g, dtype=F64)).tolist()
    lr[1] = [0.0] * T
    adv_seq = torch.randn(B, generator=g, dtype=F64).tolist()
    adv_seq[3] = 0.0
    adv = torch.randn(B, T, generator=g, dtype=F64).tolist() if token_adv else [[adv_seq[b]] * T for b in range(B)]
    w = (0.5 + 1.5 * torch.rand(B, T, generator=g, dtype=F64)).tolist()
    old = [[lp[b][t] - lr[b][t] for t in range(T)] for b in range(B)]
    garbage = [float("nan"), float("inf"), -float("inf")]

    def dirty(rows):
        return torch.tensor(
            [[x if mask[b][t] else garbage[(b + t) % 3] for t, x in enumerate(r)] for b, r in enumerate(rows)],
            dtype=F64,
        )

    ref = dict(lp=lp, old=old, adv=adv, w=w, mask=mask, sampled=sampled, B=B, T=T)
    tensors = dict(
        lp=dirty(lp),
        old=dirty(old),
        adv=dirty(adv),
        w=dirty(w),
        mask=torch.tensor(mask, dtype=F64),
        sampled=torch.tensor(sampled, dtype=F64),
    )
    return ref, tensors


def norm_of(ref):
    """Denominators as the trainer counts them: the tokens as sampled, every row a sequence."""
    return LossNorm(total_tokens=int(sum(map(sum, ref["sampled"]))), total_seqs=ref["B"], constant=CONSTANT)


def agg_coef(ref, mode):
    """∂(aggregate)/∂v[b][t] for an unmasked token, from the mode's definition (aggregation.py table; Dr.GRPO
    for `constant-normalised`): the aggregate is Σ_b Σ_t coef[b][t] · v[b][t] over unmasked tokens."""
    n_tok, n_seq = sum(map(sum, ref["sampled"])), ref["B"]
    coef = []
    for b in range(ref["B"]):
        n_b = sum(ref["sampled"][b])  # the sequence's length as sampled
        c = {
            "token-mean": 1.0 / n_tok,
            "seq-mean-token-mean": 1.0 / (max(n_b, 1) * n_seq),
            "seq-mean-token-sum": 1.0 / n_seq,
            "constant-normalised": 1.0 / (CONSTANT * n_seq),
        }[mode]
        coef.append([c if ref["mask"][b][t] else 0.0 for t in range(ref["T"])])
    return coef


def tokens(ref):
    return [(b, t) for b in range(ref["B"]) for t in range(ref["T"]) if ref["mask"][b][t]]


def seq_tokens(ref, b):
    return [t for t in range(ref["T"]) if ref["mask"][b][t]]


# ---------------------------------------------------------------- per-token references from the papers
def ref_ppo(ref, eps_low, eps_high, dual_clip):
    """Schulman et al. 2017 (asymmetric ε: DAPO; dual clip: Ye et al. 2020). Objective per token
    J = min(rA, clip(r)A), with dual clip for A<0: max(J, cA). Loss −J; ∂(−J)/∂log π = −A r on the
    unclipped branch, 0 on a clipped one."""
    out, metrics = {}, {"low": 0, "high": 0, "dual": 0, "ratio": 0.0}
    for b, t in tokens(ref):
        r, A = math.exp(ref["lp"][b][t] - ref["old"][b][t]), ref["adv"][b][t]
        unclipped, clipped = r * A, clip(r, 1 - eps_low, 1 + eps_high) * A
        J, grad = (unclipped, -A * r) if unclipped <= clipped else (clipped, 0.0)
        if clipped < unclipped:
            metrics["low" if A < 0 else "high"] += 1
        if dual_clip is not None and A < 0 and dual_clip * A > J:
            J, grad = dual_clip * A, 0.0
            metrics["dual"] += 1
        metrics["ratio"] += r
        out[b, t] = (-J, grad)
    n = len(out)
    m = {
        "loss/clip_frac_low": metrics["low"] / n,
        "loss/clip_frac_high": metrics["high"] / n,
        "loss/ratio_mean": metrics["ratio"] / n,
    }
    if dual_clip is not None:
        m["loss/dual_clip_frac"] = metrics["dual"] / n
    return out, m


def ref_gspo(ref, eps_low, eps_high):
    """GSPO-token (Zheng et al. 2025): s_i = (Π_t π_θ/π_old)^(1/|y_i|), s_i,t = sg[s_i]·π_θ(y_t)/sg[π_θ(y_t)];
    J_t = min(s_i,t A_t, clip(s_i,t) A_t). ∂(−J_t)/∂log π_θ(y_t) = −A_t s_i unclipped, else 0; nothing
    flows to the other tokens of the sequence (the stop-gradient)."""
    out, low, high, ratio = {}, 0, 0, 0.0
    for b in range(ref["B"]):
        ts = seq_tokens(ref, b)
        if not ts:
            continue
        prod = 1.0
        for t in ts:
            prod *= math.exp(ref["lp"][b][t] - ref["old"][b][t])
        s = prod ** (1.0 / len(ts))
        for t in ts:
            A = ref["adv"][b][t]
            unclipped, clipped = s * A, clip(s, 1 - eps_low, 1 + eps_high) * A
            J, grad = (unclipped, -A * s) if unclipped <= clipped else (clipped, 0.0)
            low += clipped < unclipped and A < 0
            high += clipped < unclipped and A > 0
            ratio += s
            out[b, t] = (-J, grad)
    n = len(out)
    return out, {"loss/clip_frac_low": low / n, "loss/clip_frac_high": high / n, "loss/ratio_mean": ratio / n}


def ref_cispo(ref, eps_low_is, eps_high_is):
    """MiniMax-M1 CISPO: J_t = sg[clip(r_t, 1−ε_low, 1+ε_high)] A log π_θ(y_t); ∂(−J)/∂log π = −r̂ A."""
    out, low, high, ratio = {}, 0, 0, 0.0
    for b, t in tokens(ref):
        r, A = math.exp(ref["lp"][b][t] - ref["old"][b][t]), ref["adv"][b][t]
        w = clip(r, 1 - eps_low_is, 1 + eps_high_is)
        low += r < 1 - eps_low_is
        high += r > 1 + eps_high_is
        ratio += r
        out[b, t] = (-w * A * ref["lp"][b][t], -w * A)
    n = len(out)
    return out, {"loss/clip_frac_low": low / n, "loss/clip_frac_high": high / n, "loss/ratio_mean": ratio / n}


def ref_reinforce(ref):
    """Williams 1992: J_t = A log π_θ(y_t)."""
    out, ratio = {}, 0.0
    for b, t in tokens(ref):
        A = ref["adv"][b][t]
        ratio += math.exp(ref["lp"][b][t] - ref["old"][b][t])
        out[b, t] = (-A * ref["lp"][b][t], -A)
    return out, {"loss/ratio_mean": ratio / len(out)}


def ref_sapo(ref, tau_pos, tau_neg):
    """SAPO (Gao et al. 2025): J_t = f(r_t) A_t, f(x) = (4/τ) σ(τ(x−1)), τ = τ_pos if A > 0 else τ_neg;
    ∇J_t = 4 σ(1−σ) r_t A_t ∇log π_θ(y_t) (paper's gradient weight w = 4p(1−p))."""
    out, ratio, gate = {}, 0.0, 0.0
    for b, t in tokens(ref):
        r, A = math.exp(ref["lp"][b][t] - ref["old"][b][t]), ref["adv"][b][t]
        tau = tau_pos if A > 0 else tau_neg
        p = sigmoid(tau * (r - 1))
        ratio += r
        gate += 4 * p * (1 - p)
        out[b, t] = (-(4 / tau) * p * A, -4 * p * (1 - p) * r * A)
    n = len(out)
    return out, {"loss/ratio_mean": ratio / n, "loss/gate_mean": gate / n}


def ref_topr(ref, upper, level):
    """TOPR (Le Roux et al. 2025): A ≥ 0: J = A log π(y); A < 0: J = sg[clip(ρ, 0, upper)] A log π(y),
    ρ = π_θ(y)/π_old(y) over the whole trajectory (Π_t), or per token for level='token'."""
    out, ratio, high = {}, 0.0, 0
    for b in range(ref["B"]):
        ts = seq_tokens(ref, b)
        prod = 1.0
        for t in ts:
            prod *= math.exp(ref["lp"][b][t] - ref["old"][b][t])
        for t in ts:
            A = ref["adv"][b][t]
            rho = prod if level == "sequence" else math.exp(ref["lp"][b][t] - ref["old"][b][t])
            w = 1.0 if A >= 0 else clip(rho, 0.0, upper)
            ratio += rho
            high += A < 0 and rho > upper
            out[b, t] = (-w * A * ref["lp"][b][t], -w * A)
    n = len(out)
    return out, {"loss/ratio_mean": ratio / n, "loss/clip_frac_high": high / n}


LOSS_CASES = [
    ("ppo", {}, lambda r: ref_ppo(r, 0.2, 0.2, None)),
    ("ppo", {"eps_low": 0.2, "eps_high": 0.28}, lambda r: ref_ppo(r, 0.2, 0.28, None)),
    ("ppo", {"eps_low": 0.1, "eps_high": 0.3, "dual_clip": 1.5}, lambda r: ref_ppo(r, 0.1, 0.3, 1.5)),
    ("ppo", {"eps_low": 0.0, "eps_high": 0.0}, lambda r: ref_ppo(r, 0.0, 0.0, None)),  # degenerate: clip = 1
    ("gspo", {"eps_low": 0.05, "eps_high": 0.08}, lambda r: ref_gspo(r, 0.05, 0.08)),
    ("gspo", {}, lambda r: ref_gspo(r, 3e-4, 4e-4)),
    ("cispo", {}, lambda r: ref_cispo(r, 1.0, 0.28)),
    ("cispo", {"eps_low_is": 0.3, "eps_high_is": 0.1}, lambda r: ref_cispo(r, 0.3, 0.1)),
    ("reinforce", {}, ref_reinforce),
    ("sapo", {}, lambda r: ref_sapo(r, 1.0, 1.05)),
    ("sapo", {"tau_pos": 0.5, "tau_neg": 3.0}, lambda r: ref_sapo(r, 0.5, 3.0)),
    ("topr", {}, lambda r: ref_topr(r, 1.0, "sequence")),
    ("topr", {"upper": 0.7, "level": "token"}, lambda r: ref_topr(r, 0.7, "token")),
]


def run_loss(name, kwargs, x, mode, norm, dtype=F64):
    lp = x["lp"].detach().to(dtype).clone().requires_grad_(True)
    inp = LossInputs(
        logprobs_BT=lp,
        old_logprobs_BT=x["old"].to(dtype),
        behav_logprobs_BT=x["old"].to(dtype),
        advantages_BT=x["adv"].to(dtype),
        mask_BT=x["mask"],
        weights_BT=x["w"].to(dtype),
        sampled_mask_BT=x["sampled"],
    )
    value, metrics = build_loss(name, **kwargs)(inp, mode, norm)
    value.backward()
    return value, lp.grad, metrics


def expected_loss(ref, per_token, mode):
    """value = Σ coef·w·ℓ, grad[b][t] = coef·w·∂ℓ/∂log π_θ(y_t)."""
    coef = agg_coef(ref, mode)
    value, grad = 0.0, [[0.0] * ref["T"] for _ in range(ref["B"])]
    for (b, t), (loss_t, dloss_t) in per_token.items():
        value += coef[b][t] * ref["w"][b][t] * loss_t
        grad[b][t] = coef[b][t] * ref["w"][b][t] * dloss_t
    return value, grad


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "name, kwargs, reference",
    LOSS_CASES,
    ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in kw.items()) or 'default'}" for n, kw, _ in LOSS_CASES],
)
def test_loss_value_gradient_and_metrics(name, kwargs, reference, mode, seed):
    ref, x = make_batch(seed, token_adv=seed == 1)
    value, grad, metrics = run_loss(name, kwargs, x, mode, norm_of(ref))
    per_token, ref_metrics = reference(ref)
    want_value, want_grad = expected_loss(ref, per_token, mode)
    close(value, want_value)
    close(grad, want_grad)
    for k, v in ref_metrics.items():
        close(metrics[k], v, atol=1e-13)
    n = len(tokens(ref))
    close(metrics["loss/weight_mean"], sum(ref["w"][b][t] for b, t in tokens(ref)) / n)


ONE_PER_LOSS = list({c[0]: c for c in LOSS_CASES[::-1]}.values())


@pytest.mark.parametrize("name, kwargs, reference", ONE_PER_LOSS, ids=[c[0] for c in ONE_PER_LOSS])
def test_loss_bf16_inputs_compute_in_fp32(name, kwargs, reference):
    """bf16 logprobs are upcast before the log-ratio: the value matches the fp64 reference taken on the
    bf16-rounded inputs to fp32 precision, and the gradient (cast back to bf16) to bf16 precision."""
    ref, x = make_batch(2, scale=0.3)
    rounded = {k: (v.to(torch.bfloat16).to(F64) if k in ("lp", "old", "adv", "w") else v) for k, v in x.items()}
    ref_r = dict(
        ref,
        **{
            k: [
                [0.0 if m == 0 else v for v, m in zip(row, mrow)] for row, mrow in zip(rounded[k].tolist(), ref["mask"])
            ]
            for k in ("lp", "old", "adv", "w")
        },
    )
    value, grad, _ = run_loss(name, kwargs, x, "seq-mean-token-mean", norm_of(ref), dtype=torch.bfloat16)
    assert value.dtype == torch.float32 and grad.dtype == torch.bfloat16
    want_value, want_grad = expected_loss(ref_r, reference(ref_r)[0], "seq-mean-token-mean")
    close(value, want_value, rtol=2e-5, atol=1e-6)
    close(grad, want_grad, rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_add_up_to_the_whole_batch(mode):
    """Each loss over two row-splits with the batch-wide LossNorm: values and gradients add up exactly."""
    ref, x = make_batch(3)
    for name, kwargs, _ in LOSS_CASES:
        whole_v, whole_g, _ = run_loss(name, kwargs, x, mode, norm_of(ref))
        parts = [
            run_loss(name, kwargs, {k: v[s] for k, v in x.items()}, mode, norm_of(ref))
            for s in (slice(0, 2), slice(2, None))
        ]
        close(parts[0][0] + parts[1][0], whole_v)
        close(torch.cat([parts[0][1], parts[1][1]]), whole_g)


# ---------------------------------------------------------------- extreme log-ratios (kl.py's clamp)
@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("ppo", {}),
        ("ppo", {"dual_clip": 3.0}),
        ("gspo", {}),
        ("cispo", {}),
        ("sapo", {}),
        ("topr", {}),
        ("reinforce", {}),
    ],
)
@pytest.mark.parametrize("log_ratio", [1e4, -1e4, 700.0, -700.0])
def test_extreme_log_ratios_stay_finite(name, kwargs, log_ratio):
    """A ratio e^±1e4 (inf in any float) gives finite values and gradients. The bounded cases equal the
    paper's value exactly: A > 0 and r huge is clipped at 1+ε; A < 0 with a dual clip is −cA."""
    lp = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]], dtype=F64)
    x = {
        "lp": lp,
        "old": lp - log_ratio,
        "adv": torch.tensor([[2.0, 2.0], [-1.0, -1.0]], dtype=F64),
        "w": torch.ones(2, 2, dtype=F64),
        "mask": torch.ones(2, 2, dtype=F64),
        "sampled": torch.ones(2, 2, dtype=F64),
    }
    value, grad, metrics = run_loss(name, kwargs, x, "token-mean", LossNorm(4, 2))
    assert math.isfinite(value.item()) and bool(torch.isfinite(grad).all())
    assert all(math.isfinite(v) for v in metrics.values())
    if name == "ppo" and log_ratio > 0:
        neg = 3.0 if kwargs else math.exp(20.0)  # dual clip −cA, else the documented e^20 clamp
        close(value, (2 * -2.0 * 1.2 + 2 * neg) / 4)
        close(grad, torch.zeros(2, 2, dtype=F64))
    if name == "gspo" and log_ratio > 0:  # A > 0: clipped at 1+4e-4; A < 0: sg[s_i] stops at e^20, so does its grad
        close(value, (2 * -2.0 * (1 + 4e-4) + 2 * math.exp(20.0)) / 4)
        close(grad, [[0.0, 0.0], [math.exp(20.0) / 4] * 2])


def test_sequence_chi2_saturates_at_the_clamp():
    """kl.exp_ratio's documented clamp: Σ_t log ρ_t = 30 counts as e^20 in chi2_seq (finite), not e^30."""
    behav = torch.full((1, 3), -5.0, dtype=F64)
    m = mismatch_metrics(behav + 10.0, behav, torch.ones(1, 3, dtype=F64))
    close(m["mismatch/chi2_seq"], math.exp(40.0) - 1)
    close(m["mismatch/chi2_token"], math.exp(20.0) - 1)


# ---------------------------------------------------------------- aggregation, directly
@pytest.mark.parametrize("mode", MODES)
def test_aggregation_value_and_gradient(mode):
    ref, x = make_batch(4)
    values = x["w"].clone().requires_grad_(True)  # any per-token values, garbage in padding
    out = aggregate(values, x["mask"], mode, norm_of(ref), lengths_B=x["sampled"].sum(dim=1))
    out.backward()
    coef = agg_coef(ref, mode)
    close(out, sum(coef[b][t] * ref["w"][b][t] for b, t in tokens(ref)))
    close(values.grad, coef)


# ---------------------------------------------------------------- corrections
def ratios(ref):
    return {(b, t): math.exp(ref["old"][b][t] - ref["lp"][b][t]) for b, t in tokens(ref)}


def ref_correction(ref, name, kw):
    """(weights, keep) per unmasked token from the methods' definitions (Yao et al. 2025 TIS/MIS; verl's
    geometric rejection; Hilton et al. 2022 decoupled; DeepSeek-V3.2 OPSM). Here μ = ref['lp'] (behaviour)
    and π_old = ref['old'], ρ_t = π_old/μ."""
    rho = ratios(ref)
    lo = kw.get("lower")
    hi = kw.get("upper", 2.0 if name in ("token_tis", "sequence_tis", "token_mask_is", "sequence_mask_is") else None)
    inside = lambda v: (lo is None or v >= lo) and (hi is None or v <= hi)
    trunc = lambda v: min(max(v, lo if lo is not None else -math.inf), hi if hi is not None else math.inf)
    w, keep = {}, {}
    for b in range(ref["B"]):
        ts = seq_tokens(ref, b)
        prod = 1.0
        for t in ts:
            prod *= rho[b, t]
        for t in ts:
            r, A = rho[b, t], ref["adv"][b][t]
            w[b, t], keep[b, t] = 1.0, True
            if name in ("token_tis", "decoupled"):
                w[b, t] = trunc(r)
            elif name == "sequence_tis":
                w[b, t] = trunc(prod)
            elif name == "token_mask_is":
                keep[b, t] = inside(r)
            elif name == "sequence_mask_is":
                keep[b, t] = inside(prod)
            elif name == "geometric_rejection":
                keep[b, t] = inside(prod ** (1.0 / len(ts)))
            elif name == "kl_rejection":  # estimators of KL(μ‖π_old) with samples from μ: log ratio q/p = ρ
                est = {
                    "k1": lambda v: -math.log(v),
                    "k2": lambda v: 0.5 * math.log(v) ** 2,
                    "k3": lambda v: v - 1 - math.log(v),
                }[kw.get("kind", "k3")]
                k = est(r) if kw.get("level", "token") == "token" else sum(est(rho[b, u]) for u in ts) / len(ts)
                keep[b, t] = k <= kw["threshold"]
            elif name == "opsm":  # mean over the sequence of log π_sampling − log π_θ (here μ and π_old)
                keep[b, t] = not (A < 0 and sum(-math.log(rho[b, u]) for u in ts) / len(ts) > kw["delta"])
    return w, keep


CORRECTION_CASES = [
    ("token_tis", {}),
    ("token_tis", {"lower": 0.8, "upper": 1.3}),
    ("decoupled", {}),
    ("decoupled", {"upper": 1.5}),
    ("sequence_tis", {}),
    ("sequence_tis", {"lower": 0.5, "upper": 1.5}),
    ("token_mask_is", {}),
    ("token_mask_is", {"lower": 0.7, "upper": 1.4}),
    ("sequence_mask_is", {"lower": 0.4, "upper": 2.5}),
    ("geometric_rejection", {"lower": 0.9, "upper": 1.1}),
    ("kl_rejection", {"threshold": 0.05}),
    ("kl_rejection", {"threshold": 0.05, "level": "sequence"}),
    ("kl_rejection", {"threshold": 0.02, "kind": "k2"}),
    ("kl_rejection", {"threshold": 0.1, "kind": "k1", "level": "sequence"}),
    ("opsm", {"delta": 0.05}),
]


@pytest.mark.parametrize("seed", [0, 5])
@pytest.mark.parametrize(
    "name, kw",
    CORRECTION_CASES,
    ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in kw.items()) or 'default'}" for n, kw in CORRECTION_CASES],
)
def test_correction_weights_masks_and_metrics(name, kw, seed):
    ref, x = make_batch(seed, scale=0.25)
    behav, old = x["lp"].clone().requires_grad_(True), x["old"]  # a graph on μ must not reach the weights
    w, m, metrics = build_corrections([{"name": name, **kw}])(old, behav, x["mask"], x["adv"])
    assert not w.requires_grad and not m.requires_grad
    rw, rkeep = ref_correction(ref, name, kw)
    want_w = [[rw.get((b, t), 1.0) for t in range(ref["T"])] for b in range(ref["B"])]
    want_m = [[float(rkeep.get((b, t), False)) for t in range(ref["T"])] for b in range(ref["B"])]
    close(w, want_w)
    assert m.tolist() == want_m
    key = f"correction/{name if name != 'kl_rejection' else 'kl_rejection_' + kw.get('level', 'token')}"
    n = len(rkeep)
    nonempty = [b for b in range(ref["B"]) if seq_tokens(ref, b)]
    if name in ("token_tis", "decoupled"):
        rho = ratios(ref)
        close(metrics[f"{key}/clip_frac"], sum(rw[k] != rho[k] for k in rho) / n)
        close(metrics[f"{key}/weight_mean"], sum(rw.values()) / n)
    elif name == "sequence_tis":
        rho = ratios(ref)
        clipped = [
            b for b in nonempty if rw[b, seq_tokens(ref, b)[0]] != math.prod(rho[b, t] for t in seq_tokens(ref, b))
        ]
        close(metrics[f"{key}/clip_frac"], len(clipped) / len(nonempty))
        close(metrics[f"{key}/weight_mean"], sum(rw[b, seq_tokens(ref, b)[0]] for b in nonempty) / len(nonempty))
    else:
        close(metrics[f"{key}/mask_frac"], sum(not v for v in rkeep.values()) / n)
        gone = [b for b in nonempty if not any(rkeep[b, t] for t in seq_tokens(ref, b))]
        close(metrics[f"{key}/seq_mask_frac"], len(gone) / len(nonempty))


def test_composed_corrections_multiply_weights_and_and_masks():
    ref, x = make_batch(6, scale=0.25)
    specs = [
        {"name": "sequence_tis", "upper": 1.5},
        {"name": "token_mask_is", "lower": 0.8, "upper": 1.2},
        {"name": "opsm", "delta": 0.02},
    ]
    w, m, _ = build_corrections(specs)(x["old"], x["lp"], x["mask"], x["adv"])
    want_w, want_m = [[1.0] * ref["T"] for _ in range(ref["B"])], [r[:] for r in ref["mask"]]
    for spec in specs:
        rw, rkeep = ref_correction(ref, spec["name"], {k: v for k, v in spec.items() if k != "name"})
        for (b, t), v in rw.items():
            want_w[b][t] *= v
            want_m[b][t] *= float(rkeep[b, t])
    close(w, want_w)
    assert m.tolist() == want_m


def test_decoupled_ppo_end_to_end():
    """Hilton et al. 2022: L = −E[(π_old/μ) · min(r A, clip(r) A)], r = π_θ/π_old, the behaviour weight
    constant (no gradient through π_old or μ)."""
    ref, x = make_batch(7, scale=0.2)
    behav = x["old"] - 0.3 * torch.randn(x["old"].shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    w, m, _ = build_corrections([{"name": "decoupled"}])(x["old"], behav, x["mask"])
    lp = x["lp"].clone().requires_grad_(True)
    inp = LossInputs(lp, x["old"], behav, x["adv"], m, weights_BT=w, sampled_mask_BT=x["sampled"])
    value, _ = build_loss("ppo")(inp, "token-mean", norm_of(ref))
    value.backward()
    ref_w = dict(
        ref,
        w=[
            [math.exp(o - bh) if mk else 0.0 for o, bh, mk in zip(ro, rb, rm)]
            for ro, rb, rm in zip(ref["old"], behav.tolist(), ref["mask"])
        ],
    )
    want_value, want_grad = expected_loss(ref_w, ref_ppo(ref_w, 0.2, 0.2, None)[0], "token-mean")
    close(value, want_value)
    close(lp.grad, want_grad)


# ---------------------------------------------------------------- advantages
def ref_advantages(name, rows, eps=1e-6, normalize_std=True):
    """DeepSeekMath GRPO (Bessel std), Dr.GRPO, RLOO (leave-one-out mean), REINFORCE++ (global whitening)
    and REINFORCE++-baseline (group mean, then global whitening)."""

    def std(xs):
        return statistics.stdev(xs) if len(xs) > 1 else 0.0

    if name in ("grpo", "dr_grpo"):
        out = []
        for r in rows:  # r − mean is exactly 0 for a group of equal rewards (a float sum could leave an ulp)
            mu = statistics.fmean(r)
            out.append(
                [
                    (x - mu if len(set(r)) > 1 else 0.0) / ((std(r) + eps) if normalize_std and name == "grpo" else 1.0)
                    for x in r
                ]
            )
        return out
    if name == "rloo":
        return [[x - (sum(r) - x) / (len(r) - 1) if len(r) > 1 else 0.0 for x in r] for r in rows]
    if name == "reinforce_pp_baseline":
        rows = [[x - sum(r) / len(r) for x in r] for r in rows]
    flat = [x for r in rows for x in r]
    mu, sd = sum(flat) / len(flat), std(flat)
    return [[(x - mu) / (sd + eps) for x in r] for r in rows]


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
@pytest.mark.parametrize("shape", [(3, 5), (4, 2), (3, 1), (1, 6)])
def test_advantages_against_reference(name, shape):
    g = torch.Generator().manual_seed(shape[0] * 10 + shape[1])
    rewards = torch.randn(*shape, generator=g, dtype=F64)
    if shape[0] > 1:
        rewards[1] = 0.3  # a group of equal rewards (std 0): advantage exactly 0 for the group estimators
    got = compute_advantages(name, rewards)
    want = ref_advantages(name, rewards.tolist())
    close(got, want, rtol=1e-12, atol=1e-12)
    if shape[0] > 1 and name != "reinforce_pp":
        assert got[1].tolist() == [0.0] * shape[1]


def test_grpo_without_std_and_binary_rewards():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0]], dtype=F64)
    close(
        compute_advantages("grpo", rewards, normalize_std=False),
        ref_advantages("grpo", rewards.tolist(), normalize_std=False),
    )
    close(compute_advantages("grpo", rewards, eps=1e-3), ref_advantages("grpo", rewards.tolist(), eps=1e-3))


# ---------------------------------------------------------------- KL estimators (Schulman 2020)
KL_REF = {  # value and ∂/∂log p, with r = log q − log p
    "k1": (lambda lp, lq: lp - lq, lambda lp, lq: 1.0),
    "k2": (lambda lp, lq: 0.5 * (lp - lq) ** 2, lambda lp, lq: lp - lq),
    "k3": (lambda lp, lq: math.exp(lq - lp) - 1 - (lq - lp), lambda lp, lq: 1 - math.exp(lq - lp)),
}


@pytest.mark.parametrize("kind", sorted(KL_REF))
def test_kl_estimator_values_and_gradients(kind):
    g = torch.Generator().manual_seed(8)
    logp = (-4 * torch.rand(3, 5, generator=g, dtype=F64)).requires_grad_(True)
    logq = logp.detach() + torch.randn(3, 5, generator=g, dtype=F64)
    out = kl_estimate(logp, logq, kind)
    out.sum().backward()
    value, dvalue = KL_REF[kind]
    close(out, [[value(p, q) for p, q in zip(rp, rq)] for rp, rq in zip(logp.tolist(), logq.tolist())])
    close(logp.grad, [[dvalue(p, q) for p, q in zip(rp, rq)] for rp, rq in zip(logp.tolist(), logq.tolist())])


@pytest.mark.parametrize(
    "kind, expectation, grad_of",
    [("k1", "kl", None), ("k3", "kl", "forward"), ("k2", None, "reverse"), ("k1", None, "zero")],
)
def test_kl_estimator_expectations_match_the_module_doc(kind, expectation, grad_of):
    """Exact expectations over a categorical p = softmax(θ) (y ~ p): E[k1] = E[k3] = KL(p‖q);
    E[∇k2] = ∇KL(p‖q), E[∇k3] = ∇KL(q‖p), E[∇k1] = 0 (Tang & Munos 2025), as kl.py states."""
    g = torch.Generator().manual_seed(9)
    theta = torch.randn(6, generator=g, dtype=F64).requires_grad_(True)
    logq = torch.log_softmax(torch.randn(6, generator=g, dtype=F64), 0)
    logp = torch.log_softmax(theta, 0)
    p = logp.exp().detach()  # the sampling distribution: the sample's weight carries no gradient
    est = kl_estimate(logp[None], logq[None], kind)[0]
    mean = (p * est).sum()
    if expectation == "kl":
        close(mean, sum(pi * (lp - lq) for pi, lp, lq in zip(p.tolist(), logp.tolist(), logq.tolist())))
    (grad,) = torch.autograd.grad(mean, theta, retain_graph=True)
    if grad_of == "zero":
        close(grad, torch.zeros(6, dtype=F64), atol=1e-15)
    elif grad_of is not None:
        pq = (logp.exp(), logq.exp())
        kl = (pq[0] * (logp - logq)).sum() if grad_of == "reverse" else (pq[1] * (logq - logp)).sum()
        close(grad, torch.autograd.grad(kl, theta)[0])


def test_kl_reward_penalty_against_reference():
    g = torch.Generator().manual_seed(10)
    behav = [-3 * torch.rand(n, generator=g, dtype=F64) for n in (4, 0, 2)]
    ref = [b + 0.5 * torch.randn(len(b), generator=g, dtype=F64) for b in behav]
    for kind, (value, _) in KL_REF.items():
        pen, m = kl_reward_penalty(behav, ref, kind, 0.05)
        per_seq = [sum(value(p, q) for p, q in zip(b.tolist(), r.tolist())) for b, r in zip(behav, ref)]
        close(pen, [0.05 * k for k in per_seq])
        close(m["rollout/kl_ref_per_seq"], sum(per_seq) / 3)


# ---------------------------------------------------------------- diagnostics
@pytest.mark.parametrize("seed", [0, 11])
def test_mismatch_metrics_against_reference(seed):
    ref, x = make_batch(seed, scale=0.3)
    rho = ratios(ref)  # μ = lp, π_old = old
    n = len(rho)
    nonempty = [b for b in range(ref["B"]) if seq_tokens(ref, b)]
    seq = {b: [rho[b, t] for t in seq_tokens(ref, b)] for b in nonempty}
    m = mismatch_metrics(x["old"], x["lp"], x["mask"])
    close(m["mismatch/k1"], sum(-math.log(v) for v in rho.values()) / n)
    close(m["mismatch/k3"], sum(v - 1 - math.log(v) for v in rho.values()) / n)
    # (−mean log μ) − (−mean log π_old), per sequence, then over the sequences
    close(m["mismatch/log_ppl_diff"], sum(sum(math.log(v) for v in s) / len(s) for s in seq.values()) / len(seq))
    close(m["mismatch/chi2_token"], sum(v * v for v in rho.values()) / n - 1)
    close(m["mismatch/chi2_seq"], sum(math.prod(s) ** 2 - 1 for s in seq.values()) / len(seq))
    close(m["mismatch/ess"], sum(rho.values()) ** 2 / (n * sum(v * v for v in rho.values())))
    close(
        [m["mismatch/is_weight_mean"], m["mismatch/is_weight_min"], m["mismatch/is_weight_max"]],
        [sum(rho.values()) / n, min(rho.values()), max(rho.values())],
    )
    # with token TIS at 1.1 and a token mask: figures over the kept tokens, clipping compared with ρ_t
    c = build_corrections(
        [{"name": "token_tis", "upper": 1.1}, {"name": "token_mask_is", "lower": 0.75, "upper": 100.0}]
    )
    w, final, _ = c(x["old"], x["lp"], x["mask"])
    m = mismatch_metrics(x["old"], x["lp"], x["mask"], weights_BT=w, final_mask_BT=final)
    kept = [k for k in rho if rho[k] >= 0.75]
    ws = [min(rho[k], 1.1) for k in kept]
    close(m["mismatch/ess"], sum(ws) ** 2 / (len(ws) * sum(v * v for v in ws)))
    close(m["mismatch/token_clip_frac"], sum(rho[k] > 1.1 for k in kept) / len(kept))
    kept_seqs = {b for b, _ in kept}
    close(m["mismatch/seq_clip_frac"], len({b for b, t in kept if rho[b, t] > 1.1}) / len(kept_seqs))
    close(m["mismatch/token_mask_frac"], 1 - len(kept) / n)
    close(m["mismatch/seq_mask_frac"], sum(all(v < 0.75 for v in s) for s in seq.values()) / len(seq))


def test_logprob_diff_is_slimes_definition():
    ref, x = make_batch(12, scale=0.3)
    m = logprob_diff_metrics(x["old"], x["lp"], x["mask"])
    per_seq = [
        sum(abs(ref["old"][b][t] - ref["lp"][b][t]) for t in seq_tokens(ref, b)) / len(seq_tokens(ref, b))
        for b in range(ref["B"])
        if seq_tokens(ref, b)
    ]
    close(m["train/train_rollout_logprob_abs_diff"], sum(per_seq) / len(per_seq))
    close(
        m["train/train_rollout_logprob_abs_diff_max"],
        max(abs(ref["old"][b][t] - ref["lp"][b][t]) for b, t in tokens(ref)),
    )
