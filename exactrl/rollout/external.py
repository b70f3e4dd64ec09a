"""The external-engine rollout backend: any OpenAI-compatible server that returns token ids and logprobs.

    generate        one POST {server}/v1/completions per prompt (token-id prompt, n samples),
                    at most `max_concurrency` in flight per server  ->  exactrl Completions
    update_weights  weight_sync none: the version is only noted
                    weight_sync disk: HF checkpoint (exactrl.save_model) -> POST {server}/update_weights_from_disk
                    to every server

Many servers (`base_url` plus `base_urls`, e.g. one per machine): each
request goes to the server with the fewest requests in flight, and a disk
weight sync writes the checkpoint once and has every server load it before
the next batch (`sync_dir` must then be a path all of them read, e.g. a
shared filesystem). Which server samples a prompt changes nothing in what
is sampled when the servers are `exactrl serve` with `exact` kernels on
machines of one kind: a request's tokens depend only on its seed and the
weights (docs/design.md §1), so a run over two servers logs the metrics of a
run over one, bitwise (tested).

`ExternalEngine` has the surface the training loops use of `exactrl.Engine`
(`generate`, `update_weights`, `version`, `stats`), so the loops, the
evaluation and the asynchronous rollout thread run unchanged over it
(docs/design.md §9: external engines through their OpenAI-compatible APIs).

One dialect for every server. The request carries the prompt as token ids,
`n`, `max_tokens`, `temperature`, `top_p`, `seed`, `logprobs: 0` (the
sampled token's own logprob, no alternatives: vLLM, SGLang and exactrl all
read 0 that way, and exactrl would recompute alternatives with an extra
forward for anything above), `return_token_ids: true` (vLLM >= 0.10.2) and
the vLLM-style extras `top_k` (omitted when off), `stop_token_ids` and
`ignore_eos` (`seed` is sent when the params hold one). The
answer is read from whichever of these a choice holds:
  exactrl serve  `generation_token_ids` + `generation_log_probs`
  vLLM           `token_ids` + `logprobs.token_logprobs`
  SGLang         `meta_info.output_token_logprobs`: (logprob, token id, text) triples
A server that returns neither token ids nor their logprobs is an error:
re-tokenizing the text would not give back the sampled tokens (a string has
many tokenizations), and the run would silently train on tokens nobody
sampled. A server that echoes `prompt_token_ids` must echo ours unchanged.
Each token id must lie in the trainer's vocabulary and each logprob be a
finite number <= 0 (up to `LOGPROB_SLACK` of another engine's rounding);
anything else is an `ExternalEngineError` naming the server, the prompt and
the field, before the batch reaches the trainer.

Mismatch. The server's logprobs are the behaviour policy μ; the trainer
recomputes π_old itself, so `train/train_rollout_logprob_abs_diff` and the
`mismatch/` diagnostics measure the gap and `algorithm.corrections` (token
TIS, masked IS, ...) correct it. Through `exactrl serve` with `exact`
kernels and `weight_sync: disk` the gap is 0.0, bitwise (tested): the HTTP
path loses nothing. vLLM reports logprobs of the raw logits unless started
with `--logprobs-mode processed_logprobs`; with temperature != 1 or top-k /
top-p, start it so, or the measured gap includes the temperature.

Versions. Every token is tagged with the version of the weights the server
is known to hold (`version`, the trainer's numbering: training steps).
`weight_sync: none`: the server keeps the weights it was started with, all
tokens carry version 0 (also after a resume), and `update_weights` only notes the
trainer's version (`external/trainer_version`). The data then grows staler
every step: the synchronous loop's mismatch metrics show it growing, and the
asynchronous loop's `drop_stale` refuses it once it is older than
`async.max_staleness` (so an asynchronous run that would get there is refused
when its config is read). `weight_sync: disk`: the weights are written as a
Hugging Face checkpoint into `sync_dir` (which the server must see under the
same path) and loaded by the server's `update_weights_from_disk` (SGLang's
endpoint, also `exactrl serve`'s; vLLM has none, so it runs with `none`).
The server is loaded with the trainer's weights when the run starts, so
`version` is known from the first batch on, also after a resume. A lock
keeps a weight sync from overlapping a batch. In-flight updates are
impossible (there is no hook between the server's steps): `on_step` is
refused.
"""

