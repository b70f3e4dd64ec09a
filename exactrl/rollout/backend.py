"""`RolloutBackend`: what the training loops need from whatever generates their rollouts.

Three implementations: the in-process `exactrl.Engine` (exactrl/engine), an OpenAI-compatible server
(`ExternalEngine`, exactrl/rollout/external.py) and exactrl Engines as Ray actors (`RayEngines`,
exactrl/distributed/ray_engines.py). The loops call only what is declared here and never ask which one
they hold: a difference in capability is an attribute (`step_hook`), not a type check.

Every completion's tokens carry the version of the weights that sampled them (`Completion.versions`);
versions are training steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from exactrl.engine.engine import Completion
from exactrl.engine.sampling import SamplingParams


@runtime_checkable
class RolloutBackend(Protocol):
    version: int  # the weights it holds now (the trainer's numbering)
    step_hook: bool  # True: generate's `on_step` runs between engine steps on the caller's thread, so a batch
    # in flight can take new weights or stop there; False: `on_step` is refused (no hook between the steps)

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        on_step: Callable[[], object] | None = None,
    ) -> list[list[Completion]]:
        """Blocking: outs[k][j] is sample j of prompt k."""

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int | None = None) -> int:
        """Takes the trainer's weights bit for bit (or as far as the backend's sync allows); the new version."""

    def stats(self) -> dict[str, float]:
        """`engine/version` and the backend's own gauges (`external/…`, `ray/…`)."""

    def close(self) -> None:
        """Releases what it holds (threads, clients, actors); idempotent."""
