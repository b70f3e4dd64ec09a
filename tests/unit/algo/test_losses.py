"""Every loss against hand-computed values and gradients on tiny tensors."""

import math

import pytest
import torch

from exactrl.algo.losses import LOSSES, CISPOLoss, GSPOLoss, PPOClipLoss, ReinforceLoss, SAPOLoss, TOPRLoss, build_loss
from exactrl.algo.types import LossInputs, LossNorm

F64 = torch.float64
L = math.log


def t(rows):
    return torch.tensor(rows, dtype=F64)


def make(log_ratio, adv, lp=None, mask=None, weights=None):
    """Inputs with old = −1 and log π_θ = old + log_ratio (or given lp, then old = lp − log_ratio)."""
    log_ratio = t(log_ratio)
    lp = t(lp) if lp is not None else log_ratio - 1.0
    old = lp - log_ratio
    mask = t(mask) if mask is not None else torch.ones_like(lp)
    adv = t(adv)
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(lp).clone()
    return LossInputs(
        logprobs_BT=lp.clone().requires_grad_(True),
        old_logprobs_BT=old,
        behav_logprobs_BT=old,
        advantages_BT=adv,
        mask_BT=mask,
        weights_BT=None if weights is None else t(weights),
    )


def run(loss, inp, mode="token-mean"):
    value, metrics = loss(inp, mode, LossNorm.from_mask(inp.mask_BT, constant=4.0))
    value.backward()
    return value.item(), metrics, inp.logprobs_BT.grad


PPO_RATIOS = [[L(1.5), L(0.5), L(1.1)], [L(1.5), L(0.5), L(4.0)]]


