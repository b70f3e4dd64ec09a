"""guard.py's large-body slots, driven through the body-limit middleware with a stub ASGI app (no sockets):
a large request waits for a slot once its body is whole, gives it back when its prompt is built, small
requests never wait, and the heap is trimmed when the last large request building a prompt ends."""

from __future__ import annotations

import asyncio

import pytest

from exactrl.server import guard
from exactrl.server.guard import LARGE_BODY_BYTES, LargeBodies, _BodyLimit, prompt_built

pytestmark = pytest.mark.timeout(30)  # the hang guard


class _Request:  # what prompt_built reads of a Starlette request
    def __init__(self, scope):
        self.scope = scope


def run(size: int, events: list, name: str, release: asyncio.Event):
    """A request of `size` body bytes whose app records when it has its body, then waits for `release`."""

    async def app(scope, receive, send):
        while (await receive())["more_body"]:
            pass
        events.append(f"{name} has its body")
        await release.wait()
        prompt_built(_Request(scope))
        events.append(f"{name} built its prompt")
        await send({"type": "http.response.start", "status": 200, "headers": []})

    chunks = [
        {"type": "http.request", "body": b"x" * (size // 2), "more_body": True},
        {"type": "http.request", "body": b"x" * (size - size // 2), "more_body": False},
    ]

    async def receive():
        return chunks.pop(0)

    async def send(message):
        pass

    return app, receive, send


async def _one(large: LargeBodies, size: int, events, name, release):
    app, receive, send = run(size, events, name, release)
    scope = {"type": "http", "headers": [(b"content-length", str(size).encode())]}
    await _BodyLimit(app, 8 << 20, lambda key: None, large)(scope, receive, send)


def test_large_requests_take_turns_and_small_ones_do_not_wait(monkeypatch):
    trims = []
    monkeypatch.setattr(guard, "trim_heap", lambda: trims.append(1))

    async def main():
        large = LargeBodies(1)
        events, gates = [], {k: asyncio.Event() for k in ("a", "b", "small")}
        tasks = [
            asyncio.create_task(_one(large, LARGE_BODY_BYTES, events, "a", gates["a"])),
            asyncio.create_task(_one(large, LARGE_BODY_BYTES * 2, events, "b", gates["b"])),
        ]
        small = asyncio.create_task(_one(large, 1000, events, "small", gates["small"]))
        for _ in range(20):
            await asyncio.sleep(0)
        # one large request holds the slot, the other waits with its body unread; the small one went on
        assert sorted(events) == ["a has its body", "small has its body"], events
        assert large.building == 2 and trims == []
        gates["small"].set()
        await small
        assert "b has its body" not in events and trims == []  # a small request neither waits nor trims
        gates["a"].set()
        await tasks[0]
        assert events[-1] == "b has its body"  # a's prompt is built: b takes the slot
        assert trims == []  # b is building its prompt: a trim now would be undone
        gates["b"].set()
        await tasks[1]
        assert trims == [1] and large.building == 0 and large.trims == 1
        assert large.free._value == 1  # every slot given back

    asyncio.run(main())


def test_a_large_request_that_fails_gives_back_its_slot(monkeypatch):
    monkeypatch.setattr(guard, "trim_heap", lambda: None)

    async def main():
        large = LargeBodies(1)

        async def failing(scope, receive, send):
            while (await receive())["more_body"]:
                pass
            raise ValueError("refused before its prompt was built")

        chunks = [{"type": "http.request", "body": b"x" * LARGE_BODY_BYTES, "more_body": False}]

        async def receive():
            return chunks.pop(0)

        with pytest.raises(ValueError):
            await _BodyLimit(failing, 8 << 20, lambda key: None, large)({"type": "http", "headers": []}, receive, None)
        assert large.building == 0 and large.free._value == 1 and large.trims == 1

    asyncio.run(main())
