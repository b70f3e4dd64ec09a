"""`exactrl sft CONFIG.yaml [--set key=value ...]`: supervised fine-tuning as a run.

The run keeps its files as `exactrl train` does (train/run_dir.py, train/checkpoint.py): the same run-dir
rules and lock, metrics.jsonl and TensorBoard, atomic checkpoints of model.safetensors, optimizer.pt and
state.json. A checkpoint directory is a model directory, so RL starts from it with `exactrl train --set
model.path=RUN/checkpoints/step_N --set model.tokenizer=<the tokenizer's directory>` (checkpoints hold no
tokenizer). A resume restores the weights, the optimizer, the data position and the random streams, and
goes on as the uninterrupted run would, bit for bit; it refuses other settings, data or tokenizer.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np
import torch

from exactrl.console import stderr_line
from exactrl.distributed import Ranks
from exactrl.model import load_model
from exactrl.model.checkpoint import resolve_device
from exactrl.model.tokenizer import Tokenizer, load_tokenizer
from exactrl.model.transformer import CausalLM
from exactrl.train import signals
from exactrl.train.checkpoint import latest_checkpoint, load_checkpoint, replace_durably, save_checkpoint
from exactrl.train.config import dotted, load_config
from exactrl.train.logger import MetricsLogger
from exactrl.train.resume import _restore_rng, rng_state, software_versions
from exactrl.train.run import stopped_by
from exactrl.train.run_dir import check_run_dir, claim_run_dir
from exactrl.train.setup import scheduled_lr
from exactrl.train.sft import SFTConfig, make_optimizer, sft_step
from exactrl.train.sft_data import ExampleStream, read_sft_jsonl

DISPLAY = [
    ("train/loss", "loss", "{:.4f}"),
    ("train/tokens", "tokens", "{:.0f}"),
    ("train/lr", "lr", "{:.2e}"),
    ("perf/tokens_per_s", "tok/s", "{:.0f}"),
]
# keys a resumed run may change: where and how long it runs and what it shows; a moved model or data file
# (the weights come from the checkpoint; the data's and tokenizer's fingerprints are checked)
RESUMABLE = (
    "max_steps",
    "run_dir",
    "resume",
    "progress",
    "tensorboard",
    "save_every",
    "keep_checkpoints",
    "model.path",
    "model.tokenizer",
    "data.train_jsonl",
)


@dataclass
class SFTRun:
    """What the loop needs, built from the config by `build`."""

    cfg: SFTConfig
    model: CausalLM
    optimizer: torch.optim.Optimizer
    tokenizer: Tokenizer
    data: ExampleStream
    run_dir: Path
    logger: MetricsLogger
    lock: IO[str]  # the open run_dir/.lock held for the run
    new: bool  # build created run_dir
    start_step: int

    def close(self) -> None:
        try:
            self.logger.close()
        finally:
            self.lock.close()


def sft_main(config_path: str | None, overrides: list[str]) -> int:
    cfg = load_config(config_path, overrides, SFTConfig)
    graceful = threading.current_thread() is threading.main_thread()
    signals.reset()
    previous = signal.signal(signal.SIGTERM, signals.on_sigterm) if graceful else None
    try:
        run = build(cfg)
        if run.start_step >= cfg.max_steps:
            run.close()
            print(
                f"nothing to do: run {run.run_dir} is already at step {run.start_step} (max_steps={cfg.max_steps}); "
                f"raise max_steps with --set max_steps=N to continue it"
            )
            return 0
        return _run(run, config_path)
    finally:
        if graceful:
            signal.signal(signal.SIGTERM, previous)


def build(cfg: SFTConfig, log=print) -> SFTRun:
    """Everything bad input can make fail is checked before the run directory is created: the run dir, a
    resume's settings, the tokenizer, every record of the data, the model."""
    resolve_device(cfg.model.device, cfg.model.backend)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed % 2**32)
    named = cfg.run_dir is not None
    run_dir = check_run_dir(cfg)
    ckpt = latest_checkpoint(run_dir) if run_dir.exists() else None
    if ckpt is not None:
        _check_same_run(ckpt, cfg)
    for key, path in (("model.path", cfg.model.path), ("model.tokenizer", cfg.model.tokenizer)):
        if path is not None and not Path(path).is_dir():
            raise ValueError(f"{key} {path} {'is not a directory' if Path(path).exists() else 'does not exist'}")
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
    examples = read_sft_jsonl(cfg.data.train_jsonl, tokenizer, cfg.data.prompt_format)
    model = load_model(
        cfg.model.path,
        dtype=cfg.model.dtype,
        kernels=cfg.model.kernels,
        device=cfg.model.device,
        backend=cfg.model.backend,
    )
    tokenizer.check_fits(model.config.vocab_size, "model.tokenizer" if cfg.model.tokenizer else "model.path")
    context = model.config.context_length
    for e in examples:
        if len(e.tokens) > min(cfg.data.max_tokens, context):
            what = f"data.max_tokens={cfg.data.max_tokens} (a packed sequence's budget)"
            if context < cfg.data.max_tokens:
                what = f"the model's context of {context} tokens ({model.config.context_source})"
            raise ValueError(f"{e.where}: {len(e.tokens)} tokens, more than {what}: shorten or drop the record")
    data = ExampleStream(examples, cfg.seed, cfg.data.shuffle)
    optimizer = make_optimizer(model, cfg.optim)
    start = 0
    if ckpt is not None:
        model, optimizer, start = _resume(cfg, ckpt, tokenizer, data, log)
    elif cfg.resume:
        log(f"resume=true: {run_dir} holds no checkpoint yet, so the run starts at step 0")

    def logger(cfg: SFTConfig, run_dir: Path, start: int) -> MetricsLogger:
        return MetricsLogger(run_dir, cfg.tensorboard, cfg.progress, cfg.max_steps, start, "SFT", DISPLAY)

    run_dir, new, lock, metrics = claim_run_dir(cfg, run_dir, named, ckpt, start, logger)
    return SFTRun(cfg, model, optimizer, tokenizer, data, run_dir, metrics, lock, new, start)


