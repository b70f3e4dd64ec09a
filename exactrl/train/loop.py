"""The synchronous GRPO-family training loop.

    prompts -> engine rollouts (n per prompt) -> rewards -> advantages
            -> loss over micro-batches -> AdamW step -> bitwise weight sync

The trainer and the engine hold separate copies of one model definition with
the same kernels; `engine.update_weights` copies the new weights bit for bit,
so the next step's behaviour logprobs μ equal the trainer's π_old exactly
(`train/train_rollout_logprob_abs_diff` = 0.0) in `exact` mode. Policy
versions are training steps: the weights after step k are version k.

`train_on` and `end_step` are shared with the asynchronous loop
(async_loop.py), which differs only in where the rollouts come from.

Data parallel (`exactrl train --nproc N`, exactrl/distributed): every rank
runs this loop; `sample_groups` gives every rank the whole batch, rank r
sampling the prompts r, r + N, ...; `train_step` sums the ranks' gradients;
rank 0 logs and saves.
"""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from exactrl.algo.kl import kl_reward_penalty
from exactrl.distributed import whole_optimizer_state
from exactrl.model.logprobs import token_logprobs
from exactrl.model.lora import synced_weights
from exactrl.rollout.groups import Rollout, evaluate, overlong_shaped, rollout_metrics, sample_groups, to_train_batch
from exactrl.seeds import derive_seed
from exactrl.train.checkpoint import begin_checkpoint, save_checkpoint
from exactrl.train.samples import sample_rows
from exactrl.train.setup import Run
from exactrl.train.signals import check_terminated
from exactrl.train.trainer import train_step


def train(c: Run) -> dict[str, float]:
    cfg, last = c.cfg, {}
    initial = initial_eval(c, c.engine)
    t_prev = time.perf_counter()
    for step in range(c.start_step + 1, cfg.max_steps + 1):
        before = c.engine.stats()
        groups, sampled, filtered = sample_step(c, step)
        filtered |= preemptions(before, c.engine.stats())
        t1 = time.perf_counter()
        metrics = train_on(c, step, groups)
        c.engine.update_weights(synced_weights(c.policy.model), version=step)
        t2 = time.perf_counter()
        metrics |= {"time/rollout_s": t1 - t_prev, "time/train_s": t2 - t1} | engine_metrics(c.engine) | initial
        last = end_step(c, step, sampled, metrics | filtered, t2 - t_prev, c.engine, c.data.prompts.state_dict())
        initial, t_prev = {}, time.perf_counter()
        check_terminated()
    return last


def sample_step(c: Run, step: int) -> tuple[list[list[Rollout]], list[list[Rollout]], dict[str, float]]:
    """(the groups to train on, every group sampled, the filter's metrics). One batch of P =
    prompts_per_step prompts; with `rollout.filter_groups` (DAPO's dynamic sampling) groups whose task
    rewards are all equal are set aside and more batches sampled, up to `max_sampling_rounds`, until P
    groups differ; the first P of those are trained on, filled up with set-aside groups if the rounds ran
    out. The rollout metrics cover every group sampled."""
    rs, P = c.cfg.rollout, c.cfg.rollout.prompts_per_step
    sampled, varied = [], []
    for r in range(rs.max_sampling_rounds if rs.filter_groups else 1):
        new = sample_groups(
            c.engine, c.data.tokenizer, c.data.task, c.data.prompts.take(P), rs, c.cfg.seed, step, c.ranks, offset=r * P
        )
        sampled += new
        varied += [g for g in new if len({x.reward for x in g}) > 1]
        if len(varied) >= P:
            break
    if not rs.filter_groups:
        return sampled, sampled, {}
    uniform = [g for g in sampled if len({x.reward for x in g}) == 1]
    train = (varied + uniform)[:P]
    return (
        train,
        sampled,
        {
            "rollout/sampling_rounds": r + 1,
            "rollout/filtered_groups": len(uniform),
            "rollout/uniform_groups_trained": max(0, P - len(varied)),
        },
    )


