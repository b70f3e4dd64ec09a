"""A session's sorted index (trajectory.py) gives the answers of the definitions it replaced, which compared
every record with every other: the same parent for each turn (so the same masks, logprobs, versions, first
prompts and sampling keys), the same records retired by a truncate, the same trajectories.

Random sessions over a small token alphabet, so that prompts collide, share parts of branches, repeat a
record whole or extend a retired one; with splits, truncates (of a recorded history, or of one beyond it)
and edge cases (empty prompts, empty generations).
"""

from __future__ import annotations

import random

import pytest

from exactrl.chat.trajectory import Record, Session, Trajectory, _common_prefix, _turns


class Quadratic(Session):
    """The definitions, as they were written: every record compared with every other."""

    def record(self, prompt, generated, logprobs, versions, kind="spliced", sampling=(1.0, -1, 1.0), cut_history=None):
        if kind == "truncate":
            for r in self.records:
                if cut_history[: len(r.tokens_T)] == r.tokens_T and prompt[: len(r.tokens_T)] != r.tokens_T:
                    r.retired = True
        parent, lcp = self._parent(prompt) if kind != "split" else (None, 0)
        mask, lps, vers, prompt_len = [0] * len(prompt), [0.0] * len(prompt), [-1] * len(prompt), len(prompt)
        used = {tuple(sampling)}
        if parent is not None:
            mask[:lcp], lps[:lcp], vers[:lcp] = parent.mask_T[:lcp], parent.logprobs_T[:lcp], parent.versions_T[:lcp]
            if lcp >= parent.prompt_len:
                prompt_len = parent.prompt_len
            if any(mask[:lcp]):
                used |= set(parent.sampling)
        self.records.append(
            Record(
                prompt + generated,
                mask + [1] * len(generated),
                lps + list(logprobs),
                vers + list(versions),
                prompt_len,
                tuple(sorted(used)),
            )
        )

    def _parent(self, prompt):
        best, lcp = None, 0
        for r in self.records:
            n = next(
                (i for i in range(min(len(r.tokens_T), len(prompt))) if r.tokens_T[i] != prompt[i]),
                min(len(r.tokens_T), len(prompt)),
            )
            if n > lcp:
                best, lcp = r, n
        if best is None or lcp == len(best.tokens_T) or best.retired:
            return best, lcp
        whole = [r for r in self.records if prompt[: len(r.tokens_T)] == r.tokens_T]
        best = max(whole, key=lambda r: len(r.tokens_T), default=None)
        return best, (0 if best is None else len(best.tokens_T))

    def trajectories(self):
        out = []
        for i, r in enumerate(self.records):
            if r.retired or any(
                o is not r and len(o.tokens_T) > len(r.tokens_T) and o.tokens_T[: len(r.tokens_T)] == r.tokens_T
                for o in self.records
            ):
                continue
            if any(o.tokens_T == r.tokens_T and not o.retired for o in self.records[:i]):
                continue
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


def random_turn(rng: random.Random, records: list[list[int]]) -> dict:
    """A turn: a new conversation, or a prompt taken from (part of) a recorded one, plus a generation."""
    alphabet = rng.choice([3, 6, 50])
    fresh = lambda k: [rng.randrange(alphabet) for _ in range(k)]  # noqa: E731
    prompt = fresh(rng.randint(0 if rng.random() < 0.03 else 1, 4))
    if records and rng.random() < 0.85:
        base = rng.choice(records)
        how = rng.random()
        if how < 0.5:  # extends a record whole (a next turn)
            prompt = base + fresh(rng.randint(0, 3))
        elif how < 0.8:  # part of a record, then other tokens (an edited or re-tokenized turn)
            prompt = base[: rng.randint(0, len(base))] + fresh(rng.randint(0, 3))
        else:  # a record's own prompt again (n > 1, a retried request)
            prompt = list(base[: rng.randint(1, len(base))])
    generated = fresh(rng.randint(0 if rng.random() < 0.03 else 1, 3))
    turn = {
        "prompt": prompt,
        "generated": generated,
        "logprobs": [-rng.random() for _ in generated],
        "versions": [rng.randrange(3)] * len(generated),
        "sampling": rng.choice([(1.0, -1, 1.0), (0.7, 5, 0.9)]),
    }
    kind = rng.choices(["spliced", "fresh", "split", "truncate"], [6, 2, 1, 2])[0]
    turn["kind"] = kind
    if kind == "truncate":
        cut = rng.choice(records) if records else prompt
        turn["cut_history"] = cut + (fresh(rng.randint(1, 3)) if rng.random() < 0.3 else [])
    return turn


@pytest.mark.parametrize("seed", range(40))
def test_the_index_answers_as_the_quadratic_definitions(seed):
    rng = random.Random(seed)
    new, old, recorded = Session(), Quadratic(), []
    for _ in range(rng.randint(1, 60)):
        turn = random_turn(rng, recorded)
        new.record(**turn)
        old.record(**turn)
        recorded.append(turn["prompt"] + turn["generated"])
        assert new.records == old.records  # every field, `retired` included: the same parents, the same cuts
        assert [t.to_json() for t in new.trajectories()] == [t.to_json() for t in old.trajectories()]


def test_common_prefix():
    rng = random.Random(0)
    for _ in range(2000):
        a = [rng.randrange(3) for _ in range(rng.randint(0, 40))]
        b = a[: rng.randint(0, len(a))] + [rng.randrange(3) for _ in range(rng.randint(0, 40))]
        want = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
        assert _common_prefix(a, b) == _common_prefix(b, a) == want


def test_a_session_built_from_records_is_indexed():
    s = Session()
    s.record([1, 2], [3], [-0.1], [0])
    s.record([1, 2, 3, 4], [5], [-0.2], [0])
    copy = Session(records=list(s.records))
    assert copy.index == s.index
    copy.record([1, 2, 3, 4, 5, 6], [7], [-0.3], [0])
    (t,) = copy.trajectories()
    assert t.loss_mask == [1, 0, 1, 0, 1]
