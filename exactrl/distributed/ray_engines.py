"""Rollout engines as Ray actors: many exactrl.Engines, on this machine or across a Ray cluster.

    RayEngines.generate        the prompts are dealt round-robin to the engines (prompt k to engine
                               k mod E), one actor call per engine; completions come back in prompt order
    RayEngines.update_weights  the state dict goes into Ray's object store once; every engine copies it
                               bit for bit (Engine.update_weights) before it samples again

    rollout_backend: {kind: ray, ray: {num_engines: 2, address: null, threads_per_engine: null}}

Exactness (with `exact` kernels; `fast` ones depend on the batch, so there nothing is bitwise
anyway). Each actor builds an exactrl.Engine over the trainer's model definition, with the
trainer's kernels and dtype, from a bitwise copy of its weights (pickled tensors keep every bit).
A request's tokens depend only on its prompt, its seed and the weights, not on what else is in the
batch nor on the thread count (docs/design.md §1), and each prompt's seed follows its place in the
step's batch (rollout/groups.py). So which engine samples a prompt changes nothing: a run over Ray
engines logs the metrics of a run over the in-process engine, bitwise (tested), and μ = π_old
exactly. Across machines this holds where they compute alike (one CPU kind); where they do not,
`train/train_rollout_logprob_abs_diff` and the `mismatch/` diagnostics show it.

Why Ray and not `--nproc`. Data parallelism (`exactrl train --nproc N`, this package's
__init__) gives every rank its own engine and its own copy of the trainer. Ray engines keep one
trainer and add samplers only, on any machine of a Ray cluster (`ray start --head` on one,
`ray start --address HEAD:6379` on the others, exactrl installed on all; then
`rollout_backend.ray.address=auto`). With `address: null` a private Ray instance is started on
this machine for the run and stopped after it.

Departures: the split is static (round-robin), so engines on slower machines set the pace of a
batch; in-flight weight updates (`async.inflight_updates`) are refused, as for external servers:
an actor runs a whole `generate` call before it takes new weights. Asynchronous training without
them works: the rollout thread samples a batch, then loads the newest weights (a lock keeps any
other caller's sync from landing inside a batch, so every token's version is known).

Legend: E engines.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from exactrl.engine.engine import Completion, Engine, NonFiniteLogitsError
from exactrl.engine.sampling import SamplingParams, params_per_prompt
from exactrl.model.checkpoint import build_model
from exactrl.model.config import ModelConfig


class RayEngineSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    num_engines: int = Field(2, ge=1)
    """Engine actors; each samples every E-th prompt of a batch (so at most rollout.prompts_per_step of them)."""
    address: str | None = None
    """None: start a private Ray instance on this machine for the run (or join RAY_ADDRESS if set);
    `auto` or HOST:PORT: join a running Ray cluster (`ray start`), whose machines then host the engines."""
    threads_per_engine: int | None = Field(None, ge=1)
    """torch threads (and Ray CPUs) of each engine; None: the cluster's CPUs divided by num_engines."""
    start_timeout_s: float = Field(300.0, gt=0, le=1e9)
    """How long the engines may take to start (CPUs held by other Ray jobs keep them waiting); at most 1e9 s
    (longer ones overflow Ray's millisecond timer)."""
    call_timeout_s: float = Field(3600.0, gt=0, le=1e9)
    """How long one batch's sampling or one weight load may take on the engines before the run stops with
    an error naming the engine (a stalled actor would otherwise hang the run); at most 1e9 s."""


class RayEngineError(RuntimeError):
    """An engine actor died, did not start in time, or failed while sampling or loading weights."""


# how long a HOST:PORT address may take to accept a TCP connection before it is called unreachable; a live
# cluster answers in milliseconds
PROBE_TIMEOUT_S = 10.0


def _init_ray(ray, s: RayEngineSettings) -> None:
    """Joins the cluster at `s.address` (else RAY_ADDRESS), or starts a private instance ("local": a new one,
    never a `ray start` cluster of this machine, maybe stale). An address without a cluster, or one Ray
    cannot parse, is a ValueError naming where it came from. A HOST:PORT is first probed over TCP: where
    nothing listens, ray.init would retry for many minutes (over 5 measured, Ray 2.60), saying nothing
    but warnings."""
    address = s.address or os.environ.get("RAY_ADDRESS") or "local"
    key = "rollout_backend.ray.address" if s.address else "the environment variable RAY_ADDRESS"
    fix = (
        f"start one (ray start --head) or "
        f"{'leave the address unset for a private instance' if s.address else 'unset RAY_ADDRESS'}"
    )
    host, colon, port = address.rpartition(":")
    if colon and host and port.isdigit() and "://" not in address:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT_S).close()
        except OSError as e:
            raise ValueError(
                f"no Ray cluster at {key}={address!r} (nothing accepts a connection there: {e}): {fix}"
            ) from None
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    except (ConnectionError, ValueError) as e:  # ValueError: an address Ray cannot parse
        raise ValueError(f"no Ray cluster at {key}={address!r} ({e}): {fix}") from None


