"""Access control and request limits: what stands between the network and the routes.

In the order a request meets them (outermost first), each refusal in OpenAI's
error JSON, counted under server/errors_<status>:
  Host check     with `Access.allowed_hosts` (set by `exactrl serve` on a
                 loopback bind: localhost, 127.0.0.1, [::1], any port, plus
                 --allowed-hosts), the Host header must name one of them: a web
                 page whose domain re-resolves to 127.0.0.1 (DNS rebinding)
                 reaches the port through the browser, but with its own domain
                 as the Host. 400 `invalid_host`.
  API keys       with `Access.api_keys` (--api-key, EXACTRL_API_KEY), every
                 route needs `Authorization: Bearer KEY`, OpenAI's scheme, so
                 the official client's `api_key` works; keys are compared in
                 constant time. 401 `invalid_api_key`.
  Body limit     a body beyond `Access.max_body_bytes` (--max-body-mb) is
                 refused by its Content-Length before a byte is read, or as its
                 chunks arrive past the limit. 413 `request_too_large`.
  Large bodies   a request whose body is `LARGE_BODY_BYTES` or more waits, its
                 body received, for one of `LargeBodies.slots` slots before the
                 route sees its last chunk, and holds it while its JSON is
                 decoded and its prompt rendered and tokenized: until the route
                 calls `prompt_built`, answers, or fails. Requests with smaller
                 bodies never wait. Several multi-megabyte prompts built at once
                 interleave their buffers across worker threads' malloc arenas
                 and Python's object arenas, and what stays live afterwards pins
                 them; and every such build takes CPU from the small requests.
                 When the last large request in flight ends, glibc gives the
                 freed pages back to the kernel (malloc_trim, every arena).
Slow clients: `http_protocol` is uvicorn's h11 protocol with a deadline for a
request's head (request line and headers): a connection that has not sent a
whole head within `header_timeout_s` of connecting, or of the first byte of
its next request, is closed. uvicorn's keep-alive timer only runs between
requests and restarts on every byte, so a client trickling a header held its
connection for good.
"""

from __future__ import annotations

import asyncio
import ctypes
import hmac
import ipaddress
import logging
import platform
import re
from dataclasses import dataclass

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from exactrl.server.schemas import APIError

log = logging.getLogger("exactrl.server")

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
LARGE_BODY_BYTES = 1 << 20  # a body at least this large waits for a LargeBodies slot and is followed by malloc_trim
LARGE_BODY_SLOTS = 1  # large requests whose prompts are built at once
_HOST = re.compile(r"\[([0-9a-f:.]+)\](?::\d*)?|([^:\[\]]+)(?::\d*)?")  # Host: name[:port] or [v6][:port]


@dataclass(frozen=True)
class Access:
    """Who may use a server and how much one request may send (`exactrl serve`'s access flags)."""

    api_keys: tuple[str, ...] = ()  # bearer tokens every route requires (--api-key / EXACTRL_API_KEY); (): none
    allowed_hosts: tuple[str, ...] | None = None  # Host header names accepted (any port); None: any Host
    max_body_bytes: int = 8 << 20  # a larger request body is refused with 413 (--max-body-mb)
    weight_updates: bool = False  # POST /update_weights_from_disk swaps the served weights: off unless asked
    # (--enable-weight-updates); any client that reaches the port could otherwise serve weights of its choice
    weights_root: str | None = None  # with weight updates: model_path must lie under this directory (symlinks
    # resolved), and a path outside it gets one message that says nothing of what the path is

    def __post_init__(self):
        if any(not isinstance(k, str) or not k.strip() for k in self.api_keys):
            raise ValueError("an API key (--api-key, EXACTRL_API_KEY) must be a non-empty string")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes (--max-body-mb) must be positive, got {self.max_body_bytes!r}")
        if self.allowed_hosts is not None:
            object.__setattr__(self, "allowed_hosts", tuple(_normal_host(h) for h in self.allowed_hosts))


def is_loopback(host: str) -> bool:
    """Whether a bind address (`--host`) is reachable from this machine only."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower().rstrip(".") == "localhost"


def parse_keys(text: str | None) -> tuple[str, ...]:
    """Keys from EXACTRL_API_KEY's text: comma-separated, spaces around each dropped."""
    return tuple(k.strip() for k in (text or "").split(",") if k.strip())


def _normal_host(name: str) -> str:
    return name.strip().lower().strip("[]").rstrip(".")


def _host_name(header: str) -> str | None:
    """The name of a Host header's value (its port dropped), or None if it is no host[:port]."""
    m = _HOST.fullmatch(header.strip().lower())
    return None if m is None else (m.group(1) or m.group(2)).rstrip(".")