def _saved_state(ckpt: Path) -> dict:
    try:
        state = json.loads((ckpt / "state.json").read_text())
    except (OSError, ValueError):
        return {}  # loading the checkpoint names the problem
    return state if isinstance(state, dict) else {}


def _check_same_run(ckpt: Path, cfg: SFTConfig) -> None:
    """Refuses to resume a checkpoint of another command, or with settings that would make it another run."""
    state = _saved_state(ckpt)
    if not state:
        return
    if state.get("command") != "sft":
        raise ValueError(
            f"run_dir {ckpt.parent.parent} holds checkpoints of an `exactrl train` run, not an SFT run: choose "
            f"another run_dir"
        )
    old, new = dotted(state.get("config") or {}), dotted(cfg.model_dump(mode="json", by_alias=True))
    changed = [
        f"{k}: {old.get(k)!r} -> {new.get(k)!r}"
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k) and not k.startswith(RESUMABLE)
    ]
    if changed:
        raise ValueError(
            f"resume from {ckpt} with changed settings ({'; '.join(changed)}): a resumed run keeps the settings "
            f"it was started with; drop these --set overrides, or start a new run_dir"
        )


def _resume(
    cfg: SFTConfig, ckpt: Path, tokenizer: Tokenizer, data: ExampleStream, log
) -> tuple[CausalLM, torch.optim.Optimizer, int]:
    """(model, optimizer, step) of the checkpoint, with the data position and random streams restored."""
    m = cfg.model
    model, opt_state, state = load_checkpoint(ckpt, m.dtype, m.kernels, note=log, device=m.device, backend=m.backend)
    if state.get("tokenizer") != tokenizer.fingerprint:
        raise ValueError(
            f"resume from {ckpt} with another tokenizer ({tokenizer.path}): its token ids, chat template or "
            f"special tokens differ from the run's; point model.tokenizer at the tokenizer the run started with"
        )
    optimizer = make_optimizer(model, cfg.optim)
    try:
        optimizer.load_state_dict(opt_state)
        data.load_state_dict(state["prompts"])
        _restore_rng(state, Ranks())
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"checkpoint {ckpt} cannot be resumed: its state does not fit this run ({e})") from None
    log(f"resuming {ckpt.parent.parent} from {ckpt.name}")
    return model, optimizer, state["step"]


