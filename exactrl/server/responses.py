"""POST /v1/responses (JSON or server-sent events): OpenAI's Responses API over the chat route.

Invariant: a Responses request is served as exactly one chat completions request (`chat._ChatJob`): its
input items become chat messages (responses_items.py), so the prompt is the splicer's (token-exact history,
monotonicity policy), the sampling checks, the generation and the session record are the chat route's, and
its output items are the chat route's assistant message in the Responses spelling, the token fields
(`prompt_token_ids`, `generation_token_ids`, `generation_log_probs`) on the last item of the generation.

This is NeMo Gym's contract for a Responses model server with `return_token_id_information: true`
(`responses_api_models/vllm_model`, `nemo_gym/responses_converter.py`): the token fields are returned
unless a request sends `return_token_id_information: false`. Not served (a 400 naming the field):
`previous_response_id` and `conversation` (nothing is stored: send the whole conversation as `input`),
`background`, `truncation: "auto"`, `text.format` other than text and `top_logprobs` (constrained
decoding, alternatives). `reasoning`, `include`, `store`, `metadata` are accepted and ignored. Extras as on
the chat route: `top_k`, `seed`, `monotonicity`, `chat_template_kwargs`, `stop`, `stop_token_ids`,
`ignore_eos`. As in NeMo Gym's request schema, `model` may be left out (the served model is meant) and
`tool_choice` "auto" / "none" without tools means no tools.

Streaming sends OpenAI's events: response.created, response.in_progress; reasoning as one item
(output_item.added, then .done when the text after it starts); the message item's content_part.added,
response.output_text.delta per engine update, output_text.done, content_part.done, output_item.done;
function calls when the generation ends (output_item.added, function_call_arguments.delta / .done,
output_item.done), so the items come in the order the JSON answer lists them; then response.completed
with the whole response. An error after the status line went out is an `error` event, the stream's last.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from exactrl.server import responses_items as items
from exactrl.server.chat import _chat_deltas, _ChatJob
from exactrl.server.errors import _validation_message
from exactrl.server.generation import SessionStream, drain, sse, stream_error, until_done
from exactrl.server.guard import prompt_built
from exactrl.server.schemas import DISTRIBUTION_EXTRAS, APIError, ChatCompletionRequest, Float, Int

# fields of the request body passed on to the chat route as they are (beyond OpenAI's Responses schema)
_PASSED_ON = ("stop", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "logit_bias")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # as the chat request: no "5" -> 5

    model: str | None = None  # None: the served model (NeMo Gym's model servers fill it in themselves)
    input: str | list[Any]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    text: dict[str, Any] | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    metadata: dict[str, Any] | None = None
    top_logprobs: Int | None = None
    user: str | None = None
    top_k: Int | None = None
    seed: Int | None = None
    monotonicity: Literal["raise", "split", "truncate"] | None = None
    chat_template_kwargs: Any = None
    return_token_id_information: bool = True  # NeMo Gym's name; false: the output items carry no token fields

    @model_validator(mode="before")
    @classmethod
    def _nulls_take_defaults(cls, data: Any) -> Any:
        """null is the default (OpenAI's clients send null for fields left unset)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in cls.model_fields)}
        return data


def _refuse_unserved(body: ResponsesRequest) -> None:
    for name in ("previous_response_id", "conversation"):
        if getattr(body, name) is not None:
            raise APIError(
                400,
                f"{name} is not supported: this server stores no responses; send the whole conversation as input",
                param=name,
            )
    if body.background:
        raise APIError(400, "background responses are not supported", param="background")
    if body.truncation not in (None, "disabled"):
        raise APIError(
            400, "truncation must be 'disabled': a conversation is never cut to fit the context", param="truncation"
        )
    fmt = (body.text or {}).get("format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise APIError(400, "text.format other than {'type': 'text'} needs constrained decoding", param="text")
    if body.top_logprobs:
        raise APIError(400, "top_logprobs is not supported on /v1/responses", param="top_logprobs")
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise APIError(400, f"max_output_tokens must be >= 1, got {body.max_output_tokens}", param="max_output_tokens")


def to_chat_request(body: ResponsesRequest) -> tuple[ChatCompletionRequest, items.Origins]:
    """The chat request serving `body`, and where its messages came from (for error messages)."""
    _refuse_unserved(body)
    try:
        messages, origins = items.chat_messages(body.input, body.instructions)
    except ValueError as e:
        raise APIError(400, str(e), param="input") from None
    try:
        tools = items.chat_tools(body.tools)
    except ValueError as e:
        raise APIError(400, str(e), param="tools", code="invalid_tools") from None
    try:
        tool_choice = items.chat_tool_choice(body.tool_choice, tools)
    except ValueError as e:
        raise APIError(400, str(e), param="tool_choice") from None
    fields = {
        "model": body.model,
        "messages": messages,
        "tools": tools,
        "tool_choice": tool_choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "seed": body.seed,
        "stream": body.stream,
        "user": body.user,
        "monotonicity": body.monotonicity,
        "chat_template_kwargs": body.chat_template_kwargs,
    }
    extra = {k: v for k, v in (body.model_extra or {}).items() if k in _PASSED_ON or k in DISTRIBUTION_EXTRAS}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None} | extra), origins
    except ValidationError as e:  # a passed-on extra of the wrong type
        message, param = _validation_message(e.errors(), None)
        raise APIError(400, message, param=param) from None