class EngineActor:
    """One exactrl.Engine in a Ray worker process (wrapped by `ray.remote` in RayEngines)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: str,
        kernels: str,
        block_size: int,
        weights: dict,
        engine_kwargs: dict,
        stop_token_ids: list[int],
        version: int,
        threads: int,
    ):
        torch.set_num_threads(threads)
        self.error: ValueError | None = None  # bad settings: reported by `where` as a ValueError, not a crash
        try:
            model = build_model(config, dtype, kernels, seed=None, block_size=block_size).requires_grad_(False)
            with torch.no_grad():
                model.load_state_dict(weights)  # a copy_ per tensor, same dtype (checked by RayEngines): bitwise
            self.engine = Engine(model, stop_token_ids=stop_token_ids, **engine_kwargs)
        except ValueError as e:
            self.error = e
            return
        self.engine.version = version
        self.desc = f"{dtype}, {kernels} kernels, {threads} thread(s)"

    def where(self) -> str:
        if self.error is not None:
            raise self.error
        return f"{socket.gethostname()} pid {os.getpid()}: {self.desc}"

    def check(self, prompts: list[list[int]], params: list[SamplingParams]) -> None:
        """The whole batch, before any engine samples its share: the ValueError names the prompt's index."""
        for k, (p, sp) in enumerate(zip(prompts, params)):
            try:
                self.engine.check(p, sp)
            except ValueError as e:
                raise ValueError(f"prompts[{k}]: {e}") from None

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[Completion]]:
        return self.engine.generate(prompts, params)

    def update_weights(self, state_dict: dict, version: int) -> int:
        return self.engine.update_weights(state_dict, version=version)


