"""Builds everything a run needs from its config, fresh or resumed from a checkpoint."""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from exactrl.algo.advantages import compute_advantages
from exactrl.algo.corrections import build_corrections
from exactrl.algo.losses import PolicyLoss, build_loss
from exactrl.distributed import Ranks, make_optimizer
from exactrl.envs.base import Problem, Task
from exactrl.envs.custom import build_task, task_sha256
from exactrl.envs.dataset import PromptSource, held_out_problems, make_dataset, read_jsonl
from exactrl.envs.sources import read_dataset, split_rows
from exactrl.model import load_model
from exactrl.model.checkpoint import resolve_device
from exactrl.model.lora import add_lora, engine_copy, synced_weights, trainable_parameters
from exactrl.model.tokenizer import Tokenizer, load_tokenizer
from exactrl.model.transformer import CausalLM
from exactrl.rollout.backend import RolloutBackend
from exactrl.rollout.external import ExternalEngine
from exactrl.train.activation_ckpt import apply_activation_checkpointing
from exactrl.train.config import OptimSettings, RunConfig
from exactrl.train.distill import Distiller, build_distiller
from exactrl.train.logger import MetricsLogger, NullLogger
from exactrl.train.master_weights import MasterWeights
from exactrl.train.resume import _check_resume_early, _identity, resume, rng_state, software_versions
from exactrl.train.run_dir import check_run_dir, default_run_dir
from exactrl.train.run_dir import claim_run_dir as _claim_run_dir  # (a test replaces it here)
from exactrl.train.trackers import check_trackers
from exactrl.train.trainer import StepSettings


@dataclass
class Policy:
    """What the trainer updates, and how: the model, its frozen reference, optimizer, loss and step settings."""

    model: CausalLM  # the trainer's copy
    ref_model: CausalLM | None  # frozen initial weights, only when KL is on
    optimizer: torch.optim.Optimizer
    loss_fn: PolicyLoss
    step_settings: StepSettings
    distiller: Distiller | None = None  # on-policy distillation's teachers (train/distill.py), when configured


@dataclass
class Data:
    """What the run trains and evaluates on."""

    tokenizer: Tokenizer
    task: Task
    prompts: PromptSource  # the training stream (its position is checkpointed)
    eval_problems: list[Problem]  # held out: none of them is trained on


@dataclass
class RunFiles:
    """The run directory and what the run holds open in it."""

    run_dir: Path
    logger: MetricsLogger | NullLogger  # rank 0's writes metrics.jsonl; the other ranks' writes nothing
    new: bool = False  # build created run_dir (a run that fails before its first step removes it)
    lock: IO[str] | None = None  # the open run_dir/.lock that rank 0 holds for the run (`run_dir.lock_run_dir`)
    task_sha256: str | None = None  # the source of task.module as the run imported it (resume checks it)


@dataclass
class Run:
    """Everything a training loop needs, built from the config by `build`."""

    cfg: RunConfig
    policy: Policy
    data: Data
    engine: RolloutBackend  # the in-process exactrl.Engine, an external server or Ray engines
    files: RunFiles
    start_step: int
    ranks: Ranks = Ranks()  # this process's rank in a data-parallel run (exactrl/distributed); one by default

    @property
    def run_dir(self) -> Path:
        return self.files.run_dir

    def close(self) -> None:
        """Closes the log and the rollout backend (an external server's client, Ray engines), then releases
        the run dir; idempotent."""
        try:
            self.files.logger.close()
            if self.policy.distiller is not None:
                self.policy.distiller.close()
        finally:
            try:
                self.engine.close()
            finally:
                if self.files.lock is not None:
                    self.files.lock.close()

    def set_lr(self, step: int) -> float:
        """The learning rate of `step` (`scheduled_lr`) into the optimizer."""
        lr = scheduled_lr(self.cfg.optim, step, self.cfg.max_steps)
        for g in self.policy.optimizer.param_groups:
            g["lr"] = lr
        return lr

    def trainer_state(self, prompts_state: dict[str, Any], rng: dict[str, Any] | None = None) -> dict[str, Any]:
        """What a checkpoint holds besides weights and optimizer; `prompts_state` is the data position
        after the last trained batch and `rng` the random streams then (`rng_state()`; None: now). The
        asynchronous loop's rollouts may already be further: it passes both as they were after that batch."""
        rng = rng_state() if rng is None else rng
        state = {
            "prompts": prompts_state,
            **rng,
            "config": _identity(self.cfg.model_dump(by_alias=True), self.files.task_sha256),
            "tokenizer": self.data.tokenizer.fingerprint,
            "software": software_versions(),
        }
        if self.ranks.world > 1:  # each rank's streams (a task's reward may draw from them), by rank
            state["ranks_rng"] = self.ranks.gather(rng)
        return state


