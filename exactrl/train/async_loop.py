"""Asynchronous training: the engine generates the next batches while the trainer trains.

    rollout thread:  gate -> apply newest weights -> generate batch k -> queue
    trainer thread:  batch k from queue -> drop stale -> train -> publish weights k

Versions. The weights after training step k are policy version k; the
engine samples every token under one version and records it
(`Completion.versions`). A token sampled under version v and trained on at
step k has staleness (k − 1) − v.

Bounded staleness. The rollout thread may start batch k only once the
trainer has published version k − 1 − max_staleness, so no token is staler
than `max_staleness` (AReaL's bounded-staleness gate, Fu et al. 2025). With
`max_staleness: 0` it waits for version k − 1, takes the same prompts with the
same seeds as the synchronous loop and samples under the same bits: the run
is bitwise identical to `loop.train` (tested). The trainer still drops any
group holding a token staler than the bound and counts it: a backend that
does not receive weights (an external engine with `weight_sync: none`) only
ever produces version-0 tokens.

In-flight updates (`inflight_updates: true`): new weights are applied between
two engine steps even in the middle of a batch; the engine preempts running
sequences and recomputes their cache under the new weights, so every token is
still sampled entirely under the version recorded for it — a sequence can mix
versions, each token exact for its own.

What the trainer keeps. π_old is the proximal policy, the trainer's current
weights (computed in the step's forward, as in the synchronous loop); μ is
the engine's. For stale data μ ≠ π_old and the corrections and `mismatch/`
diagnostics measure it. With `recompute_behaviour` the trainer also keeps the
weights of every version still inside the staleness window and recomputes
each token's logprob under the version that sampled it: in exact mode this
equals μ bitwise (`async/behaviour_recompute_abs_diff_max` = 0), proof that
the only off-policy gap is the staleness itself.

Data parallel (exactrl/distributed): every rank's rollout thread samples its
share of each step's prompts with its own engine; the trainer thread gathers
the shares (every collective runs on the trainer thread) and trains as the
synchronous loop does. The ranks' threads run at their own pace, so with
`max_staleness > 0` a token's version may depend on its rank's timing; each
token still records the version that sampled it.

Resume. A checkpoint holds the trained data position, not the batches the
rollout thread had sampled ahead; with `max_staleness > 0` a resumed run's
first batches are therefore fresher than an uninterrupted run's (with 0 the
two are the same run, bitwise).
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from dataclasses import dataclass

import torch

from exactrl.console import stderr_line
from exactrl.distributed import Ranks
from exactrl.engine import Engine
from exactrl.envs.prompts import prompt_ids
from exactrl.model.logprobs import token_logprobs
from exactrl.model.lora import synced_weights
from exactrl.rollout.groups import Rollout, generate_groups
from exactrl.train.config import AsyncSettings
from exactrl.train.loop import end_step, engine_metrics, initial_eval, preemptions, train_on
from exactrl.train.setup import Run, rng_state
from exactrl.train.signals import check_terminated


@dataclass
class RolloutBatch:
    """One step's rollouts, produced on the rollout thread."""

    step: int  # the training step it is for
    groups: list[list[Rollout]]  # this rank's share of the step's problems (all of them in one process)
    n_problems: int  # the step's problems over every rank
    prompts_state: dict  # PromptSource position after this batch's prompts (what a checkpoint saves)
    rng: dict  # the global random streams after this batch was scored (`rng_state`: what a checkpoint saves;
    # a task's reward may draw from them, and the next batch's draws start while this one is saved)
    rollout_s: float  # generation wall time
    engine_stats: dict[str, float]  # an external server's version and gauges when the batch was done, and the
    # batch's `rollout/preemptions` where the engine counts them


STOP_WAIT_S = 10.0  # how long a stopping run waits for its rollout thread (a batch in flight stops at its next step)


class _Stopped(Exception):
    """The trainer has stopped: the rollout thread drops its batch in flight."""


