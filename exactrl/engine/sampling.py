"""Sampling parameters and the seeded sampler: a row's token and logprob depend on its own logits, its own
parameters and (seed, sample index, position) alone, never on the other rows of the step.

The distribution is the trainer's (docs/design.md §1): `sampling_logprobs` of the
fp32 logits — temperature, top-k, top-p, renormalised — computed per row with
each row's own parameters. T = 0 samples the argmax and reports the T = 1
logprob, exactly as the trainer does.

Two details keep a row's result independent of the other rows of the step:

* `sampling_logprobs` takes its top-k / top-p branches when ANY row needs
  them, and a row with top_p = 1 inside a top-p batch can lose tail tokens to
  the rounding of the cumulative mass. The trainer always calls it with one
  set of parameters, so the engine calls it once per group of rows with the
  same (needs top-k, needs top-p) flags — the branches each row sees are then
  the ones the trainer's call takes.
* Randomness is counter-based: the uniform for sample j of a request at
  position t is a hash of (seed, j, t) (splitmix64), and the token is drawn
  by inverse CDF (float64, in two levels: blocks, then tokens; see `draw`). Nothing is shared between rows and
  there is no generator state, so a request's tokens do not depend on its
  batch companions, and a preempted sequence resumed by recomputation draws
  exactly what it would have drawn. (Departs from a stateful torch.Generator
  per request only in that; the property is the same.)

Legend: R sampled rows, V vocabulary.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from exactrl.kernels import native, sampling_logprobs
from exactrl.kernels.rowwise import check_temperature, log_softmax

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to sample the completions of one prompt. Validated on construction."""

    temperature: float = 1.0
    # 0 = greedy (argmax); the reported logprob is then the T = 1 one, as the trainer's.
    # Otherwise finite and >= 1e-5 (MIN_TEMPERATURE): below it z / T overflows fp32.
    top_p: float = 1.0
    # nucleus mass in (0, 1]; 1 disables it.
    top_k: int = -1
    # keep the k largest logits (ties at the cut-off kept); -1 disables it; at most 2**63 - 1 (an int64
    # tensor in the shared step: a larger one would fail every request of the step).
    max_tokens: int = 64
    # generated tokens at most (the stop token counts); reaching it gives finish_reason "length".
    n: int = 1
    # samples of the prompt; they share one prefill.
    seed: int | None = 0
    # sample j draws from (seed, j, position); None draws a fresh seed per request. In [-2**63, 2**63):
    # the sampler uses its 64 bits, so a wider seed would draw the same stream as another one.
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    # extra stop ids, on top of the engine's (the model's eos/end-of-turn ids).
    ignore_eos: bool = False
    # ignore the engine's default stop ids (benchmarks); `stop_token_ids` still stop.

    def __post_init__(self):
        check_temperature(self.temperature)
        _check_number("top_p", self.top_p, float)
        _check_number("top_k", self.top_k, int)
        _check_number("max_tokens", self.max_tokens, int)
        _check_number("n", self.n, int)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or not -1 <= self.top_k < 2**63:
            raise ValueError(f"top_k must be -1 (disabled) or in [1, 2**63), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.seed is not None:
            _check_number("seed", self.seed, int)
            if not -(2**63) <= self.seed < 2**63:
                raise ValueError(f"seed must be in [-2**63, 2**63) (64 bits), got {self.seed}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        stops = () if self.stop_token_ids is None else tuple(self.stop_token_ids)
        for t in stops:
            _check_number("stop_token_ids", t, int)
        object.__setattr__(self, "stop_token_ids", stops)
        if not isinstance(self.ignore_eos, bool):  # "no" or 0.0 would ignore (or not) the eos by truthiness
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")

    def branch_flags(self, vocab_size: int) -> tuple[bool, bool]:
        """(top-k active, top-p active), exactly as `sampling_logprobs` decides them."""
        # top_p in fp32, as the kernel reads it: 1 - 1e-9 is 1.0 there, no cut (struct's 'f' rounds to
        # nearest as the tensor's cast does, without a tensor: the engine asks once a request)
        return 0 < self.top_k < vocab_size, struct.unpack("f", struct.pack("f", self.top_p))[0] < 1.0


def params_per_prompt(params: SamplingParams | list[SamplingParams] | None, n_prompts: int) -> list[SamplingParams]:
    """`generate`'s params argument as one SamplingParams per prompt: None is the defaults, one is shared."""
    params = SamplingParams() if params is None else params
    plist = params if isinstance(params, list) else [params] * n_prompts
    if len(plist) != n_prompts:
        raise ValueError(f"got {len(plist)} SamplingParams for {n_prompts} prompts")
    return plist


def _check_number(field: str, value, kind: type) -> None:
    ok = isinstance(value, int) if kind is int else isinstance(value, (int, float))
    if not ok or isinstance(value, bool):
        raise ValueError(f"{field} must be {'an int' if kind is int else 'a number'}, got {value!r}")


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_uniform(seed: int, index: int, position: int) -> float:
    """A uniform in [0, 1) that depends only on (seed, sample index, position)."""
    h = _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ index) ^ position)
    return (h >> 11) * 2.0**-53