def scheduled_lr(o: OptimSettings, step: int, max_steps: int) -> float:
    """The learning rate of training step `step` (1, 2, ...), a pure function of it (resume-safe). Over the
    W = warmup_steps first steps lr·step/W; after them, with T = max_steps, r = min_lr_ratio and
    p = (step − 1 − W) / (T − W), the fraction of the decay done before the step (as Hugging Face's
    schedulers count it, 0-based):

        constant: lr     linear: lr·(r + (1 − r)(1 − p))     cosine: lr·(r + (1 − r)·½(1 + cos πp))
    """
    W, T = o.warmup_steps, max_steps
    if step <= W:
        return o.lr * step / W
    if o.lr_schedule == "constant":
        return o.lr
    p = min(1.0, (step - 1 - W) / max(1, T - W))
    f = 1 - p if o.lr_schedule == "linear" else 0.5 * (1 + math.cos(math.pi * p))
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * f)


def _check_paths(cfg: RunConfig) -> None:
    """The directories the user named, before anything is loaded from them."""
    for key, path, fix in (
        ("model.path", cfg.model.path, "a Hugging Face model directory, or unset it for the default model"),
        ("model.tokenizer", cfg.model.tokenizer, "a tokenizer directory, or unset it to use model.path's"),
        *((f"distill.teachers.{k}", p, "a teacher's model directory") for k, p in cfg.distill.teachers.items()),
        *(
            [("distill.teacher", cfg.distill.teacher, "a model directory, `initial` or `self`")]
            if cfg.distill.teacher not in (None, "initial", "self")
            else []
        ),
    ):
        if path is not None and not Path(path).is_dir():
            what = "is not a directory" if Path(path).exists() else "does not exist"
            raise ValueError(f"{key} {path} {what}: set {key} to {fix}")


def _rollout_engine(cfg: RunConfig, model: CausalLM, tokenizer: Tokenizer, start: int, log=print) -> RolloutBackend:
    """The in-process exactrl.Engine over its own copy of the model, an external server (rollout/external.py), or
    exactrl Engines as Ray actors (distributed/ray_engines.py).

    Policy versions are training steps, also across a resume: the engine starts at version `start`.
    """
    from exactrl.engine import Engine

    stops = sorted(tokenizer.stop_token_ids)
    if cfg.rollout_backend.kind == "openai":
        return ExternalEngine.connect(cfg.rollout_backend, model, stops, version=start)
    if cfg.rollout_backend.kind == "ray":
        from exactrl.distributed.ray_engines import RayEngines

        return RayEngines(cfg.rollout_backend.ray, model, cfg.engine.model_dump(), stops, version=start, log=log)
    engine = Engine(engine_copy(model), stop_token_ids=stops, **cfg.engine.model_dump())
    engine.version = start
    return engine


