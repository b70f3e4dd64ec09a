"""Token-level trajectories of an agent session, with loss masks, for training.

A session is every request made under one session id (an agent episode). Each
completion is recorded as a whole token sequence, prompt + generation, with
per-token mask (1 = sampled by the model, 0 = template, tool, user or system
token) and behaviour logprob (the engine's; 0.0 where the mask is 0).

The prompt of a new turn usually extends an earlier record (the splicer keeps
the earlier tokens exactly): the new record inherits mask and logprobs over
the longest common prefix with any earlier record, so a generated token keeps
mask 1 however many turns later it is seen. The trajectories to train on are
the records no other record extends — one per conversation branch (several
with n > 1 or parallel sub-agents). Branches share the turns before they
part, generated tokens included (mask 1 in each): each branch is a whole
episode, as each path of a tree rollout is.

A prompt that shares only part of a branch that stays a trajectory (a turn
re-tokenized or edited by a client that sent no token fields) inherits only
the records it extends whole: the branch's generated tokens are trained
there, never twice.

Monotonicity events (splice.py): `split` records a fresh segment that
inherits nothing (the old branch stays a trajectory of its own, nothing is
trained twice); `truncate` retires every record of the branch it cut (the
records of its token history that the new prompt does not extend, whose
tokens past the cut are no longer part of any context) and inherits the
common prefix.

Cost: the records are also kept in lexicographic order of their tokens
(`Session.index`), where the records sharing a prefix are one run and those
a prompt extends lie on a short walk down from its place. Recording a turn
compares it with its neighbours there (time linear in its tokens, plus a
scan of the record numbers of one run), and listing the trajectories
compares each record with the next: linear in the tokens stored. Comparing
every record with every other, as the definitions above read, cost a
session of 1,000 turns (one conversation, 40 tokens a turn) half a second
per turn on the server's event loop.

Legend: T tokens of a record.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field


@dataclass
class Record:
    tokens_T: list[int]
    mask_T: list[int]  # 1 = sampled by the model
    logprobs_T: list[float]  # behaviour logprob where mask = 1, else 0.0
    versions_T: list[int]  # engine weight version that sampled the token, -1 where mask = 0
    prompt_len: int  # length of the first prompt of its branch: training completions start here
    sampling: tuple[tuple, ...] = ()  # distinct (temperature, top_k, top_p) its generated tokens were sampled with
    retired: bool = False  # cut by a `truncate`: not trained on


@dataclass
class Trajectory:
    """One conversation branch, in TrainBatch's layout."""

    prompt_ids: list[int]  # the first prompt of the branch
    completion_ids: list[int]  # everything after it: generated tokens and interleaved template/tool/user tokens
    loss_mask: list[int]  # per completion token: 1 = generated
    behav_logprobs: list[float]  # per completion token: engine logprob, 0.0 where masked
    versions: list[int]  # per completion token: weight version, -1 where masked
    num_turns: int  # generations in the branch
    sampling: list[list[float]]  # distinct [temperature, top_k, top_p] of its generations: the trainer must use them

    def to_json(self) -> dict:
        return dict(self.__dict__)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix, by slice comparisons (C loops; halving: O(len) in all)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


_PAST = math.inf  # compares greater than every token id: Q + [_PAST] is past every list that starts with Q


