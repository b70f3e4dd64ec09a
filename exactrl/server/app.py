"""The OpenAI-compatible HTTP server: app factory, state, metrics, sessions, `serve_main`.

Routes (OpenAI's schema, so the official `openai` client works unchanged):
  GET  /v1/models, /v1/models/{id}
  POST /v1/chat/completions          JSON or SSE (stream=true)
  POST /v1/completions               JSON or SSE
  GET  /metrics                      flat JSON counters (server/…, chat/…, engine/…)
  GET  /health                       {"status": "ok"}; 503 naming the error if the engine thread stopped
  POST /update_weights_from_disk     {"model_path": DIR}: load a HF checkpoint into the engine between
                                     two steps (SGLang's endpoint; the external rollout backend's
                                     `weight_sync: disk`) -> {"success": true, "version": N}; off (403)
                                     unless `Access.weight_updates` (--enable-weight-updates)
Sessions (agent rollouts for training): the same two POST routes under
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
import collections
import contextlib
import dataclasses
import logging
import re
import reprlib
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from exactrl.chat.splice import POLICIES, Splicer
from exactrl.chat.trajectory import Session
from exactrl.server import chat as chat_api
from exactrl.server import completions as completions_api
from exactrl.server.errors import install_error_handlers
from exactrl.server.guard import Access, http_protocol, install_guards, is_loopback
from exactrl.server.loop import EngineLoop
from exactrl.server.schemas import (APIError, ChatCompletionRequest, CompletionRequest, EngineLimits,
                                    UpdateWeightsFromDiskRequest, context_error)

log = logging.getLogger("exactrl.server")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: printable stand-in character -> byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's piece for one raw byte


@dataclass
class ServerConfig:
    model_name: str  # the id /v1/models lists; requests must name it (or an alias)
    aliases: tuple[str, ...] = ()  # other accepted model names (e.g. the model dir's basename)
    monotonicity: str = "raise"  # default policy for non-monotonic chat histories: raise | split | truncate
    session_ttl_s: float = 3600.0  # a session no request used for this long is dropped; 0: never
    access: Access = field(default_factory=Access)  # API keys, Host check, body limit, weight updates (guard.py)

    def __post_init__(self):
        if self.monotonicity not in POLICIES:
            raise ValueError(f"monotonicity must be one of {list(POLICIES)}, got {self.monotonicity!r}")
        ttl = self.session_ttl_s  # compared with time.monotonic() floats: text, or an int beyond every float,
        # failed in a request (an HTTP 500), not here
        try:
            ok = isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and float(ttl) >= 0
        except OverflowError:
            ok = False
        if not ok:
            raise ValueError(f"session_ttl_s (--session-ttl) must be >= 0 seconds (0: never) and a number a float "
                             f"holds, got {self.session_ttl_s!r:.40}")


class ServerState:
    """Everything the routes share. Lives on the HTTP event loop, except `loop` (the engine thread)."""

    def __init__(self, engine, tokenizer, config: ServerConfig):
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.loop = EngineLoop(engine)
        # ids are checked against the model's vocabulary: it may be larger than the tokenizer's (padded
        # rows, as Qwen's), and every id the engine can sample must come back in as history
        self.limits = EngineLimits(max_n=engine.scheduler.max_num_seqs, vocab_size=engine.vocab_size)
        # every id the engine stops on is a stop token, not text: the tokenizer's and the model's eos ids
        # (generation_config.json lists more, e.g. Llama 3.1's <|eom_id|>, Qwen's <|endoftext|>)
        self.stop_token_ids = sorted(set(tokenizer.stop_token_ids) | {tokenizer.end_of_turn_id}
                                     | engine.stop_token_ids)
        self.splicer = Splicer(tokenizer, vocab_size=engine.vocab_size, stop_token_ids=self.stop_token_ids)
        assert self.splicer.max_token_chars > 0  # read once now (the whole vocabulary), not by the first request
        self.sessions: dict[str, Session] = {}
        self._next_sweep = 0.0  # time.monotonic() of the next look for idle sessions
        self.counters: collections.Counter = collections.Counter()
        self.started = time.time()
        self._token_str: dict[int, str] = {}
        self._token_bytes: dict[int, list[int]] = {}

    # ------------------------------------------------------------ checks
    def check_model(self, name: str) -> None:
        if name != self.config.model_name and name not in self.config.aliases:
            raise APIError(404, f"The model {reprlib.repr(name)} does not exist; this server serves "
                                f"{self.config.model_name!r}",
                           param="model", code="model_not_found")

    @property
    def context_limit(self) -> int:
        """Prompt + generation tokens one request may hold (the model's context, the KV cache's size)."""
        return min(self.engine.max_model_len, self.engine.pool.capacity_tokens)

    def resolve_max_tokens(self, requested: int | None, prompt_len: int, prompt_field: str = "messages",
                           field: str = "max_tokens", default: int | None = None) -> int:
        """The generation's max_tokens: `requested` (the client's `field`), else `default` (None: all the
        room the prompt leaves), capped at that room when the client did not ask."""
        limit, ctx = self.context_limit, self.engine.max_model_len
        if prompt_len >= limit:
            raise context_error(limit, ctx, f", but the prompt has {prompt_len} tokens", prompt_field)
        room = limit - prompt_len
        if requested is None:
            return room if default is None else min(default, room)
        if requested < 1:
            raise APIError(400, f"{field} must be >= 1, got {requested}", param=field)
        if requested > room:
            raise context_error(limit, ctx, f": the prompt has {prompt_len} tokens and {field} is {requested}; "
                                           f"lower {field} to at most {room}", field)
        return requested

    async def load_weights(self, model_path: str) -> int:
        """Reads a HF checkpoint off the event loop, then swaps it into the engine between two steps.

        The checkpoint is loaded in the served model's dtype; its configuration, names and shapes must
        match the served model's; a training checkpoint whose state.json records file digests must match
        them (flipped bytes behind an intact safetensors header load without an error). Returns the
        engine's new version.
        """
        from exactrl.model import load_model, read_config
        from exactrl.train.checkpoint import verify_digests

        if not model_path:  # Path("") is ".": whatever checkpoint the server's working directory holds
            raise APIError(400, "model_path is empty: give the checkpoint's directory", param="model_path")
        if self.config.access.weights_root is not None:
            model_path = self.under_weights_root(model_path)
        served = self.engine.model.config

        def read() -> dict:
            # only weights are copied: a checkpoint of another configuration (the served shapes, another
            # rope_theta) would be served as a model it is not, its trainer computing other logprobs.
            # Checked before its weights are read (load_model names a path that is no directory)
            verify_digests(Path(model_path))  # a ValueError naming the damaged file; False: nothing recorded
            cfg = read_config(model_path) if Path(model_path).is_dir() else served
            diff = [f.name for f in dataclasses.fields(cfg)
                    if f.name not in ("hf", "generation") and getattr(cfg, f.name) != getattr(served, f.name)]
            if diff:
                raise ValueError("its config.json does not match the model served: " + ", ".join(
                    f"{k} is {getattr(cfg, k)!r} there, {getattr(served, k)!r} here" for k in diff[:4]))
            # (load_model refuses a weight that is NaN or inf in the served dtype: every request would fail)
            served_model = self.engine.model  # read onto its device: the engine copies there without a host trip
            model = load_model(model_path, dtype=served_model.dtype, kernels="fast",  # kernels unused
                               device=served_model.device, backend=served_model.kernels.backend)
            return {k: v.detach() for k, v in model.named_parameters()}

        try:
            weights = await asyncio.to_thread(read)
            version = await asyncio.wrap_future(self.loop.update_weights(weights))
        except ValueError as e:
            raise APIError(400, f"cannot load weights from model_path {model_path!r}: {e}",
                           param="model_path") from None
        except OSError as e:  # a path the filesystem refuses (a name too long, no permission): not a 500
            raise APIError(400, f"cannot read model_path {model_path!r:.300}: {e.strerror or e}",
                           param="model_path") from None
        self.count("server/weight_updates")
        return version

    def under_weights_root(self, model_path: str) -> str:
        """`model_path` resolved (symlinks followed) if it lies under --weights-root; else one 400 that says
        nothing of the path (whether it exists, is a file, holds a config): no filesystem oracle."""
        root = Path(self.config.access.weights_root).resolve()
        try:
            path = (root / model_path).resolve()  # an absolute model_path stays itself
        except (OSError, ValueError, RuntimeError):  # a NUL byte, a symlink loop
            path = None
        if path is None or not path.is_relative_to(root):
            raise APIError(400, "model_path must name a checkpoint directory under this server's --weights-root",
                           param="model_path")
        return str(path)

    # ------------------------------------------------------------ helpers
    def session(self, session_id: str) -> Session:
        """The session's record, created by its first request. A request takes it when it starts and
        records into that object, so a DELETE during the request drops the request's record with the
        rest instead of the late record bringing the deleted session back. The request gives it back
        with `release` when it ends (the session is not dropped as idle before)."""
        self.expire_sessions()
        s = self.sessions.setdefault(session_id, Session())
        s.busy += 1
        s.last_used = time.monotonic()
        return s

    def release(self, session: Session | None) -> None:
        if session is not None:
            session.busy -= 1
            session.last_used = time.monotonic()

    def expire_sessions(self) -> None:
        """Drops the sessions no request has used for `session_ttl_s` seconds (looked for at most once
        every ttl/100 s: a request does not scan every session)."""
        ttl, now = self.config.session_ttl_s, time.monotonic()
        if not ttl or now < self._next_sweep:
            return
        self._next_sweep = now + ttl / 100
        idle = [k for k, s in self.sessions.items() if not s.busy and now - s.last_used > ttl]
        for k in idle:
            del self.sessions[k]
        if idle:
            self.count("server/sessions_expired", len(idle))

    def count(self, key: str, n: int = 1) -> None:
        self.counters[key] += n

    def count_generation(self, prompt_ids, choices) -> None:
        self.count("server/prompt_tokens", len(prompt_ids))
        self.count("server/generation_tokens", sum(len(c.token_ids) for c in choices))

    def token_str(self, t: int) -> str:
        """The token's text; "" for an id the model has but the tokenizer does not (padded vocabulary)."""
        s = self._token_str.get(t)
        if s is None:
            s = self._token_str[t] = self.tokenizer.decode([t], skip_special_tokens=False)
        return s

    def token_bytes(self, t: int) -> list[int]:
        """The token's raw bytes (a piece may be part of a UTF-8 character): a byte-level BPE piece's
        characters stand for bytes; a SentencePiece piece is text with '▁' for a space, or a byte
        fallback <0xNN>."""
        b = self._token_bytes.get(t)
        if b is None:
            piece = self.tokenizer.hf.convert_ids_to_tokens(t)
            if piece is None:  # a padded row of the model's vocabulary: no text, no bytes
                b = []
            elif t in self.tokenizer.hf.added_tokens_decoder:
                b = list(self.token_str(t).encode())
            elif self.tokenizer.byte_level:
                b = [_BYTE_OF[ch] for ch in piece] if all(ch in _BYTE_OF for ch in piece) else \
                    list(self.token_str(t).encode())
            elif (m := _BYTE_FALLBACK.fullmatch(piece)) is not None:
                b = [int(m.group(1), 16)]
            else:
                b = list(piece.replace("\u2581", " ").encode())
            self._token_bytes[t] = b
        return b

    def logprob_entry(self, t: int, lp: float, top: list[tuple[int, float]]) -> dict:
        return {"token": self.token_str(t), "logprob": lp, "bytes": self.token_bytes(t),
                "top_logprobs": [{"token": self.token_str(a), "logprob": v, "bytes": self.token_bytes(a)}
                                 for a, v in top]}

    def metrics(self) -> dict:
        s = self.loop.stats
        self.expire_sessions()
        # a C-level copy: worker threads (template rendering) may add a counter meanwhile
        out = dict(sorted(dict.copy(self.counters).items()))
        for k in ("chat/monotonicity_raise", "chat/monotonicity_split", "chat/monotonicity_truncate",
                  "server/sessions_expired"):
            out.setdefault(k, 0)
        out |= s.flat()
        out |= {"server/uptime_s": time.time() - self.started, "server/sessions": len(self.sessions)}
        return out


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

    @app.get("/health")
    async def health():
        if state.loop.error is not None:  # the engine thread is gone: a load balancer should stop sending
            return JSONResponse({"status": "error", "error": str(state.loop.stopped_error())}, status_code=503)
        return {"status": "ok"}

    def model_card() -> dict:
        return {"id": state.config.model_name, "object": "model", "created": int(state.started), "owned_by": "exactrl",
                "max_model_len": state.context_limit}  # a request's prompt + max_tokens, at most

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")  # a path: the default id is the model directory's
    async def model(model_id: str):
        return state.check_model(model_id) or model_card()  # 404 model_not_found unless it or an alias

    @app.get("/metrics")
    async def metrics():
        return state.metrics()

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await chat_api.chat_completions(state, body, request)

    @app.post("/v1/completions")
    async def complete(body: CompletionRequest, request: Request):
        return await completions_api.completions(state, body, request)

    if state.config.access.weight_updates:
        @app.post("/update_weights_from_disk")
        async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest):
            version = await state.load_weights(body.model_path)
            return {"success": True, "message": f"loaded {body.model_path}", "version": version}
    else:
        @app.post("/update_weights_from_disk")
        async def update_weights_off():
            raise APIError(403, "POST /update_weights_from_disk is off on this server (it swaps the served weights): "
                                "start it with exactrl serve --enable-weight-updates", code="weight_updates_disabled")

    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def session_chat(session_id: str, body: ChatCompletionRequest, request: Request):
        return await chat_api.chat_completions(state, body, request, session_id)

    @app.post("/sessions/{session_id}/v1/completions")
    async def session_complete(session_id: str, body: CompletionRequest, request: Request):
        return await completions_api.completions(state, body, request, session_id)

    @app.get("/sessions/{session_id}/v1/models")
    async def session_models(session_id: str):
        return await models()

    @app.get("/sessions/{session_id}/trajectories")
    async def trajectories(session_id: str):
        state.expire_sessions()
        if session_id not in state.sessions:
            ttl = state.config.session_ttl_s
            raise APIError(404, f"no session {session_id!r} (it was never used, was deleted, or" +
                           (f" was dropped after {ttl:g} s without a request: --session-ttl)" if ttl else ")"),
                           param="session_id", code="session_not_found")
        return {"session_id": session_id,
                "trajectories": [t.to_json() for t in state.sessions[session_id].trajectories()]}

    @app.delete("/sessions/{session_id}")
    async def drop_session(session_id: str):
        return {"session_id": session_id, "deleted": state.sessions.pop(session_id, None) is not None}

    return app


