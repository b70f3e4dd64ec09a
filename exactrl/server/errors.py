"""The server's errors as OpenAI's error JSON (app.py's docstring has the policy).

pydantic's validation errors become one message naming the field; a body
FastAPI could not read as JSON is named as such (its own answer is "There was
an error parsing the body" for anything but a syntax error); an unexpected
error in a route becomes a 500 answer on a connection that stays usable. Each
is counted under server/errors_<status>.
"""

from __future__ import annotations

import logging
import sys

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from exactrl.server.schemas import APIError

log = logging.getLogger("exactrl.server")


def _error(status: int, message: str, param=None, code=None) -> JSONResponse:
    return JSONResponse(APIError(status, message, param, code).body(), status_code=status)


def _is_union_tag(x) -> bool:
    """pydantic puts the member of a union it tried into `loc` ("str", "list[int]"): not a field name."""
    return isinstance(x, str) and (x in ("str", "int", "float", "bool", "none") or "[" in x)


def _validation_message(errs: list[dict], content_type: str | None) -> tuple[str, str | None]:
    """One message naming the field and the problem for pydantic's errors (the first field's)."""
    first = errs[0] if errs else {}
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    loc = [x for x in first.get("loc", ()) if x != "body"]
    if not loc:  # the body itself
        if first.get("type") == "missing":
            return "the request body is empty: send a JSON object with the request's fields", None
        if isinstance(first.get("input"), bytes):  # FastAPI reads the body as JSON only under a JSON content type
            sent = f"Content-Type {_short(content_type)}" if content_type else "no Content-Type"
            return f"the request body must be JSON sent with Content-Type: application/json, got {sent}", None
        if first.get("type") == "string_unicode":  # a field name (of the object itself) that is not text
            return f"the request body holds a field name that is not valid Unicode: {_short(first.get('input'))}", None
        return f"the request body must be a JSON object, got {_short(first.get('input'))}", None
    field = str(loc[0])
    if first.get("type") == "missing" and len(loc) == 1:
        return f"missing required field: {field}", field
    same = [err for err in errs if [x for x in err.get("loc", ()) if x != "body"][:1] == [loc[0]]]
    tags = list(dict.fromkeys(x for err in same for x in err.get("loc", ())[2:3] if _is_union_tag(x)))
    if len(tags) > 1:  # no member of a union matched
        return f"{field} must be one of {', '.join(tags)}; got {_short(_top_input(same))}", field
    path = field + "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc[1:] if not _is_union_tag(x))
    # a validator's own ValueError, without pydantic's "Value error, " in front
    msg = first["ctx"]["error"] if "error" in first.get("ctx", {}) else first.get("msg", "invalid value")
    return f"invalid {path}: {msg}; got {_short(first.get('input'))}", field


def _top_input(errs: list[dict]):
    """The whole value of the field (the error whose loc stops at the union member)."""
    for err in errs:
        loc = [x for x in err.get("loc", ()) if x != "body"]
        if len(loc) <= 2:
            return err.get("input")
    return errs[0].get("input")


def _short(value, limit: int = 80) -> str:
    r = repr(value)
    return r if len(r) <= limit else r[:limit] + "..."


def _unreadable_body(cause: BaseException) -> str:
    """What made a JSON body unreadable, for the errors FastAPI answers with "There was an error parsing the
    body" (JSON syntax errors are RequestValidationErrors, `_validation_message`)."""
    if isinstance(cause, UnicodeDecodeError):
        return f"the request body is not valid UTF-8: {cause.reason} (byte {cause.start})"
    if isinstance(cause, RecursionError):
        return "malformed JSON body: arrays or objects nested too deeply to parse"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return f"malformed JSON body: a number of more than {sys.get_int_max_str_digits()} digits"
    return f"malformed JSON body: {type(cause).__name__}: {cause}"


def install_error_handlers(app: FastAPI, state) -> None:
    """Every error as OpenAI's error JSON with its status, counted under server/errors_<status>."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        state.count(f"server/errors_{e.status}")
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        state.count("server/errors_400")
        message, param = _validation_message(e.errors(), request.headers.get("content-type"))
        return _error(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        state.count(f"server/errors_{e.status_code}")
        if e.status_code == 400 and e.__cause__ is not None:  # FastAPI could not read the body as JSON
            return _error(400, _unreadable_body(e.__cause__))
        if e.status_code == 413:  # a chunked body past --max-body-mb (guard.py)
            return _error(413, e.detail, code="request_too_large")
        return _error(e.status_code, f"{request.method} {request.url.path}: {e.detail}")

    def internal(path: str, e: Exception):
        log.exception("internal error on %s", path)
        state.count("server/errors_500")
        return _error(500, f"internal error: {type(e).__name__}: {e}")

    # not an exception handler for Exception: Starlette sends its response and then raises the error again,
    # and the server closes the connection, failing the client's next request on it
    app.add_middleware(_InternalErrors, on_error=internal)


class _InternalErrors:
    """ASGI middleware: an unexpected error in a route becomes a 500 JSON answer and the connection stays
    usable. An error after the response started (a stream) cannot be answered: it is raised."""

    def __init__(self, app, on_error):
        self.app, self.on_error = app, on_error

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as e:  # noqa: BLE001 - answered as a 500
            if started:
                raise
            await self.on_error(scope["path"], e)(scope, receive, send)
