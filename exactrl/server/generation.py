"""Following one engine request to its end: choices, stop strings, text, logprobs.

A `Generation` submits one prompt with n samples to the engine loop and
turns the engine's cumulative outputs into per-choice state. Stop strings
are the server's business (the engine stops on token ids only): a choice
whose text reaches one is finished here; its tokens up to and including the
one that completed the stop string are kept — they are what the model
generated and saw — while its text is cut before the stop string. When every
choice is finished, whatever the engine still runs is aborted, and the same
happens if the consumer goes away (client disconnect): the pages are freed.

Top logprobs are not produced by the engine; `score_top_logprobs` recomputes
them with one trainer-path forward over prompt + generation on the engine
thread. In `exact` kernel mode that forward is bitwise the engine's, so the
alternatives are those of the distribution the token was sampled from.

The helpers at the end (SSE framing, disconnect watching, usage) are shared
by the chat and completions endpoints.

Legend: L tokens of a sequence, V vocabulary, K top alternatives.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field

import torch
from fastapi.responses import StreamingResponse

from exactrl.kernels import sampling_logprobs
from exactrl.model.logprobs import HEAD_CHUNK_ROWS, forward_hidden
from exactrl.server.schemas import APIError

log = logging.getLogger("exactrl.server")


@dataclass
class Choice:
    """One sample of a generation, as the server reports it."""

    index: int
    token_ids: list[int] = field(default_factory=list)  # generated, stop token included
    logprobs: list[float] = field(default_factory=list)  # engine logprob of each token
    versions: list[int] = field(default_factory=list)  # weight version of each token
    finish_reason: str | None = None  # "stop" | "length" (chat may report "tool_calls")
    stop_string: bool = False  # finished by a stop string (the text is cut before it)
    text: str = ""  # visible text so far (stop token excluded, stop string cut)
    new_tokens: int = 0  # tokens added by the last update (for streaming logprobs)
    sent_text: int = 0  # characters already streamed
    settled: int = 0  # tokens whose text is `settled_text` and ends a whole character (`Generation.decoded`)
    settled_text: str = ""

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def text_delta(self, hold: int) -> str:
        """Unsent text that can no longer change (all of it once done)."""
        end = len(self.text)
        if not self.done:  # an incomplete UTF-8 sequence at the end first, then what may begin a stop string
            while end > self.sent_text and self.text[end - 1] == "\ufffd":
                end -= 1
            end -= hold
        delta = self.text[self.sent_text : max(end, self.sent_text)]
        self.sent_text += len(delta)
        return delta


DECODE_CONTEXT_TOKENS = 4  # prompt tokens decoded before a SentencePiece generation (Generation.text_of)


class Generation:
    """Iterate with `async for changed in gen.updates()`; choices live in `gen.choices`."""

    def __init__(self, server, prompt_ids: list[int], params, stop_strings: list[str], track_text: bool):
        self.server, self.tok = server, server.tokenizer
        self.prompt_ids, self.params = prompt_ids, params
        self.stops = stop_strings
        self.track_text = track_text or bool(stop_strings)  # decode as tokens arrive
        self.stop_ids = frozenset(params.stop_token_ids)
        self.choices = [Choice(j) for j in range(params.n)]
        self.hold = max((len(s) for s in stop_strings), default=1) - 1

    async def updates(self):
        """Yields the indexes of the choices that changed, until every choice is done."""
        loop = self.server.loop
        rid, stream = loop.submit(self.prompt_ids, self.params, asyncio.get_running_loop())
        finished = False
        try:
            while not all(c.done for c in self.choices):
                try:
                    out = await stream.get()
                except ValueError as e:  # rejected by the engine: bad input
                    finished = True
                    raise APIError(400, str(e)) from None
                finished = out.finished
                changed = [j for j, comp in enumerate(out.completions) if self._advance(self.choices[j], comp)]
                if not all(c.done for c in self.choices):  # (else the whole request is aborted below)
                    for j in changed:  # a stop string ended it, the engine's sample runs on: free its pages
                        if self.choices[j].stop_string and out.completions[j].finish_reason is None:
                            loop.abort(rid, j)
                if changed:
                    yield changed
        finally:
            if not finished:  # stop strings, a client gone, or an error: free the engine's pages
                loop.abort(rid)
        for c in self.choices:
            if not self.track_text:
                c.text = self.visible_text(c.token_ids, c.finish_reason)

    def _advance(self, c: Choice, comp) -> bool:
        c.new_tokens = 0
        if c.done:
            return False
        start = len(c.token_ids)
        for i in range(start, len(comp.token_ids)):
            c.token_ids.append(comp.token_ids[i])
            c.logprobs.append(comp.logprobs[i])
            c.versions.append(comp.versions[i])
            c.new_tokens += 1
            if self.stops and self._hit_stop_string(c, comp):
                break
        if not c.done and comp.finish_reason is not None and len(c.token_ids) == len(comp.token_ids):
            c.finish_reason = comp.finish_reason
            if self.track_text:
                c.text = self.visible_text(c.token_ids, c.finish_reason)
        elif not c.done and self.track_text and not self.stops:
            c.text = self.decoded(c)
        return c.new_tokens > 0 or c.done

    def _hit_stop_string(self, c: Choice, comp) -> bool:
        last = len(c.token_ids) == len(comp.token_ids)
        if last and comp.finish_reason == "stop" and c.token_ids[-1] in self.stop_ids:
            return False  # the stop token itself is not text
        before = len(c.text)
        c.text = self.decoded(c)
        start = max(0, before - self.hold - 1)
        hits = [i for s in self.stops if (i := c.text.find(s, start)) >= 0]
        if not hits:
            return False
        c.text = c.text[: min(hits)]
        c.finish_reason, c.stop_string = "stop", True
        return True

    def decoded(self, c: Choice) -> str:
        """The text of all of c's tokens, `text_of(c.token_ids)` exactly (for a byte-level tokenizer,
        `tok.decode`). A byte-level tokenizer's text is the settled tokens' text (kept) then the rest's, so
        each token costs the decode of the few since the last whole character, not of the whole generation
        (which made long generations quadratic on the event loop, stop strings and streams alike)."""
        if not self.tok.byte_level:
            return self.text_of(c.token_ids)
        tail = self.tok.decode(c.token_ids[c.settled :], skip_special_tokens=False)
        if tail and not tail.endswith("\ufffd"):  # ends a whole character: a place to cut the text
            c.settled_text, c.settled, tail = c.settled_text + tail, len(c.token_ids), ""
        return c.settled_text + tail

    def visible_text(self, token_ids: list[int], finish_reason: str | None) -> str:
        ids = token_ids
        if finish_reason == "stop" and ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.text_of(ids)

    def text_of(self, ids: list[int]) -> str:
        """The text generated tokens add after the prompt. A byte-level tokenizer's is their own decode; a
        SentencePiece one (Llama-2, Mistral) strips the first space of every decode, so " Paris" alone
        reads "Paris": its text is that of the prompt's last tokens and the generation, minus theirs."""
        if self.tok.byte_level or not self.prompt_ids:
            return self.tok.decode(ids, skip_special_tokens=False)
        ctx = self.prompt_ids[-DECODE_CONTEXT_TOKENS:]
        head = self.tok.decode(ctx, skip_special_tokens=False)
        full = self.tok.decode(ctx + list(ids), skip_special_tokens=False)
        return full[len(head) :] if full.startswith(head) else self.tok.decode(ids, skip_special_tokens=False)