from __future__ import annotations

import copy
import json
import os
import queue
import shutil
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from exactrl.engine.engine import Completion
from exactrl.engine.sampling import SamplingParams, params_per_prompt
from exactrl.model import save_model
from exactrl.model.transformer import CausalLM
from exactrl.rollout.settings import RolloutBackendSettings  # noqa: F401 (re-exported)

FP32_MAX = torch.finfo(torch.float32).max
# a sampled token's logprob is <= 0, and a log-softmax computed as (x - max) - log(sum) keeps it there in any
# order; another engine's fused kernel (an approximate exp, a log-sum-exp taken apart from the max) can land a
# near-certain token a few ulps above 0. Up to this much is that rounding (and is passed on as it is), beyond
# it the number is no logprob
LOGPROB_SLACK = 1e-5


class ExternalEngineError(RuntimeError):
    """The server failed, timed out, was unreachable, or answered without what exactness needs."""


class ExternalEngine:
    """exactrl.Engine's rollout surface over an OpenAI-compatible HTTP server."""

    step_hook = False  # a RolloutBackend (exactrl/rollout/backend.py): the server has no hook between its steps

    def __init__(
        self,
        s: RolloutBackendSettings,
        stop_token_ids=(),
        version: int = 0,
        policy: CausalLM | None = None,
        vocab_size: int | None = None,
    ):
        """`policy`: a copy of the policy model, used only to write `disk` checkpoints (required then).
        `vocab_size`: the trainer's; a token id the server returns outside [0, vocab_size) is an error
        (None: only a negative one)."""
        if s.kind != "openai":
            raise ValueError(f"ExternalEngine needs rollout_backend.kind=openai, got {s.kind!r}")
        if s.weight_sync == "disk" and policy is None:
            raise ValueError("weight_sync=disk needs the policy model to write checkpoints")
        self.s = s
        self.servers = s.server_roots
        self.base_url = self.servers[0]
        self.stop_token_ids = frozenset(stop_token_ids)  # sent with every request, as the in-process engine's
        self.vocab_size = vocab_size
        self.version = version  # weights the server is known to hold (the trainer's numbering)
        self.trainer_version = version  # newest version offered by update_weights
        self._policy = policy
        self._tmp = tempfile.TemporaryDirectory(prefix="exactrl-weights-") if s.weight_sync == "disk" else None
        self._sync_dir = Path(s.sync_dir) if s.sync_dir else Path(self._tmp.name) if self._tmp else None
        self._last_ckpt: Path | None = None
        key = s.api_key or os.environ.get("EXACTRL_API_KEY", "").split(",")[0].strip()
        self._client = httpx.Client(
            timeout=s.timeout_s,
            headers={"Authorization": f"Bearer {key}"} if key else {},
            limits=httpx.Limits(max_connections=s.max_concurrency * len(self.servers)),
        )
        self._lock = threading.Lock()  # a weight sync never overlaps a batch: every token's version is known
        self._in_flight = [0] * len(self.servers)  # requests now at each server (least-loaded dispatch)
        self._served = [0] * len(self.servers)  # requests each server has answered
        self._dispatch = threading.Lock()
        self._stats = {
            "external/requests": 0,
            "external/request_s": 0.0,
            "external/weight_syncs": 0,
            "external/weight_sync_s": 0.0,
        }

    @classmethod
    def connect(
        cls, s: RolloutBackendSettings, policy: CausalLM, stop_token_ids=(), version: int = 0
    ) -> ExternalEngine:
        """The backend of a run: with `disk`, the server is first loaded with the policy's current weights."""
        own = copy.deepcopy(policy).requires_grad_(False) if s.weight_sync == "disk" else None
        engine = cls(s, stop_token_ids, version, own, vocab_size=policy.config.vocab_size)
        if own is not None:
            engine._push(policy.state_dict(), version)
        else:  # `none`: the server holds the weights it was started with, version 0, also after a resume
            engine.version = 0
        return engine

    def close(self) -> None:
        self._client.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    # ------------------------------------------------------------ generation
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None, on_step=None
    ) -> list[list[Completion]]:
        """Blocking: outs[k][j] is sample j of prompt k, every token tagged with `version`."""
        if on_step is not None:
            raise ValueError(
                "in-flight weight updates (async.inflight_updates) need the in-process engine: an "
                "external server has no hook between its steps"
            )
        plist = params_per_prompt(params, len(prompts))
        bodies = [self.request_body(p, sp) for p, sp in zip(prompts, plist)]
        with self._lock:
            version, t0 = self.version, time.perf_counter()
            answers = self._map(self._complete, bodies)
            self._stats["external/requests"] += len(bodies)
            self._stats["external/request_s"] += time.perf_counter() - t0
        return [
            to_completions(a, list(p), sp, version, f"{server}/v1/completions (prompt {k})", self.vocab_size)
            for k, ((server, a), p, sp) in enumerate(zip(answers, prompts, plist))
        ]

    def _complete(self, body: dict) -> tuple[str, dict]:
        """One completion request, sent to the server with the fewest in flight: (server, answer)."""
        with self._dispatch:
            i = min(range(len(self.servers)), key=lambda j: self._in_flight[j])
            self._in_flight[i] += 1
        try:
            answer = self._post(self.servers[i], "/v1/completions", body)
        finally:
            with self._dispatch:
                self._in_flight[i] -= 1
        with self._dispatch:
            self._served[i] += 1
        return self.servers[i], answer

    def request_body(self, prompt: list[int], sp: SamplingParams) -> dict:
        """The one request dialect (see the module docstring)."""
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else self.stop_token_ids)
        body = {
            "model": self.s.model,
            "prompt": list(prompt),
            "n": sp.n,
            "max_tokens": sp.max_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "logprobs": 0,
            "return_token_ids": True,
            "stop_token_ids": sorted(stops),
            "ignore_eos": sp.ignore_eos,
        }
        if sp.top_k != -1:
            body["top_k"] = sp.top_k
        if sp.seed is not None:
            body["seed"] = sp.seed
        return body

    def _map(self, fn, items: list) -> list:
        """fn over items on up to `max_concurrency` threads per server, results in order. The first error,
        or a Ctrl-C, is raised at once: requests not yet sent are dropped, and those in flight are left to
        daemon threads that neither this call nor the interpreter's exit waits for (up to `timeout_s`)."""
        if not items:
            return []
        todo, finished = queue.SimpleQueue(), threading.Semaphore(0)
        for k in range(len(items)):
            todo.put(k)
        results, errors = [None] * len(items), []

        def work():
            while not errors:
                try:
                    k = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    results[k] = fn(items[k])
                except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                    errors.append(e)
                finally:
                    finished.release()

        for _ in range(min(self.s.max_concurrency * len(self.servers), len(items))):
            threading.Thread(target=work, name="exactrl-http", daemon=True).start()
        for _ in items:
            finished.acquire()  # a Ctrl-C interrupts the wait
            if errors:
                raise errors[0]
        return results

    def _post(self, server: str, path: str, body: dict) -> dict:
        url = f"{server}{path}"
        deadline = time.monotonic() + self.s.timeout_s
        chunks = None  # a list once the server has answered: a transport error then is not "cannot reach"
        try:
            with self._client.stream("POST", url, json=body) as r:
                chunks = []
                for chunk in r.iter_bytes():  # httpx's timeout is per read: a trickling answer never ended
                    chunks.append(chunk)
                    if time.monotonic() > deadline:
                        raise httpx.ReadTimeout("the whole answer took longer")
        except httpx.TimeoutException as e:
            raise ExternalEngineError(
                f"{url}: no answer within rollout_backend.timeout_s={self.s.timeout_s}s ({type(e).__name__})"
            ) from None
        except httpx.TransportError as e:
            if chunks is not None:
                raise ExternalEngineError(
                    f"the rollout server at {url} answered HTTP {r.status_code}, then the "
                    f"connection broke mid-answer ({type(e).__name__}: {e}): did it crash or "
                    f"restart?"
                ) from None
            if not isinstance(e, httpx.ConnectError):  # connected, and the connection broke before an answer
                raise ExternalEngineError(
                    f"the connection to the rollout server at {url} broke before an answer "
                    f"({type(e).__name__}: {e}): did it crash or restart?"
                ) from None
            raise ExternalEngineError(
                f"cannot reach the rollout server at {url}: {type(e).__name__}: {e} (is it "
                f"running? rollout_backend.base_url / base_urls)"
            ) from None
        except httpx.DecodingError as e:
            raise ExternalEngineError(
                f"{url} answered with a body that cannot be decoded as its "
                f"Content-Encoding {r.headers.get('content-encoding')!r} says: {e}"
            ) from None
        data = b"".join(chunks)
        text = data.decode(r.encoding, errors="replace")
        if r.status_code != 200:
            raise ExternalEngineError(f"{url} answered HTTP {r.status_code}: {text[:1000]}")
        try:
            return json.loads(data)
        except (ValueError, RecursionError):  # RecursionError: JSON nested too deep
            raise ExternalEngineError(f"{url} answered with a body that is not JSON: {text[:200]!r}") from None

    # ------------------------------------------------------------ weights
    def update_weights(self, state_dict, version: int | None = None) -> int:
        """`disk`: hands the weights to the server, whose tokens are then `version`; `none`: notes it only.

        Returns the version the server holds (unchanged with `none`). `version`, if given, must
        increase, as for `Engine.update_weights`.
        """
        if version is not None and not (isinstance(version, int) and version > self.trainer_version):
            raise ValueError(f"version must be an int above {self.trainer_version}, got {version!r}")
        self.trainer_version = self.trainer_version + 1 if version is None else version
        if self.s.weight_sync == "disk":
            self._push(state_dict, self.trainer_version)
        return self.version

    def _push(self, state_dict, version: int) -> None:
        """Writes the weights as a HF checkpoint once and has every server load it; then they are `version`."""
        with self._lock:
            t0 = time.perf_counter()
            self._policy.load_state_dict(state_dict)
            ckpt = self._sync_dir / f"weights-v{version}"
            save_model(self._policy, ckpt)
            body = {"model_path": str(ckpt.resolve())}
            try:
                answers = self._map(lambda server: self._post(server, "/update_weights_from_disk", body), self.servers)
            except ExternalEngineError as e:
                where = (
                    "rollout_backend.sync_dir is unset, so it is a temporary directory of this machine: set "
                    "it to a path every server reads"
                    if self.s.sync_dir is None
                    else "rollout_backend.sync_dir must be a path every server reads"
                )
                raise ExternalEngineError(
                    f"{e} (loading the checkpoint at {ckpt}; if the server could not read it: {where})"
                ) from None
            for server, answer in zip(self.servers, answers):
                if not isinstance(answer, dict) or answer.get("success") is not True:
                    raise ExternalEngineError(f"{server}/update_weights_from_disk did not load {ckpt}: {answer}")
            if self._last_ckpt is not None and self._last_ckpt != ckpt:
                shutil.rmtree(self._last_ckpt, ignore_errors=True)
            self._last_ckpt, self.version = ckpt, version
            self._stats["external/weight_syncs"] += 1
            self._stats["external/weight_sync_s"] += time.perf_counter() - t0

    def stats(self) -> dict[str, float]:
        """Flat gauges and counters for metrics logging."""
        per_server = (
            {f"external/server{i}_requests": n for i, n in enumerate(self._served)} if len(self.servers) > 1 else {}
        )
        return {
            "engine/version": self.version,
            "external/trainer_version": self.trainer_version,
            "external/weight_lag": self.trainer_version - self.version,
            "external/servers": len(self.servers),
            **self._stats,
            **per_server,
        }


