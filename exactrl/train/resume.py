"""Resuming a run: the checkpoint's identity checks (same settings, task and tokenizer), its weights,
optimizer state, data position and random streams; and the record of those a checkpoint keeps."""

from __future__ import annotations

import json
import platform
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from exactrl.distributed import Ranks
from exactrl.envs.custom import task_sha256
from exactrl.envs.dataset import PromptSource
from exactrl.model.lora import TARGETS
from exactrl.model.tokenizer import Tokenizer
from exactrl.model.transformer import CausalLM
from exactrl.train.checkpoint import latest_checkpoint, load_checkpoint
from exactrl.train.config import RunConfig, dotted

# keys a resumed run may change: where and how long it runs, what it shows, how fast the engine
# batches (results do not depend on it), held-out evaluation; everything else defines the run
RESUMABLE = (
    "max_steps",
    "run_dir",
    "resume",
    "progress",
    "tensorboard",
    "logging.",
    "save_every",
    "keep_checkpoints",
    "eval_every",
    "engine.",
    "task.eval_size",
    "model.path",
    "model.tokenizer",
    "rollout_backend.timeout_s",
    "rollout_backend.max_concurrency",
    "rollout_backend.base_urls",
    "rollout_backend.ray.",  # Ray engines sample what the in-process engine does, bitwise
    "optim.shard_state",  # the same weights and checkpoints, sharded or not
    "optim.activation_checkpointing",
    "distributed.",  # the full format is the same under either strategy; a sharded one is refused by ddp
)  # the same gradients, bit for bit


def software_versions() -> dict[str, str]:
    """The versions a checkpoint records: a resume under another torch may round differently (its kernels
    and ops are the bits the exactness rests on), so `_resume` says so."""
    from exactrl import __version__

    return {"exactrl": __version__, "torch": torch.__version__, "python": platform.python_version()}


