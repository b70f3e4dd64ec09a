"""exactrl bench train: GRPO step throughput of exactrl against TRL's GRPOTrainer, same run.

What is measured. One random Qwen3 (built with transformers, saved with the
project's own byte-level tokenizer to a temp dir) is trained from the same
weights by both sides with the same batch: P prompts per step, G completions
per prompt, prompts of exactly `--prompt` tokens (strings of random digits,
which the tokenizer splits one per token) and exactly `--new` completion
tokens per sequence (end-of-sequence ignored on both sides, so both sides
train on P·G·N completion tokens per step). The reward is a deterministic
function of the completion ids (fraction of even token ids), so group
advantages are non-zero and every token carries gradient. One optimizer step
per batch on both sides, same learning rate, AdamW, grad clip 1.0, fp32.
Model shapes are benchmarks/_common.py's SIZES: `20M` (vocab 16384, hidden
384, 6 layers, GQA 6/2 heads, tied embeddings: ≈15.7M parameters), `tiny` for
`--quick`.

- exactrl: a full step as `exactrl/train/loop.py` does it — `Engine.generate`
  (n = G per prompt) -> rewards -> `compute_advantages` -> `train_step`
  (PPO-clip, token-mean, the run config's defaults, so each group's prompt is
  laid out once in the trainer's forward: `optim.share_prompts`) -> `engine.update_weights`.
  `train/train_rollout_logprob_abs_diff` and `_max` are the metrics
  `train_step` itself returns (engine μ vs trainer π_old, docs/design.md §3); with
  `exact` kernels they must be 0.0. With `--fast` the `fast` kernels run
  the same steps too (off by default: it doubles the exactrl side's time).
- TRL: `trl.GRPOTrainer` with `num_generations=G`,
  `per_device_train_batch_size=P·G`, `steps_per_generation=1`,
  `num_iterations=1`, `beta=0` (no reference model), transformers `generate`
  (no vLLM), `min_new_tokens=max_completion_length` (EOS never sampled, so
  no completion is cut), constant lr, `gradient_checkpointing=False` (TRL
  turns it on by default; off is faster here and matches exactrl), fp32.

Throughput is completion tokens per second of wall time over whole steps,
after one untimed warm-up step: exactrl from before `generate` to after
`update_weights`; TRL between consecutive `on_step_end` callbacks (so it
includes its data loading and logging hooks, as exactrl's loop timing does).
Both trainers run one forward/backward over the whole batch (no
micro-batching). The sides alternate step by step in one process (TRL's
step i, then exactrl's step i, each timed alone: TRL's clock restarts after
exactrl's step), so a change in the machine's speed during the run (a shared
VM's neighbours) slows both sides alike; `--sequential` runs all of
exactrl's steps first, then TRL's. `phase_ratio_*` splits the speed-up: rollout (engine vs
transformers `generate`, timed around TRL's call) and the rest of the step.
`flop_floor` is the step's matmul FLOPs at the fp32 matmul peak torch's GEMM
(1024² products) reaches in the same run, and `ceiling_over_trl` TRL's step
time over that floor: what an implementation whose step were nothing but
products at that speed would gain. It is no hard bound: a GEMM nearer the
cores' FMA peak would move it. Other processes on the machine slow both sides (and small decode
ops the most); the 1-minute load average at start and end is in the output.

TRL's train/rollout logprob difference. Without vLLM, TRL keeps no sampling
logprobs (its `sampling/sampling_logp_difference/*` metrics are vLLM-only):
it trains with π_old = π_θ.detach() of its training forward, i.e. it assumes
`generate` sampled from exactly that distribution. We measure how true that
is on the warm-up step, inside TRL's own two paths: the model's `generate`
is wrapped to also return its raw per-step logits (`output_logits=True`), and
the rollout logprob of each sampled token is log_softmax(logits / T) at that
token (raw logits: the EOS ban of `min_new_tokens` is a benchmark device, not
numerics, and is left out); the trainer logprob is what
`_get_per_token_logps_and_entropies` returns in `_compute_loss` (the forward
that builds the loss graph, over the prompt+completion batch, TRL's fused
LM head). Rows are matched by their token ids (TRL shuffles the batch
between generation and training). Same definitions as exactrl's metric: per
sequence the mean of |lp_train - lp_rollout| over its completion tokens, then
the mean over sequences; `_max` over all tokens. The probe is only active on
the warm-up step, so it costs the timed steps nothing.

    exactrl bench train [--quick] [--size 20M] [--prompts 8] [--group 8] [--prompt 32] [--new 128]
                        [--steps 3] [--lr 5e-5] [--seed 0] [--no-trl] [--fast] [--sequential]

Legend: P prompts per step, G samples per prompt, B = P·G sequences, N completion tokens, V vocabulary.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.metadata
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    CONTEXT,
    SIZES,
    apply_quick,
    check_context,
    linear_weights,
    matmul_peak_gflops,
    positive_float,
    positive_int,
    seed_int,
)

TRL_MISSING = "not installed (pip install 'exactrl[bench]')"
DIFF, DIFF_MAX = "train/train_rollout_logprob_abs_diff", "train/train_rollout_logprob_abs_diff_max"


def log(msg: str) -> None:
    print(f"[bench train] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- shared setup


def build_model_dir(out: Path, size: str, seed: int) -> dict:
    """Project tokenizer + random transformers Qwen3 of `size` in `out`; returns its description."""
    import transformers

    from exactrl.envs import ArithmeticTask
    from exactrl.model.tokenizer import build_tokenizer, default_tokenizer_corpus, load_tokenizer

    shape = SIZES[size]
    rng = random.Random(seed)
    # random words give BPE enough distinct pairs to fill the size's vocabulary (16k for 20M)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))) for _ in range(20000)]
    texts = default_tokenizer_corpus([ArithmeticTask()], 300, seed) + [
        " ".join(rng.choices(words, k=50)) for _ in range(4000)
    ]
    build_tokenizer(out, texts, vocab_size=shape["vocab_size"])
    tok = load_tokenizer(out)
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        **{**shape, "vocab_size": tok.vocab_size},
        max_position_embeddings=CONTEXT,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    hf = transformers.Qwen3ForCausalLM(cfg)
    hf.save_pretrained(out)
    body, head = linear_weights(hf)[:-1], linear_weights(hf)[-1]
    return {
        "size": size,
        "params": sum(p.numel() for p in hf.parameters()),
        "vocab_size": tok.vocab_size,
        "layers": shape["num_hidden_layers"],
        "hidden": shape["hidden_size"],
        "dtype": "float32",
        "matmul_params_body": sum(w.numel() for w in body),
        "matmul_params_head": head.numel(),
    }


def make_prompts(n: int, length: int, seed: int) -> list[str]:
    """`n` distinct strings of `length` random digits: the tokenizer splits digits one per token."""
    rng = random.Random(seed)
    return ["".join(rng.choice("0123456789") for _ in range(length)) for _ in range(n)]


def even_token_reward(completion_ids: list[int]) -> float:
    """Fraction of even token ids: deterministic in the completion, varies within a group."""
    return sum(t % 2 == 0 for t in completion_ids) / max(len(completion_ids), 1)


def diff_stats(train: list[torch.Tensor], rollout: list[torch.Tensor]) -> tuple[float, float]:
    """docs/design.md §3: mean over sequences of the per-sequence mean |Δ|, and the max over all tokens."""
    abs_diffs = [(a.double() - b.double()).abs() for a, b in zip(train, rollout)]
    return (sum(d.mean().item() for d in abs_diffs) / len(abs_diffs), max(d.max().item() for d in abs_diffs))


def throughput(step_s: list[float], tokens_per_step: int) -> dict:
    return {
        "completion_tokens_per_s": round(tokens_per_step * len(step_s) / sum(step_s), 1),
        "step_s_mean": round(sum(step_s) / len(step_s), 3),
        "step_s": [round(s, 3) for s in step_s],
    }


# ---------------------------------------------------------------- exactrl side


def exactrl_components(model_dir: Path, kernels: str, a) -> dict:
    """What `exactrl.train.setup.build` makes for a run, with the run config's defaults."""
    import exactrl
    from exactrl.algo.losses import build_loss
    from exactrl.train.config import EngineSettings, RunConfig
    from exactrl.train.trainer import StepSettings

    cfg = RunConfig()
    model = exactrl.load_model(model_dir, dtype="float32", kernels=kernels)
    tok = exactrl.load_tokenizer(model_dir)
    eng = EngineSettings().model_dump()
    # the whole step's batch decodes at once (no preemption), as with the default job's sizes;
    # + 64 tokens per sequence covers its partly filled pages
    eng["kv_budget_tokens"] = max(eng["kv_budget_tokens"], a.prompts * a.group * (a.prompt + a.new + 64))
    engine = exactrl.Engine(
        copy.deepcopy(model).requires_grad_(False), stop_token_ids=sorted(tok.stop_token_ids), **eng
    )
    o, alg = cfg.optim, cfg.algorithm
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=o.betas, weight_decay=o.weight_decay)
    # one forward/backward over the whole batch, as TRL's per_device_train_batch_size = P·G does
    micro = max(o.micro_batch_size, a.prompts * a.group)
    settings = StepSettings(
        temperature=1.0,
        top_k=-1,
        top_p=1.0,
        micro_batch_size=micro,
        agg_mode=alg.agg_mode,
        agg_constant=float(a.new),
        grad_clip=o.grad_clip,
        share_prompts=o.share_prompts,
    )
    return {
        "model": model,
        "tokenizer": tok,
        "engine": engine,
        "optimizer": optimizer,
        "settings": settings,
        "loss_fn": build_loss(alg.loss, **alg.loss_kwargs),
        "advantage": (alg.advantage, alg.advantage_kwargs),
    }


