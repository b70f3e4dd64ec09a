"""The OpenAI-compatible HTTP server: the app factory, its routes and `serve_main` (state.py: what they share).

Routes (OpenAI's schema, so the official `openai` client works unchanged):
  GET  /v1/models, /v1/models/{id}
  POST /v1/chat/completions          JSON or SSE (stream=true)
  POST /v1/completions               JSON or SSE
  POST /v1/responses                 JSON or SSE: the Responses API over the chat route (responses.py)
  GET  /metrics                      flat JSON counters (server/…, chat/…, engine/…)
  GET  /health                       {"status": "ok"}; 503 naming the error if the engine thread stopped
  POST /update_weights_from_disk     {"model_path": DIR}: load a HF checkpoint into the engine between
                                     two steps (SGLang's endpoint; the external rollout backend's
                                     `weight_sync: disk`) -> {"success": true, "version": N}; off (403)
                                     unless `Access.weight_updates` (--enable-weight-updates)
Sessions (agent rollouts for training): the same three POST routes under
`/sessions/{session_id}/v1/…` record every completion of the session as
token-level trajectories with loss masks (`exactrl.chat.trajectory`);
  GET    /sessions/{session_id}/trajectories
  DELETE /sessions/{session_id}     (drops its record, including requests still running)
An agent only needs `base_url=<server>/sessions/<id>/v1`. A session exists
from the start of its first request whose fields are valid (one that then
fails, on its history say, or is cancelled leaves it empty: its trajectories
are `[]`) until it is deleted, or
until no request has used it for `session_ttl_s` seconds (`--session-ttl`,
default an hour; 0 keeps sessions forever): a trainer that crashed never
deletes its sessions, and a long-running server would keep them all. A
session with a request running is never dropped; the count of dropped ones
is `server/sessions_expired`. A request under a dropped session's id starts a
new, empty session.

Errors are OpenAI's error JSON: 400 for malformed JSON, missing or invalid
fields, prompts beyond the context, non-monotonic histories (and `logprobs`
with `stream=true` on /v1/completions: its alternatives are scored after
generation); 404 for an unknown model or route; 409 `weights_changed` when
top logprobs or echo would be scored under weights that did not sample the
tokens; 500 (the server stays up) for anything unexpected. API keys, the Host
check and the body limit (401, 400, 413) are guard.py's. A client that
leaves before a JSON answer is logged as 499 and its generation aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from exactrl.server import chat as chat_api
from exactrl.server import completions as completions_api
from exactrl.server import responses as responses_api
from exactrl.server.errors import install_error_handlers
from exactrl.server.guard import Access, http_protocol, install_guards, is_loopback
from exactrl.server.schemas import APIError, ChatCompletionRequest, CompletionRequest, UpdateWeightsFromDiskRequest
from exactrl.server.state import _BYTE_OF, ServerConfig, ServerState  # noqa: F401 (re-exported)

log = logging.getLogger("exactrl.server")


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI app over a ServerState; the engine thread runs for the app's lifetime."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.loop.start()
        yield
        state.loop.stop()

    app = FastAPI(title="exactrl", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.exactrl = state
    install_error_handlers(app, state)
    install_guards(app, state.config.access, state.count)
    _add_status_routes(app, state)
    _add_generation_routes(app, state)
    _add_weight_routes(app, state)
    _add_session_routes(app, state)
    return app


def _model_card(state: ServerState) -> dict:
    return {
        "id": state.config.model_name,
        "object": "model",
        "created": int(state.started),
        "owned_by": "exactrl",
        "max_model_len": state.context_limit,
    }  # a request's prompt + max_tokens, at most


def _add_status_routes(app: FastAPI, state: ServerState) -> None:
    """/health, /metrics and the model list (the served model and its aliases)."""

    @app.get("/health")
    async def health():
        if state.loop.error is not None:  # the engine thread is gone: a load balancer should stop sending
            return JSONResponse({"status": "error", "error": str(state.loop.stopped_error())}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/sessions/{session_id}/v1/models")
    async def session_models(session_id: str):
        return await models()

    @app.get("/v1/models/{model_id:path}")  # a path: the default id is the model directory's
    async def model(model_id: str):
        return state.check_model(model_id) or _model_card(state)  # 404 model_not_found unless it or an alias

    @app.get("/metrics")
    async def metrics():
        return state.metrics()


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    """Chat completions, completions and Responses, alone or as a turn of a session (/sessions/{id}/v1/...)."""

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await chat_api.chat_completions(state, body, request)

    @app.post("/v1/completions")
    async def complete(body: CompletionRequest, request: Request):
        return await completions_api.completions(state, body, request)

    @app.post("/v1/responses")
    async def respond(body: responses_api.ResponsesRequest, request: Request):
        return await responses_api.responses(state, body, request)

    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def session_chat(session_id: str, body: ChatCompletionRequest, request: Request):
        return await chat_api.chat_completions(state, body, request, session_id)

    @app.post("/sessions/{session_id}/v1/completions")
    async def session_complete(session_id: str, body: CompletionRequest, request: Request):
        return await completions_api.completions(state, body, request, session_id)

    @app.post("/sessions/{session_id}/v1/responses")
    async def session_respond(session_id: str, body: responses_api.ResponsesRequest, request: Request):
        return await responses_api.responses(state, body, request, session_id)


def _add_weight_routes(app: FastAPI, state: ServerState) -> None:
    """POST /update_weights_from_disk: swaps the served weights where access allows it, a 403 naming the flag
    otherwise."""
    if state.config.access.weight_updates:

        @app.post("/update_weights_from_disk")
        async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest):
            version = await state.load_weights(body.model_path)
            return {"success": True, "message": f"loaded {body.model_path}", "version": version}
    else:

        @app.post("/update_weights_from_disk")
        async def update_weights_off():
            raise APIError(
                403,
                "POST /update_weights_from_disk is off on this server (it swaps the served weights): "
                "start it with exactrl serve --enable-weight-updates",
                code="weight_updates_disabled",
            )


def _add_session_routes(app: FastAPI, state: ServerState) -> None:
    """A session's recorded trajectories, and dropping it."""

    @app.get("/sessions/{session_id}/trajectories")
    async def trajectories(session_id: str):
        state.expire_sessions()
        if session_id not in state.sessions:
            ttl = state.config.session_ttl_s
            raise APIError(
                404,
                f"no session {session_id!r} (it was never used, was deleted, or"
                + (f" was dropped after {ttl:g} s without a request: --session-ttl)" if ttl else ")"),
                param="session_id",
                code="session_not_found",
            )
        return {
            "session_id": session_id,
            "trajectories": [t.to_json() for t in state.sessions[session_id].trajectories()],
        }

    @app.delete("/sessions/{session_id}")
    async def drop_session(session_id: str):
        return {"session_id": session_id, "deleted": state.sessions.pop(session_id, None) is not None}