def initial_eval(c: Run, eval_engine) -> dict[str, float]:
    """Held-out accuracy before any training, as `eval/initial_accuracy` of the first step's row.

    It rides on step 1's row (a run resumed later has it already): every row
    of metrics.jsonl is a training step with the keys docs/design.md §3 promises.
    """
    if c.start_step != 0 or not c.cfg.task.eval_size:
        return {}
    with own_random_streams(c.cfg.seed, 0):  # (the asynchronous loop's rollout thread starts after it)
        metrics, groups = evaluate(
            eval_engine, c.data.tokenizer, c.data.task, c.data.eval_problems, c.cfg.rollout, c.cfg.seed, c.ranks
        )
    log_samples(c, 0, "eval", groups)  # step 0: before the first
    return {"eval/initial_accuracy": metrics["eval/accuracy"]}


def log_samples(c: Run, step: int, kind: str, groups: list[list[Rollout]]) -> None:
    """A few of the groups' samples to samples.jsonl, the trackers and the terminal (train/samples.py)."""
    n = max(c.cfg.logging.samples, c.cfg.progress.samples)
    if n and c.ranks.main:
        c.files.logger.log_samples(sample_rows(groups, n, step, kind, c.data.tokenizer))


@contextlib.contextmanager
def own_random_streams(seed: int, step: int):
    """Python's, numpy's and torch's global random streams seeded from (seed, step) inside, and given back
    as they were after: a task whose reward draws from them (a sampled judge) scores the held-out problems
    without moving the training's streams, so when and how often a run evaluates (eval_every, a resume
    with another max_steps) changes none of its training. Only where no other thread draws meanwhile."""
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    mixed = derive_seed(seed, step)
    random.seed(mixed)
    np.random.seed(mixed)
    torch.manual_seed(mixed)
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


