"""`Quadratic`: the session index's definitions written plainly (every record compared with every other), the
reference the sorted index is tested against."""

from __future__ import annotations

from exactrl.chat.trajectory import Record, Session, Trajectory, _turns


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