def rng_state() -> dict[str, Any]:
    """This process's global random streams (torch, Python, numpy), as a checkpoint holds them."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch_rng": torch.get_rng_state().tolist(),
        "python_rng": list(random.getstate()[1]),
        "python_gauss_next": random.getstate()[2],
        "numpy_rng": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
    }


def _restore_rng(state: dict[str, Any], ranks: Ranks, any_world: bool = False, log=print) -> None:
    """This rank's random streams from a checkpoint; a run resumes with the number of ranks it saved, or, with
    `any_world` (an FSDP run from a full checkpoint), another: rank r takes the saved rank r mod W's."""
    saved = state.get("ranks_rng", [state])
    if len(saved) != ranks.world and any_world:
        if ranks.main:
            log(
                f"note: the checkpoint was saved by {len(saved)} rank(s) and this run has {ranks.world}: rank r "
                f"takes the random streams of saved rank r mod {len(saved)} (the run goes on, not bitwise "
                f"the uninterrupted one: the gradient's sums run in another order)"
            )
        saved = [saved[r % len(saved)] for r in range(ranks.world)]
    if len(saved) != ranks.world:
        raise ValueError(
            f"it was saved by a run of {len(saved)} rank(s) and this run has {ranks.world}: resume "
            f"it with the same number (exactrl train --nproc {len(saved)})"
        )
    rng = saved[ranks.rank]
    torch.set_rng_state(torch.tensor(rng["torch_rng"], dtype=torch.uint8))
    # Python's `random` and numpy's global one too (a task's generate/reward may use them); version 3 is
    # CPython's Mersenne Twister
    random.setstate((3, tuple(rng["python_rng"]), rng.get("python_gauss_next")))
    if "numpy_rng" in rng:  # checkpoints saved before it was kept have none
        kind, keys, pos, has_gauss, gauss = rng["numpy_rng"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


def _check_resume_early(cfg: RunConfig, run_dir: Path) -> None:
    """Settings a resume refuses, before a warm start or a model load is spent on them."""
    early = latest_checkpoint(run_dir) if run_dir.exists() else None
    if early is not None and _saved_command(early) == "sft":
        raise ValueError(
            f"run_dir {run_dir} holds checkpoints of an `exactrl sft` run: start RL from one of them in a new "
            f"run_dir (--set model.path={early} --set model.tokenizer=<its tokenizer's directory>)"
        )
    if early is not None:
        _check_same_run(_saved_config(early), cfg, early)


def _saved_command(ckpt: Path) -> str | None:
    """The command that wrote a checkpoint (`exactrl sft` records it; None: `exactrl train`, or unreadable)."""
    try:
        state = json.loads((ckpt / "state.json").read_text())
    except (OSError, ValueError):
        return None
    return state.get("command") if isinstance(state, dict) else None


def _saved_config(ckpt: Path) -> dict | None:
    """The run config a checkpoint holds (None if unreadable: loading the checkpoint then names the problem)."""
    try:
        config = json.loads((ckpt / "state.json").read_text()).get("config")
    except (OSError, ValueError, AttributeError):
        return None
    return config if isinstance(config, dict) else None


def _check_same_run(saved: dict | None, cfg: RunConfig, ckpt: Path) -> None:
    """Refuses to resume a checkpoint with settings that would make it a different run, naming them."""
    if saved is None:  # a checkpoint from before configs were saved in it
        return
    # as state.json holds it; a task module's source only where the checkpoint has it (older ones do not)
    try:
        sha = task_sha256(cfg.task) if "module_sha256" in saved.get("task", {}) else None
    except (OSError, ImportError):  # gone (a file, or a dotted name's package): importing it names the problem
        sha = None
    new = _identity(cfg.model_dump(mode="json", by_alias=True), sha)
    old, new = dotted(saved), dotted(new)
    # in float32 the key has no effect (the same weights and checkpoints): either value resumes; a bf16
    # checkpoint written before the key existed ran as false (the bf16 weights stepped themselves)
    # keys added since: a checkpoint from before them ran as their defaults
    for key, default in (
        ("model.lora.rank", 0),
        ("model.lora.alpha", 16.0),
        ("model.lora.dropout", 0.0),
        ("model.lora.targets", list(TARGETS)),
        ("optim.lr_schedule", "constant"),
        ("optim.min_lr_ratio", 0.0),
        ("rollout.filter_groups", False),
        ("rollout.max_sampling_rounds", 3),
        ("task.dataset", None),
        ("task.columns", {}),
        ("task.reward", None),
        ("task.kind", "task"),
        ("task.env_id", None),
        ("task.env_args", {}),
    ):
        if not any(k.startswith(f"{key}.") for k in old):  # a mapping that is not empty is its keys below it
            old.setdefault(key, default)
    if old.get("model.dtype") != "bfloat16":
        old["optim.fp32_master_weights"] = new["optim.fp32_master_weights"]
    elif "optim.fp32_master_weights" not in old:
        old["optim.fp32_master_weights"] = False
    # the weights come from the checkpoint, so model.path may move; but with KL on, the reference model
    # is read from model.path (the starting weights): another path would be another reference
    resumable = RESUMABLE if not cfg.algorithm.kl.coef else tuple(k for k in RESUMABLE if k != "model.path")
    # the in-process engine and Ray engines sample the same tokens (distributed/ray_engines.py): a run
    # may move between them, e.g. from a laptop to a Ray cluster (with fast kernels the bits depend on
    # the batch anyway, as with a change of engine.*)
    exact_backends = {old.get("rollout_backend.kind", "engine"), new["rollout_backend.kind"]} <= {"engine", "ray"}
    changed = [
        f"{k}: {old.get(k)!r} -> {new.get(k)!r}"
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k)
        and not k.startswith(resumable)
        and not (k == "rollout_backend.kind" and exact_backends)
    ]
    if changed:
        raise ValueError(
            f"resume from {ckpt} with changed settings ({'; '.join(changed)}): a resumed run keeps "
            f"the settings it was started with; drop these --set overrides, or start a new run_dir"
        )


