"""RoPE's inverse frequencies and cos/sin scale for the `rope_type`s transformers names (default, linear,
llama3, yarn, dynamic), computed with transformers' own formulas and torch ops (modeling_rope_utils), so the
tables hold its bits.

The tables are a function of (config, absolute position) only, built in fixed chunks
(`CausalLM.rope_reach`): a token's rotation never depends on the batch it is in. `dynamic` (NTK) is read
in that form. transformers recomputes its frequencies from the longest position of each forward
(seq_len = max position + 1, at least max_position_embeddings L):

    base(seq_len) = theta · (factor · seq_len / L − (factor − 1))^(d / (d − 2))

so in one forward of a batch, every token's rotation would follow the longest sequence. Here position p
always rotates with base(max(p + 1, L)): the rotation transformers gives the newest token of a cached
generation (each decode step's seq_len is that token's position + 1, and the cached keys keep the rotation
they were written with). The same function of p alone in the engine and the trainer, so their bits agree;
it equals transformers' full-sequence forward up to position L − 1 (the base is theta's) and its cached,
token-by-token forward everywhere (tested). Positions reach factor · L (`ModelConfig.context_length`).
Every other type is refused by name.
"""

from __future__ import annotations

import math
from typing import Any

import torch

IMPLEMENTED = ("default", "linear", "llama3", "yarn", "dynamic")
REFUSED: dict[str, str] = {}


def _number(rope: dict, key: str, where: str, default=None, positive: bool = True) -> float:
    v = rope.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
        raise ValueError(f"config.json: {where}.{key} must be a {'positive ' if positive else ''}number, got {v!r}")
    return float(v)


def check_rope(rope: dict[str, Any], where: str, max_positions: int) -> dict[str, Any]:
    """The parameters of `rope` (a rope_parameters / rope_scaling object, rope_theta already in it) that the
    tables read, checked and with transformers' defaults filled in; a type not implemented is refused by name."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if not isinstance(kind, str):
        raise ValueError(f"config.json: {where}.rope_type must be a string, got {kind!r}")
    if kind in REFUSED:
        raise ValueError(f"unsupported {where}.rope_type={kind!r}: {REFUSED[kind]}")
    if kind not in IMPLEMENTED:
        raise ValueError(f"unsupported {where}.rope_type={kind!r}; implemented: {', '.join(IMPLEMENTED)}")
    prf = rope.get("partial_rotary_factor", 1.0)
    if prf != 1.0:
        raise ValueError(f"unsupported {where}.partial_rotary_factor={prf!r}: RoPE rotates the whole head_dim here")
    out: dict[str, Any] = {"rope_type": kind}
    if kind == "default":
        return out
    if kind in ("linear", "llama3", "dynamic"):
        out["factor"] = _number(rope, "factor", where)
    if kind == "dynamic" and out["factor"] < 1:
        raise ValueError(f"config.json: {where}.factor must be >= 1 for dynamic RoPE, got {out['factor']}")
    if kind in ("llama3", "yarn"):
        out["original_max_position_embeddings"] = omp = rope.get("original_max_position_embeddings", max_positions)
        if type(omp) is not int or omp < 1:
            raise ValueError(
                f"config.json: {where}.original_max_position_embeddings must be an integer >= 1, got {omp!r}"
            )
    if kind == "llama3":
        lo, hi = _number(rope, "low_freq_factor", where), _number(rope, "high_freq_factor", where)
        if lo == hi:
            raise ValueError(f"config.json: {where}.low_freq_factor and high_freq_factor must differ, both {lo}")
        out.update(low_freq_factor=lo, high_freq_factor=hi)
    if kind == "yarn":
        out["factor"] = (
            _number(rope, "factor", where)
            if rope.get("factor") is not None
            else max_positions / out["original_max_position_embeddings"]
        )
        for key in ("attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow"):
            if rope.get(key) is not None:
                out[key] = _number(rope, key, where, positive=key != "mscale_all_dim" and key != "mscale")
        truncate = rope.get("truncate", True)
        if truncate not in (True, False):
            raise ValueError(f"config.json: {where}.truncate must be true or false, got {truncate!r}")
        out["truncate"] = truncate
    return out


def rope_frequencies(head_dim: int, theta: float, rope: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] fp32, the factor cos and sin are multiplied by) of a `check_rope` result."""
    dim, kind = head_dim, rope["rope_type"]
    if kind == "yarn":
        return _yarn(dim, theta, rope)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "linear":
        inv_freq /= rope["factor"]
    elif kind == "llama3":
        factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        low_freq_wavelen, high_freq_wavelen = old / lo, old / hi
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old / wavelen - lo) / (hi - lo)
        smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
    return inv_freq, 1.0


def dynamic_tables(
    head_dim: int, theta: float, rope: dict[str, Any], max_positions: int, start: int, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [count, head_dim] fp32 of positions start.. under `dynamic` RoPE (the module docstring), with
    transformers' ops and dtypes (`_compute_dynamic_ntk_parameters`): below L the frequencies it builds at
    load (seq_len the int L), from L on those of seq_len = p + 1 (an int64 tensor, as its forward passes it)."""
    dim, factor, L = head_dim, rope["factor"], max_positions
    exps = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    pos = torch.arange(start, start + count)
    at_load = theta * ((factor * L / L) - (factor - 1)) ** (dim / (dim - 2))  # Python floats: theta's, or 1 ulp off
    inv = (1.0 / (at_load**exps)).expand(count, -1)
    seq_len = pos + 1
    base = theta * ((factor * seq_len / L) - (factor - 1)) ** (dim / (dim - 2))  # float32 [count]
    inv = torch.where((seq_len > L)[:, None], 1.0 / (base[:, None] ** exps[None, :]), inv)
    freqs = pos.float()[:, None] * inv
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _yarn(dim: int, base: float, rope: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """transformers' `_compute_yarn_parameters`, step for step."""
    factor, omp = rope["factor"], rope["original_max_position_embeddings"]
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")

    def get_mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
            if mscale and mscale_all_dim
            else get_mscale(factor)
        )
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(omp / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = inv_freq_interpolation * (1 - extrapolation_factor) + inv_freq_extrapolation * extrapolation_factor
    return inv_freq, attention_factor