class RolloutWorker:
    """Owns the rollout engine on its own thread, at most `max_staleness` steps ahead of the trainer."""

    def __init__(self, c: Run, s: AsyncSettings):
        self.c, self.s = c, s
        self._cond = threading.Condition()
        self._published = c.start_step  # newest version the trainer has published
        self._pending: tuple[int, dict] | None = None  # newest weights not yet in the engine
        self._stopping = False
        self._out: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="exactrl-rollout", daemon=True)
        self._in_process = c.engine.step_hook  # it takes a hook between its steps

    def _between_steps(self) -> None:
        """Before each engine step of a batch: stop if told to; apply new weights with in-flight updates."""
        if self._stopping:
            raise _Stopped
        if self.s.inflight_updates:
            self._apply_pending()

    def __enter__(self) -> RolloutWorker:
        self._thread.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        """Stops the rollout thread: the in-process engine drops the batch in flight at its next step. A
        task's reward that does not return cannot be stopped: after an error or a Ctrl-C the run waits
        STOP_WAIT_S for the thread, then goes on without it, saying so. An external or Ray backend's batch
        in flight cannot be stopped either, and is normal there: the run waits 5 s, silently (the thread is
        a daemon; it only ever hands batches to the trainer, and steps no engine once told to stop)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if exc_type is None:
            self._thread.join()
            return
        self._thread.join(STOP_WAIT_S if self._in_process else 5.0)
        if self._in_process and self._thread.is_alive():
            stderr_line(
                f"exactrl: the rollout thread did not stop within {STOP_WAIT_S:g} s (a task's reward that does "
                f"not return?); the run stops without it"
            )

    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Trainer thread: hands over the weights of `version` (copied: the trainer keeps updating its own)."""
        weights = {k: v.detach().clone() for k, v in state_dict.items()}
        with self._cond:
            self._published, self._pending = version, (version, weights)
            self._cond.notify_all()

    def next_batch(self) -> RolloutBatch:
        item = self._out.get()
        if isinstance(item, BaseException):  # its own words on the last line of a traceback, its frames as the cause
            raise RuntimeError(f"the rollout thread failed: {type(item).__name__}: {item}") from item
        return item

    def _apply_pending(self) -> None:
        with self._cond:
            pending, self._pending = self._pending, None
        if pending is not None:
            self.c.engine.update_weights(pending[1], version=pending[0])

    def _run(self) -> None:
        c, cfg = self.c, self.c.cfg
        try:
            for step in range(c.start_step + 1, cfg.max_steps + 1):
                with self._cond:
                    self._cond.wait_for(lambda: self._stopping or self._published >= step - 1 - self.s.max_staleness)
                    if self._stopping:
                        return
                self._apply_pending()
                t0, before = time.perf_counter(), c.engine.stats()
                problems = c.data.prompts.take(cfg.rollout.prompts_per_step)
                mine = c.ranks.shard(len(problems))  # a data-parallel rank's share; the trainer gathers them
                groups = generate_groups(
                    c.engine,
                    c.data.tokenizer,
                    c.data.task,
                    [problems[k] for k in mine],
                    cfg.rollout,
                    cfg.seed,
                    step,
                    on_step=self._between_steps if self._in_process else None,
                    indices=mine,
                )
                # read here, on the thread that drives the engine; the trainer only logs the snapshot
                stats = engine_metrics(c.engine)
                stats = stats if any(k.startswith(("external/", "ray/")) for k in stats) else {}
                stats |= preemptions(before, c.engine.stats())
                self._out.put(
                    RolloutBatch(
                        step,
                        groups,
                        len(problems),
                        c.data.prompts.state_dict(),
                        rng_state(),
                        time.perf_counter() - t0,
                        stats,
                    )
                )
        except _Stopped:
            return
        except BaseException as e:  # handed to the trainer, which raises it
            self._out.put(e)


def drop_stale(
    groups: list[list[Rollout]], version: int, max_staleness: int
) -> tuple[list[list[Rollout]], dict[str, float]]:
    """Removes every group holding a token older than `version − max_staleness`; staleness metrics.

    Whole groups go, so group-relative advantages never see a partial group.
    """
    kept, dropped = [], 0
    ages = []
    for g in groups:
        g_ages = [version - v for r in g for v in r.versions]
        if g_ages and max(g_ages) > max_staleness:
            dropped += len(g)
        else:
            kept.append(g)
            ages += g_ages
    if not kept:
        raise ValueError(
            f"every sample of the batch is staler than max_staleness={max_staleness} at version "
            f"{version}: is the rollout backend receiving weights (external weight_sync: none)?"
        )
    t = torch.tensor(ages or [0], dtype=torch.float64)
    return kept, {
        "async/staleness_mean": t.mean().item(),
        "async/staleness_max": t.max().item(),
        "async/dropped_samples": float(dropped),
    }