def exactrl_step(c: dict, prompt_ids_P: list[list[int]], a, step: int) -> tuple[dict, dict]:
    """One GRPO step as the synchronous loop runs it; returns (train_step metrics, phase times)."""
    from exactrl import SamplingParams
    from exactrl.algo.advantages import compute_advantages
    from exactrl.train.trainer import TrainBatch, train_step

    t0 = time.perf_counter()
    params = [
        SamplingParams(
            temperature=1.0, max_tokens=a.new, n=a.group, seed=a.seed * 1000 + step * 100 + k, ignore_eos=True
        )
        for k in range(len(prompt_ids_P))
    ]
    outs = c["engine"].generate(prompt_ids_P, params)
    t1 = time.perf_counter()
    flat = [(p, o) for p, samples in zip(prompt_ids_P, outs) for o in samples]
    assert all(len(o.token_ids) == a.new for _, o in flat), "ignore_eos: every completion has --new tokens"
    rewards_PG = torch.tensor([[even_token_reward(o.token_ids) for o in s] for s in outs], dtype=torch.float32)
    name, kwargs = c["advantage"]
    adv = compute_advantages(name, rewards_PG, **kwargs).reshape(-1).tolist()
    batch = TrainBatch(
        prompt_ids=[p for p, _ in flat],
        completion_ids=[list(o.token_ids) for _, o in flat],
        behav_logprobs=[list(o.logprobs) for _, o in flat],
        advantages=adv,
    )
    metrics = train_step(c["model"], c["optimizer"], c["loss_fn"], batch, c["settings"])
    t2 = time.perf_counter()
    c["engine"].update_weights(c["model"].state_dict(), version=step)
    t3 = time.perf_counter()
    return metrics, {"rollout_s": t1 - t0, "train_s": t2 - t1, "sync_s": t3 - t2, "step_s": t3 - t0}


