"""The engine's KV cache: a fixed pool of pages, allocated once, with refcounts.

A page holds `block_size` consecutive positions of one sequence for every
layer (the model's paged store, [P, Hk, B, Dh] per layer for k and v). The
page size IS the exact attention block (docs/design.md §6), so the cache layout and
the reduction order are the same thing and where a sequence's pages sit in the
pool has no effect on its bits.

Sharing: the `n` samples of a prompt are prefilled once. The samples then
share all the prompt's pages (refcount n); a page is copied only when a
sample is about to write into a page another sample still reads
(copy-on-write), which happens only for the partial last page of the prompt —
so full pages are shared read-only and each sample gets its own copy of the
partial one, lazily, on its first decode step.
"""

from __future__ import annotations

import os

import torch


class PagePool:
    """Page ids, refcounts and the KV tensors of a fixed budget."""

    def __init__(self, model, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"the KV budget must hold at least one page of {model.block_size} tokens")
        self.num_pages = num_pages
        self.block_size = model.block_size
        # per layer [k_pages, v_pages], each [P + 1, Hk, B, Dh]: the last page is scratch, never handed out
        # (the padding rows of a decode graph write there: engine/graph.py)
        need = model.kv_bytes(num_pages + 1)
        if model.device.type == "cuda":
            ram, where = torch.cuda.mem_get_info(model.device)[0], "the GPU has free"
        else:
            ram, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the machine has"
        if need > ram:  # a budget beyond torch's int64 sizes is a TypeError; one beyond RAM may be OOM-killed
            raise ValueError(
                f"a KV budget of {num_pages * self.block_size} tokens does not fit in memory "
                f"({need / 2**30:.4g} GiB of KV cache, {where} {ram / 2**30:.4g} GiB): lower "
                f"kv_budget_tokens"
            )
        try:
            self.kv = model.new_kv(num_pages + 1)
        except (RuntimeError, MemoryError) as e:  # torch's allocator: "can't allocate memory"
            raise ValueError(
                f"a KV budget of {num_pages * self.block_size} tokens does not fit in memory "
                f"({type(e).__name__}: {str(e).splitlines()[0]}): lower kv_budget_tokens"
            ) from None
        self.scratch_page = num_pages
        self._refs = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: low ids are reused first

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool holds in all: the KV budget rounded up to whole pages."""
        return self.num_pages * self.block_size

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self._free), "allocation beyond the pool; the scheduler checks first"
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        for p in pages:
            assert self._refs[p] > 0
            self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            assert self._refs[p] > 0, f"page {p} released twice"
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def is_shared(self, page: int) -> bool:
        return self._refs[page] > 1

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copies whole pages src -> dst in every layer (before the forward that writes dst)."""
        if not pairs:
            return
        dev = self.kv[0][0].device
        src = torch.tensor([s for s, _ in pairs], device=dev)
        dst = torch.tensor([d for _, d in pairs], device=dev)
        for layer in self.kv:
            for pages in layer:
                pages[dst] = pages[src]