class BehaviourCheck:
    """The weights of recent versions, to recompute each token's logprob under the version that sampled it."""

    def __init__(self, model, start_version: int):
        self.scratch = copy.deepcopy(model).requires_grad_(False)
        self.weights = {start_version: {k: v.detach().clone() for k, v in model.state_dict().items()}}

    def keep(self, version: int, model, oldest_needed: int) -> None:
        self.weights[version] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        for v in [v for v in self.weights if v < oldest_needed]:
            del self.weights[v]

    def max_abs_diff(self, groups: list[list[Rollout]], rs, ranks: Ranks = Ranks()) -> float | None:
        """max over tokens of |μ − log π_v(token)| with v the token's version (0.0 when exact); a
        data-parallel rank recomputes its share of the sequences, the max is taken over ranks. Only tokens
        of versions it holds: a resumed run holds none from before it (an external server without weight
        sync keeps sampling as version 0); None if no token was checked."""
        flat = [r for g in groups for r in g if r.completion_ids]
        flat = [flat[k] for k in ranks.shard(len(flat))]
        worst = None
        for v in sorted({v for r in flat for v in r.versions} & self.weights.keys()):
            self.scratch.load_state_dict(self.weights[v])
            rows = [r for r in flat if v in r.versions]
            with torch.no_grad():
                lps, _ = token_logprobs(
                    self.scratch,
                    [r.prompt_ids + r.completion_ids for r in rows],
                    rs.temperature,
                    rs.top_k,
                    rs.top_p,
                    first=[len(r.prompt_ids) for r in rows],
                )
            for r, ours in zip(rows, lps):
                for i, tv in enumerate(r.versions):
                    if tv == v:
                        worst = max(worst or 0.0, abs(float(ours[i]) - r.behav_logprobs[i]))
        checked = [w for w in ranks.gather(worst) if w is not None]
        return max(checked) if checked else None


def train_async(c: Run, s: AsyncSettings) -> dict[str, float]:
    cfg, last = c.cfg, {}
    # evaluation runs on the trainer thread over the trainer's own weights; the rollout engine is busy. A
    # quarter of its KV budget, but room for the longest held-out problem and its answer
    eval_engine = None
    if cfg.task.eval_size:
        kv = cfg.engine.kv_budget_tokens
        prompts = [prompt_ids(c.data.tokenizer, c.data.task, p) for p in c.data.eval_problems]
        longest = max(map(len, prompts), default=0) + cfg.rollout.max_tokens
        eval_engine = Engine(
            c.policy.model,
            stop_token_ids=sorted(c.data.tokenizer.stop_token_ids),
            kv_budget_tokens=min(kv, max(kv // 4, longest)),
        )
    initial = initial_eval(c, eval_engine)
    check = BehaviourCheck(c.policy.model, c.start_step) if s.recompute_behaviour else None
    with RolloutWorker(c, s) as worker:
        t_prev = time.perf_counter()
        for step in range(c.start_step + 1, cfg.max_steps + 1):
            item = worker.next_batch()
            assert item.step == step, (item.step, step)
            # every rank's share (a collective: on this thread only, never on the rollout thread)
            groups = c.ranks.gather_sharded(item.n_problems, item.groups)
            t1 = time.perf_counter()
            groups, metrics = drop_stale(groups, step - 1, s.max_staleness)
            if check is not None and (diff := check.max_abs_diff(groups, cfg.rollout, c.ranks)) is not None:
                metrics["async/behaviour_recompute_abs_diff_max"] = diff
            metrics |= train_on(c, step, groups)
            if eval_engine is not None:  # it shares the trainer's weights, which the step just wrote
                eval_engine.weights_changed()
            worker.publish(step, synced_weights(c.policy.model))
            if check is not None:  # batch k+1 may hold versions down to k − max_staleness
                check.keep(step, c.policy.model, step - s.max_staleness)
            t2 = time.perf_counter()
            metrics |= (
                {
                    "time/rollout_s": item.rollout_s,
                    "time/wait_rollout_s": t1 - t_prev,
                    "time/train_s": t2 - t1,
                    "engine/version": step,
                }
                | item.engine_stats
                | initial
            )  # in process: the version published
            # to the engine; an external server: the version it held (0 with weight_sync none) and its lag
            last = end_step(c, step, groups, metrics, t2 - t_prev, eval_engine, item.prompts_state, item.rng)
            initial, t_prev = {}, time.perf_counter()
            check_terminated()
    return last