def _check_backend_options(cfg: RunConfig) -> None:
    """Options that only the in-process engine supports, refused by name for an external or Ray backend."""
    kind = cfg.rollout_backend.kind
    if kind != "engine" and cfg.async_.enabled and cfg.async_.inflight_updates:
        raise ValueError(
            f"async.inflight_updates needs rollout_backend.kind=engine: "
            f"{'an external server' if kind == 'openai' else 'a Ray engine'} has "
            f"no hook between its steps to take new weights (use inflight_updates=false)"
        )
    if cfg.model.lora.rank and kind != "engine":
        raise ValueError(
            f"model.lora with rollout_backend.kind={kind}: only the in-process engine runs "
            f"the base weights with unmerged adapters; use rollout_backend.kind=engine"
        )


def _algorithm(cfg: RunConfig):
    """(loss, corrections or None) of `algorithm`, every name and argument checked now: the advantage
    estimator by a dry run on one group of two zero rewards, with the checks and message of the first
    training step (rollout/groups.py to_train_batch)."""
    a = cfg.algorithm
    loss_fn = build_loss(a.loss, **a.loss_kwargs)
    corrections = build_corrections(a.corrections) if a.corrections else None
    weighing = [c.key for c in corrections.corrections if c.weighs] if corrections else []
    if a.bypass and weighing:  # the bypass ratio π_θ/μ already is ρ: a weight ρ on top would square it
        raise ValueError(
            f"algorithm.bypass takes the loss ratio against μ, which already weighs each token by "
            f"π_old/μ: the corrections {weighing} would apply that ratio twice; use them without "
            f"bypass, or keep only masking corrections (token_mask_is, geometric_rejection, ...)"
        )
    try:
        compute_advantages(a.advantage, torch.zeros(1, 2), **a.advantage_kwargs)
    except ValueError as e:
        raise ValueError(f"algorithm.advantage_kwargs: {e}") if a.advantage_kwargs else e from None
    return loss_fn, corrections


def build(cfg: RunConfig, log=print, ranks: Ranks = Ranks()) -> Run:
    """Everything that bad input can make fail is checked or loaded before the warm start (~90 s) and
    before the run directory is created, so a failed start costs little and leaves no empty run behind.

    `ranks`: a data-parallel run's (exactrl/distributed); rank 0 picks the run dir, builds the default
    model if needed, creates the dir and logs."""
    _check_backend_options(cfg)
    check_ranks(cfg, ranks)
    resolve_device(cfg.model.device, cfg.model.backend)  # a missing GPU or triton named before the warm start
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed % 2**32)
    named = cfg.run_dir is not None or ranks.world > 1
    if ranks.world > 1:  # one run dir for every rank: rank 0's choice
        cfg.run_dir = ranks.broadcast(cfg.run_dir if cfg.run_dir is not None else default_run_dir())
    run_dir = check_run_dir(cfg)
    _check_resume_early(cfg, run_dir)
    _check_paths(cfg)
    if ranks.main:  # rank 0 alone logs: a tracker's missing package or bad URI is named before the warm start
        check_trackers(cfg.logging)
    task = build_task(cfg.task)
    task_sha = task_sha256(cfg.task)  # as imported: an edit during the run is not this run's task
    loss_fn, corrections = _algorithm(cfg)
    prompts, eval_problems = _datasets(cfg, task)
    model_dir = _model_dir(cfg, log, ranks)
    model = load_model(
        model_dir, dtype=cfg.model.dtype, kernels=cfg.model.kernels, device=cfg.model.device, backend=cfg.model.backend
    )
    tokenizer = load_tokenizer(cfg.model.tokenizer or model_dir)
    tokenizer.check_fits(model.config.vocab_size, "model.tokenizer" if cfg.model.tokenizer else "model.path")
    if cfg.rollout.max_tokens >= model.config.context_length:  # prompt + answer must fit the context
        raise ValueError(
            f"rollout.max_tokens={cfg.rollout.max_tokens} leaves no room for a prompt in the model's "
            f"context of {model.config.context_length} tokens ({model.config.context_source})"
        )
    initial = None  # the starting weights, frozen: KL's reference, distill.teacher=initial
    if cfg.algorithm.kl.coef > 0 or cfg.distill.teacher == "initial":
        initial = copy.deepcopy(model).requires_grad_(False)
    ref_model = initial if cfg.algorithm.kl.coef > 0 else None
    if cfg.model.lora.rank:  # after the reference copies: the reference and the initial teacher are the base model
        lo = cfg.model.lora
        add_lora(model, lo.rank, lo.alpha, lo.targets, seed=cfg.seed, base=str(Path(model_dir).resolve()))
    model, optimizer, start, ckpt = resume(
        cfg, run_dir, model, tokenizer, prompts, ranks, log, lambda m: _optimizer(cfg, m, ranks)
    )
    engine = _rollout_engine(cfg, model, tokenizer, start, log)
    # after the engine's copy of the model: its layers run as they are (they never recompute anyway)
    apply_activation_checkpointing(model, cfg.optim.activation_checkpointing)
    try:  # from here on a failure stops the engines too (Ray actors, a server's client)
        distiller = _distiller(cfg, model, tokenizer, task, initial) if cfg.distill.enabled else None
        settings = _step_settings(cfg, corrections)
        settings.distill = distiller if distiller is not None and cfg.distill.kind != "reverse_kl" else None
        model, optimizer = _share(cfg, model, optimizer, ranks, ckpt, engine, start, settings)
        policy = Policy(model, ref_model, optimizer, loss_fn, settings, distiller)
        data = Data(tokenizer, task, prompts, eval_problems)
        if not ranks.main:  # rank 0 alone writes the run dir; the others learn whether it could
            refused = ranks.broadcast(None)
            if refused is not None:
                raise ValueError(f"rank 0 could not start the run: {refused}")
            return Run(cfg, policy, data, engine, RunFiles(run_dir, NullLogger(), task_sha256=task_sha), start, ranks)
        try:
            run_dir, new_run_dir, run_lock, logger = _claim_run_dir(cfg, run_dir, named, ckpt, start)
        except ValueError as e:
            ranks.broadcast(str(e))
            raise
        ranks.broadcast(None)
        return Run(cfg, policy, data, engine, RunFiles(run_dir, logger, new_run_dir, run_lock, task_sha), start, ranks)
    except BaseException:
        engine.close()
        raise