def sampling_key(params) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) as the trainer sees them (T = 0 reports the T = 1 logprobs)."""
    return (float(params.temperature) or 1.0, int(params.top_k), float(params.top_p))


def score_top_logprobs(
    engine, token_ids: list[int], start: int, params, k: int, versions: list[int] = ()
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Logprob of token_ids[i] and its top-k alternatives, for i in [start, L), under the sampling distribution.
    Only those rows go through the LM head, HEAD_CHUNK_ROWS at a time: memory stays at a chunk's [rows, V]
    whatever the prompt's length (the exact head is row-invariant, so the bits are those of one call).
    `versions`: the weight versions that sampled the generated tokens; a 409 if the engine holds others now
    (the alternatives would come from another distribution than the token)."""
    changed = sorted({v for v in versions if v != engine.version})
    if changed:
        raise APIError(
            409,
            f"the model's weights changed between sampling (version {changed[0]}) and scoring "
            f"the top logprobs (version {engine.version}): send the request again, or without "
            f"top logprobs",
            code="weights_changed",
        )
    chosen, tops = [], []
    with torch.inference_mode():
        hidden_LD, _ = forward_hidden(engine.model, [token_ids])
        for a in range(start - 1, len(token_ids) - 1, HEAD_CHUNK_ROWS):
            rows = engine.model.logits(hidden_LD[a : min(a + HEAD_CHUNK_ROWS, len(token_ids) - 1)])
            n = rows.shape[0]
            lp_NV = sampling_logprobs(
                rows,
                torch.full((n,), float(params.temperature)),
                torch.full((n,), int(params.top_k)),
                torch.full((n,), float(params.top_p)),
            )
            chosen += lp_NV.gather(1, torch.tensor(token_ids[a + 1 : a + 1 + n])[:, None]).squeeze(1).tolist()
            if k == 0:
                tops += [[] for _ in range(n)]
                continue
            vals, idx = lp_NV.topk(min(k, lp_NV.shape[1]), dim=-1)
            tops += [
                [(int(t), float(v)) for t, v in zip(ti, vi) if v != float("-inf")]
                for ti, vi in zip(idx.tolist(), vals.tolist())
            ]
    return chosen, tops


