"""Request schemas (OpenAI's, plus a few vLLM-style extras) and OpenAI error bodies: a request whose sampling
the engine could not serve, or the trainer could not reproduce, is refused here with a 400 naming the field.

Known fields are validated strictly, as OpenAI does: a number sent as text
(`max_tokens: "5"`), a bool as a number or a number as a bool is a 400 naming
the field (an int is a number where a float is expected: `temperature: 1`).
Unknown fields are accepted and ignored, as OpenAI clients send fields a
server may not know; fields that would change the sampling distribution
(penalties, logit_bias, and the vLLM / SGLang extras in `DISTRIBUTION_EXTRAS`:
repetition_penalty, min_p, min_tokens, allowed_token_ids, bad_words, guided_*,
...) are rejected unless neutral, because the trainer could not reproduce the
distribution the tokens were sampled from.

Every numeric sampling field is checked here, against the served engine's
limits (`EngineLimits`), before anything is built for the request: a value
that reached the engine's shared step could fail every request in flight
(a top_k beyond int64), and a huge n would build n per-choice objects.

Extras beyond OpenAI's schema:
  top_k            keep the k most likely tokens (-1 off), as vLLM
  stop_token_ids   extra stop token ids, as vLLM
  ignore_eos       do not stop at the end-of-turn / eos tokens (benchmarks)
  monotonicity     per-request override of the server's policy: raise | split | truncate
  chat_template_kwargs  more chat template variables, as vLLM (Qwen3: {"enable_thinking": false})
  return_token_ids accepted for vLLM's dialect; the token ids are always returned
                   (`prompt_token_ids`, `generation_token_ids`, `generation_log_probs`)
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, model_validator

from exactrl.engine import SamplingParams


class APIError(Exception):
    """An error answered in OpenAI's error JSON."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, type: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or {400: "invalid_request_error", 404: "invalid_request_error", 500: "internal_error"}.get(
            status, "invalid_request_error"
        )

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def context_error(limit: int, max_model_len: int, detail: str, param: str) -> APIError:
    """400 context_length_exceeded in OpenAI's words ("This model's maximum context length is N tokens"),
    naming --kv-budget-tokens when the server's KV cache, not the model's context, sets N."""
    why = " (this server's KV cache: exactrl serve --kv-budget-tokens)" if limit < max_model_len else ""
    return APIError(
        400,
        f"This model's maximum context length is {limit} tokens{why}{detail}",
        param=param,
        code="context_length_exceeded",
    )


def _not_bool(v: Any) -> Any:
    """true / false are not numbers (pydantic's lax mode reads them as 1 / 0: `top_k: true` would be greedy)."""
    if isinstance(v, bool):
        raise ValueError(f"must be a number, not {str(v).lower()}")
    return v


Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[float, BeforeValidator(_not_bool)]


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # strict: no "5" -> 5, 1 -> true (ints still floats)

    model: str
    n: Int = 1
    temperature: Float | None = None  # OpenAI default 1.0
    top_p: Float | None = None
    top_k: Int | None = None
    max_tokens: Int | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    user: str | None = None
    response_format: dict[str, Any] | None = None  # only {"type": "text"}: the rest needs constrained decoding
    best_of: Int | None = None  # only n: the best of more samples is not a sample the trainer can weigh (vLLM
    # takes it on both routes; chat ignored it, answering plain samples to a client that asked for the best)

    @model_validator(mode="before")
    @classmethod
    def _nulls_take_defaults(cls, data: Any) -> Any:
        """A client may send null for a field it leaves unset (OpenAI's API allows it): null is the default."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in cls.model_fields)}
        return data


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    monotonicity: Literal["raise", "split", "truncate"] | None = None
    chat_template_kwargs: Any = None  # vLLM's: more chat template variables (Qwen3's enable_thinking)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]  # StrictInt: true/false are not token ids
    logprobs: Int | None = None
    echo: bool = False
    suffix: str | None = None
    return_token_ids: bool | None = None  # vLLM's flag; exactrl returns the token ids in any case


class UpdateWeightsFromDiskRequest(BaseModel):
    """POST /update_weights_from_disk, SGLang's name and body (its other fields are accepted and ignored)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model_path: str  # Hugging Face checkpoint directory (config.json + safetensors) on the server's filesystem


MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20
MAX_SEQUENCES = 2048  # prompts x n of one /v1/completions request: bounds how long it can hold back others
SEED_RANGE = (-(2**63), 2**63)  # int64, passed to the engine unchanged: distinct seeds draw distinct streams


@dataclass(frozen=True)
class EngineLimits:
    """What the served engine accepts; requests beyond it are refused before anything is built for them."""

    max_n: int  # the engine's max_num_seqs: the n samples of a prompt run side by side
    vocab_size: int  # the model's vocabulary (may exceed the tokenizer's: padded rows)