def _renamed(e: APIError, origins: items.Origins) -> APIError:
    """The chat route's error in the Responses request's field names."""
    param = {"messages": "input", "max_completion_tokens": "max_output_tokens"}.get(e.param, e.param)
    return APIError(e.status, origins.rename(e.message), param=param, code=e.code, type=e.type)


class _ResponsesJob:
    """A chat job and what its Responses answer needs: ids, the request's echoed fields."""

    def __init__(self, job: _ChatJob, body: ResponsesRequest):
        self.job, self.body = job, body
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.ids = {"reasoning": f"rs_{uuid.uuid4().hex}", "message": f"msg_{uuid.uuid4().hex}"}

    def output(self, c) -> list[dict]:
        msg = self.job.message(c)
        return items.output_items(
            msg, self.ids, self.body.return_token_id_information, incomplete=c.finish_reason == "length"
        )

    def response(self, status: str, output: list[dict], c=None) -> dict:
        b = self.body
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": b.model,
            "status": status,
            "output": output,
            "instructions": b.instructions,
            "tools": b.tools or [],
            "tool_choice": b.tool_choice or "auto",
            "parallel_tool_calls": True if b.parallel_tool_calls is None else b.parallel_tool_calls,
            "temperature": b.temperature,
            "top_p": b.top_p,
            "max_output_tokens": b.max_output_tokens,
            "metadata": b.metadata,
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": None,
            "usage": None,
        }
        if c is not None:
            prompt, gen = len(self.job.plan.prompt_ids), len(c.token_ids)
            out["usage"] = {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": gen,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + gen,
            }
        return out

    def finished(self) -> None:
        """Records the turn in its session (a turn the client is sent only) and counts its tokens."""
        self.job.record()
        self.job.st.count_generation(self.job.plan.prompt_ids, self.job.gen.choices)


async def responses(st, body: ResponsesRequest, request: Request, session_id: str | None = None):
    body.model = body.model if body.model is not None else st.config.model_name
    chat_body, origins = to_chat_request(body)
    try:
        job = await _ChatJob.create(st, chat_body, session_id)
    except APIError as e:
        raise _renamed(e, origins) from None
    prompt_built(request)  # a large body's slot goes to the next (guard.py)
    st.count("server/responses_requests")
    rjob = _ResponsesJob(job, body)
    if body.stream:  # the stream gives the session back when it ends
        return SessionStream(_stream(rjob, request), st, job.session)
    try:
        if await until_done(st, drain(job.gen), request) is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        c = job.gen.choices[0]
        answer = JSONResponse(rjob.response(_status(c), rjob.output(c), c))
        rjob.finished()
        return answer
    finally:
        st.release(job.session)


def _status(c) -> str:
    return "incomplete" if c.finish_reason == "length" else "completed"


class _Events:
    """Server-sent events of one response, numbered in order."""

    def __init__(self):
        self.n = 0

    def __call__(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.n, **fields}
        self.n += 1
        return f"event: {kind}\n" + sse(data)


