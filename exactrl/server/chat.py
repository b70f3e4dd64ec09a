"""POST /v1/chat/completions (JSON or server-sent events).

A chat request is: validate -> prompt from the splicer (token-exact history,
monotonicity policy) -> one engine request with n samples -> parse each
choice's text for the client (reasoning, content, tool calls) -> OpenAI's
response, where every assistant message also carries `prompt_token_ids`,
`generation_token_ids` and `generation_log_probs`. Inside a session
(`/sessions/{id}/v1/...`) every choice is also recorded for training.

Tool calls are read in the format the chat template writes them in
(`Splicer.tool_call_format`: Hermes `<tool_call>` blocks or Llama 3's bare
JSON); a request that asks for them with a template of neither format is
refused (400 `unsupported_tool_call_format`).

Streaming sends one chunk per engine update: a role chunk, then content /
reasoning / tool-call deltas (`StreamParser`; a Llama 3 JSON call is sent
when the choice ends, and text that could still become one is held until
then); the delta that finishes a choice also carries the three token
fields and its `finish_reason`; optionally a usage chunk, then
`data: [DONE]`. An error after the status line went out is an in-stream
`{"error": ...}` event followed by `[DONE]`.

Building the prompt (chat template renders, tokenization) is CPU work that
grows with the conversation: it runs in a worker thread, so one long
conversation does not stall every other request on the event loop.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from exactrl.chat.messages import (
    InconsistentTokenFieldsError,
    check_tool_choice,
    validate_template_kwargs,
    validate_tools,
)
from exactrl.chat.parsing import HERMES, StreamParser, parse_assistant_text
from exactrl.chat.splice import MonotonicityError, PromptTooLongError
from exactrl.server.generation import (
    Generation,
    SessionStream,
    drain,
    sampling_key,
    score_top_logprobs,
    sse,
    stream_error,
    token_fields,
    until_done,
    usage,
)
from exactrl.server.guard import prompt_built
from exactrl.server.schemas import (
    MAX_TOP_LOGPROBS,
    APIError,
    ChatCompletionRequest,
    check_common,
    context_error,
    sampling_params,
)


class _ChatJob:
    """A checked chat request: its prompt plan, parameters and generation. Made by `await _ChatJob.create(...)`."""

    def __init__(self, st, body: ChatCompletionRequest, session_id: str | None):
        """The cheap checks, on the event loop (nothing is built for a request that fails them)."""
        self.st, self.body, self.session_id = st, body, session_id
        st.check_model(body.model)
        self.stops = check_common(body, st.limits)
        try:
            self.tools = validate_tools(body.tools)
        except ValueError as e:
            raise APIError(400, str(e), param="tools", code="invalid_tools") from None
        try:
            self.parse_tools = check_tool_choice(body.tool_choice, self.tools)
        except ValueError as e:
            raise APIError(400, str(e), param="tool_choice") from None
        # the template's tool call format: how the model was shown calls, so how its text is read
        self.tool_format = st.splicer.tool_call_format or HERMES
        if self.parse_tools and st.splicer.tool_call_format is None:
            raise APIError(
                400,
                "this model's chat template writes tool calls in neither format this server parses "
                '(<tool_call>{"name": ..., "arguments": ...}</tool_call> blocks: Hermes, Qwen2.5, '
                'Qwen3; a bare {"name": ..., "parameters": ...} object: Llama 3.1, 3.2), or '
                "refuses tools: the model's calls would come back as content. Send "
                "tool_choice='none' to get them as content",
                param="tools",
                code="unsupported_tool_call_format",
            )
        try:
            self.template_kwargs = validate_template_kwargs(body.chat_template_kwargs)
        except ValueError as e:
            raise APIError(400, str(e), param="chat_template_kwargs") from None
        self.top = self._check_logprobs(body)

    @classmethod
    async def create(cls, st, body: ChatCompletionRequest, session_id: str | None) -> _ChatJob:
        job = cls(st, body, session_id)
        # the session as it is now: a DELETE while this request runs (building its prompt included) drops
        # its record too (see app.session)
        job.session = st.session(session_id) if session_id is not None else None
        try:
            plan = await asyncio.to_thread(job._plan)  # template renders and tokenization: off the event loop
            job._start(plan)
        except BaseException:
            st.release(job.session)
            raise
        return job

    def _plan(self):
        st, body = self.st, self.body
        policy = body.monotonicity or st.config.monotonicity
        try:
            return st.splicer.build(
                body.messages, self.tools, policy, max_len=st.context_limit, template_kwargs=self.template_kwargs
            )
        except PromptTooLongError as e:
            raise context_error(
                e.limit, st.engine.max_model_len, f", but the prompt has at least {e.length} tokens", "messages"
            ) from None
        except MonotonicityError as e:
            st.count("chat/monotonicity_raise")
            raise APIError(400, str(e), param="messages", code="non_monotonic_history") from None
        except InconsistentTokenFieldsError as e:
            raise APIError(400, str(e), param="messages", code="inconsistent_token_fields") from None
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None

    def _start(self, plan) -> None:
        st, body = self.st, self.body
        self.plan = plan
        st.count(f"chat/prompts_{plan.kind}")
        if plan.kind in ("split", "truncate"):
            st.count(f"chat/monotonicity_{plan.kind}")
        st.count("chat/history_tokens_reused", plan.reused)
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = st.resolve_max_tokens(getattr(body, field), len(plan.prompt_ids), field=field)
        self.params = sampling_params(body, max_tokens, st.stop_token_ids)
        self.gen = Generation(st, plan.prompt_ids, self.params, self.stops, track_text=body.stream)
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    @staticmethod
    def _check_logprobs(body) -> int:
        top = body.top_logprobs
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}", param="top_logprobs")
        if top and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if top and body.stream:
            raise APIError(
                400,
                "top_logprobs is not available with stream=true (alternatives are recomputed after "
                "generation); use stream=false",
                param="top_logprobs",
            )
        return top or 0

    def message(self, c) -> dict:
        msg = parse_assistant_text(c.text, self.parse_tools, self.tool_format).to_message()
        return msg | token_fields(self.plan.prompt_ids, c)

    def finish_reason(self, c, has_calls: bool) -> str:
        return "tool_calls" if has_calls and c.finish_reason == "stop" else c.finish_reason

    async def logprobs(self, c) -> dict | None:
        if not self.body.logprobs:
            return None
        tops = [[] for _ in c.token_ids]
        if self.top:
            _, tops = await asyncio.wrap_future(
                self.st.loop.call(
                    lambda eng: score_top_logprobs(
                        eng,
                        self.plan.prompt_ids + c.token_ids,
                        len(self.plan.prompt_ids),
                        self.params,
                        self.top,
                        c.versions,
                    )
                )
            )
        return {
            "content": [self.st.logprob_entry(t, lp, top) for t, lp, top in zip(c.token_ids, c.logprobs, tops)],
            "refusal": None,
        }

    def record(self) -> None:
        if self.session is not None:
            for c in self.gen.choices:
                self.session.record(
                    self.plan.prompt_ids,
                    c.token_ids,
                    c.logprobs,
                    c.versions,
                    self.plan.kind,
                    sampling_key(self.params),
                    self.plan.history,
                )

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        out = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.body.model,
            "choices": choices,
        }
        if usage is not None:
            out["usage"] = usage
        return out


async def chat_completions(st, body: ChatCompletionRequest, request: Request, session_id: str | None = None):
    job = await _ChatJob.create(st, body, session_id)
    prompt_built(request)  # a large body's slot goes to the next (guard.py)
    st.count("server/chat_requests")
    if body.stream:  # the stream gives the session back when it ends
        return SessionStream(_chat_stream(job, request), st, job.session)
    try:
        return await _chat_answer(st, job, body, request)
    finally:
        st.release(job.session)


async def _chat_answer(st, job: _ChatJob, body: ChatCompletionRequest, request: Request):
    if await until_done(st, drain(job.gen), request) is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    choices = []
    for c in job.gen.choices:
        msg = job.message(c)
        choices.append(
            {
                "index": c.index,
                "message": msg,
                "logprobs": await job.logprobs(c),
                "finish_reason": job.finish_reason(c, "tool_calls" in msg),
            }
        )
    answer = JSONResponse(
        {
            "id": job.id,
            "object": "chat.completion",
            "created": job.created,
            "model": body.model,
            "choices": choices,
            "usage": usage(len(job.plan.prompt_ids), job.gen.choices),
        }
    )
    job.record()  # only a turn the client is sent: a failure above records nothing
    st.count_generation(job.plan.prompt_ids, job.gen.choices)
    return answer


async def _chat_stream(job: _ChatJob, request: Request):
    st = job.st
    yield sse(
        job.chunk(
            [
                {
                    "index": c.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for c in job.gen.choices
            ]
        )
    )
    completed = False
    try:
        async for chunk in _chat_deltas(job):
            if await request.is_disconnected():
                return  # leaving the generator aborts the engine request
            yield sse(chunk)
        completed = True
    except Exception as e:  # the status line is already sent: the error goes in the stream, then [DONE]
        completed = True
        yield stream_error(st, e)
        yield "data: [DONE]\n\n"
        return
    finally:
        if not completed:  # the client went away (or the stream was cancelled when it did)
            st.count("server/client_disconnects")
    job.record()
    st.count_generation(job.plan.prompt_ids, job.gen.choices)
    if (job.body.stream_options or {}).get("include_usage"):
        yield sse(job.chunk([], usage=usage(len(job.plan.prompt_ids), job.gen.choices)))
    yield "data: [DONE]\n\n"


async def _chat_deltas(job: _ChatJob):
    """One chunk per engine update: reasoning / content / tool-call deltas, token fields when a choice ends."""
    gen, st = job.gen, job.st
    parsers = [StreamParser(job.parse_tools, job.tool_format) for _ in gen.choices]
    n_calls = [0] * len(gen.choices)
    async for changed in gen.updates():
        out = []
        for j in changed:
            c = gen.choices[j]
            d = parsers[j].feed(c.text_delta(gen.hold))
            if c.done:
                d2 = parsers[j].finish()
                d.reasoning, d.content, d.tool_calls = (
                    d.reasoning + d2.reasoning,
                    d.content + d2.content,
                    d.tool_calls + d2.tool_calls,
                )
            delta = {}
            if d.reasoning:
                delta["reasoning_content"] = d.reasoning
            if d.content:
                delta["content"] = d.content
            if d.tool_calls:
                delta["tool_calls"] = [{"index": n_calls[j] + k, **tc.to_openai()} for k, tc in enumerate(d.tool_calls)]
                n_calls[j] += len(d.tool_calls)
            lp = None
            if job.body.logprobs and c.new_tokens:
                new = range(len(c.token_ids) - c.new_tokens, len(c.token_ids))
                lp = {"content": [st.logprob_entry(c.token_ids[i], c.logprobs[i], []) for i in new], "refusal": None}
            finish = None
            if c.done:  # the closing delta carries the turn's exact tokens
                delta |= token_fields(job.plan.prompt_ids, c)
                finish = job.finish_reason(c, n_calls[j] > 0)
            if delta or lp:
                out.append({"index": j, "delta": delta, "logprobs": lp, "finish_reason": finish})
        if out:
            yield job.chunk(out)
