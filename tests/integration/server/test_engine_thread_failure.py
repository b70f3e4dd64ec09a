"""Review of the engine thread's failure path (server/loop.py): a weight update or scoring call racing the
thread's death is failed once, and no request queued behind it is left waiting."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
from types import SimpleNamespace

import pytest

from exactrl.server.loop import EngineLoop, RequestStream


class FakeEngine:
    """Takes every request; `stats` (called by the thread after every command or step, outside any guard) raises
    once `broken`, which stops the thread; `before_death` runs just before (the other threads' moves)."""

    pool = SimpleNamespace(num_pages=1, num_free=1)
    broken = False
    before_death = staticmethod(lambda: None)

    def has_unfinished(self) -> bool:
        return False

    def add_request(self, *a, **kw):
        pass

    def stats(self) -> dict:
        if self.broken:
            self.before_death()
            raise KeyError("broken on purpose")
        return {}


class PutThenDie(queue.Queue):
    """A command queue whose `call` put lets the thread take it, die and drain before `call` goes on."""

    def __init__(self, loop: EngineLoop):
        super().__init__()
        self.loop = loop

    def put(self, item, *a, **kw):
        super().put(item, *a, **kw)
        if item[0] == "call":
            self.loop.engine.broken = True
            self.loop.start()
            self.loop._thread.join(timeout=30)


def test_a_call_whose_future_the_dying_thread_settled_returns_it():
    """`call` put its command, the thread ran it and died, then `call` saw the error: it failed the settled
    future again (RuntimeError('Future in unexpected state') out of `call`, a 500 naming nothing)."""
    loop = EngineLoop(FakeEngine())
    loop._commands = PutThenDie(loop)
    fut = loop.call(lambda engine: 1)
    assert loop.error is not None and fut.result(timeout=10) == 1


def test_a_future_its_caller_failed_first_leaves_no_request_behind_it_waiting():
    """The other order: a `call` sees the error and fails its future before the dying thread drains the queue,
    which met the failed future (RuntimeError in its handler) and never failed the request queued after it."""

    async def main():
        engine = FakeEngine()
        loop = EngineLoop(engine)
        stream = RequestStream(asyncio.get_running_loop())
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def others():  # a call, then a request, queued before the error is set; the call's caller fails its
            loop._commands.put(("call", lambda e: 1, fut))  # future once it sees the error
            loop._commands.put(("add", "req-after", [1], None, stream))
            assert fut.set_running_or_notify_cancel()
            fut.set_exception(RuntimeError("the engine thread stopped (as call() words it)"))

        engine.before_death = others
        engine.broken = True
        loop.start()
        loop._commands.put(("wake",))
        loop._thread.join(timeout=30)
        with pytest.raises(RuntimeError, match="the engine thread stopped"):
            await asyncio.wait_for(stream.get(), 10)

    asyncio.run(main())