class ExactrlRun:
    """exactrl's side, step by step: `step(i)` runs step i (0 is the untimed warm-up), `result()` sums up."""

    def __init__(self, model_dir: Path, prompts: list[str], a, kernels: str):
        self.c, self.a, self.kernels = exactrl_components(model_dir, kernels, a), a, kernels
        self.ids = [self.c["tokenizer"].encode(p) for p in prompts]
        assert all(len(x) == a.prompt for x in self.ids), "digit prompts must tokenize to --prompt tokens"
        self.diffs, self.maxes, self.times = [], [], []

    def step(self, step: int) -> None:
        a = self.a
        metrics, t = exactrl_step(self.c, self.ids[step * a.prompts : (step + 1) * a.prompts], a, step + 1)
        self.diffs.append(metrics[DIFF]), self.maxes.append(metrics[DIFF_MAX])
        if step > 0:  # the first step warms up allocator and kernels
            self.times.append(t)
        log(
            f"exactrl {self.kernels} step {step + 1}: {t['step_s']:.2f} s (rollout {t['rollout_s']:.2f}, "
            f"train {t['train_s']:.2f}), diff {metrics[DIFF]:.3g} max {metrics[DIFF_MAX]:.3g}"
        )

    def result(self) -> dict:
        a, times = self.a, self.times
        assert len(times) == a.steps, (len(times), a.steps)
        out = throughput([t["step_s"] for t in times], a.prompts * a.group * a.new)
        for k in ("rollout_s", "train_s", "sync_s"):
            out[f"{k}_mean"] = round(sum(t[k] for t in times) / len(times), 3)
        # worst step over all steps (warm-up included): the contract holds on every step
        out[DIFF], out[DIFF_MAX] = max(self.diffs), max(self.maxes)
        return out