# ---------------------------------------------------------------- running it
class ServerThread:
    """uvicorn in a background thread on an already-bound loopback socket (tests, benchmarks, rollouts)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 header_timeout_s: float = 10.0):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_keep_alive=30,
                                                    http=http_protocol(header_timeout_s)))
        self._thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                        name="exactrl-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
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


def build_state(model_dir: str, tokenizer_dir: str | None = None, dtype: str = "float32", kernels: str = "exact",
                monotonicity: str = "raise", model_name: str | None = None, session_ttl_s: float = 3600.0,
                access: Access = Access(), device: str = "cpu", backend: str | None = None,
                **engine_kwargs) -> ServerState:
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
    return ServerState(engine, tok, ServerConfig(name, aliases=(Path(model_dir).name,), monotonicity=monotonicity,
                                                 session_ttl_s=session_ttl_s, access=access))


def serve_main(args) -> int:
    """`exactrl serve`: blocks serving until interrupted."""
    import uvicorn

    logging.basicConfig(level=logging.INFO)
    _check_listen(args.host, args.port)  # before the model loads: a typo is named in a second, not a minute
    access = access_of(args)
    state = build_state(args.model, args.tokenizer, args.dtype, args.kernels, args.monotonicity,
                        session_ttl_s=args.session_ttl, access=access, device=args.device, backend=args.backend,
                        kv_budget_tokens=args.kv_budget_tokens, max_num_seqs=args.max_num_seqs)
    log.info("serving %s (%s, %s kernels, monotonicity=%s, session ttl %d s) on http://%s:%d",
             state.config.model_name, args.dtype, args.kernels, args.monotonicity, args.session_ttl, args.host,
             args.port)
    if not access.api_keys and not is_loopback(args.host):
        log.warning("listening on %s without an API key: anyone who reaches the port can use this server; "
                    "set EXACTRL_API_KEY or --api-key", args.host)
    uvicorn.run(create_app(state), host=args.host, port=args.port, log_level="info",
                http=http_protocol(args.header_timeout))
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
    return Access(api_keys=keys, allowed_hosts=hosts, max_body_bytes=int(args.max_body_mb * 2**20),
                  weight_updates=args.enable_weight_updates, weights_root=args.weights_root)


def _check_listen(host: str, port: int) -> None:
    """ValueError naming --host / --port unless a socket can listen there now (SO_REUSEADDR, as uvicorn)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(addr)
    except (OSError, UnicodeError) as e:  # socket.gaierror is an OSError
        raise ValueError(f"cannot listen on --host {host!r} --port {port}: {e}") from None