async def _stream(r: _ResponsesJob, request: Request):
    st, ev = r.job.st, _Events()
    yield ev("response.created", response=r.response("in_progress", []))
    yield ev("response.in_progress", response=r.response("in_progress", []))
    completed = False
    try:
        async for event in _events(r, ev):
            if await request.is_disconnected():
                return  # leaving the generator aborts the engine request
            yield event
        completed = True
    except Exception as e:  # the status line is already sent: the error goes in the stream
        completed = True
        err = json.loads(stream_error(st, e)[len("data: ") :])["error"]
        yield ev("error", code=err["code"], message=err["message"], param=err["param"])
        return
    finally:
        if not completed:  # the client went away (or the stream was cancelled when it did)
            st.count("server/client_disconnects")


async def _events(r: _ResponsesJob, ev: _Events):
    """The item events as the chat route's deltas come, then the calls and response.completed."""
    reasoning = ""
    opened: list[str] = []  # the items streamed so far, in output order: "reasoning", "message"
    done: set[str] = set()
    mid = r.ids["message"]
    async for chunk in _chat_deltas(r.job):
        d = chunk["choices"][0]["delta"]
        if d.get("reasoning_content"):  # (the parser sends reasoning only before any content)
            if not opened:
                opened.append("reasoning")
                yield ev("response.output_item.added", output_index=0, item=_reasoning(r, "") | {"summary": []})
            reasoning += d["reasoning_content"]
        if d.get("content"):
            if opened == ["reasoning"]:  # the reasoning is whole: its item is done
                done.add("reasoning")
                yield ev("response.output_item.done", output_index=0, item=_reasoning(r, reasoning))
            if "message" not in opened:
                opened.append("message")
                yield ev("response.output_item.added", output_index=len(opened) - 1, item=_opening_message(mid))
                yield ev(**_part_event("added", mid, len(opened) - 1, ""))
            yield ev(
                "response.output_text.delta",
                item_id=mid,
                output_index=opened.index("message"),
                content_index=0,
                delta=d["content"],
                logprobs=[],
            )
    c = r.job.gen.choices[0]
    output = r.output(c)  # the parse of the whole text: the deltas above add up to its text
    for k, item in enumerate(output):
        kind = item["type"]
        if kind in done:
            continue
        if kind not in opened:
            yield ev("response.output_item.added", output_index=k, item=_opening(item))
            if kind == "message":
                yield ev(**_part_event("added", mid, k, ""))
        if kind == "message":
            text = item["content"][0]["text"]
            yield ev("response.output_text.done", item_id=mid, output_index=k, content_index=0, text=text, logprobs=[])
            yield ev(**_part_event("done", mid, k, text))
        elif kind == "function_call":
            args = {"item_id": item["id"], "output_index": k}
            yield ev("response.function_call_arguments.delta", delta=item["arguments"], **args)
            yield ev("response.function_call_arguments.done", arguments=item["arguments"], **args)
        yield ev("response.output_item.done", output_index=k, item=item)
    r.finished()  # recorded before the client reads that the response is complete (and sends the next turn)
    yield ev("response.completed", response=r.response(_status(c), output, c))


def _reasoning(r: _ResponsesJob, text: str) -> dict:
    return items.reasoning_item(r.ids["reasoning"], text)


def _opening_message(item_id: str) -> dict:
    return items.message_item(item_id, "", "in_progress") | {"content": []}


def _opening(item: dict) -> dict:
    """An item as output_item.added shows it: in progress, no text or arguments yet, no token fields."""
    if item["type"] == "message":
        return _opening_message(item["id"])
    bare = {k: v for k, v in item.items() if k not in items.TOKEN_FIELDS}
    return bare | ({"arguments": "", "status": "in_progress"} if item["type"] == "function_call" else {})


def _part_event(which: str, item_id: str, index: int, text: str) -> dict:
    return {
        "kind": f"response.content_part.{which}",
        "item_id": item_id,
        "output_index": index,
        "content_index": 0,
        "part": {"type": "output_text", "text": text, "annotations": []},
    }
