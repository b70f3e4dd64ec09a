"""The one thread that owns the engine.

The engine is not thread-safe, so a single background thread drives it:
it takes commands (add, abort, call, weight updates) from a queue between steps, runs
`engine.step()` while anything is unfinished, and pushes every request's
cumulative output to that request's `RequestStream` — an asyncio queue on the
HTTP event loop, fed with `call_soon_threadsafe`. When nothing is running it
blocks on the command queue, so an idle server uses no CPU.

Aborting a request (client gone, stop string reached) goes through the same
queue: the engine frees its pages before the next step.

Should the thread itself ever stop on an error no step or command catches,
every waiting request fails with it, later ones fail at once, and /health
answers 503 naming it (`EngineLoop.error`): the server never hangs on a
thread that is gone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from exactrl.engine import NonFiniteLogitsError

log = logging.getLogger("exactrl.server")


class RequestStream:
    """Outputs of one engine request, consumed on an asyncio loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:  # called from the engine thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def get(self):
        """The next RequestOutput (cumulative); raises the engine's error if the request failed."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


@dataclass
class LoopStats:
    """Snapshot published by the engine thread after every step (read by /metrics)."""

    steps: int = 0
    unfinished_requests: int = 0  # engine requests a client is waiting on
    kv_pages_free: int = 0
    kv_pages_total: int = 0
    aborted: int = 0  # engine requests (or samples of one) aborted: client gone, stop string reached
    busy_s: float = 0.0  # wall time spent in engine.step
    step_errors: int = 0
    engine: dict = field(default_factory=dict)  # Engine.stats(): version, running, waiting, preemptions, kv usage

    def flat(self) -> dict:
        out = {f"engine/{k}": v for k, v in self.__dict__.items() if k != "engine"}
        return out | self.engine


class EngineLoop:
    def __init__(self, engine):
        self.engine = engine
        self.stats = LoopStats(kv_pages_total=engine.pool.num_pages)
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._stopped = threading.Event()
        self.error: BaseException | None = None  # what stopped the thread, if anything did
        self._failing = threading.Lock()  # the dying thread and a call's caller may both fail its future
        self._thread = threading.Thread(target=self._run, name="exactrl-engine", daemon=True)
        self._publish()  # before the thread starts, so /metrics is complete from the first request

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._commands.put(("wake",))
        self._thread.join()

    # ------------------------------------------------------------ API (any thread)
    def submit(self, prompt_ids: list[int], params, loop: asyncio.AbstractEventLoop) -> tuple[str, RequestStream]:
        request_id = f"req-{uuid.uuid4().hex}"
        stream = RequestStream(loop)
        self._commands.put(("add", request_id, prompt_ids, params, stream))
        if self.error is not None:  # checked after the put: the dying thread fails what it drains after
            stream.put(self.stopped_error())  # setting the error, this fails what came later (twice is harmless)
        return request_id, stream

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Drops the request (or only its sample `index`: `Engine.abort`) at the next command."""
        self._commands.put(("abort", request_id, index))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Runs fn(engine) on the engine thread between steps (scoring, weight updates)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, fut))
        if self.error is not None:  # (as in submit)
            self._fail_call(fut)
        return fut

    def update_weights(self, state_dict: dict) -> concurrent.futures.Future:
        """Swaps the engine's weights between two steps; the future holds the new version.

        The engine preempts its running sequences and recomputes their cache, so every token
        generated afterwards is the new weights' (`Engine.update_weights`).
        """
        return self.call(lambda engine: engine.update_weights(state_dict))

    # ------------------------------------------------------------ engine thread
    def stopped_error(self) -> RuntimeError:
        return RuntimeError(
            f"the engine thread stopped ({type(self.error).__name__}: {self.error}); restart the server"
        )

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._drain(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    self._step()
                self._publish()
        except BaseException as e:  # nothing caught it: fail every waiting request instead of leaving it hanging
            log.exception("the engine thread stopped")
            self.error = e
            for stream in self._streams.values():
                stream.put(self.stopped_error())
            self._streams.clear()
            while True:
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                if cmd[0] == "add":
                    cmd[4].put(self.stopped_error())
                elif cmd[0] == "call":
                    self._fail_call(cmd[2])

    def _fail_call(self, fut: concurrent.futures.Future) -> None:
        """Fails a call's future with the stopped error unless it is settled (a future settles once: a second
        try is a RuntimeError, which in the thread's handler left the commands after it waiting)."""
        with self._failing:
            if not fut.done() and fut.set_running_or_notify_cancel():
                fut.set_exception(self.stopped_error())

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(block=block)
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, stream = cmd
            try:
                self.engine.add_request(prompt, params, request_id=rid)
            except ValueError as e:
                stream.put(e)
                return
            except Exception as e:  # not bad input: this request fails (a 500), the engine goes on
                log.exception("engine refused request %s", rid)
                stream.put(RuntimeError(f"the engine could not take the request: {type(e).__name__}: {e}"))
                return
            self._streams[rid] = stream
        elif kind == "abort":
            _, rid, index = cmd
            if index is not None:  # one sample: the request and its stream go on
                if rid in self._streams and self.engine.abort(rid, index):
                    self.stats.aborted += 1
            elif self._streams.pop(rid, None) is not None and self.engine.abort(rid):
                self.stats.aborted += 1
        elif kind == "call":
            _, fn, fut = cmd
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as e:  # handed to the caller, who re-raises it
                    fut.set_exception(e)

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outs = self.engine.step()
        except NonFiniteLogitsError as e:  # only those requests fail (the engine aborted them); the rest go on
            log.error("%s", e)
            self.stats.step_errors += 1
            for rid in e.request_ids:
                stream = self._streams.pop(rid, None)
                if stream is not None:
                    stream.put(RuntimeError(str(e)))
            return
        except Exception as e:  # keep serving: fail the in-flight requests, free their pages
            log.exception("engine step failed; aborting %d requests", len(self._streams))
            self.stats.step_errors += 1
            for rid, stream in list(self._streams.items()):
                self.engine.abort(rid)
                stream.put(RuntimeError(f"engine step failed: {e}"))
            self._streams.clear()
            return
        self.stats.busy_s += time.perf_counter() - t0
        self.stats.steps += 1
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted while in the step
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _publish(self) -> None:
        s = self.stats
        s.unfinished_requests = len(self._streams)
        s.kv_pages_free = self.engine.pool.num_free
        s.engine = self.engine.stats()