def run_exactrl(model_dir: Path, prompts: list[str], a, kernels: str) -> dict:
    run = ExactrlRun(model_dir, prompts, a, kernels)
    for step in range(1 + a.steps):
        run.step(step)
    return run.result()


# ---------------------------------------------------------------- TRL side


class TRLProbe:
    """Records TRL's rollout-side and trainer-side logprobs of the same sequences while `active`."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.active = True  # only the warm-up step: the probe keeps B·N·V logits around
        self.rollout: dict[tuple, torch.Tensor] = {}  # prompt+completion ids -> logprob_N
        self.train: dict[tuple, torch.Tensor] = {}
        self.completion_tokens: list[int] = []  # per generate call (every step)
        self.generate_s: list[float] = []  # wall time of each generate call

    def wrap_generate(self, model) -> None:
        """Makes `model.generate` also return raw logits while active; it still returns the sequences only."""
        orig = model.generate

        def generate(*args, **kwargs):
            t = time.perf_counter()
            if not self.active:
                seqs = orig(*args, **kwargs)
            else:
                gc = copy.deepcopy(kwargs.pop("generation_config"))
                gc.output_logits, gc.return_dict_in_generate = True, True
                out = orig(*args, **kwargs, generation_config=gc)
                seqs = out.sequences
                self._record_rollout(seqs, out.logits)
            self.generate_s.append(time.perf_counter() - t)
            self.completion_tokens.append(seqs.shape[0] * (seqs.shape[1] - kwargs["input_ids"].shape[1]))
            return seqs

        model.generate = generate

    def _record_rollout(self, seqs_BL: torch.Tensor, logits_N_BV: tuple[torch.Tensor, ...]) -> None:
        N = len(logits_N_BV)
        sampled_BN = seqs_BL[:, -N:]
        lp_BN = torch.stack(
            [
                torch.log_softmax(lg.float() / self.temperature, dim=-1).gather(1, sampled_BN[:, t : t + 1])[:, 0]
                for t, lg in enumerate(logits_N_BV)
            ],
            dim=1,
        )
        for row, lp in zip(seqs_BL.tolist(), lp_BN):
            self.rollout[tuple(row)] = lp

    def record_train(self, input_ids_BL: torch.Tensor, logps_BN: torch.Tensor) -> None:
        for row, lp in zip(input_ids_BL.tolist(), logps_BN.detach()):
            self.train[tuple(row)] = lp

    def diff(self) -> tuple[float, float, int]:
        if not self.rollout or set(self.rollout) != set(self.train):
            raise RuntimeError(
                f"TRL probe: {len(self.rollout)} generated vs {len(self.train)} trained sequences "
                f"matched by token ids; TRL's generate/_get_per_token_logps_and_entropies changed?"
            )
        keys = sorted(self.rollout)
        mean, mx = diff_stats([self.train[k] for k in keys], [self.rollout[k] for k in keys])
        return mean, mx, len(keys)


def probed_trainer(probe: TRLProbe):
    """GRPOTrainer whose training forward also reports its per-token logprobs to `probe`."""
    from trl import GRPOTrainer

    class ProbedGRPOTrainer(GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kw):
            out = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kw
            )
            # with beta = 0 and one step per generation, the call with grad is `_compute_loss`'s forward
            if probe.active and torch.is_grad_enabled():
                assert bool(attention_mask.all()), "equal-length prompts and completions: no padding expected"
                probe.record_train(input_ids, out[0])
            return out

    return ProbedGRPOTrainer


def trl_config(out_dir: str, a):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=a.seed,
        max_steps=1 + a.steps,
        num_generations=a.group,
        per_device_train_batch_size=a.prompts * a.group,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        beta=0.0,
        max_completion_length=a.new,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        generation_kwargs={"min_new_tokens": a.new},
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta2=0.99,
        max_grad_norm=1.0,
        gradient_checkpointing=False,
        disable_dropout=True,
        dataloader_num_workers=0,
        log_completions=False,
    )


def run_trl(model_dir: Path, prompts: list[str], a, between: Callable[[int], None] | None = None) -> dict:
    """TRL's side. `between(i)`, if given, runs after TRL's step i, outside TRL's timing (interleaving)."""
    import transformers
    from datasets import Dataset

    probe = TRLProbe(temperature=1.0)
    ends: list[float] = []
    resumes: list[float] = []  # when TRL's clock restarts after step i: its end, or after `between`

    class StepTimes(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter())
            probe.active = False
            log(f"TRL step {len(ends)}" + (f": {ends[-1] - resumes[-1]:.2f} s" if len(ends) > 1 else " (warm-up)"))
            if between is not None:
                between(len(ends) - 1)
            resumes.append(time.perf_counter())

    model = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    probe.wrap_generate(model)
    with tempfile.TemporaryDirectory() as out_dir, contextlib.redirect_stdout(sys.stderr):
        trainer = probed_trainer(probe)(
            model=model,
            reward_funcs=[trl_even_token_reward],
            args=trl_config(out_dir, a),
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=tok,
            callbacks=[StepTimes()],
        )
        trainer.train()
    tokens_per_step = a.prompts * a.group * a.new
    if probe.completion_tokens != [tokens_per_step] * (1 + a.steps):
        raise RuntimeError(
            f"TRL generated {probe.completion_tokens} completion tokens per step, expected "
            f"{tokens_per_step} each (min_new_tokens should force --new tokens)"
        )
    out = throughput([t1 - t0 for t0, t1 in zip(resumes, ends[1:])], tokens_per_step)
    gen_s = probe.generate_s[1:]  # the timed steps' rollouts
    out["generate_s_mean"] = round(sum(gen_s) / len(gen_s), 3)
    out["rest_s_mean"] = round(out["step_s_mean"] - out["generate_s_mean"], 3)  # logprobs, loss, backward, step
    mean, mx, n = probe.diff()
    out |= {
        DIFF: mean,
        DIFF_MAX: mx,
        "logprob_diff_sequences": n,
        "logprob_diff_measured": "warm-up step: HF generate raw logits, log_softmax(logits/T) at the sampled "
        "token, vs GRPOTrainer._get_per_token_logps_and_entropies in _compute_loss",
        "trl_logged_logprob_diff": "none without vLLM (sampling/sampling_logp_difference/* is vLLM-only)",
        "settings": "transformers generate, beta=0, num_iterations=1, steps_per_generation=1, "
        "gradient_checkpointing=False, fp32, constant lr",
    }
    return out


