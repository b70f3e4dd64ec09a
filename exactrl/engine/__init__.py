"""Rollout engine: paged KV cache, continuous batching, seeded sampling, weight updates."""

from exactrl.engine.engine import Completion, Engine, NonFiniteLogitsError, RequestOutput
from exactrl.engine.sampling import SamplingParams

__all__ = ["Engine", "SamplingParams", "Completion", "RequestOutput", "NonFiniteLogitsError"]