def _refuse(status: int, message: str, code: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(APIError(status, message, code=code).body(), status_code=status, headers=headers)


def install_guards(app, access: Access, count) -> None:
    """Adds the middleware, outermost first as in the module docstring; `count(key)` counts each refusal."""
    app.add_middleware(
        _BodyLimit,
        limit=access.max_body_bytes,
        count=count,  # each added goes outside the last
        large=LargeBodies(LARGE_BODY_SLOTS),
    )
    if access.api_keys:
        app.add_middleware(_APIKeys, keys=access.api_keys, count=count)
    if access.allowed_hosts is not None:
        app.add_middleware(_HostCheck, allowed=access.allowed_hosts, count=count)


class _HostCheck:
    def __init__(self, app, allowed: tuple[str, ...], count):
        self.app, self.allowed, self.count = app, frozenset(allowed), count

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if _host_name(header) not in self.allowed:
            self.count("server/errors_400")
            names = ", ".join(f"[{h}]" if ":" in h else h for h in sorted(self.allowed))
            return await _refuse(
                400,
                f"Host {header[:100]!r} is not a name of this server ({names}, any port); "
                f"another name needs exactrl serve --allowed-hosts",
                "invalid_host",
            )(scope, receive, send)
        await self.app(scope, receive, send)


class _APIKeys:
    def __init__(self, app, keys: tuple[str, ...], count):
        self.app, self.keys, self.count = app, [k.encode() for k in keys], count

    def valid(self, token: bytes) -> bool:
        # every key is compared (no early exit), each in constant time
        return any([hmac.compare_digest(token, k) for k in self.keys])

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer" or not self.valid(token.strip()):
            self.count("server/errors_401")
            given = "an incorrect API key" if scheme.lower() == b"bearer" else "no API key"
            return await _refuse(
                401,
                f"this server needs an API key and the request sent {given}: send "
                f"'Authorization: Bearer KEY' (the openai client's api_key)",
                "invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )(scope, receive, send)
        await self.app(scope, receive, send)


class LargeBodies:
    """The slots large requests take while their prompts are built, and how many are being built."""

    def __init__(self, slots: int):
        assert slots >= 1
        self.slots = slots
        self.free = asyncio.Semaphore(slots)
        self.building = 0  # large requests from their body's last chunk until their prompt is built
        self.trims = 0  # malloc_trim calls


class _LargeRequest:
    """One request's hold on a LargeBodies slot: taken once its body is whole, given back once; the heap is
    trimmed when a large request ends and no other is building its prompt (a trim then would be undone)."""

    def __init__(self, large: LargeBodies):
        self.large, self.entered, self.building, self.holding = large, False, False, False

    async def enter(self) -> None:
        self.entered = self.building = True
        self.large.building += 1
        await self.large.free.acquire()
        self.holding = True

    def prompt_built(self) -> None:
        if self.building:
            self.building = False
            self.large.building -= 1
        if self.holding:
            self.holding = False
            self.large.free.release()

    def end(self) -> None:
        self.prompt_built()
        if self.entered and self.large.building == 0:
            self.large.trims += 1
            trim_heap()


def prompt_built(request) -> None:
    """Called by a route once its prompt is built (tokenized): a large request gives back its slot while it
    generates. Nothing for a request with a small body."""
    held = request.scope.get("exactrl.large_request")
    if held is not None:
        held.prompt_built()


class _BodyLimit:
    def __init__(self, app, limit: int, count, large: LargeBodies):
        self.app, self.limit, self.count, self.large = app, limit, count, large

    def message(self) -> str:
        return (
            f"the request body is larger than this server's limit of {self.limit / 2**20:g} MB "
            f"(exactrl serve --max-body-mb)"
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:  # (h11 refuses a Content-Length that is no number)
            self.count("server/errors_413")
            return await _refuse(413, self.message(), "request_too_large")(scope, receive, send)
        received = 0
        held = scope["exactrl.large_request"] = _LargeRequest(self.large)

        async def limited():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:  # a chunked body: refused as it passes the limit (errors.py answers)
                    raise StarletteHTTPException(413, self.message())
                if received >= LARGE_BODY_BYTES and not message.get("more_body", False) and not held.entered:
                    await held.enter()  # the body is whole: a client sending slowly holds no slot
            return message

        async def sending(message):
            held.prompt_built()  # answered (or refused): its prompt is built or will not be
            await send(message)

        try:
            await self.app(scope, limited, sending)
        finally:
            held.end()


def trim_heap() -> None:
    """Hands freed heap memory back to the kernel (glibc's malloc_trim; nothing elsewhere)."""
    if _libc is not None:
        _libc.malloc_trim(0)


_libc = ctypes.CDLL("libc.so.6") if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc" else None


def http_protocol(header_timeout_s: float) -> type:
    """uvicorn's h11 protocol, closing a connection whose request head takes longer than `header_timeout_s`."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadline(H11Protocol):
        _deadline = None  # asyncio.TimerHandle while a request head is awaited

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._deadline is None and self.conn.their_state is h11.IDLE:  # the first byte of a next request
                self._arm()
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the head is in (or the connection failed)
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._deadline = self.loop.call_later(header_timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                log.info(
                    "closed a connection from %s: no whole request head within %g s (--header-timeout)",
                    self.client,
                    header_timeout_s,
                )
                self.transport.close()

    return HeaderDeadline
