"""exactrl bench memory: a train_step's peak memory and time with and without activation checkpointing.

One random Qwen3 of `--size` (benchmarks/_common.py SIZES) runs `train_step`
(PPO-clip, token-mean, one micro-batch, AdamW) on `--seqs` sequences of
`--prompt` + `--completion` tokens, once per `optim.activation_checkpointing`
mode (train/activation_ckpt.py).

- peak: the most heap bytes in use during the step above those in use before it, read from glibc's
  `mallinfo2` (heap in use + mmapped chunks, the main arena: the thread that calls the ops allocates
  their outputs) after every torch op (a `TorchDispatchMode`, active through the backward and its
  recomputation). torch's CPU tensors come from malloc, which tracemalloc does not see; the figure counts
  every tensor alive at an op's end (a temporary inside one op, e.g. a C kernel's scratch, only when it
  outlives the op). The gradients of the warm-up step are dropped before it, so the peak counts the
  step's own gradients. The metered step is a separate step from the timed ones (the meter slows each op).
- act. peak: the most of the same readings less the bytes of the gradients alive at each: activations,
  saved tensors and temporaries, what activation checkpointing cuts.
- time: best of `--steps` timed steps after one warm-up, unmetered.
- the loss and gradient norm of the step per mode, equal across the modes (the recomputation is exact).

Ratios (peak_ratio, act_peak_ratio, time_ratio) are against `none`; the 1-minute load average at start
and end is in the output. Run on one
machine, one mode after another, in one process: a later mode's peak, read in a process the modes before
it ran in, comes out lower than in a process of its own (docs/performance.md), so the figures to quote
come from `--ranks 1`, one process per mode.

    exactrl bench memory [--quick] [--size 20M] [--seqs 8] [--prompt 32] [--completion 480] [--steps 2]
                         [--dtype float32]
    exactrl bench memory --ranks 1,2,4 [...]   ddp against fsdp per number of ranks (benchmarks/memory_ranks.py)

Legend: B sequences, T tokens per sequence.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SIZES, apply_quick, check_context, positive_int, qwen3_config  # noqa: E402

from exactrl.algo.losses import build_loss  # noqa: E402
from exactrl.model import build_model  # noqa: E402
from exactrl.train.activation_ckpt import MODES, apply_activation_checkpointing  # noqa: E402
from exactrl.train.trainer import StepSettings, TrainBatch, train_step  # noqa: E402


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


_libc = ctypes.CDLL(None)
_libc.mallinfo2.restype = _Mallinfo2


def heap_in_use() -> int:
    """Bytes malloc has handed out and not taken back: heap chunks in use + mmapped chunks (glibc >= 2.33)."""
    m = _libc.mallinfo2()
    return m.uordblks + m.hblkhd


class PeakHeap(TorchDispatchMode):
    """`with PeakHeap() as m: ...` leaves in `m.peak` the most heap bytes in use, above those at entry, at the
    end of any torch op run inside (forward, backward, recomputation). With `less` (a function: bytes in use
    that are not to count, e.g. the gradients alive at that moment), `m.peak_less` is the most of the same
    readings less `less()` taken at each."""

    def __init__(self, less: Callable[[], int] | None = None):
        super().__init__()
        self.less = less

    def __enter__(self):
        self.base, self.peak, self.peak_less = heap_in_use(), 0, 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        used = heap_in_use() - self.base
        self.peak = max(self.peak, used)
        if self.less is not None:
            self.peak_less = max(self.peak_less, used - self.less())
        return out


def grad_bytes(params: list[torch.Tensor]) -> Callable[[], int]:
    """A function: the bytes of the gradients `params` hold now (a DTensor's local shard)."""

    def count() -> int:
        total = 0
        for p in params:
            g = p.grad
            if g is not None:
                g = g.to_local() if isinstance(g, DTensor) else g
                total += g.numel() * g.element_size()
        return total

    return count


def _batch(vocab: int, seqs: int, prompt: int, completion: int) -> TrainBatch:
    rng = random.Random(0)
    return TrainBatch(
        [[rng.randrange(vocab) for _ in range(prompt)] for _ in range(seqs)],
        [[rng.randrange(vocab) for _ in range(completion)] for _ in range(seqs)],
        [[-1.0] * completion for _ in range(seqs)],
        [rng.uniform(-1, 1) for _ in range(seqs)],
    )


def measure(size: str, seqs: int, prompt: int, completion: int, steps: int, dtype: str) -> dict:
    cfg = qwen3_config(size)
    batch = _batch(cfg.vocab_size, seqs, prompt, completion)
    s = StepSettings(
        temperature=1.0,
        top_k=-1,
        top_p=1.0,
        micro_batch_size=seqs,
        agg_mode="token-mean",
        agg_constant=None,
        grad_clip=1.0,
    )
    out = {
        "size": size,
        "dtype": dtype,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "sequences": seqs,
        "tokens": seqs * (prompt + completion),
        "load_avg_1m_start": os.getloadavg()[0],
        "modes": {},
    }
    for mode in MODES:
        model = apply_activation_checkpointing(build_model(cfg, dtype=dtype, seed=0), mode)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        out["params"] = sum(p.numel() for p in model.parameters())
        m = train_step(model, opt, build_loss("ppo"), batch, s)  # warm-up: AdamW's moments, packed weights
        opt.zero_grad(set_to_none=True)  # the start holds no gradients: the peak counts the step's own
        gc.collect()  # the previous mode's model (its checkpointed layers' bound methods are cycles) goes now
        with PeakHeap(less=grad_bytes(list(model.parameters()))) as meter:
            m = train_step(model, opt, build_loss("ppo"), batch, s)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            train_step(model, opt, build_loss("ppo"), batch, s)
            times.append(time.perf_counter() - t)
        out["modes"][mode] = {
            "peak_mb": round(meter.peak / 2**20, 1),
            "act_peak_mb": round(meter.peak_less / 2**20, 1),
            "step_s": round(min(times), 3),
            "loss": m["train/loss"],
            "grad_norm": m["train/grad_norm"],
        }
    out["load_avg_1m_end"] = os.getloadavg()[0]  # other processes slow the steps, not the peaks
    base = out["modes"]["none"]
    for r in out["modes"].values():
        r["peak_ratio"] = round(r["peak_mb"] / base["peak_mb"], 3)
        r["act_peak_ratio"] = round(r["act_peak_mb"] / base["act_peak_mb"], 3)
        r["time_ratio"] = round(r["step_s"] / base["step_s"], 3)
    return out


def _ints(text: str) -> list[int]:
    """argparse type: comma-separated positive integers ("1,2,4")."""
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"every number of ranks must be >= 1, got {text!r}")
    return out


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="exactrl bench memory")
    p.add_argument("--size", default="20M", choices=sorted(SIZES))
    p.add_argument("--seqs", type=positive_int, default=8)
    p.add_argument("--prompt", type=positive_int, default=32)
    p.add_argument("--completion", type=positive_int, default=480)
    p.add_argument("--steps", type=positive_int, default=2, help="timed steps per mode (best of)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quick", action="store_true", help="tiny model, short sequences (smoke test)")
    p.add_argument("--ranks", type=_ints, help="numbers of rank processes, e.g. 1,2,4: ddp against fsdp")
    p.add_argument("--strategies", default="ddp,fsdp", help="with --ranks: distributed.strategy values")
    p.add_argument("--ac", default="none,full", help="with --ranks: optim.activation_checkpointing modes")
    a = p.parse_args(argv)
    if a.quick:
        apply_quick(p, a, size="tiny", seqs=2, prompt=8, completion=56, steps=1)
    check_context(p, "--prompt + --completion", a.prompt + a.completion)
    if a.ranks:  # benchmarks/memory_ranks.py
        from memory_ranks import measure_ranks

        strategies, modes = a.strategies.split(","), a.ac.split(",")
        if not set(strategies) <= {"ddp", "fsdp"} or not set(modes) <= set(MODES):
            p.error(f"--strategies takes ddp,fsdp and --ac {','.join(MODES)}")
        out = measure_ranks(a.ranks, strategies, modes, a.size, a.seqs, a.prompt, a.completion, a.dtype)
        print(json.dumps(out, indent=2))
        return
    print(json.dumps(measure(a.size, a.seqs, a.prompt, a.completion, a.steps, a.dtype), indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
