"""What the server's routes share: the served model's config, the engine thread, the sessions and the
counters (`ServerState`), and `ServerConfig`, what `exactrl serve`'s flags set."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import re
import reprlib
import time
from dataclasses import dataclass, field
from pathlib import Path

from exactrl.chat.splice import POLICIES, Splicer
from exactrl.chat.trajectory import Session
from exactrl.server.guard import Access
from exactrl.server.loop import EngineLoop
from exactrl.server.schemas import APIError, EngineLimits, context_error

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
            raise ValueError(
                f"session_ttl_s (--session-ttl) must be >= 0 seconds (0: never) and a number a float "
                f"holds, got {self.session_ttl_s!r:.40}"
            )


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
        self.stop_token_ids = sorted(set(tokenizer.stop_token_ids) | {tokenizer.end_of_turn_id} | engine.stop_token_ids)
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
            raise APIError(
                404,
                f"The model {reprlib.repr(name)} does not exist; this server serves {self.config.model_name!r}",
                param="model",
                code="model_not_found",
            )

    @property
    def context_limit(self) -> int:
        """Prompt + generation tokens one request may hold (the model's context, the KV cache's size)."""
        return min(self.engine.max_model_len, self.engine.pool.capacity_tokens)

    def resolve_max_tokens(
        self,
        requested: int | None,
        prompt_len: int,
        prompt_field: str = "messages",
        field: str = "max_tokens",
        default: int | None = None,
    ) -> int:
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
            raise context_error(
                limit,
                ctx,
                f": the prompt has {prompt_len} tokens and {field} is {requested}; lower {field} to at most {room}",
                field,
            )
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
            diff = [
                f.name
                for f in dataclasses.fields(cfg)
                if f.name not in ("hf", "generation") and getattr(cfg, f.name) != getattr(served, f.name)
            ]
            if diff:
                raise ValueError(
                    "its config.json does not match the model served: "
                    + ", ".join(f"{k} is {getattr(cfg, k)!r} there, {getattr(served, k)!r} here" for k in diff[:4])
                )
            # (load_model refuses a weight that is NaN or inf in the served dtype: every request would fail)
            served_model = self.engine.model  # read onto its device: the engine copies there without a host trip
            model = load_model(
                model_path,
                dtype=served_model.dtype,
                kernels="fast",  # kernels unused
                device=served_model.device,
                backend=served_model.kernels.backend,
            )
            return {k: v.detach() for k, v in model.named_parameters()}

        try:
            weights = await asyncio.to_thread(read)
            version = await asyncio.wrap_future(self.loop.update_weights(weights))
        except ValueError as e:
            raise APIError(
                400, f"cannot load weights from model_path {model_path!r}: {e}", param="model_path"
            ) from None
        except OSError as e:  # a path the filesystem refuses (a name too long, no permission): not a 500
            raise APIError(
                400, f"cannot read model_path {model_path!r:.300}: {e.strerror or e}", param="model_path"
            ) from None
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
            raise APIError(
                400,
                "model_path must name a checkpoint directory under this server's --weights-root",
                param="model_path",
            )
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
                b = (
                    [_BYTE_OF[ch] for ch in piece]
                    if all(ch in _BYTE_OF for ch in piece)
                    else list(self.token_str(t).encode())
                )
            elif (m := _BYTE_FALLBACK.fullmatch(piece)) is not None:
                b = [int(m.group(1), 16)]
            else:
                b = list(piece.replace("\u2581", " ").encode())
            self._token_bytes[t] = b
        return b

    def logprob_entry(self, t: int, lp: float, top: list[tuple[int, float]]) -> dict:
        return {
            "token": self.token_str(t),
            "logprob": lp,
            "bytes": self.token_bytes(t),
            "top_logprobs": [{"token": self.token_str(a), "logprob": v, "bytes": self.token_bytes(a)} for a, v in top],
        }

    def metrics(self) -> dict:
        s = self.loop.stats
        self.expire_sessions()
        # a C-level copy: worker threads (template rendering) may add a counter meanwhile
        out = dict(sorted(dict.copy(self.counters).items()))
        for k in (
            "chat/monotonicity_raise",
            "chat/monotonicity_split",
            "chat/monotonicity_truncate",
            "server/sessions_expired",
        ):
            out.setdefault(k, 0)
        out |= s.flat()
        out |= {"server/uptime_s": time.time() - self.started, "server/sessions": len(self.sessions)}
        return out