# ---------------------------------------------------------------- running it
class ServerThread:
    """uvicorn in a background thread on an already-bound loopback socket (tests, benchmarks, rollouts)."""

    def __init__(
        self,
        app: FastAPI,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        header_timeout_s: float = 10.0,
    ):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = uvicorn.Server(
            uvicorn.Config(app, log_level=log_level, timeout_keep_alive=30, http=http_protocol(header_timeout_s))
        )
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])), name="exactrl-http", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        t0 = time.time()
        while not self.server.started:
            if not self._thread.is_alive() or time.time() - t0 > timeout:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
        self.sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def build_state(
    model_dir: str,
    tokenizer_dir: str | None = None,
    dtype: str = "float32",
    kernels: str = "exact",
    monotonicity: str = "raise",
    model_name: str | None = None,
    session_ttl_s: float = 3600.0,
    access: Access = Access(),
    device: str = "cpu",
    backend: str | None = None,
    **engine_kwargs,
) -> ServerState:
    """Loads model + tokenizer from disk and wraps them in an engine and a ServerState (the model on `device`
    with `backend`, as `load_model` takes them)."""
    import exactrl
    from exactrl.engine import Engine

    # first: a bad --model is named as such
    model = exactrl.load_model(model_dir, dtype=dtype, kernels=kernels, device=device, backend=backend)
    tok = exactrl.load_tokenizer(tokenizer_dir or model_dir)
    tok.check_fits(model.config.vocab_size, "--tokenizer" if tokenizer_dir else "--model")
    engine = Engine(model, stop_token_ids=sorted(tok.stop_token_ids), **engine_kwargs)
    name = model_name or str(model_dir)
    return ServerState(
        engine,
        tok,
        ServerConfig(
            name, aliases=(Path(model_dir).name,), monotonicity=monotonicity, session_ttl_s=session_ttl_s, access=access
        ),
    )