@dataclass
class Session:
    records: list[Record] = field(default_factory=list)
    # the server's bookkeeping (server/app.py), for dropping sessions left idle: requests now using the
    # session, and when one last took or released it (time.monotonic)
    busy: int = field(default=0, compare=False)
    last_used: float = field(default_factory=time.monotonic, compare=False)
    # (tokens_T, record number) of every record, sorted: lexicographic order of the tokens, identical
    # tokens in order of recording. The records starting with a prefix are one run of it
    index: list[tuple[list[int], int]] = field(default_factory=list, init=False, compare=False, repr=False)

    def __post_init__(self):
        self.index = sorted((r.tokens_T, i) for i, r in enumerate(self.records))

    def record(
        self,
        prompt: list[int],
        generated: list[int],
        logprobs: list[float],
        versions: list[int],
        kind: str = "spliced",
        sampling: tuple = (1.0, -1, 1.0),
        cut_history: list[int] | None = None,
    ) -> None:
        """Adds one completion. `kind` is the PromptPlan kind of its prompt; `sampling` (T, top_k, top_p);
        `cut_history`: with `truncate`, the token history it cut (PromptPlan.history)."""
        _check_turn(prompt, generated, logprobs, versions)
        if kind == "truncate":
            if cut_history is None:
                raise ValueError("a truncate record needs the token history it cut (cut_history)")
            # the cut branch: its records the new prompt no longer extends, i.e. the prefixes of the
            # history longer than what the prompt keeps of it
            kept = _common_prefix(cut_history, prompt)
            for r in self._prefixes(cut_history, longer_than=kept):
                r.retired = True
        parent, lcp = self._parent(prompt) if kind != "split" else (None, 0)
        mask = [0] * len(prompt)
        lps = [0.0] * len(prompt)
        vers = [-1] * len(prompt)
        prompt_len = len(prompt)
        used = {tuple(sampling)}
        if parent is not None:
            mask[:lcp], lps[:lcp], vers[:lcp] = parent.mask_T[:lcp], parent.logprobs_T[:lcp], parent.versions_T[:lcp]
            if lcp >= parent.prompt_len:
                prompt_len = parent.prompt_len
            if any(mask[:lcp]):
                used |= set(parent.sampling)
        r = Record(
            prompt + generated,
            mask + [1] * len(generated),
            lps + list(logprobs),
            vers + list(versions),
            prompt_len,
            tuple(sorted(used)),
        )
        bisect.insort(self.index, (r.tokens_T, len(self.records)))
        self.records.append(r)

    def _parent(self, prompt: list[int]) -> tuple[Record | None, int]:
        """The record whose tokens the prompt inherits, and over how many: the one sharing the longest prefix
        (the first recorded of those) if the prompt extends it whole or it was retired (a truncate); else
        only part of a branch that stays a trajectory is shared (a re-tokenized or edited turn): its
        generated tokens would be trained twice, so the longest record the prompt extends whole is the parent."""
        index = self.index
        at = bisect.bisect_left(index, (prompt,))
        # the longest prefix shared with any record is shared with a neighbour of the prompt's place
        lcp = max((_common_prefix(index[k][0], prompt) for k in (at - 1, at) if 0 <= k < len(index)), default=0)
        if lcp == 0:
            return None, 0
        shared = prompt[:lcp]  # every record starting with it: one run around the prompt's place
        run = index[bisect.bisect_left(index, (shared,)) : bisect.bisect_left(index, (shared + [_PAST],))]
        best = self.records[min(i for _, i in run)]
        if lcp == len(best.tokens_T) or best.retired:
            return best, lcp
        best = next(self._prefixes(prompt), None)
        return best, (0 if best is None else len(best.tokens_T))

    def _prefixes(self, tokens: list[int], longer_than: int = -1):
        """The records that are prefixes of `tokens` (itself included) and longer than `longer_than`,
        longest first, identical ones in order of recording.

        A prefix of `tokens` sorts before it, and every record between the two extends the prefix: the
        record just before `tokens` is the longest prefix, or shares some prefix with it, and the next
        prefix is no longer than that."""
        index, q = self.index, tokens
        while len(q) > longer_than:
            end = bisect.bisect_left(index, (q, _PAST))  # past every record <= q
            if end == 0:
                return
            prev = index[end - 1][0]
            n = _common_prefix(prev, q)
            if n < len(prev):  # not a prefix: the prefixes of q are those of q[:n]
                q = q[:n]
                continue
            if n <= longer_than:
                return
            for _, i in index[bisect.bisect_left(index, (prev,)) : end]:
                yield self.records[i]
            if n == 0:
                return
            q = prev[: n - 1]

    def trajectories(self) -> list[Trajectory]:
        """The maximal records (no other record extends them), in order of recording."""
        index, keep, k = self.index, [], 0
        while k < len(index):
            tokens = index[k][0]
            end = k + 1
            while end < len(index) and index[end][0] == tokens:
                end += 1
            # a record extending these tokens sorts right after them (after their copies) if any does
            extended = end < len(index) and index[end][0][: len(tokens)] == tokens
            if not extended:
                # of identical records, the first still live: a copy is trained once (compared by position:
                # a copy equal in every field is another record)
                keep += [next((i for _, i in index[k:end] if not self.records[i].retired), None)]
            k = end
        out = []
        for i in sorted(i for i in keep if i is not None):
            r = self.records[i]
            p = r.prompt_len
            out.append(
                Trajectory(
                    r.tokens_T[:p],
                    r.tokens_T[p:],
                    r.mask_T[p:],
                    r.logprobs_T[p:],
                    r.versions_T[p:],
                    num_turns=_turns(r.mask_T),
                    sampling=[list(x) for x in r.sampling],
                )
            )
        return out


def _check_turn(prompt: list[int], generated: list[int], logprobs: list[float], versions: list[int]) -> None:
    """A ValueError naming the field of a completion that cannot be a turn: a record is kept for training, so
    a misaligned one would put logprobs on the wrong tokens (an assert vanishes under `python -O`)."""
    for name, ids in (("prompt", prompt), ("generated", generated)):
        if set(map(type, ids)) <= {int} and (not ids or min(ids) >= 0):  # C loops: a long prompt, every turn
            continue
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or t < 0), None)
        if bad is not None:
            raise ValueError(f"Session.record: {name} holds {bad!r}, not a token id (an integer >= 0)")
    if len(logprobs) != len(generated) or len(versions) != len(generated):
        raise ValueError(
            f"Session.record: {len(generated)} generated tokens but {len(logprobs)} logprobs and "
            f"{len(versions)} versions: one of each per generated token"
        )
    bad = next((x for x in logprobs if not (isinstance(x, (int, float)) and math.isfinite(x) and x <= 0)), None)
    if bad is not None:
        raise ValueError(f"Session.record: logprobs holds {bad!r}, not a finite log-probability <= 0")


def _turns(mask: list[int]) -> int:
    return sum(1 for i, m in enumerate(mask) if m == 1 and (i == 0 or mask[i - 1] == 0))