def _run(run: SFTRun, config_path: str | None) -> int:
    cfg = run.cfg
    print(
        f"run dir: {run.run_dir}  (sft, kernels={cfg.model.kernels}, dtype={cfg.model.dtype}, steps={cfg.max_steps}, "
        f"{len(run.data.examples)} examples)"
    )
    try:
        replace_durably(run.run_dir / "config.json", json.dumps(cfg.model_dump(by_alias=True), indent=2))
        last = train(run)
        run.close()  # flushes TensorBoard's last events: a full disk may show only here
    except BaseException as e:
        return _stopped(run, e, config_path)
    finally:
        run.close()
    print("final:", json.dumps({k: last[k] for k in ("step", "train/loss", "train/tokens")}))
    return 0


def train(run: SFTRun) -> dict:
    """The loop: a step, its metrics row, a checkpoint every `save_every` steps and at the last."""
    cfg, last = run.cfg, {}
    for step in range(run.start_step + 1, cfg.max_steps + 1):
        t0 = time.perf_counter()
        lr = scheduled_lr(cfg.optim, step, cfg.max_steps)
        for g in run.optimizer.param_groups:
            g["lr"] = lr
        batch = run.data.take(cfg.data.batch_size)
        metrics = sft_step(run.model, run.optimizer, batch, cfg.data.max_tokens, cfg.optim.grad_clip)
        dt = time.perf_counter() - t0
        last = metrics | {
            "step": step,
            "train/lr": lr,
            "data/epoch": run.data.epoch + run.data.index / len(run.data.examples),
            "time/step_s": dt,
            "perf/tokens_per_s": metrics["train/seq_tokens"] / dt,
        }
        run.logger.log(last)
        if step % cfg.save_every == 0 or step == cfg.max_steps:
            run.logger.flush()
            state = {
                "command": "sft",
                "prompts": run.data.state_dict(),  # the checkpoint format's data position
                **rng_state(),
                "config": cfg.model_dump(mode="json", by_alias=True),
                "tokenizer": run.tokenizer.fingerprint,
                "software": software_versions(),
            }
            save_checkpoint(run.run_dir, step, run.model, run.optimizer, state, cfg.keep_checkpoints)
        signals.check_terminated()
    return last


def _stopped(run: SFTRun, e: BaseException, config_path: str | None) -> int:
    """After an error or a signal: a new run dir that holds no step is removed; otherwise what is kept and how
    to go on is said (Ctrl-C, SIGTERM: its exit code is returned) or added to a disk error's message."""
    try:
        run.close()
    except Exception:  # a failing close (a full disk) must not replace the error that stopped the run
        pass
    ckpt = latest_checkpoint(run.run_dir)
    metrics = run.run_dir / "metrics.jsonl"
    if run.new and ckpt is None and not (metrics.exists() and metrics.stat().st_size):
        shutil.rmtree(run.run_dir, ignore_errors=True)  # a failed start leaves nothing behind
        if isinstance(e, KeyboardInterrupt):
            how, code = stopped_by(e)
            stderr_line(f"\n{how} before the first step: the new run dir {run.run_dir} was removed")
            return code
        raise e
    go_on = (
        f"exactrl sft {f'{config_path} ' if config_path else ''}--set run_dir={run.run_dir} --set resume=true "
        f"(and the same settings)"
    )
    kept = f"run {run.run_dir} is kept and " + (
        f"its last checkpoint is {ckpt.name}" if ckpt else "it has no checkpoint"
    )
    if isinstance(e, KeyboardInterrupt):
        how, code = stopped_by(e)
        stderr_line(f"\n{how}: {kept}; continue it with {go_on}")
        return code
    if isinstance(e, OSError):
        raise OSError(f"{e}; {kept}: fix that and continue it with {go_on}") from e
    raise e
