"""POST /v1/completions (JSON or server-sent events): text or token-id prompts, n samples each.

Every choice carries `prompt_token_ids`, `generation_token_ids` and
`generation_log_probs` next to OpenAI's fields; `logprobs=k` / `echo` are
scored by one trainer-path forward after generation (`score_top_logprobs`).

Streaming: with `echo` the first chunk carries each choice's prompt text; with
`stream_options.include_usage` a usage chunk precedes `data: [DONE]`; an
error after the status line is an in-stream `{"error": ...}` event, then
`[DONE]`. Text prompts are tokenized in a worker thread (off the event loop),
and one too long for the context is refused before it is tokenized.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from exactrl.chat.trajectory import Session
from exactrl.server.generation import (
    Generation,
    SessionStream,
    drain_all,
    sampling_key,
    score_top_logprobs,
    sse,
    stream_error,
    token_fields,
    until_done,
)
from exactrl.server.guard import prompt_built
from exactrl.server.schemas import (
    MAX_SEQUENCES,
    MAX_TOP_LOGPROBS,
    APIError,
    CompletionRequest,
    check_common,
    context_error,
    sampling_params,
)


def _prompts(st, prompt) -> list[list[int]]:
    """Token ids of each prompt; ids are checked against the model's vocabulary (it may exceed the tokenizer's)."""
    single = isinstance(prompt, str) or bool(prompt) and all(isinstance(p, int) for p in prompt)

    def name(k: int) -> str:  # which prompt of a list a message is about
        return "prompt" if single else f"prompt[{k}]"

    texts = [prompt] if isinstance(prompt, str) else prompt
    if texts and all(isinstance(p, str) for p in texts):
        prompts = []
        for k, p in enumerate(texts):
            try:  # a text too long for the context is refused before it is tokenized
                need = st.splicer.min_tokens(p, st.context_limit)
                ids = st.tokenizer.encode(p) if need < st.context_limit else None
            except ValueError as e:  # not valid Unicode
                raise APIError(400, f"{name(k)}: {e}", param="prompt") from None
            if ids is None:
                e = context_error(
                    st.context_limit, st.engine.max_model_len, f", but the prompt has at least {need} tokens", "prompt"
                )
                e.message = e.message if single else f"{name(k)}: {e.message}"
                raise e
            prompts.append(ids)
    elif single:
        prompts = [list(prompt)]
    else:
        prompts = [list(p) for p in prompt]
    if not prompts:
        raise APIError(400, "prompt must be non-empty", param="prompt")
    vocab = st.limits.vocab_size
    for k, p in enumerate(prompts):
        if not p:
            raise APIError(400, f"{name(k)} must be non-empty", param="prompt")
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise APIError(
                400, f"{name(k)} holds token id {bad[0]} outside the vocabulary [0, {vocab})", param="prompt"
            )
    return prompts


async def completions(st, body: CompletionRequest, request: Request, session_id: str | None = None):
    st.check_model(body.model)
    stops = check_common(body, st.limits)
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_TOP_LOGPROBS:
        raise APIError(400, f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {body.logprobs}", param="logprobs")
    if body.logprobs is not None and body.stream:  # (0 too: a stream cannot carry them)
        raise APIError(
            400,
            "logprobs is not available with stream=true (alternatives are recomputed after "
            "generation); the stream's last chunk of each choice carries generation_log_probs, "
            "the sampled tokens' logprobs",
            param="logprobs",
        )
    # the session as it is now: a DELETE while this request runs (tokenizing its prompts included) drops its
    # record too (see app.session)
    session = st.session(session_id) if session_id is not None else None
    try:
        gens = await _generations(st, body, stops)
    except BaseException:
        st.release(session)
        raise
    prompt_built(request)  # a large body's slot goes to the next (guard.py)
    st.count("server/completion_requests")
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if body.stream:  # the stream gives the session back when it ends
        return SessionStream(_completion_stream(st, body, gens, cid, created, request, session), st, session)
    try:
        return await _completion_answer(st, body, gens, cid, created, request, session)
    finally:
        st.release(session)


async def _generations(st, body: CompletionRequest, stops: list[str]) -> list[Generation]:
    """One Generation per prompt, its max_tokens resolved against the context."""
    prompts = await asyncio.to_thread(_prompts, st, body.prompt)
    if len(prompts) * body.n > MAX_SEQUENCES:
        raise APIError(
            400,
            f"{len(prompts)} prompts x n={body.n} is more than {MAX_SEQUENCES} sequences in one "
            f"request: send fewer prompts per request",
            param="prompt",
        )
    gens = []
    for k, p in enumerate(prompts):
        try:
            max_tokens = st.resolve_max_tokens(body.max_tokens, len(p), "prompt", default=16)  # OpenAI's default
        except APIError as e:
            if len(prompts) > 1 and e.code == "context_length_exceeded":  # which prompt of the list is too long
                e.message = f"prompt[{k}]: {e.message}"
            raise
        gens.append(Generation(st, p, sampling_params(body, max_tokens, st.stop_token_ids), stops, body.stream))
    return gens


async def _completion_answer(
    st,
    body: CompletionRequest,
    gens: list[Generation],
    cid: str,
    created: int,
    request: Request,
    session: Session | None,
):
    if await until_done(st, drain_all(gens), request) is None:
        return Response(status_code=499)
    choices = []
    for k, g in enumerate(gens):
        prompt_text = st.tokenizer.decode(g.prompt_ids, skip_special_tokens=False) if body.echo else ""
        for c in g.choices:
            choices.append(
                {
                    "index": k * body.n + c.index,
                    "text": prompt_text + c.text,
                    "logprobs": await _completion_logprobs(st, body, g, c, prompt_text),
                    "finish_reason": c.finish_reason,
                }
                | token_fields(g.prompt_ids, c)
            )
    answer = JSONResponse(
        {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": body.model,
            "choices": choices,
            "usage": _usage(gens),
        }
    )
    for g in gens:  # only now that the answer is whole: a request that failed (409) leaves no trajectory
        _record(session, g)
        st.count_generation(g.prompt_ids, g.choices)
    return answer


def _record(session: Session | None, g: Generation) -> None:
    if session is not None:
        for c in g.choices:
            session.record(g.prompt_ids, c.token_ids, c.logprobs, c.versions, sampling=sampling_key(g.params))


async def _completion_logprobs(st, body: CompletionRequest, g: Generation, c, prompt_text: str) -> dict | None:
    if body.logprobs is None:
        return None
    ids, lps = list(c.token_ids), list(c.logprobs)
    start = len(g.prompt_ids)
    if body.echo or body.logprobs:
        first = 1 if body.echo else start
        full = g.prompt_ids + c.token_ids
        chosen, tops = await asyncio.wrap_future(
            st.loop.call(lambda eng: score_top_logprobs(eng, full, first, g.params, body.logprobs, c.versions))
        )
        if body.echo:  # the prompt's tokens are scored too (the first one has no logprob; nor has one that
            ids = full  # the request's top_k / top_p leave out: -inf, which JSON cannot carry)
            lps = [None] + [lp if math.isfinite(lp) else None for lp in chosen[: start - 1]] + lps
            tops = [None] + tops
    else:  # logprobs=0 without echo: no alternatives, nothing to score
        tops = [[] for _ in ids]
    # as OpenAI and vLLM: the chosen token is always in its row ("up to logprobs + 1 elements"), so
    # top_logprobs[i][tokens[i]] is there wherever token_logprobs[i] is
    tops = [
        row if row is None or lp is None or any(t == tid for t, _ in row) else row + [(tid, lp)]
        for row, tid, lp in zip(tops, ids, lps)
    ]
    tokens = [st.token_str(t) for t in ids]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    top_dicts = [None if row is None else {st.token_str(t): v for t, v in row} for row in tops]
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_dicts, "text_offset": offsets}


def _usage(gens: list[Generation]) -> dict:
    prompt = sum(len(g.prompt_ids) for g in gens)
    completion = sum(len(c.token_ids) for g in gens for c in g.choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _completion_stream(st, body, gens: list[Generation], cid, created, request: Request, session: Session | None):
    queue: asyncio.Queue = asyncio.Queue()

    def chunk(choices: list[dict], **extra) -> str:
        return sse(
            {"id": cid, "object": "text_completion", "created": created, "model": body.model, "choices": choices}
            | extra
        )

    async def pump(k: int, g: Generation):
        try:
            async for changed in g.updates():
                await queue.put((k, changed))
        except Exception as e:  # handed to the stream, which reports it
            await queue.put((k, e))
            return
        await queue.put((k, None))

    tasks = [asyncio.ensure_future(pump(k, g)) for k, g in enumerate(gens)]
    completed, closed = False, set()
    try:
        if body.echo:  # the prompt's text first, as in the JSON answer
            yield chunk(
                [
                    {
                        "index": k * body.n + c.index,
                        "text": st.tokenizer.decode(g.prompt_ids),
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for k, g in enumerate(gens)
                    for c in g.choices
                ]
            )
        live = len(gens)
        while live:
            k, changed = await queue.get()
            if isinstance(changed, Exception):
                raise changed
            if changed is None:
                live -= 1
                continue
            if await request.is_disconnected():
                return
            g, out = gens[k], []
            for j in changed:
                c = g.choices[j]
                if (k, j) in closed:  # an update queued before the consumer saw the choice finish
                    continue
                text = c.text_delta(g.hold)
                if text or c.done:
                    out.append(
                        {"index": k * body.n + j, "text": text, "logprobs": None, "finish_reason": c.finish_reason}
                        | (token_fields(g.prompt_ids, c) if c.done else {})
                    )
                if c.done:  # a choice's last chunk, with its token fields, goes out once
                    closed.add((k, j))
            if out:
                yield chunk(out)
        for g in gens:
            _record(session, g)
            st.count_generation(g.prompt_ids, g.choices)
        completed = True
        if (body.stream_options or {}).get("include_usage"):
            yield chunk([], usage=_usage(gens))
        yield "data: [DONE]\n\n"
    except Exception as e:  # the status line is already sent: the error goes in the stream, then [DONE]
        completed = True
        yield stream_error(st, e)
        yield "data: [DONE]\n\n"
    finally:
        if not completed:
            st.count("server/client_disconnects")
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
