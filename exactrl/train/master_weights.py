"""fp32 master weights for a bf16 model (`optim.fp32_master_weights`).

A bf16 weight w moves only if its update is at least half its spacing,
about |w|·2⁻⁹. AdamW's update is close to lr per element, so at the learning
rates of RL fine-tuning (1e-6 to 1e-5) most weights of a bf16 model would
not move at all, and even at 5e-5 a tiny Qwen3 kept half of them. The usual
remedy (mixed-precision training, Micikevicius et al. 2018) keeps an fp32
copy of every weight for the optimizer:

    g₃₂ = float32(g₁₆);   AdamW step on w₃₂;   w₁₆ = bf16(w₃₂)   (round to nearest even)

The forward, the backward and the rollout engine keep using the bf16 weights
w₁₆, so the engine and the trainer still compute with the same bits
(`train/train_rollout_logprob_abs_diff` stays 0.0); only the optimizer sees
fp32. The master copy and the inner optimizer's moments are in its
`state_dict`, so a checkpoint resumes bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class MasterWeights:
    """An optimizer over fp32 copies of low-precision parameters; `make_inner(params)` builds the optimizer
    that steps the copies (AdamW, or ZeRO over it: `distributed.make_optimizer`). It has what the trainer
    uses of an optimizer: `param_groups` (the inner's: the learning-rate schedule sets them), `zero_grad`,
    `step`, `state_dict` and `load_state_dict`."""

    def __init__(self, params, make_inner: Callable[[list[torch.Tensor]], torch.optim.Optimizer]):
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.inner = make_inner(self.master)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self.inner.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for p, m in zip(self.params, self.master):
            p.copy_(m)  # rounds to the parameter's dtype (nearest even)

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "master": [m.detach().clone() for m in self.master]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """A checkpoint of a run with master weights; or, from one without (a plain AdamW state, e.g. a
        run saved before they existed), the moments alone, the master copy taken from the loaded bf16
        weights."""
        if not (isinstance(state, dict) and "inner" in state and "master" in state):
            self.inner.load_state_dict(state)
            return
        saved = state["master"]
        if len(saved) != len(self.master) or any(s.shape != m.shape for s, m in zip(saved, self.master)):
            raise ValueError(
                f"the checkpoint's master weights ({len(saved)} tensors) do not fit this model's "
                f"{len(self.master)} parameters"
            )
        for m, s in zip(self.master, saved):
            m.copy_(s)
        self.inner.load_state_dict(state["inner"])
