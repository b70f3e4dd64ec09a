"""The rollout engine: continuous batching over the one model, exact logprobs.

A step is: schedule (scheduler.py) -> copy-on-write page copies -> ONE model
forward over every scheduled chunk (prefill chunks and decode tokens mixed) ->
logits for the rows that sample only -> per-row `sampling_logprobs` and a
counter-based draw (sampling.py) -> append, stop, fork, free.

Exactness (docs/design.md §1): with `exact` kernels every logits row is
bitwise what the trainer's whole-sequence forward computes, whatever the batch,
chunking or page placement; the logprob kept for a token is read from the
same `sampling_logprobs` the trainer calls, so engine and trainer agree
bitwise. Weight updates preempt every running sequence, so every token
is sampled from a KV cache computed entirely under the version recorded for it
(`Completion.versions`): token i's logprob equals the trainer's under the
weights of version `versions[i]`.

Legend: N tokens of the step, S scheduled sequences, J pages per sequence,
R sampled rows, V vocabulary.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import threading
from collections.abc import Callable, Mapping

import torch

from exactrl.engine.cache import PagePool
from exactrl.engine.cuda_graph import TritonDecodeGraphs
from exactrl.engine.graph import DecodeGraphs
from exactrl.engine.outputs import Completion, NonFiniteLogitsError, RequestOutput, _Batch, completion_of  # noqa: F401 (re-exported)
from exactrl.engine.sampling import SampleRows, SamplingParams, params_per_prompt, sample_uniform
from exactrl.engine.scheduler import Request, Scheduler, SchedulerOutput, Sequence, Status
from exactrl.kernels import TokenLayout
from exactrl.kernels.linear import PackedWeights, using_packed
from exactrl.model.lora import adapter_weights
from exactrl.model.moe import moe_layers, selected_experts


class Engine:
    """Continuous-batching generator with bitwise-exact logprobs (in `exact` kernel mode)."""

    step_hook = True  # a RolloutBackend (exactrl/rollout/backend.py): generate's on_step runs between steps

    def __init__(
        self,
        model,
        *,
        stop_token_ids=None,
        kv_budget_tokens: int = 16384,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        decode_graphs: bool = True,
    ):
        model.kernels.ensure_built()  # what stepping needs in either kernel mode: a missing compiler is named now
        self.model = model
        self._moe = moe_layers(model)  # its MoE layers, whose selections each step reports (empty if dense)
        cfg = model.config
        self.vocab_size = cfg.vocab_size
        for name, v in (
            ("kv_budget_tokens", kv_budget_tokens),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_num_seqs", max_num_seqs),
            ("max_model_len", max_model_len),
        ):
            if not (v is None and name == "max_model_len") and (type(v) is not int or v < 1):
                raise ValueError(f"Engine {name} must be an int >= 1, got {v!r}")
        if max_model_len is not None and not 1 <= max_model_len <= cfg.context_length:
            raise ValueError(
                f"max_model_len={max_model_len} must be in [1, {cfg.context_length}] (the model's context, "
                f"{cfg.context_source})"
            )
        # prompt + max_tokens of a request must fit in it
        self.max_model_len = max_model_len or cfg.context_length
        # kv_budget_tokens: KV memory in tokens, allocated once (rounded up to whole pages)
        self.pool = PagePool(model, -(-kv_budget_tokens // model.block_size))
        self.scheduler = Scheduler(self.pool, max_num_batched_tokens, max_num_seqs)
        eos = cfg.eos_token_ids
        self._check_ids("the model's eos_token_id (config.json / generation_config.json)", eos)
        self._check_ids("stop_token_ids", sorted(frozenset(stop_token_ids or ())))
        self.stop_token_ids = frozenset(eos) | frozenset(stop_token_ids or ())
        self.version = 0  # incremented by every update_weights
        self._drive_lock, self._driver = threading.Lock(), None  # who runs generate / step now (_driving)
        # packed copies of the weights (fp32 for the native linear, bf16 for oneDNN: kernels/linear.py),
        # packed again by update_weights
        self._packed = PackedWeights()
        # decode_graphs: replay recorded decode steps (engine/graph.py: exact fp32 native kernels; engine/
        # cuda_graph.py: exact triton kernels of a dense model), else run every step's forward eagerly. The
        # same bits either way.
        graphs = next((g for g in (DecodeGraphs, TritonDecodeGraphs) if g.supported(model)), None)
        self._graphs = (
            graphs(
                model,
                self.pool.kv,
                self.pool.scratch_page,
                min(-(-self.max_model_len // model.block_size), self.pool.num_pages),
            )
            if decode_graphs and graphs is not None
            else None
        )
        model.kernels.prepare(model.linear_weights())  # at start, so that no request waits for them
        self._requests: dict[str, Request] = {}
        self._weights_broken: str | None = None  # why stepping is refused: a failed update_weights
        self._seq_ids = itertools.count()  # arrival order of sequences = scheduling priority
        self._request_ids = itertools.count()
        self._unclaimed: list[RequestOutput] = []  # other requests' outputs finished inside generate()

    # ------------------------------------------------------------ requests
    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queues a prompt; returns its id. Raises ValueError (engine untouched) on bad input."""
        params = SamplingParams() if params is None else params
        prompt = self._validate(prompt_token_ids, params, request_id)
        while request_id is None or request_id in self._requests:
            request_id = f"req-{next(self._request_ids)}"
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.stop_token_ids)
        req = Request(request_id, prompt, params, seed, stops, params.branch_flags(self.vocab_size))
        req.seqs = [Sequence(next(self._seq_ids), req, j, list(prompt)) for j in range(params.n)]
        for f in req.seqs[1:]:
            f.status = Status.FORK_WAIT
        req.seqs[0].followers = req.seqs[1:]
        self._requests[request_id] = req
        self.scheduler.add(req.seqs[0])
        return request_id

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises the ValueError `add_request` would raise for this request; queues nothing (a caller that
        splits a batch, e.g. over Ray engines, checks it whole before any part runs)."""
        self._validate(prompt_token_ids, params, None)

    def _validate(self, prompt, params, request_id) -> list[int]:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id is not None and not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id is not None and request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"prompt_token_ids must be a list of token ids, got {type(prompt).__name__}")
        prompt = list(prompt)
        if not prompt:
            raise ValueError("prompt_token_ids is empty")
        self._check_ids("prompt_token_ids", prompt)
        self._check_ids("stop_token_ids", params.stop_token_ids)
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt_token_ids ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{total} exceeds the model's context max_model_len={self.max_model_len}"
            )
        capacity = self.pool.capacity_tokens
        if total > capacity:
            raise ValueError(
                f"prompt_token_ids + max_tokens = {total} exceeds the engine's KV budget of "
                f"{capacity} tokens (raise kv_budget_tokens)"
            )
        if params.n > self.scheduler.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds the engine's max_num_seqs={self.scheduler.max_num_seqs}")
        return prompt

    def _check_ids(self, field: str, ids) -> None:
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"{field} holds {t!r}, not a token id in [0, {self.vocab_size})")

    def abort(self, request_id: str, index: int | None = None) -> bool:
        """Drops a request and frees its pages; False if it is unknown or already finished.

        With `index`, only its sample `index` (a server's stop string ended that one): its pages are
        freed, its finish_reason is "abort", the other samples go on. False if that sample is finished,
        or is sample 0 before its prompt is computed (the other samples will start from it). If it was
        the last one running, the request is finished: the next `step` (or the `generate` waiting for
        it) returns it with every sample's completion."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        if index is not None:
            if not (type(index) is int and 0 <= index < len(req.seqs)):  # not a bool
                raise ValueError(
                    f"index must be a sample of request {request_id!r}, 0..{len(req.seqs) - 1}, got {index!r}"
                )
            seq = req.seqs[index]
            if seq.status is Status.FINISHED or seq.followers:
                return False
            if seq.status is Status.FORK_WAIT:
                req.seqs[0].followers.remove(seq)
            self.scheduler.remove(seq)
            seq.finish_reason = "abort"
            if req.finished:
                del self._requests[request_id]
                self._unclaimed.append(self._output(req))
            return True
        del self._requests[request_id]
        for seq in req.seqs:
            if seq.status is not Status.FINISHED:
                self.scheduler.remove(seq)
        return True

    def has_unfinished(self) -> bool:
        """Requests running, or finished and not yet returned by `step` (finished inside another caller's
        `generate`, or by an abort of their last sample): `while has_unfinished(): step()` sees them all."""
        return bool(self._requests or self._unclaimed)

    def stats(self) -> dict[str, float]:
        """Flat gauges and counters for metrics logging."""
        sch = self.scheduler
        return {
            "engine/version": self.version,
            "engine/num_requests": len(self._requests),
            "engine/num_running": len(sch.running),
            "engine/num_waiting": len(sch.waiting),
            "engine/num_preemptions": sch.num_preemptions,
            "engine/kv_usage": 1.0 - self.pool.num_free / self.pool.num_pages,
        }

    # ------------------------------------------------------------ stepping
    @contextlib.contextmanager
    def _driving(self, what: str):
        """One caller drives the engine at a time: another thread waits its turn; the driving thread itself
        (a `generate` or `step` from inside `on_step`) is refused, as its steps would take the outer call's."""
        if self._driver == threading.get_ident():
            raise RuntimeError(
                f"Engine.{what} called while this thread is already driving the engine (from "
                f"generate's on_step?): add requests with add_request instead"
            )
        with self._drive_lock:
            self._driver = threading.get_ident()
            try:
                yield
            finally:
                self._driver = None

    def step(self) -> list[RequestOutput]:
        """Runs one forward; returns the requests that got tokens or finished in it."""
        with self._driving("step"):
            touched = self._step()
        outs, self._unclaimed = self._unclaimed, []
        return outs + [self._output(r) for r in touched]

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        on_step: Callable[[], object] | None = None,
    ) -> list[list[Completion]]:
        """Blocking: outs[k][j] is sample j of prompt k.

        `on_step` runs before every engine step, on this thread: the place for
        in-flight weight updates (`update_weights` between two steps). If a step
        raises (e.g. NonFiniteLogitsError, or on_step itself), every request of
        this call is aborted before the error propagates; requests added by others
        (`add_request`) keep running. One caller drives the engine at a time: a
        `generate` or `step` from another thread waits for this one to return.
        """
        if not isinstance(prompts, (list, tuple, torch.Tensor)):
            raise ValueError(f"prompts must be a list of prompts (lists of token ids), got {type(prompts).__name__}")
        if on_step is not None and not callable(on_step):
            raise ValueError(f"on_step must be a callable or None, got {on_step!r}")
        plist = params_per_prompt(params, len(prompts))
        for k, (p, sp) in enumerate(zip(prompts, plist)):  # all checked before any is queued
            try:
                self._validate(p, sp, None)
            except ValueError as e:
                raise ValueError(f"prompts[{k}]: {e}") from None
        with self._driving("generate"):
            return self._generate(prompts, plist, on_step)

    def _generate(self, prompts: list[list[int]], plist: list[SamplingParams], on_step) -> list[list[Completion]]:
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        mine = set(ids)
        done: dict[str, list[Completion]] = {}
        try:
            while len(done) < len(ids):
                if on_step is not None:
                    on_step()
                if any(o.request_id in mine for o in self._unclaimed):  # finished by an abort of one sample
                    done |= {o.request_id: o.completions for o in self._unclaimed if o.request_id in mine}
                    self._unclaimed = [o for o in self._unclaimed if o.request_id not in mine]
                gone = [i for i in ids if i not in done and i not in self._requests]
                if gone:  # aborted while we waited (from on_step, another thread): it will never finish
                    raise RuntimeError(f"request {gone[0]!r} of this generate() call was aborted")
                for req in self._step():
                    if req.finished:
                        out = self._output(req)
                        if req.request_id in mine:
                            done[req.request_id] = out.completions
                        else:
                            self._unclaimed.append(out)
        except BaseException:  # the caller gets no ids to claim the rest with: they must not run on unseen
            for i in ids:
                self.abort(i)
            raise
        return [done[i] for i in ids]

    def _step(self) -> list[Request]:
        """One scheduled forward; returns touched requests (finished ones are dropped from the engine)."""
        if not self.scheduler.has_work():  # nothing to compute: finished outputs still go out, weights or not
            return []
        if self._weights_broken:
            raise RuntimeError(self._weights_broken)
        sched = self.scheduler.schedule()
        assert sched.chunks, "work is queued but nothing could be scheduled"
        experts = None
        with torch.inference_mode(), using_packed(self._packed):
            self.pool.copy(sched.copies)
            batch = self._build_batch(sched)
            if batch.decode and self._graphs is not None and self._graphs.applies():
                logits_RV = self._graphs.logits(batch.tokens_N, batch.layout)
            else:
                hidden_ND = self.model(batch.tokens_N, batch.layout, self.pool.kv)
                logits_RV = self.model.logits(hidden_ND[batch.rows_R]) if batch.targets else None
            picked = selected_experts(self.model, self._moe)  # [N, L, K] of a MoE model, else None
            experts = None if picked is None or not batch.targets else picked[batch.rows_R].tolist()
            if batch.targets:
                rows = self._sample_rows(batch.targets)
                tok_R, lp_R = self.model.kernels.sample(logits_RV, rows)
                toks = tok_R.tolist()
                self._check_drawn(toks, batch.targets)
        # only now is the step's work kept: if anything above raised, every chunk is simply
        # computed again by the next step (its KV slots are rewritten with the same values)
        for c in sched.chunks:
            c.seq.num_computed += c.length
        if not batch.targets:
            return []
        return self._commit(batch.targets, toks, lp_R.tolist(), experts)

    def _check_drawn(self, toks: list[int], targets: list[Sequence]) -> None:
        """A row with a NaN or no finite logprob cannot be sampled (`draw` gives it token -1): its requests
        are aborted, the step raises."""
        if min(toks) >= 0:
            return
        ids = sorted({targets[i].request.request_id for i, t in enumerate(toks) if t < 0})
        for rid in ids:
            self.abort(rid)
        raise NonFiniteLogitsError(ids)

    def _build_batch(self, sched: SchedulerOutput) -> _Batch:
        tokens: list[int] = []
        seq_idx: list[int] = []
        pos: list[int] = []
        rows: list[int] = []
        targets: list[Sequence] = []
        for s, c in enumerate(sched.chunks):
            tokens += c.seq.tokens[c.start : c.start + c.length]
            pos += range(c.start, c.start + c.length)
            seq_idx += [s] * c.length
            if c.samples:
                # a leader finishing its prompt samples for all its followers from the same row
                fork = c.seq.followers if c.seq.num_generated == 0 else []
                rows += [len(tokens) - 1] * (1 + len(fork))
                targets += [c.seq] + fork
        J = max(len(c.seq.pages) for c in sched.chunks)
        table = [c.seq.pages + [-1] * (J - len(c.seq.pages)) for c in sched.chunks]
        layout = TokenLayout(torch.tensor(seq_idx), torch.tensor(pos), torch.tensor(table))
        decode = len(tokens) == len(sched.chunks) and rows == list(range(len(tokens)))
        return _Batch(torch.tensor(tokens), layout, torch.tensor(rows, dtype=torch.int64), targets, decode)

    def _sample_rows(self, targets: list[Sequence]) -> SampleRows:
        ps = [s.request.params for s in targets]
        return SampleRows(
            temperature=[float(p.temperature) for p in ps],
            top_k=[p.top_k for p in ps],
            top_p=[float(p.top_p) for p in ps],
            uniform=[sample_uniform(s.request.seed, s.index, len(s.tokens)) for s in targets],
            flags=[s.request.flags for s in targets],
        )

    def _commit(self, targets: list[Sequence], toks: list[int], lps: list[float], experts=None) -> list[Request]:
        touched: dict[str, Request] = {}
        for i, (seq, tok, lp) in enumerate(zip(targets, toks, lps)):
            if experts is not None:
                seq.experts.append(experts[i])
            if seq.followers and seq.num_generated == 0:
                self.scheduler.fork(seq)
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            seq.versions.append(self.version)
            req = seq.request
            if tok in req.stop_ids:
                self.scheduler.finish(seq, "stop")
            elif seq.num_generated >= req.params.max_tokens:
                self.scheduler.finish(seq, "length")
            touched[req.request_id] = req
        for rid, req in touched.items():
            if req.finished:
                del self._requests[rid]
        return list(touched.values())

    def _output(self, req: Request) -> RequestOutput:
        comps = [completion_of(s) for s in req.seqs]
        return RequestOutput(req.request_id, list(req.prompt), comps, req.finished)

    def weights_changed(self) -> None:
        """The model's weights were changed in place by their owner (a trainer whose model this engine
        shares, as the asynchronous loop's evaluation engine does): drops the packed copies made of them.
        Needed because a write through `.data` (ZeRO's broadcast, for one) leaves a weight's version
        counter alone. Only between requests: a running sequence's KV cache holds the old weights
        (`update_weights` recomputes it)."""
        if self._requests:
            raise RuntimeError("weights_changed() with requests running: use update_weights, which recomputes them")
        self._packed.clear()
        if self._graphs is not None:  # they point at the packed copies just dropped
            self._graphs.clear()

    def close(self) -> None:
        """Nothing to release (the KV pool goes with the engine); every rollout backend closes alike
        (rollout/external.py, distributed/ray_engines.py)."""

    # ------------------------------------------------------------ weights
    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int | None = None) -> int:
        """Copies the tensors into the model bit for bit; returns the new version.

        The version becomes `version` if given (a trainer numbering policies by
        its step; it must increase), else the current one plus 1.

        Every running sequence is preempted: its KV cache was computed under the
        old weights, so it is recomputed, and the tokens sampled from now on
        are exactly the new policy's. Names are the model's parameter names (HF
        names); a tied model ignores `lm_head.weight`. A model with LoRA adapters
        (model/lora.py) takes either every parameter or its adapters alone (`lora_A`,
        `lora_B`: what a LoRA run trains and syncs; the base weights stay). All names,
        shapes and dtypes are checked before anything is copied (a dtype cast would
        not be bitwise).
        """
        if not isinstance(state_dict, Mapping):
            raise ValueError(
                f"state_dict must be a mapping of parameter name -> tensor, got {type(state_dict).__name__}"
            )
        params = dict(self.model.named_parameters())
        tied = self.model.config.tie_word_embeddings
        sd = {k: v for k, v in state_dict.items() if not (tied and k == "lm_head.weight")}
        if version is not None and not (
            isinstance(version, int) and not isinstance(version, bool) and version > self.version
        ):
            raise ValueError(f"version must be an int above the current version {self.version}, got {version!r}")
        adapters = set(adapter_weights(self.model))
        if adapters and sd and set(sd) <= adapters:  # the adapters alone: all of them
            missing = sorted(adapters - set(sd))
            if missing:
                raise ValueError(
                    f"state_dict holds some of the model's LoRA adapters but not {missing[:5]}: pass every "
                    f"adapter (exactrl.model.lora.adapter_weights) or every parameter"
                )
        else:
            missing, unexpected = sorted(set(params) - set(sd)), sorted(set(sd) - set(params))
            if missing or unexpected:
                raise ValueError(
                    f"state_dict does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
                )
        for k, v in sd.items():
            _check_weight(k, v, params[k])
        try:
            with torch.no_grad():
                for k, v in sd.items():
                    params[k].copy_(v.detach())
        except BaseException as e:  # some weights are new, some old: nothing may be sampled from that
            self.scheduler.preempt_all()
            self._packed.clear()
            if self._graphs is not None:
                self._graphs.clear()
            self._weights_broken = (
                f"the engine's weights are partly updated: update_weights failed copying them "
                f"({type(e).__name__}: {e}); call update_weights again with a whole state_dict"
            )
            raise
        self._weights_broken = None
        # packed again in place, so the decode graphs that point at the packed copies stay valid
        self._packed.refresh([params[k] for k in sd])
        if self._graphs is not None:
            self._graphs.weights_updated()
        self.version = self.version + 1 if version is None else version
        self.scheduler.preempt_all()
        return self.version


def _check_weight(k: str, v, p: torch.Tensor) -> None:
    """`update_weights`' rule for one tensor: a plain dense tensor of the parameter's shape, dtype and device."""
    if not isinstance(v, torch.Tensor):
        raise ValueError(f"state_dict[{k!r}] is a {type(v).__name__}, not a tensor")
    if tuple(v.shape) != tuple(p.shape):
        raise ValueError(f"state_dict[{k!r}] has shape {tuple(v.shape)}, expected {tuple(p.shape)}")
    if v.dtype != p.dtype:  # a cast is not the bitwise copy exactness needs (docs/design.md §3)
        raise ValueError(
            f"state_dict[{k!r}] is {v.dtype}, the engine's model is {p.dtype}: the copy "
            f"would not be bitwise; cast it yourself (v.to({p.dtype})) if you mean it"
        )
    if type(v) not in (torch.Tensor, torch.nn.Parameter) or v.layout != torch.strided or v.device != p.device:
        raise ValueError(
            f"state_dict[{k!r}] must be a dense tensor on {p.device}, got a "
            f"{type(v).__name__} ({v.layout}) on {v.device}: pass plain tensors (a DTensor's "
            f"full_tensor(), .to_dense(), .to('{p.device}'))"
        )
