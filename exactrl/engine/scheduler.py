"""Continuous batching: which tokens of which sequences go into the next forward.

One sequence = one sample of one request. Its state is `tokens` (prompt +
generated) and `num_computed` (a prefix of `tokens` whose keys/values are in
the cache). Every step computes a chunk `tokens[num_computed : num_computed+len]`
of each scheduled sequence; when the chunk reaches the end of `tokens`, the
logits of its last row sample the next token. That one rule covers a decode
step (len 1), a prompt prefill (chunked under the step's token budget) and the
resumption of a preempted sequence (a prefill of prompt + generated so far).
Prefill chunks and decode tokens share the step's one forward.

Policy (vLLM-like, FCFS by arrival):
  1. running sequences, decodes first then unfinished prefills, oldest first;
     a running sequence that needs a page when the pool is empty preempts the
     youngest running sequence not yet scheduled this step (or itself if it
     is the youngest): its pages are freed and it goes back to `waiting`,
     keeping its tokens, logprobs and versions — it resumes by recomputation,
     and because draws are counter-based and exact kernels are
     batch-invariant, its results are unchanged.
  2. waiting sequences in arrival order while the token budget, the sequence
     slots (`max_num_seqs`, counting the n samples of a prompt) and free pages
     allow; the first that does not fit stops admission (no overtaking).
A request with n > 1 enters as its sample 0 (the leader); samples 1..n-1 are
forked from it once its prompt is computed (see cache.py for page sharing).

Legend: B page size.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from enum import Enum

from exactrl.engine.cache import PagePool
from exactrl.engine.sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"  # in the waiting queue (new, or preempted)
    FORK_WAIT = "fork_wait"  # sample j > 0 waiting for sample 0's prefill
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int  # resolved (a fresh one when params.seed is None)
    stop_ids: frozenset[int]  # params.stop_token_ids + the engine's (unless ignore_eos)
    flags: tuple[bool, bool] = (False, False)  # params.branch_flags(vocab size), asked once per request
    seqs: list[Sequence] = field(default_factory=list)  # sample j at index j

    @property
    def finished(self) -> bool:
        return all(s.status is Status.FINISHED for s in self.seqs)


@dataclass(eq=False)
class Sequence:
    seq_id: int  # engine-wide arrival counter: lower = older = higher priority
    request: Request
    index: int  # j, which of the request's n samples
    tokens: list[int]  # prompt + generated
    num_computed: int = 0  # leading tokens whose KV is in `pages`
    pages: list[int] = field(default_factory=list)  # page of block b = pages[b]
    logprobs: list[float] = field(default_factory=list)  # one per generated token
    versions: list[int] = field(default_factory=list)  # policy version per generated token
    # mixture of experts: per generated token, the experts each MoE layer selected at the row it was sampled
    # from ([L][K] ids, `model/moe.py`); empty for a dense model
    experts: list[list[list[int]]] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" once finished
    followers: list[Sequence] = field(default_factory=list)  # samples to fork after prefill

    @property
    def num_prompt(self) -> int:
        return len(self.request.prompt)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed


@dataclass
class Chunk:
    """Tokens `seq.tokens[start : start + length]` at positions start.. of `seq`."""

    seq: Sequence
    start: int  # = seq.num_computed when scheduled
    length: int

    @property
    def samples(self) -> bool:
        """Does the chunk reach the last known token, so its last row samples the next one?"""
        return self.start + self.length == len(self.seq.tokens)


@dataclass
class SchedulerOutput:
    """What the engine runs in one step. Built by `Scheduler.schedule`."""

    chunks: list[Chunk]  # in forward order; one per scheduled sequence
    num_tokens: int  # sum of chunk lengths (<= max_num_batched_tokens)
    copies: list[tuple[int, int]]  # (src, dst) page copies to do before the forward (copy-on-write)
    preempted: list[Sequence]  # sequences sent back to `waiting` while scheduling this step


class Scheduler:
    def __init__(self, pool: PagePool, max_num_batched_tokens: int, max_num_seqs: int):
        self.pool = pool
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: list[Sequence] = []  # sorted by seq_id
        self.running: list[Sequence] = []  # sorted by seq_id
        self.num_preemptions = 0  # sequences preempted for lack of pages, since the start

    # ------------------------------------------------------------ lifecycle
    def add(self, leader: Sequence) -> None:
        """Queues a request's sample 0; its other samples sit in `leader.followers`."""
        bisect.insort(self.waiting, leader, key=lambda s: s.seq_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.pool.block_size)

    def fork(self, leader: Sequence) -> list[Sequence]:
        """Gives the leader's followers its computed prompt and pages (shared, refcounted)."""
        forked, leader.followers = leader.followers, []
        for f in forked:
            assert f.status is Status.FORK_WAIT and f.num_computed == 0
            f.num_computed = leader.num_computed
            f.pages = list(leader.pages)
            self.pool.share(f.pages)
            f.status = Status.RUNNING
            bisect.insort(self.running, f, key=lambda s: s.seq_id)
        return forked

    def finish(self, seq: Sequence, reason: str) -> None:
        assert seq.status is Status.RUNNING
        self.running.remove(seq)
        self._drop_pages(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def remove(self, seq: Sequence) -> None:
        """Drops a sequence wherever it is (abort); frees its pages."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self._drop_pages(seq)
        seq.status = Status.FINISHED

    def preempt(self, seq: Sequence) -> None:
        """Frees the pages of a running sequence and requeues it for recomputation."""
        assert seq.status is Status.RUNNING
        self.running.remove(seq)
        self._drop_pages(seq)
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.seq_id)

    def preempt_all(self) -> None:
        for seq in list(self.running):
            self.preempt(seq)

    def _drop_pages(self, seq: Sequence) -> None:
        self.pool.release(seq.pages)
        seq.pages, seq.num_computed = [], 0

    # ------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        chunks: list[Chunk] = []
        copies: list[tuple[int, int]] = []
        preempted: list[Sequence] = []
        scheduled: set[int] = set()
        decodes = [s for s in self.running if s.num_uncomputed == 1]
        prefills = [s for s in self.running if s.num_uncomputed > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted as a victim above
                continue
            n = min(seq.num_uncomputed, budget)
            if self._reserve(seq, n, scheduled, copies, preempted):
                chunks.append(Chunk(seq, seq.num_computed, n))
                scheduled.add(seq.seq_id)
                budget -= n
        seats = sum(1 + len(s.followers) for s in self.running)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            need_seats = 1 + len(seq.followers)
            n = min(seq.num_uncomputed, budget)
            # admitted only when all its tokens fit, not just this step's chunk: a sequence let in on one chunk's
            # pages is the first victim when a running one grows, and a preempted one recomputes from its start,
            # so two long sequences over a tight budget would evict each other over and over
            if seats + need_seats > self.max_num_seqs or self.pages_for(seq.num_uncomputed) > self.pool.num_free:
                break
            self.waiting.pop(0)
            seq.pages = self.pool.allocate(self.pages_for(n))
            seq.status = Status.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.seq_id)
            chunks.append(Chunk(seq, 0, n))
            seats += need_seats
            budget -= n
        return SchedulerOutput(chunks, self.max_num_batched_tokens - budget, copies, preempted)

    def _reserve(
        self, seq: Sequence, n: int, scheduled: set[int], copies: list[tuple[int, int]], preempted: list[Sequence]
    ) -> bool:
        """Pages for computing n more tokens of a running sequence; may preempt (even itself)."""
        first = seq.num_computed // self.pool.block_size
        cow = first < len(seq.pages) and self.pool.is_shared(seq.pages[first])
        need = self.pages_for(seq.num_computed + n) - len(seq.pages) + int(cow)
        while self.pool.num_free < need:
            victim = next((s for s in reversed(self.running) if s.seq_id not in scheduled and s is not seq), None)
            if victim is None or victim.seq_id < seq.seq_id:
                victim = seq
            self.preempt(victim)
            preempted.append(victim)
            self.num_preemptions += 1
            if victim is seq:
                return False
            cow = first < len(seq.pages) and self.pool.is_shared(seq.pages[first])
            need = self.pages_for(seq.num_computed + n) - len(seq.pages) + int(cow)
        if cow:
            (page,) = self.pool.allocate(1)
            copies.append((seq.pages[first], page))
            self.pool.release([seq.pages[first]])
            seq.pages[first] = page
        seq.pages += self.pool.allocate(self.pages_for(seq.num_computed + n) - len(seq.pages))
        return True