# ---------------------------------------------------------------- shared by the endpoints
class SessionStream(StreamingResponse):
    """An SSE response that gives its session back (`ServerState.release`) exactly once, however it ends.

    A body that runs out gives it back before the response's closing frame is sent, so a client that has
    read the whole stream never sees its session still busy (releasing after `__call__` returned raced
    with that client's next request). A body that failed, was cancelled, lost its client or never
    started (it then never runs) gives it back when the response ends. The body is closed then too, so
    its clean-up (aborting its generation) runs at once: Starlette leaves an abandoned body iterator to
    be finalized, and this one is in a reference cycle with the response, i.e. to the cycle collector.
    """

    def __init__(self, body, st, session):
        super().__init__(self._released_at_end(body), media_type="text/event-stream")
        self._st, self._session, self._released = st, session, False

    async def _released_at_end(self, body):
        try:
            async for chunk in body:
                yield chunk
        finally:
            try:
                await body.aclose()  # the body's own clean-up first (a no-op once it ran out)
            finally:
                self._release()

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._st.release(self._session)

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # a body left mid-stream: its clean-up now, not at some gc
            finally:
                self._release()


# characters str.splitlines ends a line at that JSON leaves raw: a client reading the stream line by line that
# way (httpx's aiter_lines) cut an event inside a string when the model generated one. In a JSON text they
# can only stand inside strings, where their escape means the same
_LINE_BREAKS = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"})


def sse(obj) -> str:
    """One server-sent event: JSON text on one line, whatever line breaks a client's reader knows."""
    return f"data: {json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"


def stream_error(st, e: Exception) -> str:
    """The SSE event for an error raised after a stream's status line went out (OpenAI's error body).

    Counted as an error of its status (500 for anything but an APIError), never as a client disconnect.
    """
    if not isinstance(e, APIError):
        log.error("stream failed: %s: %s", type(e).__name__, e, exc_info=e)
        e = APIError(500, f"internal error: {type(e).__name__}: {e}")
    st.count(f"server/errors_{e.status}")
    return sse(e.body())


async def until_done(st, coro, request):
    """Awaits coro, cancelling it (and so aborting its generation) if the client disconnects."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if done:
                return task.result()
            if await request.is_disconnected():
                st.count("server/client_disconnects")
                return None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def drain(gen: Generation) -> Generation:
    async for _ in gen.updates():
        pass
    return gen


async def drain_all(gens: list[Generation]) -> list[Generation]:
    """`drain` of every generation at once; when one fails (or this is cancelled) the others are
    cancelled too, which aborts what they still run (a plain gather left them generating, unread)."""
    tasks = [asyncio.ensure_future(drain(g)) for g in gens]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def token_fields(prompt_ids, c) -> dict:
    return {
        "prompt_token_ids": list(prompt_ids),
        "generation_token_ids": list(c.token_ids),
        "generation_log_probs": list(c.logprobs),
    }


def usage(prompt_len: int, choices, n_prompts: int = 1) -> dict:
    gen = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt_len * n_prompts,
        "completion_tokens": gen,
        "total_tokens": prompt_len * n_prompts + gen,
    }