def trl_even_token_reward(completion_ids: list[list[int]], **kwargs) -> list[float]:
    """TRL reward function: the same reward as the exactrl side's."""
    return [even_token_reward(ids) for ids in completion_ids]


# ---------------------------------------------------------------- driver


def versions(with_trl: bool) -> dict:
    import transformers

    v = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "exactrl": importlib.metadata.version("exactrl"),
    }
    if with_trl:
        v["trl"] = importlib.metadata.version("trl")
    return v


def trl_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl") is not None


def ratios(exactrl: dict, trl: dict) -> dict:
    """exactrl/TRL speed-ups: whole step (the figure of merit), and per phase to show where time goes."""
    out = {}
    for k, r in exactrl.items():
        out[f"ratio_{k}_over_trl"] = round(r["completion_tokens_per_s"] / trl["completion_tokens_per_s"], 2)
        out[f"phase_ratio_{k}_over_trl"] = {
            "rollout": round(trl["generate_s_mean"] / r["rollout_s_mean"], 2),  # engine vs HF generate
            "rest": round(trl["rest_s_mean"] / (r["train_s_mean"] + r["sync_s_mean"]), 2),
        }  # everything else
    out["target_ratio"] = 3.0
    return out


def flop_floor(model: dict, a, trl: dict | None) -> dict:
    """The step's matmul FLOPs at torch's fp32 GEMM peak measured in the run: a floor for a step of products.

    Rollout: the prompt's prefill once per prompt (P·prompt rows), whose last row's
    LM head gives the G samples their first token (P head rows), then one row per
    generated token fed back (B·(N − 1): the last is never fed). Training: forward +
    backward (3 × 2 FLOPs per weight and row) through the layers over each prompt
    once and every completion token but the last, whose output predicts nothing
    (P·prompt + B·(N − 1) rows: a group's samples share their prompt, as exactrl's
    trainer lays it out, `optim.share_prompts`; TRL computes B·(prompt + N) rows), and
    the LM head on the B·N rows that predict a completion token (as TRL's
    `logits_to_keep`). Attention scores, norms and the optimizer are left out, so the
    floor is lower than any real step; `ceiling_over_trl` = TRL's step time / floor
    is what a step of nothing but these products at that speed would gain.
    """
    body, head = model["matmul_params_body"], model["matmul_params_head"]
    P, B, N = a.prompts, a.prompts * a.group, a.new
    rollout = 2 * body * (P * a.prompt + B * (N - 1)) + 2 * head * (P + B * (N - 1))
    train = 6 * body * (P * a.prompt + B * (N - 1)) + 6 * head * B * N
    peak = matmul_peak_gflops()
    floor_s = (rollout + train) / 1e9 / peak
    out = {
        "gflop_rollout": round(rollout / 1e9, 3),
        "gflop_train": round(train / 1e9, 3),
        "matmul_peak_gflops_fp32": round(peak, 1),
        "floor_step_s": float(f"{floor_s:.3g}"),
    }
    if trl is not None:
        out["ceiling_over_trl"] = round(trl["step_s_mean"] / floor_s, 2)
    return out