# ---------------------------------------------------------------- answers
def to_completions(
    answer: dict, prompt: list[int], sp: SamplingParams, version: int, where: str, vocab_size: int | None = None
) -> list[Completion]:
    """The n choices of one /v1/completions answer, by index, as Completions of `version`; a token id
    outside [0, vocab_size) is an error (the server holds another vocabulary or model)."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    indexes = [c.get("index") if isinstance(c, dict) else None for c in choices or ()]
    # `in range` alone took 0.0 and True for index 0 and 1
    if (
        not isinstance(choices, list)
        or len(choices) != sp.n
        or not all(type(i) is int and i in range(sp.n) for i in indexes)
        or len(set(indexes)) != sp.n
    ):
        raise ExternalEngineError(
            f"{where}: expected `choices` with indexes 0..{sp.n - 1} (n={sp.n}), got {str(answer)[:300]}"
        )
    out = []
    for c in sorted(choices, key=lambda c: c["index"]):
        ids, lps = parse_choice(c, where)
        top = vocab_size if vocab_size is not None else float("inf")
        bad = next((t for t in ids if not 0 <= t < top), None)
        if bad is not None:
            raise ExternalEngineError(
                f"{where}: choice {c['index']} has token id {str(bad)[:40]}, outside the "
                f"trainer's vocabulary [0, {top}): does the server hold the trainer's model?"
            )
        echoed = c.get("prompt_token_ids")
        if echoed is not None and echoed != prompt:
            raise ExternalEngineError(
                f"{where}: the server changed the prompt's tokens (prompt_token_ids "
                f"{str(echoed)[:40]}... vs sent {prompt[:8]}...), e.g. by adding a BOS"
            )
        if c.get("finish_reason") not in ("stop", "length"):
            raise ExternalEngineError(
                f"{where}: choice {c['index']} has finish_reason "
                f"{c.get('finish_reason')!r}, expected 'stop' or 'length'"
            )
        if len(ids) > sp.max_tokens:
            raise ExternalEngineError(f"{where}: choice {c['index']} has {len(ids)} tokens, max_tokens={sp.max_tokens}")
        out.append(Completion(c["index"], list(prompt), ids, lps, [version] * len(ids), c["finish_reason"]))
    return out


def parse_choice(c: dict, where: str) -> tuple[list[int], list[float]]:
    """Generated token ids and their logprobs from one choice, in the dialect of whichever server sent it."""
    try:  # each dialect's fields, as its server sends them; anything else is a malformed answer
        meta = c.get("meta_info") or {}
        if "generation_token_ids" in c:  # exactrl serve
            ids, lps, lp_field = c["generation_token_ids"], c.get("generation_log_probs"), "generation_log_probs"
        elif "token_ids" in c:  # vLLM with return_token_ids
            ids, lp_field = c["token_ids"], "logprobs.token_logprobs"
            lps = (c.get("logprobs") or {}).get("token_logprobs")
        elif "output_token_logprobs" in meta:  # SGLang
            triples = meta["output_token_logprobs"]
            ids, lps, lp_field = [t[1] for t in triples], [t[0] for t in triples], "meta_info.output_token_logprobs"
        else:
            ids = None
    except (TypeError, AttributeError, IndexError, KeyError) as e:
        raise ExternalEngineError(f"{where}: a malformed choice ({type(e).__name__}: {e}): {str(c)[:300]}") from None
    if ids is None:
        raise ExternalEngineError(
            f"{where}: the answer holds no generated token ids (no `generation_token_ids` (exactrl), `token_ids` "
            f"(vLLM >= 0.10.2 with return_token_ids) or `meta_info.output_token_logprobs` (SGLang); the choice "
            f"has {sorted(c)}). The text cannot be re-tokenized instead: that would not give back the sampled "
            f"tokens. Use a server that returns token ids."
        )
    if lps is None:
        raise ExternalEngineError(
            f"{where}: the answer has token ids but no logprobs (`{lp_field}` missing): "
            f"the server must return the sampled tokens' logprobs (request logprobs=0)"
        )
    if not isinstance(ids, list) or not isinstance(lps, list):
        raise ExternalEngineError(
            f"{where}: token ids and `{lp_field}` must be lists, got {str(ids)[:80]} and {str(lps)[:80]}"
        )
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ExternalEngineError(f"{where}: token ids must be integers, got {ids[:8]}")
    if len(lps) != len(ids) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in lps):
        raise ExternalEngineError(
            f"{where}: `{lp_field}` must hold one number per token ({len(ids)} tokens), got {lps[:8]}"
        )
    # NaN reached the trainer as μ and a positive one weighted its token silently; the trainer reads fp32
    bad = next((x for x in lps if not -FP32_MAX <= x <= LOGPROB_SLACK), None)
    if bad is not None:
        raise ExternalEngineError(
            f"{where}: `{lp_field}` holds {str(bad)[:40]}: a sampled token's logprob is a "
            f"finite (fp32) number <= 0 (up to {LOGPROB_SLACK:g} of rounding)"
        )
    return list(ids), [float(x) for x in lps]
