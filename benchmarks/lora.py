"""exactrl bench lora: LoRA against full fine-tuning, memory and time, both measured in one run.

One random Qwen3 of `--size` (benchmarks/_common.py SIZES) is trained in two
modes, one after the other in this process: `full` (every weight trains) and
`lora` (adapters of `--rank` on `--targets`, model/lora.py). Per mode, as an
RL run holds and does it (train/setup.py, train/loop.py):

- state_mb: the bytes of every distinct tensor a run keeps between steps: the
  trainer's weights and the engine's (its copy; a LoRA engine shares the frozen
  base, `lora.engine_copy`), the gradients, AdamW's moments. The engine's KV
  pool and its packed weight copies are left out (the same in both modes, but
  for the adapters' small ones).
- step_peak_mb: the most heap bytes in use above those at its start during one
  `train_step` (PPO-clip, token-mean, one micro-batch, AdamW): activations,
  this step's gradients, temporaries (benchmarks/memory.py's `PeakHeap`).
- step_s: best of `--steps` timed `train_step`s after a warm-up.
- rollout_s: best of `--steps` `Engine.generate` calls, one completion of
  `--completion` tokens per sequence (`ignore_eos`), decode graphs on.
- sync_s: best of `--steps` `Engine.update_weights` of what the loop syncs
  (`lora.synced_weights`: every weight, or the adapters alone).
- checkpoint_mb: the bytes of the model part (model.safetensors, or the PEFT
  adapter files) plus optimizer.pt, as a checkpoint writes them.

Ratios are lora / full. The 1-minute load average at start and end is in the output.

    exactrl bench lora [--quick] [--size 20M] [--rank 16] [--alpha 32] [--targets all] [--seqs 8]
                       [--prompt 32] [--completion 224] [--steps 2] [--dtype float32]

Legend: B sequences, T tokens per sequence.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SIZES, apply_quick, check_context, positive_float, positive_int, qwen3_config  # noqa: E402
from memory import PeakHeap  # noqa: E402

from exactrl.algo.losses import build_loss  # noqa: E402
from exactrl.engine import Engine, SamplingParams  # noqa: E402
from exactrl.model import build_model, save_model  # noqa: E402
from exactrl.model.lora import TARGETS, add_lora, engine_copy, synced_weights, trainable_parameters  # noqa: E402
from exactrl.model.lora_files import save_adapters  # noqa: E402
from exactrl.train.trainer import StepSettings, TrainBatch, train_step  # noqa: E402

MODES = ("full", "lora")


def _bytes(tensors) -> int:
    """Bytes of the distinct storages among `tensors` (a tensor shared by two holders counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def random_batch(vocab: int, seqs: int, prompt: int, completion: int) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(vocab, (seqs, n), generator=g).tolist()
    advantages = (torch.rand(seqs, generator=g) * 2 - 1).tolist()
    return TrainBatch(ids(prompt), ids(completion), [[-1.0] * completion for _ in range(seqs)], advantages)


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure_mode(mode: str, cfg, a, batch, settings: StepSettings) -> dict:
    model = build_model(cfg, dtype=a.dtype, seed=0)
    if mode == "lora":
        add_lora(model, a.rank, a.alpha, a.targets, seed=0)
    engine = Engine(engine_copy(model), kv_budget_tokens=a.seqs * (a.prompt + a.completion) + 64)
    opt = torch.optim.AdamW(trainable_parameters(model), lr=1e-6)
    loss = build_loss("ppo")
    sp = SamplingParams(max_tokens=a.completion, seed=0, ignore_eos=True)
    engine.generate(batch.prompt_ids, sp)  # warm-up: packed weights, decode graphs
    rollout_s = _best(lambda: engine.generate(batch.prompt_ids, sp), a.steps)
    train_step(model, opt, loss, batch, settings)  # warm-up: AdamW's moments, the gradients
    with PeakHeap() as meter:
        m = train_step(model, opt, loss, batch, settings)
    step_s = _best(lambda: train_step(model, opt, loss, batch, settings), a.steps)
    versions = iter(range(1, 10**6))
    sync_s = _best(lambda: engine.update_weights(synced_weights(model), version=next(versions)), a.steps)
    params = list(model.parameters()) + list(engine.model.parameters())
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    moments = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    with tempfile.TemporaryDirectory() as d:
        (save_adapters if mode == "lora" else save_model)(model, d)
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        ckpt = sum(f.stat().st_size for f in Path(d).iterdir() if "safetensors" in f.name) + buf.tell()
    return {
        "trainable_params": sum(p.numel() for p in trainable_parameters(model)),
        "weights_mb": round(_bytes(params) / 2**20, 1),
        "grads_mb": round(_bytes(grads) / 2**20, 1),
        "optimizer_mb": round(_bytes(moments) / 2**20, 1),
        "state_mb": round(_bytes(params + grads + moments) / 2**20, 1),
        "step_peak_mb": round(meter.peak / 2**20, 1),
        "step_s": round(step_s, 3),
        "rollout_s": round(rollout_s, 3),
        "sync_s": round(sync_s, 4),
        "checkpoint_mb": round(ckpt / 2**20, 2),
        "loss": m["train/loss"],
    }


def measure(a) -> dict:
    cfg = qwen3_config(a.size)
    batch = random_batch(cfg.vocab_size, a.seqs, a.prompt, a.completion)
    settings = StepSettings(
        temperature=1.0,
        top_k=-1,
        top_p=1.0,
        micro_batch_size=a.seqs,
        agg_mode="token-mean",
        agg_constant=None,
        grad_clip=1.0,
    )
    out = {
        "size": a.size,
        "dtype": a.dtype,
        "lora": {"rank": a.rank, "alpha": a.alpha, "targets": list(a.targets)},
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "sequences": a.seqs,
        "tokens": a.seqs * (a.prompt + a.completion),
        "load_avg_1m_start": os.getloadavg()[0],
        "modes": {mode: measure_mode(mode, cfg, a, batch, settings) for mode in MODES},
    }
    out["load_avg_1m_end"] = os.getloadavg()[0]  # other processes slow the steps, not the byte counts
    full, lora = out["modes"]["full"], out["modes"]["lora"]
    out["params"] = full["trainable_params"]
    keys = ("trainable_params", "state_mb", "step_peak_mb", "step_s", "rollout_s", "sync_s", "checkpoint_mb")
    out["lora_over_full"] = {k: round(lora[k] / full[k], 4) if full[k] else None for k in keys}
    return out


def _targets(text: str) -> tuple[str, ...]:
    names = TARGETS if text == "all" else tuple(text.split(","))
    bad = [n for n in names if n not in TARGETS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown target {bad[0]!r}; choose from {list(TARGETS)} or 'all'")
    return names


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="exactrl bench lora")
    p.add_argument("--size", default="20M", choices=sorted(SIZES))
    p.add_argument("--rank", type=positive_int, default=16)
    p.add_argument("--alpha", type=positive_float, default=32.0)
    p.add_argument("--targets", type=_targets, default=TARGETS, help="comma-separated projections, or 'all'")
    p.add_argument("--seqs", type=positive_int, default=8)
    p.add_argument("--prompt", type=positive_int, default=32)
    p.add_argument("--completion", type=positive_int, default=224)
    p.add_argument("--steps", type=positive_int, default=2, help="timed repeats of each measurement (best of)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quick", action="store_true", help="tiny model, short sequences (smoke test)")
    a = p.parse_args(argv)
    if a.quick:
        apply_quick(p, a, size="tiny", seqs=2, prompt=8, completion=24, steps=1, rank=4)
    check_context(p, "--prompt + --completion", a.prompt + a.completion)
    print(json.dumps(measure(a), indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