def parse_args(argv: list[str]):
    p = argparse.ArgumentParser(prog="exactrl bench train", description=__doc__.splitlines()[0])
    p.add_argument("--size", default="20M", choices=sorted(SIZES), help="model shape (benchmarks/_common.py)")
    p.add_argument("--prompts", type=positive_int, default=8, help="prompts per step (P)")
    p.add_argument("--group", type=positive_int, default=8, help="completions per prompt (G, >= 2)")
    p.add_argument("--prompt", type=positive_int, default=32, help="prompt tokens")
    p.add_argument("--new", type=positive_int, default=128, help="completion tokens per sequence (N, eos ignored)")
    p.add_argument("--steps", type=positive_int, default=3, help="timed steps, after one warm-up step")
    p.add_argument("--lr", type=positive_float, default=5e-5)
    p.add_argument("--seed", type=seed_int, default=0, help="0..2**32-1 (TRL's seeding of numpy takes no other)")
    p.add_argument("--no-trl", action="store_true", help="skip TRL's GRPOTrainer")
    p.add_argument("--fast", action="store_true", help="also run exactrl with fast kernels (non-zero diff)")
    p.add_argument(
        "--sequential",
        action="store_true",
        help="run exactrl's steps, then TRL's (default: each exactrl step right after TRL's)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, 2x4 sequences, 8+8 tokens, 1 step")
    a = p.parse_args(argv)
    if a.quick:
        apply_quick(p, a, size="tiny", prompts=2, group=4, prompt=8, new=8, steps=1)
    if a.group < 2 or a.prompts < 1 or a.prompt < 1 or a.new < 1 or a.steps < 1:
        p.error(
            "need --group >= 2 (GRPO compares completions of a prompt) and --prompts, --prompt, --new, --steps >= 1"
        )
    check_context(p, f"--prompt {a.prompt} + --new {a.new}", a.prompt + a.new)
    return a


