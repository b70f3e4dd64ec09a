"""What the engine hands back (a request's completions, each token tagged with the weights' version) and
the error it stops on."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exactrl.engine.scheduler import Sequence
from exactrl.kernels import TokenLayout


class NonFiniteLogitsError(RuntimeError):
    """The logits of some requests hold NaN/inf (non-finite weights, e.g. a diverged update).

    Those requests are aborted; the engine keeps every other request and can keep stepping.
    """

    def __init__(self, request_ids: list[str]):
        self.request_ids = request_ids
        super().__init__(
            f"non-finite logits (NaN or inf) for request(s) {request_ids}: the model's weights or "
            f"activations are not finite (a diverged update?); those requests were aborted"
        )

    def __reduce__(self):
        """Pickled as its request ids (a Ray engine's error reaching the trainer): the default, its message,
        would be taken for the ids and the message said twice."""
        return type(self), (self.request_ids,)


@dataclass
class Completion:
    """One sample of one prompt."""

    index: int  # j, which of the prompt's n samples
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens; a stop token is included
    logprobs: list[float]  # logprob of each token under the distribution it was sampled from
    versions: list[int]  # engine.version that sampled each token
    finish_reason: str | None  # "stop" | "length" | "abort" (abort(request_id, index)); None while running
    # mixture of experts: per token, the experts ([L][K] ids) each MoE layer selected where it was sampled;
    # None for a dense model or an engine that does not report them (`mismatch/routing_agreement`)
    experts: list[list[list[int]]] | None = None


def completion_of(s: Sequence) -> Completion:
    """Sequence `s`'s completion so far (copies: later steps do not change it)."""
    return Completion(
        s.index,
        list(s.request.prompt),
        s.tokens[s.num_prompt :],
        list(s.logprobs),
        list(s.versions),
        s.finish_reason,
        [list(e) for e in s.experts] if s.experts else None,
    )


@dataclass
class RequestOutput:
    """State of a request after a step (returned by `Engine.step`)."""

    request_id: str
    prompt_token_ids: list[int]
    completions: list[Completion]  # its n samples by index, cumulative
    finished: bool  # all samples finished


@dataclass
class _Batch:
    """Model inputs of one step and where the sampled rows go."""

    tokens_N: torch.Tensor
    layout: TokenLayout
    rows_R: torch.Tensor  # row of the step's hidden states each sample reads
    targets: list[Sequence]  # sequence receiving each sampled token (R of them)
    decode: bool  # one token per sequence, each row sampled once, in order: a step a decode graph replays