def _identity(config: dict, module_sha: str | None) -> dict:
    """A run's config as its checkpoints keep it: with the sha256 of its task module's source, if any (an
    edited task file is another task)."""
    return config if module_sha is None else {**config, "task": {**config["task"], "module_sha256": module_sha}}


def resume(
    cfg: RunConfig,
    run_dir: Path,
    model: CausalLM,
    tokenizer: Tokenizer,
    prompts: PromptSource,
    ranks: Ranks,
    log: Callable[[str], object],
    new_optimizer: Callable[[CausalLM], torch.optim.Optimizer],
) -> tuple[CausalLM, torch.optim.Optimizer, int, Path | None]:
    """(model, optimizer, start step, checkpoint): from run_dir's latest checkpoint, else fresh at step 0.
    The checkpoint's prompt position and random streams are restored into `prompts` and this process;
    `new_optimizer` makes the optimizer over a model's parameters."""
    optimizer = new_optimizer(model)
    start = 0
    ckpt = latest_checkpoint(run_dir) if run_dir.exists() else None
    if ckpt is not None:
        model, opt_state, state = load_checkpoint(
            ckpt,
            cfg.model.dtype,
            cfg.model.kernels,
            note=log,
            device=cfg.model.device,
            backend=cfg.model.backend,
            base=model,  # a LoRA run's checkpoint: its adapters go onto the model from model.path
        )
        _check_same_run(state.get("config"), cfg, ckpt)
        if state.get("tokenizer", tokenizer.fingerprint) != tokenizer.fingerprint:
            raise ValueError(
                f"resume from {ckpt} with another tokenizer ({tokenizer.path}: model.tokenizer, or "
                f"model.path without it): its token ids, chat template or special tokens differ from "
                f"the run's; point model.tokenizer at the tokenizer the run started with"
            )
        optimizer = new_optimizer(model)
        fsdp = cfg.distributed.strategy == "fsdp" and ranks.world > 1
        if opt_state is None and not fsdp:
            n = len(state.get("ranks_rng", [state]))
            raise ValueError(
                f"checkpoint {ckpt} holds FSDP shards (distributed.checkpoint=sharded): resume it with "
                f"exactrl train --nproc {n} --set distributed.strategy=fsdp"
            )
        try:
            if opt_state is not None:
                optimizer.load_state_dict(opt_state)
            prompts.load_state_dict(state["prompts"])
            _restore_rng(state, ranks, any_world=cfg.distributed.strategy == "fsdp" and opt_state is not None, log=log)
        except (KeyError, TypeError, AttributeError, IndexError, RuntimeError) as e:
            raise ValueError(
                f"checkpoint {ckpt} cannot be resumed: its state does not fit this run "
                f"({type(e).__name__}: {e}); remove it to resume from an older one"
            ) from None
        except ValueError as e:  # a data position or random stream refused in its own words (a dataset or rank count
            # that differs: an older checkpoint would not fit either)
            raise ValueError(
                f"checkpoint {ckpt} cannot be resumed: its state.json does not fit this run ({e})"
            ) from None
        start = state["step"]
        log(f"resuming {run_dir} from {ckpt.name}")
        saved, now = state.get("software"), software_versions()
        if isinstance(saved, dict) and saved.get("torch") not in (None, now["torch"]):
            log(
                f"warning: {ckpt.name} was written under torch {saved['torch']}, this run has {now['torch']}: "
                f"its next steps may differ in the last bits from the run it continues (engine and trainer "
                f"still agree bitwise with each other)"
            )
    elif cfg.resume:  # e.g. a job that always passes resume=true, on its first start
        log(f"resume=true: {run_dir} holds no checkpoint yet, so the run starts at step 0")
    return model, optimizer, start, ckpt