def serve_main(args) -> int:
    """`exactrl serve`: blocks serving until interrupted."""
    import uvicorn

    logging.basicConfig(level=logging.INFO)
    _check_listen(args.host, args.port)  # before the model loads: a typo is named in a second, not a minute
    access = access_of(args)
    state = build_state(
        args.model,
        args.tokenizer,
        args.dtype,
        args.kernels,
        args.monotonicity,
        session_ttl_s=args.session_ttl,
        access=access,
        device=args.device,
        backend=args.backend,
        kv_budget_tokens=args.kv_budget_tokens,
        max_num_seqs=args.max_num_seqs,
    )
    log.info(
        "serving %s (%s, %s kernels, monotonicity=%s, session ttl %d s) on http://%s:%d",
        state.config.model_name,
        args.dtype,
        args.kernels,
        args.monotonicity,
        args.session_ttl,
        args.host,
        args.port,
    )
    if not access.api_keys and not is_loopback(args.host):
        log.warning(
            "listening on %s without an API key: anyone who reaches the port can use this server; "
            "set EXACTRL_API_KEY or --api-key",
            args.host,
        )
    uvicorn.run(
        create_app(state), host=args.host, port=args.port, log_level="info", http=http_protocol(args.header_timeout)
    )
    return 0


def access_of(args) -> Access:
    """`exactrl serve`'s access flags: keys from --api-key, else EXACTRL_API_KEY (comma-separated); on a loopback
    bind only this machine's names as Host (DNS rebinding), plus --allowed-hosts; on another bind, the
    --allowed-hosts if any are given."""
    import os

    from exactrl.server.guard import LOOPBACK_HOSTS, parse_keys

    keys = tuple(args.api_key or ()) or parse_keys(os.environ.get("EXACTRL_API_KEY"))
    extra = tuple(h.strip() for hosts in args.allowed_hosts or () for h in hosts.split(",") if h.strip())
    hosts = LOOPBACK_HOSTS + extra if is_loopback(args.host) else extra or None
    if args.weights_root is not None and not args.enable_weight_updates:
        raise ValueError("--weights-root only applies with --enable-weight-updates")
    if args.weights_root is not None and not Path(args.weights_root).is_dir():
        raise ValueError(f"--weights-root {args.weights_root!r} is not a directory")
    return Access(
        api_keys=keys,
        allowed_hosts=hosts,
        max_body_bytes=int(args.max_body_mb * 2**20),
        weight_updates=args.enable_weight_updates,
        weights_root=args.weights_root,
    )


def _check_listen(host: str, port: int) -> None:
    """ValueError naming --host / --port unless a socket can listen there now (SO_REUSEADDR, as uvicorn)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(addr)
    except (OSError, UnicodeError) as e:  # socket.gaierror is an OSError
        raise ValueError(f"cannot listen on --host {host!r} --port {port}: {e}") from None
