"""exactrl bench kernels: exact vs fast kernel throughput on ~20M and ~100M models.

train: forward+backward of `sequence_logprobs` over a [batch, seq] trainer batch.
decode: one decode step of `batch` sequences against a paged cache at position `ctx`, with the
        weights packed once, as in the engine (the trainer's forward packs per call).
The machine's fp32 matmul peak is measured in the same run, so model-FLOPs
utilisation (≈ 6·params·tokens for fwd+bwd, 2·params·tokens for decode) can be read off
(`train_mfu` is against the fp32 peak also with `--dtype bfloat16`, whose matmuls run
at up to ~2.3x that peak on a CPU with AVX512-BF16).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    apply_quick,
    check_context,
    matmul_peak_gflops,
    peak_rss_mb,
    positive_int,
    positive_ints,
    qwen3_config,
    size_names,
    timeit,
)

import exactrl  # noqa: E402
from exactrl.kernels import TokenLayout  # noqa: E402
from exactrl.kernels.linear import PackedWeights, using_packed  # noqa: E402
from exactrl.model import build_model  # noqa: E402
from exactrl.model.logprobs import pack_layout  # noqa: E402


def train_step_time(model, batch: int, seq: int, repeat: int) -> float:
    rng = random.Random(0)
    ids = [[rng.randrange(model.config.vocab_size) for _ in range(seq)] for _ in range(batch)]

    def step():
        lps = exactrl.sequence_logprobs(model, ids)
        torch.cat(lps).sum().backward()
        model.zero_grad(set_to_none=True)

    return timeit(step, repeat=repeat)


def decode_step_time(model, batch: int, ctx: int, repeat: int) -> float:
    V = model.config.vocab_size
    lay, pages = pack_layout([ctx] * batch, model.block_size)
    kv = model.new_kv(pages + batch)
    with torch.inference_mode():
        model(torch.randint(V, (ctx * batch,)), lay, kv)
        step_lay = TokenLayout(torch.arange(batch), torch.full((batch,), ctx), lay.block_table_SJ)
        # one more block per sequence in case ctx starts a new page
        extra = torch.arange(pages, pages + batch)[:, None]
        step_lay.block_table_SJ = (
            torch.cat([lay.block_table_SJ, extra], 1) if ctx % model.block_size == 0 else lay.block_table_SJ
        )
        tok = torch.randint(V, (batch,))
        with using_packed(PackedWeights()):  # as the engine runs its steps (kernels/linear.py)
            return timeit(lambda: model.logits(model(tok, step_lay, kv)), repeat=repeat * 3)


def run(sizes, train_shape, decode_batches, ctx, repeat, dtype: str = "float32") -> dict:
    out = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": dtype,
        "matmul_peak_gflops_fp32": round(matmul_peak_gflops(), 1),
        "models": {},
    }
    for size in sizes:
        cfg = qwen3_config(size)
        res = {}
        for mode in ("exact", "fast"):
            model = build_model(cfg, dtype=dtype, kernels=mode, seed=0)
            n_params = sum(p.numel() for p in model.parameters())
            b, s = train_shape
            t = train_step_time(model, b, s, repeat)
            r = {
                "train_tokens_per_s": round(b * s / t, 1),
                "train_mfu": round(6 * n_params * b * s / t / 1e9 / out["matmul_peak_gflops_fp32"], 3),
            }
            for db in decode_batches:
                r[f"decode_b{db}_tokens_per_s"] = round(db / decode_step_time(model, db, ctx, repeat), 1)
            res[mode] = r
        res["params"] = n_params
        res["ratio_exact_over_fast"] = {
            k: round(res["exact"][k] / res["fast"][k], 3) for k in res["exact"] if k.endswith("per_s")
        }
        out["models"][size] = res
        print(json.dumps({size: res}), file=sys.stderr, flush=True)
    out["train_shape"], out["decode_ctx"], out["peak_rss_mb"] = list(train_shape), ctx, round(peak_rss_mb())
    return out


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="exactrl bench kernels")
    p.add_argument("--sizes", type=size_names, default="20M,100M")
    p.add_argument("--train-batch", type=positive_int, default=8)
    p.add_argument("--train-seq", type=positive_int, default=256)
    p.add_argument("--decode-batches", type=positive_ints, default="1,32")
    p.add_argument("--ctx", type=positive_int, default=160)
    p.add_argument("--repeat", type=positive_int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quick", action="store_true", help="tiny model, small shapes (smoke test)")
    a = p.parse_args(argv)
    if a.quick:
        apply_quick(p, a, sizes=["tiny"], train_batch=2, train_seq=40, ctx=40, repeat=1)
    check_context(p, f"--train-seq {a.train_seq}", a.train_seq)
    check_context(p, f"--ctx {a.ctx} + the decoded token", a.ctx + 1)
    res = run(a.sizes, (a.train_batch, a.train_seq), a.decode_batches, a.ctx, a.repeat, a.dtype)
    print(json.dumps(res, indent=2))
