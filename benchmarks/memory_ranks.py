"""exactrl bench memory --ranks 1,2,4: per-rank memory and step time of `ddp` against `fsdp`, with and without
activation checkpointing, each rank a process on this machine (gloo).

For every number of ranks W in `--ranks`, strategy (`ddp`; `fsdp` from 2 ranks: in one process it has no
effect) and `optim.activation_checkpointing` mode in `--ac`, W processes build the same random Qwen3 of
`--size`, shard it (`fsdp`: exactrl/distributed/fsdp.py) and run `train_step` (PPO-clip, token-mean, one
micro-batch per rank, AdamW) over one batch of `--seqs` x (`--prompt` + `--completion`) tokens, each rank
its share. Rank 0 reports:

- state_mb: the bytes of the parameters and AdamW's state this rank holds (a DTensor's local shard);
- peak_mb: the most heap bytes in use above the step's start during one metered step (benchmarks/memory.py
  `PeakHeap`: every tensor alive at an op's end, the step's gradients and the gathered weights included;
  the warm-up's gradients are dropped before the step starts);
- grads_mb: the bytes of this rank's gradients after the step, and act_peak_mb: the most of the same
  readings less the bytes of the gradients alive at each, the part that is not gradients (activations,
  gathered weights, temporaries);
- step_s: one unmetered step after it.

Ratios: `fsdp` against `ddp` at the same W and mode (state_ratio, against the target 1/W + 10%), and each
mode's act_peak against `none` at the same W and strategy. A warm-up step on a one-sequence batch first
(AdamW's moments exist, weights packed).

    exactrl bench memory --ranks 1,2,4 [--strategies ddp,fsdp] [--ac none,full] [--size 20M] [--seqs 8]
                         [--prompt 32] [--completion 480]
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import time

import torch
from torch.distributed.tensor import DTensor

from exactrl.algo.losses import build_loss
from exactrl.distributed import Ranks
from exactrl.model import build_model
from exactrl.train.activation_ckpt import apply_activation_checkpointing
from exactrl.train.trainer import StepSettings, TrainBatch, train_step


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t  # a DTensor's own shard
        total += t.numel() * t.element_size()
    return total


def _rank(rank: int, world: int, port: int, job: dict, out) -> None:
    """One rank of one configuration: the figures above, put on `out` by rank 0."""
    import torch.distributed as dist
    from _common import qwen3_config
    from memory import PeakHeap, _batch, grad_bytes

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    ranks = Ranks(rank, world)
    if world > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=3600),
        )
    cfg = qwen3_config(job["size"])
    model = apply_activation_checkpointing(build_model(cfg, dtype=job["dtype"], seed=0), job["ac"])
    sharded = job["strategy"] == "fsdp" and world > 1
    if sharded:
        from exactrl.distributed import fsdp

        fsdp.shard_model(model, ranks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    s = StepSettings(1.0, -1, 1.0, job["seqs"], "token-mean", None, 1.0, fsdp=sharded)
    loss = build_loss("ppo")
    warm = TrainBatch([[1] * 8] * world, [[2] * 8] * world, [[-1.0] * 8] * world, [0.5] * world)
    train_step(model, opt, loss, warm, s, ranks=ranks)
    batch = _batch(cfg.vocab_size, job["seqs"], job["prompt"], job["completion"])
    state = _local_bytes(model.parameters()) + _local_bytes(
        t for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim()
    )
    opt.zero_grad(set_to_none=True)  # the start holds no gradients: the peak counts the step's own
    gc.collect()  # nothing unreachable is left to be freed inside the metered step
    with PeakHeap(less=grad_bytes(list(model.parameters()))) as meter:
        m = train_step(model, opt, loss, batch, s, ranks=ranks)
    grads = _local_bytes(p.grad for p in model.parameters() if p.grad is not None)
    t = time.perf_counter()
    train_step(model, opt, loss, batch, s, ranks=ranks)
    step_s = time.perf_counter() - t
    if rank == 0:
        mb = 2**20
        out.put(
            {
                "state_mb": round(state / mb, 1),
                "peak_mb": round(meter.peak / mb, 1),
                "grads_mb": round(grads / mb, 1),
                "act_peak_mb": round(meter.peak_less / mb, 1),
                "step_s": round(step_s, 2),
                "loss": m["train/loss"],
                "grad_norm": m["train/grad_norm"],
            }
        )
    if world > 1:
        dist.destroy_process_group()


def run_one(job: dict, world: int) -> dict:
    """The configuration `job` over `world` rank processes; rank 0's figures."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, job, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = q.get(timeout=7200)
    for p in procs:
        p.join(600)
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"a rank of {job} at {world} ranks exited with {bad[0]}")
    return res


def measure_ranks(worlds, strategies, modes, size, seqs, prompt, completion, dtype) -> dict:
    out = {
        "size": size,
        "dtype": dtype,
        "torch": torch.__version__,
        "tokens": seqs * (prompt + completion),
        "cores": len(os.sched_getaffinity(0)),
        "load_avg_1m_start": os.getloadavg()[0],
        "rows": [],
    }
    for world in worlds:
        for strategy in strategies:
            if strategy == "fsdp" and world == 1:
                continue
            for ac in modes:
                job = dict(
                    size=size, dtype=dtype, strategy=strategy, ac=ac, seqs=seqs, prompt=prompt, completion=completion
                )
                row = {"ranks": world, "strategy": strategy, "ac": ac, **run_one(job, world)}
                out["rows"].append(row)
                print(row, flush=True)
    out["load_avg_1m_end"] = os.getloadavg()[0]
    _ratios(out["rows"])
    return out


def _ratios(rows: list[dict]) -> None:
    def find(world, strategy, ac):
        return next((r for r in rows if (r["ranks"], r["strategy"], r["ac"]) == (world, strategy, ac)), None)

    for r in rows:
        ddp = find(r["ranks"], "ddp", r["ac"])
        if r["strategy"] == "fsdp" and ddp is not None:
            r["state_ratio"] = round(r["state_mb"] / ddp["state_mb"], 3)
            r["state_target"] = round(1.1 / r["ranks"], 3)
            r["state_target_met"] = r["state_ratio"] <= r["state_target"]
            r["time_ratio_vs_ddp"] = round(r["step_s"] / ddp["step_s"], 3)
        none = find(r["ranks"], r["strategy"], "none")
        if none is not None and r["ac"] != "none":
            r["act_peak_cut"] = round(none["act_peak_mb"] / max(r["act_peak_mb"], 0.1), 2)
            r["peak_cut"] = round(none["peak_mb"] / max(r["peak_mb"], 0.1), 2)