def main(argv: list[str]) -> None:
    a = parse_args(argv)
    with_trl = not a.no_trl and trl_available()
    out = {
        "benchmark": "train",
        "versions": versions(with_trl),
        "threads": torch.get_num_threads(),
        # other processes on the machine slow both sides; the load average says how busy it was
        "load_avg_1min_start": os.getloadavg()[0],
        "shapes": {
            "prompts_per_step": a.prompts,
            "group_size": a.group,
            "sequences_per_step": a.prompts * a.group,
            "prompt_tokens": a.prompt,
            "completion_tokens": a.new,
            "completion_tokens_per_step": a.prompts * a.group * a.new,
            "warmup_steps": 1,
            "timed_steps": a.steps,
            "lr": a.lr,
        },
        "reward": "fraction of even completion token ids (same function both sides)",
    }
    prompts = make_prompts((1 + a.steps) * a.prompts, a.prompt, a.seed)
    with tempfile.TemporaryDirectory() as d:
        out["model"] = build_model_dir(Path(d), a.size, a.seed)
        log(f"model {out['model']['params'] / 1e6:.1f}M params; {out['shapes']}")
        kernels = ["exact", "fast"] if a.fast else ["exact"]
        if with_trl and not a.sequential:  # each exactrl step right after TRL's: drift slows both alike
            runs = {k: ExactrlRun(Path(d), prompts, a, k) for k in kernels}
            out["trl"] = run_trl(Path(d), prompts, a, between=lambda i: [r.step(i) for r in runs.values()])
            out["exactrl"] = {k: r.result() for k, r in runs.items()}
        else:
            out["exactrl"] = {k: run_exactrl(Path(d), prompts, a, k) for k in kernels}
            out["trl"] = (
                run_trl(Path(d), prompts, a) if with_trl else ("skipped (--no-trl)" if a.no_trl else TRL_MISSING)
            )
        out["order"] = (
            "interleaved (TRL step, then exactrl's: " + ", ".join(kernels) + ")"
            if with_trl and not a.sequential
            else "sequential"
        )
    if with_trl:
        out |= ratios(out["exactrl"], out["trl"])
    out["flop_floor"] = flop_floor(out["model"], a, out["trl"] if with_trl else None)
    out["load_avg_1min_end"] = os.getloadavg()[0]
    out["threads_after"] = torch.get_num_threads()  # TRL/accelerate must not have changed the thread count
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
