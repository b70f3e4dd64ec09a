"""`exactrl train [CONFIG.yaml] [--set key=value ...] [--nproc N]`.

With `--nproc N` (or under torchrun) every rank runs `train_main`; rank 0
alone prints, writes the run dir's files and the report (exactrl/distributed).
"""

from __future__ import annotations

import json
import signal
import threading

from exactrl.console import stderr_line
from exactrl.train import signals
from exactrl.train.config import dotted, ignored_settings, load_config
from exactrl.train.signals import Terminated


def stopped_by(e: KeyboardInterrupt) -> tuple[str, int]:
    """How a run was stopped, and its exit code (128 + the signal, as a shell reports it)."""
    return ("terminated (SIGTERM)", 143) if isinstance(e, Terminated) else ("interrupted", 130)


def train_main(config_path: str | None, overrides: list[str]) -> int:
    from exactrl.distributed import init_from_env

    cfg = load_config(config_path, overrides)
    ranks = init_from_env()  # one rank unless started by `--nproc N` or torchrun (exactrl/distributed)
    graceful = ranks.world == 1 and threading.current_thread() is threading.main_thread()
    signals.reset()
    previous = signal.signal(signal.SIGTERM, signals.on_sigterm) if graceful else None
    try:
        _check_same_settings(cfg, ranks)
        code = _train(cfg, ranks, print if ranks.main else _quiet)
        if code not in (130, 143):  # an interrupted rank may have left the others in another collective: no barrier
            ranks.barrier()  # every rank is done before any tears the group down
        return code
    except RuntimeError as e:  # outside the training loop (setting up, the last barrier): one line as in it
        left = rank_left(e, ranks)
        if left is not None:
            raise left from None
        raise
    finally:
        if graceful:
            signal.signal(signal.SIGTERM, previous)
        if ranks.world > 1:
            import torch.distributed

            torch.distributed.destroy_process_group()


def _check_same_settings(cfg, ranks) -> None:
    """Every rank runs rank 0's settings. torchrun starts each rank with its own command line, and ranks
    with, say, another `model.kernels` or `algorithm.loss` would train a model none of them describes:
    every rank raises, naming the keys that differ (a collective: every rank takes part)."""
    if ranks.world == 1:
        return
    mine = settings_leaves(cfg)
    first = ranks.broadcast(mine)

    def shown(d: dict, k: str) -> str:
        return repr(d[k]) if k in d else "unset"

    diffs = ranks.gather(
        [
            f"{k} ({shown(mine, k)} vs rank 0's {shown(first, k)})"
            for k in sorted(first.keys() | mine.keys())
            if first.get(k, ...) != mine.get(k, ...)
        ]
    )
    bad = {r: d for r, d in enumerate(diffs) if d}
    if bad:
        where = "; ".join(f"rank {r}: " + ", ".join(d) for r, d in bad.items())
        raise ValueError(
            f"the ranks were started with different settings ({where}); start every rank with the "
            f"same config file and --set options"
        )


def settings_leaves(cfg) -> dict:
    """The config as `--set` keys and their values (an empty mapping has no key below it: none)."""
    return {k: v for k, v in dotted(cfg.model_dump(by_alias=True)).items() if v != {}}


def rank_left(e: BaseException, ranks) -> ConnectionError | None:
    """The one-line error for a collective that failed because another rank is gone; None for any other."""
    from exactrl.distributed import lost_rank

    lost = lost_rank(e) if ranks.world > 1 else None
    return ConnectionError(f"another rank left the run ({lost}); its own output says why") if lost else None


def _quiet(*args, **kwargs) -> None:
    """`print` on ranks other than 0: rank 0 speaks for the run."""


def _say_shares(c, ranks, say) -> None:
    """What rank 0 holds of a sharded run's state (optim.shard_state, distributed.strategy=fsdp)."""
    from exactrl.distributed import optimizer_share

    if c.policy.step_settings.fsdp:
        from exactrl.distributed.fsdp import local_numel

        mine, total = local_numel(list(c.policy.model.parameters()))
        say(
            f"FSDP over {ranks.world} ranks: rank 0 holds {mine:,} of {total:,} parameter elements, their "
            f"gradients and AdamW state"
        )
    elif c.cfg.optim.shard_state and ranks.world > 1:
        mine, total = optimizer_share(c.policy.optimizer)
        say(
            f"AdamW state sharded over {ranks.world} ranks: rank 0 keeps the moments of {mine:,} of {total:,} "
            f"parameter elements"
        )