class RayEngines:
    """exactrl.Engine's rollout surface (`generate`, `update_weights`, `version`, `stats`) over E engine actors."""

    step_hook = False  # a RolloutBackend (exactrl/rollout/backend.py): the actors step on their own

    def __init__(
        self, s: RayEngineSettings, model, engine_kwargs: dict, stop_token_ids=(), version: int = 0, log=print
    ):
        try:
            import ray
        except ImportError:
            raise ValueError(
                "rollout_backend.kind=ray needs Ray: pip install 'exactrl[ray]' (in this repo: make dev)"
            ) from None

        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
        if len(dtypes) != 1:  # an actor builds the model in one dtype; loading another would cast the weights
            raise ValueError(f"Ray engines need a model whose parameters share one dtype, got {dtypes}")
        self._ray, self.s, self.actors, self.places, self._closed = ray, s, [], [], False
        self._started = not ray.is_initialized()
        if self._started:
            _init_ray(ray, s)
        try:
            threads = self._threads()
            log(f"starting {s.num_engines} Ray engine(s) of {threads} thread(s) each ...")
            weights = ray.put({k: v.detach() for k, v in model.state_dict().items()})
            actor = ray.remote(EngineActor).options(num_cpus=threads, scheduling_strategy="SPREAD")
            self.actors = [
                actor.remote(
                    model.config,
                    dtypes[0],
                    model.kernels.mode,
                    model.block_size,
                    weights,
                    engine_kwargs,
                    sorted(stop_token_ids),
                    version,
                    threads,
                )
                for _ in range(s.num_engines)
            ]
            starts = [a.where.remote() for a in self.actors]
            ready, _ = ray.wait(starts, num_returns=len(starts), timeout=s.start_timeout_s)
            if len(ready) < len(starts):
                free = ray.available_resources().get("CPU", 0)
                raise RayEngineError(
                    f"{len(starts) - len(ready)} of {len(starts)} Ray engines did not start within "
                    f"rollout_backend.ray.start_timeout_s={s.start_timeout_s:g} s; the cluster has "
                    f"{free:g} CPUs free now (other Ray jobs may hold the rest)"
                )
            self.places = self._get(starts, "starting")
        except BaseException:
            self.close()
            raise
        self.version = version
        self._lock = threading.Lock()  # a weight sync never overlaps a batch: every token's version is known
        self._stats = {
            "ray/engines": s.num_engines,
            "ray/generate_s": 0.0,
            "ray/weight_syncs": 0,
            "ray/weight_sync_s": 0.0,
        }

    def _threads(self) -> int:
        """Threads per engine; refused if the engines cannot all be placed (Ray would wait forever)."""
        s, ray = self.s, self._ray
        per_node = [int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n["Alive"]]
        threads = s.threads_per_engine or max(1, sum(per_node) // s.num_engines)
        if sum(c // threads for c in per_node) < s.num_engines:  # an engine's threads are on one machine
            raise ValueError(
                f"rollout_backend.ray.num_engines={s.num_engines} engines of {threads} thread(s) each "
                f"do not fit the Ray cluster's machines ({', '.join(map(str, per_node))} CPUs): lower "
                f"num_engines or threads_per_engine, or add machines"
            )
        return threads

    def close(self) -> None:
        """Stops the engines, and the Ray instance if this object started it; idempotent. After it, `generate`
        and `update_weights` are refused (with no engine they would return nothing or load nowhere). If Ray
        was already shut down (by the caller who started it), its actors went with it: nothing to kill, and a
        stale handle would raise."""
        if self._ray.is_initialized():
            for a in self.actors:
                self._ray.kill(a)
        self.actors, self._closed = [], True
        if self._started and self._ray.is_initialized():
            self._ray.shutdown()

    def _check_open(self) -> None:
        if self._closed:
            raise RayEngineError("the Ray engines are closed (RayEngines.close): start new ones")

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None, on_step=None
    ) -> list[list[Completion]]:
        """Blocking: outs[k][j] is sample j of prompt k, sampled by engine k mod E."""
        if on_step is not None:
            raise ValueError(
                "in-flight weight updates (async.inflight_updates) need the in-process engine: a Ray "
                "engine runs a whole batch before it takes new weights"
            )
        if not isinstance(prompts, (list, tuple, torch.Tensor)):  # as Engine.generate: before len() fails on it
            raise ValueError(f"prompts must be a list of prompts (lists of token ids), got {type(prompts).__name__}")
        self._check_open()
        plist = params_per_prompt(params, len(prompts))
        E = len(self.actors)
        shares = [list(range(e, len(prompts), E)) for e in range(E)]
        with self._lock:
            t0 = time.perf_counter()
            self._get([self.actors[0].check.remote(prompts, plist)], "checking the batch")  # all engines alike
            busy = [e for e in range(E) if shares[e]]
            calls = [
                self.actors[e].generate.remote([prompts[k] for k in shares[e]], [plist[k] for k in shares[e]])
                for e in busy
            ]
            answers = self._get(calls, "sampling", busy)
            self._stats["ray/generate_s"] += time.perf_counter() - t0
        outs: list[Any] = [None] * len(prompts)
        for e, answer in zip(busy, answers):
            for k, completions in zip(shares[e], answer):
                outs[k] = completions
        return outs

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int | None = None) -> int:
        """Every engine copies the weights bit for bit; returns the new version (as `Engine.update_weights`)."""
        self._check_open()
        with self._lock:
            if version is not None and not (
                isinstance(version, int) and not isinstance(version, bool) and version > self.version
            ):
                raise ValueError(f"version must be an int above the current version {self.version}, got {version!r}")
            version = self.version + 1 if version is None else version
            t0 = time.perf_counter()
            # tensors go detached (no autograd history to pickle); anything else goes as it is, for the engines'
            # own checks to name it as the in-process engine does (not a mapping, not a tensor, a wrong shape)
            if isinstance(state_dict, Mapping):
                state_dict = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in state_dict.items()}
            ref = self._ray.put(state_dict)  # once, for every engine
            self._get([a.update_weights.remote(ref, version) for a in self.actors], "loading weights")
            self.version = version
            self._stats["ray/weight_syncs"] += 1
            self._stats["ray/weight_sync_s"] += time.perf_counter() - t0
        return version

    def stats(self) -> dict[str, float]:
        """Flat gauges and counters for metrics logging."""
        return {"engine/version": self.version, **self._stats}

    def _get(self, refs: list, doing: str, engines: list[int] | None = None) -> list:
        """The results of one call per engine (`engines`: whose, default all in order), taken as the calls
        finish: the first engine to fail ends the wait, so an engine that died is named at once, not after
        the other engines' batches (which may take minutes on a slow machine)."""
        engines = list(range(len(refs))) if engines is None else engines
        waiting, out = dict(zip(refs, engines)), {}
        deadline = time.monotonic() + self.s.call_timeout_s
        while waiting:
            done, _ = self._ray.wait(list(waiting), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                raise RayEngineError(
                    f"{self._where(min(waiting.values()))} did not finish {doing} within "
                    f"rollout_backend.ray.call_timeout_s={self.s.call_timeout_s:g} s (a training "
                    f"run keeps its checkpoints: resume it with --set resume=true)"
                )
            e = waiting.pop(done[0])
            out[e] = self._result(done[0], e, doing)
        return [out[e] for e in engines]

    def _result(self, ref, e: int, doing: str):
        """A finished call's result, with engine e's errors as this module's: a ValueError (bad input) stays a
        ValueError, as does a NonFiniteLogitsError (the weights diverged); any other failure names the engine
        and its place."""
        exc = self._ray.exceptions
        try:
            return self._ray.get(ref)
        except exc.RayTaskError as err:
            if isinstance(err.cause, ValueError):
                raise ValueError(str(err.cause)) from None
            if isinstance(err.cause, NonFiniteLogitsError):  # diverged weights, not a broken engine: the
                raise err.cause from None  # trainer names it as it does the in-process engine's (cli.py)
            raise RayEngineError(f"{self._where(e)} failed while {doing}: {err.cause!r}") from None
        except exc.RayActorError as err:
            hint = (
                ""
                if doing == "starting"
                else " (a training run keeps its checkpoints: resume it with --set resume=true)"
            )
            raise RayEngineError(f"{self._where(e)} died while {doing}: {err}{hint}") from None

    def _where(self, e: int) -> str:
        return f"Ray engine {e}" + (f" ({self.places[e]})" if self.places else "")