def test_ppo_values_and_metrics():
    value, m, _ = run(PPOClipLoss(0.2, 0.2), make(PPO_RATIOS, [1.0, -1.0]))
    # A=+1: −min(r, clip r) = −1.2, −0.5, −1.1 ; A=−1: max(r, clip r) = 1.5, 0.8, 4.0
    assert value == pytest.approx((-1.2 - 0.5 - 1.1 + 1.5 + 0.8 + 4.0) / 6, rel=1e-12)
    assert m["loss/clip_frac_high"] == pytest.approx(1 / 6)
    assert m["loss/clip_frac_low"] == pytest.approx(1 / 6)
    assert m["loss/ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 1.5 + 0.5 + 4.0) / 6)
    assert "loss/dual_clip_frac" not in m


def test_ppo_dual_clip_bounds_negative_advantage():
    value, m, grad = run(PPOClipLoss(0.2, 0.2, dual_clip=3.0), make(PPO_RATIOS, [1.0, -1.0]))
    assert value == pytest.approx((-1.2 - 0.5 - 1.1 + 1.5 + 0.8 + 3.0) / 6, rel=1e-12)
    assert m["loss/dual_clip_frac"] == pytest.approx(1 / 6)
    assert grad[1, 2].item() == 0.0  # bounded by −c·A: no gradient
    assert grad[1, 0].item() == pytest.approx(1.5 / 6)  # d(−A r)/dlp = −A r /N


def test_ppo_asymmetric_eps():
    value, m, _ = run(PPOClipLoss(eps_low=0.2, eps_high=0.28), make([[L(1.5)]], [1.0]))
    assert value == pytest.approx(-1.28)
    assert m["loss/clip_frac_high"] == 1.0


@pytest.mark.parametrize(
    "log_ratio, adv, dual, expected_grad",
    [
        (L(1.1), 2.0, None, -2.0 * 1.1),  # inside the clip: −A r
        (L(1.5), 2.0, None, 0.0),  # clipped high
        (L(0.5), -1.0, None, 0.0),  # clipped low
        (L(4.0), -1.0, None, 4.0),  # negative A, large r, no dual clip: −A r
        (L(4.0), -1.0, 3.0, 0.0),  # dual clip
    ],
)
def test_ppo_gradient_one_token(log_ratio, adv, dual, expected_grad):
    _, _, grad = run(PPOClipLoss(0.2, 0.2, dual), make([[log_ratio]], [adv]))
    assert grad.item() == pytest.approx(expected_grad, abs=1e-12)


def test_gspo_value_and_token_gradient():
    # row 0: log-ratios 0.1, −0.3 -> s = e^−0.1 (inside [0.8, 1.2]); row 1: 0.5, 0.5 -> s = e^0.5 clipped
    inp = make([[0.1, -0.3], [0.5, 0.5]], [1.0, 1.0])
    value, m, grad = run(GSPOLoss(0.2, 0.2), inp, "seq-mean-token-mean")
    s = math.exp(-0.1)
    assert value == pytest.approx((-s + -1.2) / 2, rel=1e-12)
    # sequence-level GSPO: d(−A s)/dlp_t = −A s/|y|, then /total_seqs
    assert grad[0].tolist() == pytest.approx([-s / 2 / 2, -s / 2 / 2], rel=1e-12)
    assert grad[1].tolist() == [0.0, 0.0]
    assert m["loss/clip_frac_high"] == pytest.approx(0.5)


def test_gspo_negative_advantage_and_padding():
    inp = make([[0.2, 0.4, 9.0]], [-1.0], mask=[[1, 1, 0]])  # masked token must not enter the mean
    value, _, grad = run(GSPOLoss(0.2, 0.4), inp)
    s = math.exp(0.3)
    assert value == pytest.approx(s, rel=1e-12)  # −A s = s, inside clip
    assert grad[0].tolist() == pytest.approx([s / 2, s / 2, 0.0], rel=1e-12)  # token-mean: s ∇lp_t / N


def test_cispo_value_and_detached_weight():
    inp = make([[L(2.0), L(0.5)]], [1.0], lp=[[-1.0, -2.0]])
    value, m, grad = run(CISPOLoss(eps_low_is=1.0, eps_high_is=0.28), inp)
    # w = clip(r, 0, 1.28) = 1.28, 0.5 ; ℓ = −w A lp = 1.28, 1.0
    assert value == pytest.approx((1.28 + 1.0) / 2, rel=1e-12)
    assert grad[0].tolist() == pytest.approx([-1.28 / 2, -0.5 / 2], rel=1e-12)  # no grad through w
    assert m["loss/clip_frac_high"] == pytest.approx(0.5)


def test_reinforce():
    inp = make([[0.0, 0.0]], [[2.0, -1.0]], lp=[[-0.5, -3.0]])
    value, _, grad = run(ReinforceLoss(), inp)
    assert value == pytest.approx((1.0 - 3.0) / 2)
    assert grad[0].tolist() == pytest.approx([-1.0, 0.5])


def test_sapo_soft_gate_value_and_gradient():
    inp = make([[L(1.2)], [L(0.7)]], [1.0, -2.0])
    value, m, grad = run(SAPOLoss(tau_pos=1.0, tau_neg=1.05), inp)

    def sig(x):
        return 1 / (1 + math.exp(-x))

    f_pos = 4.0 * sig(0.2)
    f_neg = 4.0 / 1.05 * sig(1.05 * -0.3)
    assert value == pytest.approx((-f_pos * 1.0 + f_neg * 2.0) / 2, rel=1e-12)
    # dℓ/dlp = −4 σ(1−σ) r A
    g_pos = -4 * sig(0.2) * (1 - sig(0.2)) * 1.2 * 1.0
    g_neg = -4 * sig(-0.315) * (1 - sig(-0.315)) * 0.7 * -2.0
    assert grad[:, 0].tolist() == pytest.approx([g_pos / 2, g_neg / 2], rel=1e-12)
    assert m["loss/gate_mean"] == pytest.approx(
        (4 * sig(0.2) * (1 - sig(0.2)) + 4 * sig(-0.315) * (1 - sig(-0.315))) / 2
    )


def test_topr_sequence_level():
    inp = make([[0.0, 0.0], [0.3, -0.8], [0.5, 0.4]], [1.0, -1.0, -1.0], lp=[[-1.0, -2.0], [-1.5, -0.5], [-1.0, -1.0]])
    value, m, grad = run(TOPRLoss(), inp)
    w1 = math.exp(-0.5)  # row 1: ρ = e^(0.3−0.8) < 1 ; row 2: ρ = e^0.9 truncated to 1
    expected = [1.0, 2.0, w1 * -1.5, w1 * -0.5, -1.0, -1.0]
    assert value == pytest.approx(sum(expected) / 6, rel=1e-12)
    assert grad.flatten().tolist() == pytest.approx([-1 / 6, -1 / 6, w1 / 6, w1 / 6, 1 / 6, 1 / 6], rel=1e-12)
    assert m["loss/clip_frac_high"] == pytest.approx(2 / 6)


def test_topr_token_level():
    inp = make([[0.3, -0.8]], [-1.0], lp=[[-1.5, -0.5]])
    value, _, _ = run(TOPRLoss(level="token"), inp)
    assert value == pytest.approx((1.0 * -1.5 + math.exp(-0.8) * -0.5) / 2, rel=1e-12)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_weights_multiply_the_token_loss(name):
    base = make([[0.1, -0.2], [0.05, 0.3]], [1.0, -0.5], lp=[[-1.0, -2.0], [-0.5, -1.5]])
    scaled = make(
        [[0.1, -0.2], [0.05, 0.3]], [1.0, -0.5], lp=[[-1.0, -2.0], [-0.5, -1.5]], weights=[[2.0, 2.0], [2.0, 0.0]]
    )
    loss = build_loss(name)
    v_base, _, _ = run(loss, base)
    per_token = [
        run(
            loss,
            make(
                [[0.1, -0.2], [0.05, 0.3]],
                [1.0, -0.5],
                lp=[[-1.0, -2.0], [-0.5, -1.5]],
                weights=[[1.0 * (i == 0), 1.0 * (i == 1)], [1.0 * (i == 2), 1.0 * (i == 3)]],
            ),
        )[0]
        for i in range(4)
    ]
    v_scaled, _, _ = run(loss, scaled)
    assert sum(per_token) == pytest.approx(v_base, rel=1e-10, abs=1e-12)
    assert v_scaled == pytest.approx(2 * (per_token[0] + per_token[1] + per_token[2]), rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant-normalised"])
def test_everything_masked(name, mode):
    inp = make(
        [[0.5, float("nan")], [float("inf"), 0.1]],
        [[float("nan"), 1.0], [1.0, -1.0]],
        lp=[[float("nan"), -1.0], [-float("inf"), -2.0]],
        mask=[[0, 0], [0, 0]],
    )
    value, metrics, grad = run(build_loss(name), inp, mode)
    assert value == 0.0
    assert torch.equal(grad, torch.zeros(2, 2, dtype=F64))
    assert all(isinstance(k, str) and isinstance(v, float) and math.isfinite(v) for k, v in metrics.items())


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_empty_response_contributes_nothing(name):
    norm = LossNorm(total_tokens=2, total_seqs=2, constant=4.0)
    with_empty = make([[0.1, -0.2], [0.0, 0.0]], [1.0, -1.0], mask=[[1, 1], [0, 0]])
    alone = make([[0.1, -0.2]], [1.0])
    v1, _ = build_loss(name)(with_empty, "seq-mean-token-mean", norm)
    v2, _ = build_loss(name)(alone, "seq-mean-token-mean", norm)
    assert math.isfinite(v1.item()) and v1.item() == pytest.approx(v2.item(), rel=1e-12)
    assert v1.item() != 0.0


def test_registry_and_build_errors():
    assert set(LOSSES) == {"ppo", "gspo", "cispo", "reinforce", "sapo", "topr"}
    assert isinstance(build_loss("ppo", eps_high=0.28, dual_clip=3.0), PPOClipLoss)
    with pytest.raises(ValueError, match="valid losses"):
        build_loss("grpo")
    with pytest.raises(ValueError, match="clip_ratio"):
        build_loss("ppo", clip_ratio=0.2)
    with pytest.raises(ValueError, match="dual_clip"):
        build_loss("ppo", dual_clip=0.5)
    with pytest.raises(ValueError, match=r"^loss 'gspo': eps_high must be >= 0"):  # which loss, too
        build_loss("gspo", eps_high=-1e-4)
    with pytest.raises(ValueError, match="tau"):
        build_loss("sapo", tau_neg=0.0)
    with pytest.raises(ValueError, match="level"):
        build_loss("topr", level="batch")


def test_metrics_are_flat_python_floats():
    _, metrics, _ = run(PPOClipLoss(dual_clip=3.0), make(PPO_RATIOS, [1.0, -1.0]))
    assert metrics and all(type(v) is float and k.startswith("loss/") for k, v in metrics.items())


def test_fp32_and_bf16_inputs_compute_in_fp32():
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16, requires_grad=True)
    inp = LossInputs(lp, lp.detach(), lp.detach(), torch.ones(1, 2, dtype=torch.bfloat16), torch.ones(1, 2))
    value, _ = PPOClipLoss()(inp, "token-mean", LossNorm(2, 1))
    assert value.dtype == torch.float32 and value.item() == -1.0


def test_a_token_removed_by_a_correction_stays_in_its_sequences_length():
    """seq-mean-token-mean: a sequence of 4 sampled tokens, one of them masked by a correction. The 3 kept
    tokens each get 1/4 of the sequence's weight (as under token-mean), not 1/3: masking shrinks the step."""
    lp = t([[-1.0, -2.0, -3.0, -4.0]])
    sampled, kept = torch.ones(1, 4, dtype=F64), t([[1.0, 0.0, 1.0, 1.0]])
    inp = LossInputs(
        lp.clone().requires_grad_(True), lp, lp, torch.ones(1, 4, dtype=F64), kept, sampled_mask_BT=sampled
    )
    value, _ = ReinforceLoss()(inp, "seq-mean-token-mean", LossNorm(total_tokens=4, total_seqs=1))
    value.backward()
    assert value.item() == pytest.approx(-(-1.0 - 3.0 - 4.0) / 4)
    assert inp.logprobs_BT.grad.tolist() == [[-0.25, 0.0, -0.25, -0.25]]
    with pytest.raises(ValueError, match="may only remove sampled tokens"):
        LossInputs(lp, lp, lp, torch.ones(1, 4, dtype=F64), sampled, sampled_mask_BT=kept)