# vLLM / SGLang sampling extras that change the distribution, with their neutral values: the trainer could not
# reproduce the distribution they sample from, so anything else is refused (param names the field).
DISTRIBUTION_EXTRAS: dict[str, tuple] = {
    "repetition_penalty": (None, 1, 1.0),
    "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "min_new_tokens": (None, 0),
    "typical_p": (None, 1, 1.0),
    "epsilon_cutoff": (None, 0, 0.0),
    "eta_cutoff": (None, 0, 0.0),
    "top_a": (None, 0, 0.0),
    "tfs": (None, 1, 1.0),
    "length_penalty": (None, 1, 1.0),
    "use_beam_search": (None, False),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "logits_processors": (None, []),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_whitespace_pattern": (None,),
    "structured_outputs": (None,),
    "regex": (None,),
    "json_schema": (None,),
    "ebnf": (None,),
    "dry_multiplier": (None, 0, 0.0),
    "xtc_probability": (None, 0, 0.0),
    "mirostat": (None, 0),
    "custom_logit_processor": (None,),
}


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


def _is_neutral(value, neutral: tuple) -> bool:
    for v in neutral:
        if v is None or isinstance(v, bool):
            if value is v:
                return True
        elif not isinstance(value, bool) and value == v:
            return True
    return False


def check_common(req: _Sampling, limits: EngineLimits) -> list[str]:
    """Checks the fields every endpoint shares against the engine's limits; returns the stop strings."""
    for name, value in (req.model_extra or {}).items():
        if name in DISTRIBUTION_EXTRAS and not _is_neutral(value, DISTRIBUTION_EXTRAS[name]):
            raise _bad(
                name,
                f"{name}={reprlib.repr(value)} is not supported: it changes the sampling distribution, "
                f"which the trainer could not reproduce (omit it or send its neutral value)",
            )
    if req.response_format and req.response_format.get("type") not in (None, "text"):
        raise _bad("response_format", "response_format other than 'text' needs constrained decoding, not implemented")
    if req.presence_penalty or req.frequency_penalty:
        raise _bad(
            "presence_penalty" if req.presence_penalty else "frequency_penalty",
            "presence/frequency penalties are not supported: the trainer could not reproduce the "
            "penalised distribution (use 0)",
        )
    if req.logit_bias:
        raise _bad("logit_bias", "logit_bias is not supported: the trainer could not reproduce the biased distribution")
    if req.temperature is not None and not 0 <= req.temperature <= 2:
        raise _bad("temperature", f"temperature must be in [0, 2], got {req.temperature}")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise _bad("top_p", f"top_p must be in (0, 1], got {req.top_p}")
    if req.top_k is not None and not (req.top_k == -1 or 1 <= req.top_k <= limits.vocab_size):
        raise _bad(
            "top_k", f"top_k must be -1 (off) or in [1, {limits.vocab_size}] (the model's vocabulary), got {req.top_k}"
        )
    if not 1 <= req.n <= limits.max_n:
        raise _bad("n", f"n must be in [1, {limits.max_n}] (the engine's max_num_seqs), got {req.n}")
    if req.best_of not in (None, req.n):
        raise _bad(
            "best_of",
            f"best_of={req.best_of} other than n={req.n} is not supported: the best of more "
            f"samples is not a sample of the policy, which the trainer could not weigh",
        )
    if req.seed is not None and not SEED_RANGE[0] <= req.seed < SEED_RANGE[1]:
        raise _bad("seed", f"seed must be a 64-bit signed integer in [-2**63, 2**63), got {req.seed}")
    bad = [t for t in req.stop_token_ids or [] if not 0 <= t < limits.vocab_size]
    if bad:
        raise _bad("stop_token_ids", f"stop_token_ids holds {bad[0]}, not a token id in [0, {limits.vocab_size})")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise _bad("stop", f"at most {MAX_STOP_STRINGS} stop sequences, got {len(stops)}")
    if any(s == "" for s in stops):
        raise _bad("stop", "stop sequences must be non-empty")
    if req.stream_options is not None and not req.stream:
        raise _bad("stream_options", "stream_options is only allowed with stream=true")
    return stops


_PARAMS = ("temperature", "top_p", "top_k", "max_tokens", "n", "seed", "stop_token_ids")


def sampling_params(req: _Sampling, max_tokens: int, stop_ids: list[int]) -> SamplingParams:
    """The engine's parameters for a checked request (max_tokens already resolved)."""
    extra = list(req.stop_token_ids or [])
    try:
        return SamplingParams(
            temperature=float(1.0 if req.temperature is None else req.temperature),
            top_p=float(1.0 if req.top_p is None else req.top_p),
            top_k=-1 if req.top_k is None else req.top_k,
            max_tokens=max_tokens,
            n=req.n,
            seed=req.seed,
            stop_token_ids=extra + ([] if req.ignore_eos else list(stop_ids)),
            ignore_eos=req.ignore_eos,
        )
    except ValueError as e:  # SamplingParams' messages start with the field's name
        field = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param=field if field in _PARAMS else None) from None