def _datasets(cfg: RunConfig, task) -> tuple[PromptSource, list]:
    """The training stream and the evaluation problems: the task's held-out split, and none of a training
    file's prompts, so evaluation scores problems never trained on (`envs.dataset.held_out`); a verifiers
    environment's tasks are split as a dataset's rows."""
    if cfg.task.kind == "verifiers":
        train, eval_problems = split_rows(task.problems, task, cfg.task.eval_size, f"task.env_id {cfg.task.env_id}")
        return PromptSource(train, seed=cfg.seed), eval_problems
    if cfg.task.dataset:
        if cfg.task.train_jsonl:
            raise ValueError("task.dataset and task.train_jsonl both give training problems: set one")
        try:  # a row the task cannot score fails now, not when a later step first draws it
            rows = read_dataset(cfg.task.dataset, cfg.task.columns, check=task.check)
            train, eval_problems = split_rows(rows, task, cfg.task.eval_size, cfg.task.dataset)
        except ValueError as e:
            raise ValueError(f"task.dataset: {e}") from None
        return PromptSource(train, seed=cfg.seed), eval_problems
    if cfg.task.columns:
        raise ValueError("task.columns maps the columns of task.dataset, which is not set")
    if cfg.task.train_jsonl:
        try:  # a row the task cannot score fails now, not when a later step first draws it
            train = read_jsonl(cfg.task.train_jsonl, check=task.check)
        except ValueError as e:
            raise ValueError(f"task.train_jsonl: {e}") from None
    else:
        train = make_dataset(task, cfg.task.train_size, cfg.seed, split="train")
    seen = {task.split_key(p) for p in train} if cfg.task.train_jsonl else set()
    eval_problems = held_out_problems(task, cfg.task.eval_size, cfg.seed, exclude=seen)
    if cfg.task.eval_size and not eval_problems:
        raise ValueError(
            f"task.train_jsonl holds every held-out problem of task {cfg.task.name!r} that evaluation "
            f"drew: nothing is left to evaluate on (set task.eval_size=0, or train on fewer problems)"
        )
    return PromptSource(train, seed=cfg.seed), eval_problems