def preemptions(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """`rollout/preemptions`: sequences the in-process engine sent back to wait for KV pages between two
    `stats()` snapshots (a step's sampling), each resumed by recomputing its prompt and the tokens it had
    drawn (chunked prefill, the same bits); absent for a backend that does not count them."""
    key = "engine/num_preemptions"
    return {"rollout/preemptions": after[key] - before[key]} if key in after else {}


def engine_metrics(engine) -> dict[str, float]:
    """The version the rollout engine holds now and, for an external server or Ray engines, their counters.

    `engine/version` is the engine's own: the step just synced in process or with
    `weight_sync: disk`, the starting 0 with `weight_sync: none`, where
    `external/weight_lag` (trainer version − server version) shows how far behind it is.
    """
    return {k: v for k, v in engine.stats().items() if k == "engine/version" or k.startswith(("external/", "ray/"))}


def train_on(c: Run, step: int, groups: list[list[Rollout]]) -> dict[str, float]:
    """Advantages, one optimizer step over micro-batches; the step's training metrics."""
    a, shaped = c.cfg.algorithm, {}
    if c.policy.ref_model is not None and a.kl.coef and a.kl.where == "reward":
        groups, shaped = kl_shaped_rewards(c, groups)
    if a.overlong.buffer_len:
        groups, more = overlong_shaped(
            groups, c.cfg.rollout.max_tokens, a.overlong.buffer_len, a.overlong.penalty_factor
        )
        shaped |= more
    distiller = c.policy.distiller
    # pure distillation trains on the teacher's advantages alone: the rewards' (a group of one, say) count 0
    advantage = "dr_grpo" if distiller is not None and distiller.s.reward_coef == 0 else a.advantage
    batch = to_train_batch(
        groups, advantage, a.advantage_kwargs if advantage == a.advantage else {}, a.overlong.mask_truncated
    )
    if distiller is not None:
        batch, more = distiller.apply(groups, batch, c.ranks)
        shaped |= more
    lr = c.set_lr(step)
    return (
        train_step(
            c.policy.model,
            c.policy.optimizer,
            c.policy.loss_fn,
            batch,
            c.policy.step_settings,
            c.policy.ref_model,
            c.ranks,
        )
        | {"train/lr": lr}
        | shaped
    )


def kl_shaped_rewards(c: Run, groups: list[list[Rollout]]) -> tuple[list[list[Rollout]], dict[str, float]]:
    """The groups with reward − β·Σ_t KL_t(π‖π_ref) (algo/kl.py `kl_reward_penalty`); the task reward stays in
    the rollout metrics, the shaped one only drives the advantages."""
    rs, flat = c.cfg.rollout, [r for g in groups for r in g]
    mine = [flat[k] for k in c.ranks.shard(len(flat))]  # each rank scores its share; all get every score
    with torch.no_grad():
        ref, _ = token_logprobs(
            c.policy.ref_model,
            [r.prompt_ids + r.completion_ids for r in mine],
            rs.temperature,
            -1,
            1.0,
            first=[len(r.prompt_ids) for r in mine],  # untruncated: kl.py
            share_prompts=c.cfg.optim.share_prompts,
        )
    ref = c.ranks.gather_sharded(len(flat), [t.clone() for t in ref])  # a view would send its whole batch
    penalties, metrics = kl_reward_penalty(
        [torch.tensor(r.behav_logprobs) for r in flat], ref, c.cfg.algorithm.kl.kind, c.cfg.algorithm.kl.coef
    )
    it = iter(penalties)
    return [[replace(r, reward=r.reward - next(it)) for r in g] for g in groups], metrics


def end_step(
    c: Run,
    step: int,
    groups: list[list[Rollout]],
    metrics: dict[str, float],
    step_s: float,
    eval_engine,
    prompts_state: dict,
    rng: dict | None = None,
) -> dict[str, float]:
    """Rollout metrics, throughput, evaluation, logging and checkpointing of a finished step. `rng`: the random
    streams a checkpoint keeps (None: as they are now)."""
    cfg = c.cfg
    n_tokens = sum(len(r.completion_ids) for g in groups for r in g)
    metrics = (
        metrics
        | rollout_metrics(groups)
        | {
            "step": step,
            "time/step_s": step_s,
            "perf/tokens_per_s": n_tokens / step_s,
            "perf/completion_tokens": n_tokens,
        }
    )
    if cfg.task.eval_size and (step % cfg.eval_every == 0 or step == cfg.max_steps):
        # its own streams where the loop is synchronous (`rng` None); the asynchronous loop's rollout thread
        # draws from the global ones meanwhile
        with own_random_streams(cfg.seed, step) if rng is None else contextlib.nullcontext():
            scores, eval_groups = evaluate(
                eval_engine, c.data.tokenizer, c.data.task, c.data.eval_problems, cfg.rollout, cfg.seed, c.ranks
            )
        metrics |= scores
        log_samples(c, step, "eval", eval_groups)
    log_samples(c, step, "train", groups)
    c.files.logger.log(metrics)  # rank 0's; the other ranks' logger writes nothing
    if step % cfg.save_every == 0 or step == cfg.max_steps:
        save_step(c, step, c.trainer_state(prompts_state, rng))  # every rank's random streams (a collective)
    return metrics


def save_step(c: Run, step: int, state: dict) -> None:
    """Rank 0 writes the checkpoint of `step`; every rank enters (each part below may be a collective)."""
    p, keep = c.policy, c.cfg.keep_checkpoints
    if not p.step_settings.fsdp:
        with whole_optimizer_state(p.optimizer):  # optim.shard_state: every rank's moments
            if c.ranks.main:
                c.files.logger.flush()
                save_checkpoint(c.run_dir, step, p.model, p.optimizer, state, keep)
        return
    from exactrl.distributed import fsdp

    whole, shards = None, c.cfg.distributed.checkpoint == "sharded"
    if shards:  # each rank's shards into the directory rank 0 prepares, then rank 0 completes it
        tmp = c.ranks.broadcast(str(begin_checkpoint(c.run_dir, step)) if c.ranks.main else None)
        fsdp.save_sharded(Path(tmp), p.model, p.optimizer)
    else:  # gathered into the one-process format
        whole = fsdp.full_state(p.model.state_dict()), fsdp.full_state(p.optimizer.state_dict())
    if c.ranks.main:
        c.files.logger.flush()
        save_checkpoint(c.run_dir, step, p.model, p.optimizer, state, keep, whole=whole, shards=shards)
