"""The one rule for what a reward is, for a task's `reward()` and an agent environment's episode alike.

A reward is a finite real number: a Python int or float, a numpy scalar, or a one-element numpy array or
torch tensor. A bool of any of those kinds (`answer == expected`, `np.isclose(...)`) is a verdict and reads
as 1.0 or 0.0. Anything else (None, text, NaN, ±inf, several elements, an int beyond float's range) is
refused: a NaN would turn the whole step's advantages into NaN, and text such as "1" would be a silent
guess.
"""

from __future__ import annotations

import math
import reprlib
from typing import Any

import numpy as np
import torch


def as_reward(value: Any, what: str) -> float:
    """`value` as a reward (the rule above), or a ValueError: "{what} must be a finite number, got …"."""
    reward = _number(value)
    if reward is None or not math.isfinite(reward):
        raise ValueError(f"{what} must be a finite number, got {reprlib.repr(value)} ({type(value).__name__})")
    return reward


def _number(value: Any) -> float | None:
    if isinstance(value, (str, bytes)):
        return None
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if (value.size if isinstance(value, np.ndarray) else value.numel()) != 1:
            return None
        value = value.item()  # a Python bool, int or float
    if isinstance(value, (bool, np.bool_)):
        return 1.0 if value else 0.0
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return None