def _train(cfg, ranks, say) -> int:
    from exactrl.train.async_loop import train_async
    from exactrl.train.checkpoint import CheckpointWriteError, latest_checkpoint, replace_durably
    from exactrl.train.loop import train
    from exactrl.train.report import write_report
    from exactrl.train.setup import build

    for key in ignored_settings(cfg):
        say(f"note: {key}")
    c = build(cfg, say, ranks)
    if c.start_step >= cfg.max_steps:
        c.close()
        say(
            f"nothing to do: run {c.run_dir} is already at step {c.start_step} (max_steps={cfg.max_steps}); "
            f"raise max_steps with --set max_steps=N to continue it"
        )
        if ranks.main and not (c.run_dir / "report").is_dir():  # stopped after its last checkpoint, before it
            say(f"report: {write_report(c.run_dir)[0]}")
        return 0
    mode = f"async, max_staleness={cfg.async_.max_staleness}" if cfg.async_.enabled else "sync"
    mode += f", {ranks.world} ranks" if ranks.world > 1 else ""
    say(f"run dir: {c.run_dir}  (kernels={cfg.model.kernels}, dtype={cfg.model.dtype}, steps={cfg.max_steps}, {mode})")
    _say_shares(c, ranks, say)
    try:
        if ranks.main:
            replace_durably(c.run_dir / "config.json", json.dumps(cfg.model_dump(by_alias=True), indent=2))
        last = train_async(c, cfg.async_) if cfg.async_.enabled else train(c)
        c.close()  # flushes TensorBoard's last events: a full disk may show only here, after the last step
    except BaseException as e:
        _close_after(c)
        interrupted = isinstance(e, KeyboardInterrupt)
        how, stop_code = stopped_by(e) if interrupted else ("", 0)
        removed = ranks.main and _remove_if_empty(c)  # an error's own message follows on one line (cli.py)
        if removed and interrupted:
            stderr_line(f"\n{how} before the first step: the new run dir {c.run_dir} held nothing and was removed")
        elif interrupted and ranks.main:  # Ctrl-C: what is saved stays; say how to go on
            ckpt = latest_checkpoint(c.run_dir)
            where = f"its last checkpoint is {ckpt.name}" if ckpt else "it has no checkpoint yet"
            nproc = f" --nproc {ranks.world}" if ranks.world > 1 else ""
            stderr_line(
                f"\n{how}: run {c.run_dir} is kept and {where}; continue it with "
                f"exactrl train{nproc} --set run_dir={c.run_dir} --set resume=true (and the same settings)"
            )
        if interrupted:
            return stop_code
        left = rank_left(e, ranks)
        if left is not None:  # one line, not gloo's traceback: the rank that left (its output, the launcher's) says why
            e = left
        nproc = f"--nproc {ranks.world} " if ranks.world > 1 else ""
        resume = f"exactrl train {nproc}--set run_dir={c.run_dir} --set resume=true"
        if isinstance(e, CheckpointWriteError) and ranks.main:  # it names the checkpoint kept: add the command
            raise CheckpointWriteError(f"{e}: {resume}") from e
        if isinstance(e, OSError) and ranks.main and not removed:
            ckpt = latest_checkpoint(c.run_dir)  # a full disk, a run dir gone read-only: what is kept, what next
            raise OSError(
                f"{e}; run {c.run_dir} is kept and "
                f"{f'its last checkpoint {ckpt.name} is intact' if ckpt else 'it has no checkpoint yet'}: "
                f"fix that and continue it with {resume}"
            ) from e
        if left is not None:
            raise e from None
        raise
    finally:
        c.close()
    if not ranks.main:
        return 0
    _say_final(c.run_dir, last)
    return 0


FINAL_KEYS = (
    "step",
    "rollout/reward_mean",
    "eval/accuracy",
    "train/train_rollout_logprob_abs_diff",
    "train/train_rollout_logprob_abs_diff_max",
)


def _say_final(run_dir, last: dict) -> None:
    """Writes the run's report and prints its last step's headline metrics and the report's path."""
    from exactrl.train.report import write_report

    plots = write_report(run_dir)
    print("final:", json.dumps({k: last[k] for k in FINAL_KEYS if k in last}))
    print(f"report: {plots[0]}")


def _close_after(c) -> None:
    """Closes what a run opened after an error or a signal stopped it. A close that fails too (a full disk
    fails TensorBoard's last flush as well) would replace the error that stopped the run, and its message
    (what is kept, the command to go on) with it: the first error is the one named."""
    try:
        c.close()
    except Exception:
        pass


def _remove_if_empty(c) -> bool:
    """Removes a run dir this run created if it holds no step: no metrics row and no checkpoint
    (only config.json and TensorBoard's empty event file), so a failed start leaves nothing behind."""
    import shutil

    from exactrl.train.checkpoint import latest_checkpoint

    metrics = c.run_dir / "metrics.jsonl"
    if not c.files.new or latest_checkpoint(c.run_dir) is not None or (metrics.exists() and metrics.stat().st_size):
        return False
    shutil.rmtree(c.run_dir)
    return True
