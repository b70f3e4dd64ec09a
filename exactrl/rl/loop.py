"""The synchronous GRPO-family training loop.

    prompts -> engine rollouts (n per prompt) -> rewards -> advantages
            -> loss over micro-batches -> AdamW step -> bitwise weight sync

The trainer and the engine hold separate copies of one model definition with
the same kernels; `engine.update_weights` copies the new weights bit for bit,
so the next step's behaviour logprobs μ equal the trainer's π_old exactly
(`train/train_rollout_logprob_abs_diff` = 0.0) in `exact` mode.
"""
from __future__ import annotations

import time

from exactrl.rl.checkpoint import save_checkpoint
from exactrl.rl.rollout import evaluate, generate_groups, rollout_metrics, to_train_batch
from exactrl.rl.setup import Components
from exactrl.rl.trainer import train_step


def train(c: Components) -> dict[str, float]:
    cfg, last = c.cfg, {}
    if c.start_step == 0 and cfg.task.eval_size:
        c.logger.log({"step": 0, **evaluate(c.engine, c.tokenizer, c.task, c.eval_problems, cfg.rollout, cfg.seed)})
    for step in range(c.start_step + 1, cfg.max_steps + 1):
        t0 = time.perf_counter()
        problems = c.prompts.take(cfg.rollout.prompts_per_step)
        groups = generate_groups(c.engine, c.tokenizer, c.task, problems, cfg.rollout, cfg.seed, step)
        batch = to_train_batch(groups, cfg.algorithm.advantage, cfg.algorithm.advantage_kwargs)
        t1 = time.perf_counter()
        lr = c.set_lr(step)
        metrics = train_step(c.model, c.optimizer, c.loss_fn, batch, c.step_settings, c.ref_model)
        c.engine.update_weights(c.model.state_dict())
        t2 = time.perf_counter()
        n_tokens = sum(len(x) for x in batch.completion_ids)
        metrics |= rollout_metrics(groups) | {
            "step": step, "time/rollout_s": t1 - t0, "time/train_s": t2 - t1, "perf/tokens_per_s": n_tokens / (t2 - t0),
            "perf/completion_tokens": n_tokens, "train/lr": lr, "engine/version": c.engine.version}
        if cfg.task.eval_size and (step % cfg.eval_every == 0 or step == cfg.max_steps):
            metrics |= evaluate(c.engine, c.tokenizer, c.task, c.eval_problems, cfg.rollout, cfg.seed)
        c.logger.log(metrics)
        if step % cfg.save_every == 0 or step == cfg.max_steps:
            save_checkpoint(c.run_dir, step, c.model, c.optimizer, c.trainer_state(step), cfg.keep_checkpoints)
        last = metrics
    return last