def _model_dir(cfg: RunConfig, log, ranks: Ranks) -> Path:
    """model.path, or the default job's model: rank 0 builds it (once, cached), the others read it there."""
    from exactrl.train.warmstart import default_model_dir

    if cfg.model.path:
        return Path(cfg.model.path)
    # a warm start draws from the global random streams only when it is not cached: without the restore, a
    # run's streams (a task's sampled judge) would differ between a machine's first run and the next
    streams = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        model_dir = ranks.broadcast(str(default_model_dir(cfg, log)) if ranks.main else None)
    finally:
        random.setstate(streams[0])
        np.random.set_state(streams[1])
        torch.set_rng_state(streams[2])
    if not (Path(model_dir) / "config.json").is_file():
        raise ValueError(
            f"rank {ranks.rank} cannot read the default model rank 0 built at {model_dir}: give every "
            f"rank one filesystem for it (EXACTRL_ARTIFACTS, a shared path) or set model.path to a "
            f"model every rank reads"
        )
    return Path(model_dir)


def _distiller(cfg: RunConfig, model: CausalLM, tokenizer: Tokenizer, task: Task, initial: CausalLM | None):
    """The run's teachers (train/distill.py); a teacher directory loads as the run's model does."""

    def load(path: str, where: str) -> CausalLM:
        teacher_tok = Path(path) / "tokenizer.json"
        if teacher_tok.is_file() and load_tokenizer(path).hf.get_vocab() != tokenizer.hf.get_vocab():
            raise ValueError(
                f"{where} {path} has another tokenizer than the student's ({tokenizer.path}): their token ids "
                f"differ, so the teacher cannot score the student's tokens; use a teacher of the same family"
            )
        return load_model(
            path, dtype=cfg.model.dtype, kernels=cfg.model.kernels, device=cfg.model.device, backend=cfg.model.backend
        )

    return build_distiller(cfg.distill, model, tokenizer, task, cfg.rollout.temperature, load, initial)


