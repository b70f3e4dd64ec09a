"""Old import paths, kept for one release: `exactrl.rl.X` is the same module object as its new home.

    exactrl.rl.{advantages, losses, corrections, kl, aggregation, diagnostics, types} -> exactrl.algo.*
    exactrl.rl.rollout -> exactrl.rollout.groups, exactrl.rl.agent_rollout -> exactrl.rollout.agents,
    exactrl.rl.external -> exactrl.rollout.external
    exactrl.rl.{trainer, loop, async_loop, setup, config, config_docs, checkpoint, run_dir, logger,
                report, run, warmstart, master_weights, activation_ckpt} -> exactrl.train.*

A module is imported when its old name is first used, so `import exactrl.rl` stays light.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {
    **{
        m: f"exactrl.algo.{m}"
        for m in ("advantages", "losses", "corrections", "kl", "aggregation", "diagnostics", "types")
    },
    "rollout": "exactrl.rollout.groups",
    "agent_rollout": "exactrl.rollout.agents",
    "external": "exactrl.rollout.external",
    **{
        m: f"exactrl.train.{m}"
        for m in (
            "trainer",
            "loop",
            "async_loop",
            "setup",
            "config",
            "config_docs",
            "checkpoint",
            "run_dir",
            "logger",
            "report",
            "run",
            "warmstart",
            "master_weights",
            "activation_ckpt",
        )
    },
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `exactrl.rl.X` and hands back the module at its new path (one object, two names)."""

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, leaf = fullname.rpartition(".")
        if prefix != __name__ or leaf not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name.rpartition(".")[2]])

    def exec_module(self, module):
        pass  # the new module ran when it was imported


if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.insert(0, _Alias())


def __getattr__(name: str):
    if name in MOVED:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
