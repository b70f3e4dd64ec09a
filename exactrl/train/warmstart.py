"""The default job's model: a project-built tokenizer, a tiny Qwen3, a supervised warm start.

Built on first use and cached under `artifacts/default-<hash>/` (the hash
covers everything that shapes the result: task name and kwargs, a task
file's content, SFT settings, seed, dtype, model sizes), so a second `make run` skips straight to RL. The
warm start is deliberately short: it teaches the answer format and part of
the task, leaving RL something to improve (docs/performance.md reports the accuracies
before and after).

The warm start is `exactrl sft`'s step (train/sft.py): the loss is the mean negative logprob of the answer
tokens (plus the end-of-turn token) given the rendered prompt, through the same `token_logprobs` trainer
path as RL.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
import uuid
from pathlib import Path

from exactrl.envs import get_task
from exactrl.envs.base import module_sha256
from exactrl.envs.prompts import answer_ids, prompt_ids
from exactrl.model import ModelConfig, build_model, save_model
from exactrl.model.tokenizer import build_tokenizer, default_tokenizer_corpus, load_tokenizer
from exactrl.train.setup import scheduled_lr
from exactrl.train.sft import SFTOptimSettings, make_optimizer, sft_step
from exactrl.train.sft_data import Example

# the cache of warm-started default models: ./artifacts, or where EXACTRL_ARTIFACTS points (one cache for
# runs started from any directory)
ARTIFACTS = Path(os.environ.get("EXACTRL_ARTIFACTS", "artifacts"))

# the default policy: a Qwen3-architecture model of ~0.9M parameters
TINY_QWEN3 = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


def _hash(cfg) -> str:
    # The warm start reads only task.name and task.kwargs of the task section. The other task fields
    # (train_jsonl, train_size, eval_size) enter the key at their defaults and `module`, `dataset`, `columns`,
    # `reward`, `kind`, `env_id` and `env_args` not at all, so changing them reuses the cache and every key
    # computed before stays valid (the default job's is still default-db305121dee7).
    # A task from a user's file (`task.module`) adds the file's content: an edited task is a new warm start.
    task = type(cfg.task)(name=cfg.task.name, kwargs=cfg.task.kwargs)
    parts = {
        "task": task.model_dump(exclude={"module", "dataset", "columns", "reward", "kind", "env_id", "env_args"}),
        "sft": cfg.sft.model_dump(),
        "seed": cfg.seed,
        "dtype": cfg.model.dtype,
        "tiny": TINY_QWEN3,
        "v": 1,
    }
    if cfg.task.module:
        parts["module_sha256"] = module_sha256(cfg.task.module)
    if cfg.model.dtype != "float32":  # fp32 keys stay as they were: the flag changes nothing there
        parts["fp32_master_weights"] = cfg.optim.fp32_master_weights
    key = json.dumps(parts, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def default_model_dir(cfg, log=print) -> Path:
    """Returns the cached warm-started model directory, building it if needed.

    Each build writes a directory of its own and renames it into place, so two runs building the same model
    at once both finish (the first rename wins; they shared one scratch directory, and one deleted the other's
    half-built model), and a crash leaves no half-built cache entry."""
    out = ARTIFACTS / f"default-{_hash(cfg)}"
    if _complete(out):
        return out
    try:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        tmp = ARTIFACTS / f".tmp-{out.name}-{uuid.uuid4().hex[:12]}"  # mkdtemp's would be private (0700)
        tmp.mkdir()
    except OSError as e:
        why = "a file, not a directory" if ARTIFACTS.is_file() else e.strerror or e
        raise ValueError(
            f"cannot write the default model's cache in {ARTIFACTS} ({why}): point "
            f"EXACTRL_ARTIFACTS at a writable directory, or set model.path to a model"
        ) from None
    t0 = time.time()
    try:
        _build(cfg, tmp, log)
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"warm start done in {time.time() - t0:.0f}s -> {out}")
    return out


def _complete(d: Path) -> bool:
    return (d / "model.safetensors").is_file() and (d / "config.json").is_file()


def _publish(tmp: Path, out: Path) -> None:
    """Renames the built `tmp` to `out`, unless another run's complete build got there first; an incomplete
    `out` (its files deleted by hand) is replaced."""
    if out.exists() and not _complete(out):
        stale = ARTIFACTS / f".stale-{out.name}-{uuid.uuid4().hex[:12]}"
        out.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:  # a directory of that name appeared meanwhile: another run's build
        if not _complete(out):
            raise


def _build(cfg, tmp: Path, log) -> None:
    """Tokenizer, model and warm start into `tmp`."""
    task = get_task(cfg.task.name, **cfg.task.kwargs)
    build_tokenizer(tmp, default_tokenizer_corpus([task], 2000, cfg.seed), vocab_size=384)
    tok = load_tokenizer(tmp)
    hf = {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": tok.vocab_size,
        "hidden_act": "silu",
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "eos_token_id": tok.end_of_turn_id,
        "pad_token_id": tok.pad_token_id,
        **TINY_QWEN3,
    }
    model = build_model(ModelConfig.from_hf(hf), dtype=cfg.model.dtype, kernels="exact", seed=cfg.seed)
    log(
        f"warm start: tokenizer ({tok.vocab_size} tokens) and a {sum(p.numel() for p in model.parameters()):,}"
        f"-parameter Qwen3; {cfg.sft.steps} SFT steps"
    )
    supervised_finetune(
        model,
        tok,
        task,
        cfg.sft.steps,
        cfg.sft.batch_size,
        cfg.sft.lr,
        cfg.seed,
        log,
        echo_frac=cfg.sft.echo_frac,
        fp32_master_weights=cfg.optim.fp32_master_weights,
    )
    save_model(model, tmp)


def supervised_finetune(
    model,
    tok,
    task,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    log=print,
    echo_frac: float = 0.0,
    fp32_master_weights: bool = True,
) -> None:
    """`exactrl sft`'s step (train/sft.py) on demonstrations drawn from the task: AdamW, the learning rate
    decaying linearly to 0, each step's batch one packed sequence. A bf16 model's steps go through fp32 master
    weights (`optim.fp32_master_weights`, as RL's do): without them the decaying steps round away (the default
    bf16 warm start ended at NLL 0.278 without them, 0.249 with them, fp32 at 0.224)."""
    rng = random.Random(seed + 1)
    echo_rng = random.Random(seed + 2)  # its own stream: echo_frac does not change which problems are drawn
    o = SFTOptimSettings(
        lr=lr, betas=(0.9, 0.98), grad_clip=1.0, lr_schedule="linear", fp32_master_weights=fp32_master_weights
    )
    opt = make_optimizer(model, o)
    for step in range(1, steps + 1):
        batch = [demonstration(tok, task, task.generate(rng), echo_rng, echo_frac) for _ in range(batch_size)]
        for g in opt.param_groups:  # linear decay keeps the end of the warm start stable
            g["lr"] = scheduled_lr(o, step, steps)
        m = sft_step(model, opt, batch, sum(len(e.tokens) for e in batch), o.grad_clip)
        if step % 50 == 1 or step == steps:
            log(f"  sft step {step - 1:4d}  nll {m['train/loss']:.3f}")


def demonstration(tok, task, problem, echo_rng: random.Random, echo_frac: float) -> Example:
    """The task's prompt as RL renders it, then the demonstrated answer and end of turn (the trained tokens)."""
    prompt = prompt_ids(tok, task, problem)
    answer = answer_ids(tok, problem, echo_rng.random() < echo_frac)
    return Example(prompt + answer, [False] * len(prompt) + [True] * len(answer), problem.prompt)