def _optimizer(cfg: RunConfig, model: CausalLM, ranks: Ranks) -> torch.optim.Optimizer:
    o = cfg.optim
    adamw = dict(lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
    params = trainable_parameters(model)  # a LoRA model's adapters alone
    zero = o.shard_state and cfg.distributed.strategy == "ddp"  # fsdp's AdamW steps each rank's shards alone
    if cfg.model.dtype == "bfloat16" and o.fp32_master_weights:
        return MasterWeights(params, lambda params: make_optimizer(params, ranks, zero, **adamw))
    return make_optimizer(params, ranks, zero, **adamw)


def _share(cfg: RunConfig, model: CausalLM, optimizer, ranks: Ranks, ckpt, engine, start: int, settings):
    """Checks that every rank loaded the same weights; then, with `distributed.strategy: fsdp`, shards them
    (`_fully_shard`, `settings.fsdp`). Returns (model, optimizer)."""
    ranks.check_same(
        "starting weights",
        model.parameters(),
        "every rank must load the same model and checkpoint: are model.path and run_dir one shared "
        "path for every rank (the same filesystem)?",
    )
    if cfg.distributed.strategy == "fsdp" and ranks.world > 1:
        model, optimizer = _fully_shard(cfg, model, optimizer, ranks, ckpt, engine, start)
        settings.fsdp = True
    return model, optimizer


def _fully_shard(cfg: RunConfig, model: CausalLM, optimizer, ranks: Ranks, ckpt: Path | None, engine, start: int):
    """(model, optimizer) under FSDP2 (distributed/fsdp.py): the loaded model sharded in place, the optimizer
    built again over its shards, its state cut from the whole one (a full checkpoint's, or none yet) or read
    from a sharded checkpoint, whose weights then go to the engine (built from model.path's)."""
    from exactrl.distributed import fsdp

    whole = optimizer.state_dict()
    fsdp.shard_model(model, ranks)
    optimizer = _optimizer(cfg, model, ranks)
    if ckpt is not None and (ckpt / fsdp.DCP_METADATA).is_file():
        try:
            fsdp.load_sharded(ckpt, model, optimizer)
        except (RuntimeError, ValueError) as e:
            raise ValueError(
                f"checkpoint {ckpt} cannot be resumed: its shards do not fit this run ({e}); a sharded "
                f"checkpoint resumes with the number of ranks that wrote it"
            ) from None
        engine.version = start - 1  # the same version, now with the checkpoint's weights
        engine.update_weights(synced_weights(model), version=start)
    else:
        fsdp.load_full_optimizer_state(optimizer, whole)
    return model, optimizer


def _step_settings(cfg: RunConfig, corrections) -> StepSettings:
    a, r = cfg.algorithm, cfg.rollout
    return StepSettings(
        temperature=r.temperature,
        top_k=r.top_k,
        top_p=r.top_p,
        micro_batch_size=cfg.optim.micro_batch_size,
        agg_mode=a.agg_mode,
        agg_constant=float(r.max_tokens),
        grad_clip=cfg.optim.grad_clip,
        router_aux_loss_coef=cfg.optim.router_aux_loss_coef,
        entropy_coef=a.entropy_coef,
        kl_coef=a.kl.coef,
        kl_kind=a.kl.kind,
        kl_in_loss=a.kl.where == "loss",
        corrections=corrections,
        bypass=a.bypass,
        share_prompts=cfg.optim.share_prompts,
        max_tokens_per_micro_batch=cfg.optim.max_tokens_per_micro_batch,
    )


def check_ranks(cfg: RunConfig, ranks: Ranks) -> None:
    """What a data-parallel run does not support, refused before anything is loaded."""
    if ranks.world == 1:
        return
    if cfg.model.device != "cpu":
        raise ValueError(
            f"model.device={cfg.model.device} with {ranks.world} ranks: data-parallel ranks exchange "
            f"gradients over gloo on CPU tensors, so a run on a GPU has one rank (leave out --nproc)"
        )
    if cfg.rollout_backend.kind != "engine":
        more = (
            "servers with rollout_backend.base_urls"
            if cfg.rollout_backend.kind == "openai"
            else "more engines with rollout_backend.ray.num_engines"
        )
        raise ValueError(
            f"rollout_backend.kind={cfg.rollout_backend.kind} runs in one process (spread rollouts "
            f"over {more} instead); a data-parallel run ({ranks.world} ranks) uses each rank's own "
            f"engine"
        )
    if cfg.task.kind == "verifiers":
        raise ValueError(
            f"task.kind=verifiers runs its episodes through one server over one engine: a data-parallel run "
            f"({ranks.world} ranks) is not supported"
        )
    if cfg.rollout.prompts_per_step < ranks.world:
        raise ValueError(
            f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} gives some of the {ranks.world} "
            f"ranks no prompt: raise it to at least {ranks.world} or run fewer ranks"
        )
    if cfg.distributed.strategy != "fsdp":
        return
    for key, on in (
        ("model.lora.rank", bool(cfg.model.lora.rank)),  # the adapters are small: ddp replicates them cheaply
        ("async.enabled", cfg.async_.enabled),  # its trainer thread keeps whole weight versions
        ("distill.teacher", cfg.distill.enabled),  # a `self` teacher's forward would be one rank's alone
    ):
        if on:
            raise ValueError(
                f"{key} with distributed.strategy=fsdp is not supported: use distributed.strategy=ddp "
                f"(optim.shard_state=true shards AdamW's state)"
            )


Components = Run  # the name before `Run`, kept for one release
