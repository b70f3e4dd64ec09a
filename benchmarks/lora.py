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
  this step's gradients, temporaries (benchmarks/memory.py's `PeakHeap`). The
  step first frees the last step's gradients, which the start counts, so in
  `full` mode this is below the activations' own peak: compare totals.
- total_mb: state_mb + step_peak_mb, the most the run holds during a step
  (the KV pool and packed copies aside).
- rollout_s: `Engine.generate` of one completion of `--completion` tokens
  per sequence (`ignore_eos`), decode graphs on.
- step_s: one `train_step`.
- sync_s: `Engine.update_weights` of what the loop syncs
  (`lora.synced_weights`: every weight, or the adapters alone).
- times are the best of `--steps` rounds after a warm-up; in each round the
  modes take turns (rollout, step, sync of one, then of the other), so a
  change in the machine's load falls on both.
- checkpoint_mb: the bytes of the model part (model.safetensors, or the PEFT
  adapter files) plus optimizer.pt, as a checkpoint writes them.

Ratios are lora / full. The 1-minute load average at start and end is in the output.

    exactrl bench lora [--quick] [--size 20M] [--rank 16] [--alpha 32] [--targets all] [--seqs 8]
                       [--prompt 32] [--completion 224] [--steps 3] [--dtype float32]

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


class Mode:
    """One mode's model, engine and optimizer, as train/setup.py builds them."""

    def __init__(self, name: str, cfg, a, batch: TrainBatch, settings: StepSettings):
        self.name, self.batch, self.settings = name, batch, settings
        self.model = build_model(cfg, dtype=a.dtype, seed=0)
        if name == "lora":
            add_lora(self.model, a.rank, a.alpha, a.targets, seed=0)
        self.engine = Engine(engine_copy(self.model), kv_budget_tokens=a.seqs * (a.prompt + a.completion) + 64)
        self.opt = torch.optim.AdamW(trainable_parameters(self.model), lr=1e-6)
        self.loss = build_loss("ppo")
        self.sp = SamplingParams(max_tokens=a.completion, seed=0, ignore_eos=True)
        self.versions = iter(range(1, 10**9))
        self.times: dict[str, list[float]] = {"rollout_s": [], "step_s": [], "sync_s": []}

    def rollout(self):
        return self.engine.generate(self.batch.prompt_ids, self.sp)

    def step(self):
        return train_step(self.model, self.opt, self.loss, self.batch, self.settings)

    def sync(self):
        return self.engine.update_weights(synced_weights(self.model), version=next(self.versions))

    def timed(self) -> None:
        for key, fn in (("rollout_s", self.rollout), ("step_s", self.step), ("sync_s", self.sync)):
            t = time.perf_counter()
            fn()
            self.times[key].append(time.perf_counter() - t)

    def memory(self) -> dict:
        """After the warm-ups: the metered step, then the bytes it keeps (see the module docstring)."""
        with PeakHeap() as meter:
            self.step()
        model, opt = self.model, self.opt
        params = list(model.parameters()) + list(self.engine.model.parameters())
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        moments = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
        with tempfile.TemporaryDirectory() as d:
            (save_adapters if self.name == "lora" else save_model)(model, d)
            buf = io.BytesIO()
            torch.save(opt.state_dict(), buf)
            ckpt = sum(f.stat().st_size for f in Path(d).iterdir() if "safetensors" in f.name) + buf.tell()
        state, peak = round(_bytes(params + grads + moments) / 2**20, 1), round(meter.peak / 2**20, 1)
        return {
            "trainable_params": sum(p.numel() for p in trainable_parameters(model)),
            "weights_mb": round(_bytes(params) / 2**20, 1),
            "grads_mb": round(_bytes(grads) / 2**20, 1),
            "optimizer_mb": round(_bytes(moments) / 2**20, 1),
            "state_mb": state,
            "step_peak_mb": peak,
            "total_mb": round(state + peak, 1),
            "checkpoint_mb": round(ckpt / 2**20, 2),
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
    }
    modes = [Mode(name, cfg, a, batch, settings) for name in MODES]
    for m in modes:  # warm-ups: packed weights, decode graphs, AdamW's moments, the gradients
        m.rollout(), m.step(), m.sync()
    out["modes"] = {m.name: m.memory() for m in modes}
    for _ in range(a.steps):  # the modes take turns, so a change in the machine's load falls on both
        for m in modes:
            m.timed()
    for m in modes:
        out["modes"][m.name] |= {k: round(min(v), 4) for k, v in m.times.items()}
    out["load_avg_1m_end"] = os.getloadavg()[0]  # other processes slow the steps, not the byte counts
    full, lora = out["modes"]["full"], out["modes"]["lora"]
    out["params"] = full["trainable_params"]
    keys = (
        "trainable_params",
        "state_mb",
        "step_peak_mb",
        "total_mb",
        "step_s",
        "rollout_s",
        "sync_s",
        "checkpoint_mb",
    )
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
    p.add_argument("--steps", type=positive_int, default=3, help="timed rounds (best of)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quick", action="store_true", help="tiny model, short sequences (smoke test)")
    a = p.parse_args(argv)
    if a.quick:
        apply_quick(p, a, size="tiny", seqs=2, prompt=8, completion=24, steps=1, rank=4)
    check_context(p, "--prompt + --completion", a.prompt + a.completion)
    print(json.dumps(measure(a), indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