@dataclass
class SampleRows:
    """Per-row parameters of one sampling call; lists of length R."""

    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    uniform: list[float]  # the row's draw, from `sample_uniform`
    flags: list[tuple[bool, bool]]  # (needs top-k, needs top-p): rows are grouped by it


def _plain(rows: SampleRows) -> bool:
    """No row tempers or truncates: the distribution is log_softmax of the logits (T = 0 reports T = 1)."""
    return all(t in (0.0, 1.0) for t in rows.temperature) and not any(k or p for k, p in rows.flags)


def sample(logits_RV: torch.Tensor, rows: SampleRows) -> tuple[torch.Tensor, torch.Tensor]:
    """`draw(row_logprobs(logits_RV, rows), rows)`, bit for bit. When no row tempers or truncates, one C
    pass per row computes each log-probability where the draw reads it (`native.sample`), so the [R, V]
    log-probabilities are neither written nor read back."""
    if not _plain(rows):
        return draw(row_logprobs(logits_RV, rows), rows)
    greedy = torch.tensor([t == 0 for t in rows.temperature], dtype=torch.bool)
    return native.sample(logits_RV.float(), DRAW_BLOCK, torch.tensor(rows.uniform, dtype=torch.float64), greedy)


def row_logprobs(logits_RV: torch.Tensor, rows: SampleRows, kernels=None) -> torch.Tensor:
    """`sampling_logprobs` with each row's parameters, called once per flag group (through `kernels`'
    row reductions when given, else the native ones)."""
    lsm = log_softmax if kernels is None else kernels.log_softmax
    dist = sampling_logprobs if kernels is None else kernels.sampling_logprobs
    if _plain(rows):
        return lsm(logits_RV.float())  # what sampling_logprobs computes then, without its ~10 checks
    temp_R = torch.tensor(rows.temperature, dtype=torch.float32)
    top_k_R = torch.tensor(rows.top_k, dtype=torch.int64)
    top_p_R = torch.tensor(rows.top_p, dtype=torch.float32)
    groups = set(rows.flags)
    if len(groups) == 1:
        return dist(logits_RV, temp_R, top_k_R, top_p_R)
    out_RV = torch.empty_like(logits_RV, dtype=torch.float32)
    for flag in groups:
        idx = torch.tensor([i for i, f in enumerate(rows.flags) if f == flag])
        dev_idx = idx.to(logits_RV.device)
        out_RV[dev_idx] = dist(logits_RV[dev_idx], temp_R[idx], top_k_R[idx], top_p_R[idx])
    return out_RV


DRAW_BLOCK = 256  # tokens per block of the two-level inverse CDF


def draw(lp_RV: torch.Tensor, rows: SampleRows) -> tuple[torch.Tensor, torch.Tensor]:
    """Token of each row (inverse CDF of exp(lp), argmax for T = 0) and its logprob.

    Two levels, both in float64 (a token's share of the CDF stays resolvable
    down to ~1e-16): the row's target mass x = u · total picks the block of
    DRAW_BLOCK tokens whose cumulative block sum first exceeds it, then the
    token inside that block whose cumulative sum first exceeds what is left.
    Same distribution as one cumulative sum over V, at the cost of one pass
    over the row plus one block. Every chosen block and token has non-zero
    probability: the targets are kept strictly below the block totals they
    search. One C call for all rows (native/pointwise.c, `exactrl_draw`,
    has the exact rule), where torch ops would take ~15 calls and more
    passes over the rows.
    """
    greedy = torch.tensor([t == 0 for t in rows.temperature], dtype=torch.bool)
    return native.draw(lp_RV, DRAW_BLOCK, torch.tensor(rows.uniform, dtype=torch.float64), greedy)
