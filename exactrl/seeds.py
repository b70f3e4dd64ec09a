"""One rule for deriving seeds from a run's seed: every seeded stream a run draws from (a prompt's samples,
an agent episode's turns, an evaluation's random streams, a parity check's prompts) is
`derive_seed(seed, *parts)` of what names it, so it depends on nothing else (batch composition,
concurrency, how often a run evaluates)."""

from __future__ import annotations

SEED_PRIME = 1_000_003
SEED_MODULUS = 2**31 - 1  # a prime; below it a seed suits every consumer (the sampler, numpy, torch)


def derive_seed(seed: int, *parts: int) -> int:
    """`seed` mixed with `parts` by Horner's rule, in [0, 2**31 − 1):

        (((seed·P + p₁)·P + p₂)·P + …) mod (2**31 − 1),   P = 1,000,003

    Any int seed is accepted (negative, or beyond 64 bits); the result is a pure function of its arguments
    (no Python `hash`, which is salted per process)."""
    for name, value in (("seed", seed), *((f"part {i}", p) for i, p in enumerate(parts))):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"derive_seed: {name} must be an int, got {value!r}")
    h = seed % SEED_MODULUS
    for p in parts:
        h = (h * SEED_PRIME + p) % SEED_MODULUS
    return h
