"""Experiment trackers beside metrics.jsonl and TensorBoard: Weights & Biases and MLflow (optional extras).

Each tracker gets the run config once and then every metrics row (at its `step`) and every sample table
(train/samples.py); the logger calls them through the `Tracker` protocol. A tracker is opened before the
run's first step: a missing package, a bad URI or a refused login is a ValueError naming its config key
then, not a run lost later. The tracker's run id is kept in run_dir/trackers.json, and a resumed run
continues that tracker run. Steps redone after a resume (those past the checkpoint) are logged again:
W&B drops a step below its run's last one (it warns), MLflow keeps both points of such a step.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field

from exactrl.train.checkpoint import replace_durably
from exactrl.train.settings import _STRICT


class WandbSettings(BaseModel):
    model_config = _STRICT

    enabled: bool = False
    """Log every metrics row, the run config and the sample tables to a Weights & Biases run (the
    `wandb` extra: pip install 'exactrl[wandb]'). Its files go to run_dir/wandb."""
    project: str = "exactrl"
    """The W&B project."""
    entity: str | None = None
    """The W&B team or user; null: the account's default entity."""
    name: str | None = None
    """The W&B run's display name; null: the run dir's name."""
    mode: Literal["online", "offline"] = "online"
    """`online` streams to the W&B server (needs `wandb login` or WANDB_API_KEY); `offline` writes
    run_dir/wandb only, for `wandb sync` later."""


class MlflowSettings(BaseModel):
    model_config = _STRICT

    enabled: bool = False
    """Log every metrics row, the run config (as params and config.json) and the sample tables to an MLflow
    run (the `mlflow` extra: pip install 'exactrl[mlflow]')."""
    tracking_uri: str | None = None
    """Where MLflow keeps runs: a server (http://host:5000), a database (sqlite:///mlflow.db) or a local
    store (file:///path/mlruns; MLflow 3 takes one only with MLFLOW_ALLOW_FILE_STORE=true); null: MLflow's
    own default (MLFLOW_TRACKING_URI, else its local store)."""
    experiment: str = "exactrl"
    """The MLflow experiment (created if missing)."""
    run_name: str | None = None
    """The MLflow run's name; null: the run dir's name."""


class LoggingSettings(BaseModel):
    model_config = _STRICT

    samples: int = Field(4, ge=0)
    """Samples of each training step and of each evaluation written to run_dir/samples.jsonl (prompt and
    completion text and token ids, engine logprobs, reward) and shown as tables in the trackers; 0 = none."""
    wandb: WandbSettings = Field(default_factory=WandbSettings)
    """Weights & Biases."""
    mlflow: MlflowSettings = Field(default_factory=MlflowSettings)
    """MLflow."""


class Tracker(Protocol):
    def log_metrics(self, metrics: dict[str, Any]) -> None:
        """One metrics row, at its `step`."""

    def log_samples(self, rows: list[dict[str, Any]]) -> None:
        """One step's sample rows of one kind (train/samples.py), as a table."""

    def close(self) -> None:
        """Ends the tracker run (its last data written); idempotent."""


def close_all(trackers: list[Tracker]) -> None:
    """Closes every tracker; the first error raised (after all were tried)."""
    error = None
    for t in trackers:
        try:
            t.close()
        except Exception as e:  # the others still close: each holds its own run's last data
            error = error or e
    if error is not None:
        raise error


def open_trackers(s: LoggingSettings, config: dict[str, Any], run_dir: Path) -> list[Tracker]:
    """The trackers `s` enables, started (or continued, by the ids in run_dir/trackers.json) with `config`."""
    ids = _read_ids(run_dir)
    trackers: list[Tracker] = []
    try:
        if s.wandb.enabled:
            trackers.append(WandbTracker(s.wandb, config, run_dir, ids.get("wandb")))
            ids["wandb"] = trackers[-1].run_id
        if s.mlflow.enabled:
            trackers.append(MlflowTracker(s.mlflow, config, run_dir, ids.get("mlflow")))
            ids["mlflow"] = trackers[-1].run_id
    except BaseException:
        close_all(trackers)
        raise
    if trackers:
        replace_durably(run_dir / "trackers.json", json.dumps(ids, indent=2))
    return trackers


def check_trackers(s: LoggingSettings) -> None:
    """The enabled trackers' packages import, and MLflow's tracking URI names a store MLflow can use: checked
    before anything expensive (a warm start, a model load). Starting their runs comes later."""
    if s.wandb.enabled:
        _import("wandb", "logging.wandb")
    if s.mlflow.enabled:
        _mlflow_client(s.mlflow)


def _import(name: str, key: str):
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ValueError(
            f"{key}.enabled needs the {name} package ({e}): pip install 'exactrl[{name}]', or set {key}.enabled=false"
        ) from None


def _read_ids(run_dir: Path) -> dict[str, str]:
    path = run_dir / "trackers.json"
    if not path.exists():
        return {}
    try:
        ids = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{path} is not readable JSON ({e}): fix or delete it (a new tracker run then starts)"
        ) from None
    if not isinstance(ids, dict) or not all(isinstance(v, str) for v in ids.values()):
        raise ValueError(f"{path} must map tracker names to run ids: fix or delete it (a new tracker run then starts)")
    return ids


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if k != "step" and isinstance(v, (int, float))}


def _table_key(rows: list[dict[str, Any]]) -> str:
    kinds = {r["kind"] for r in rows}
    assert len(kinds) == 1 and len({r["step"] for r in rows}) == 1, "one table holds one step's rows of one kind"
    return f"samples/{kinds.pop()}"


class WandbTracker:
    """A W&B run: the config as its config, each metrics row as one `log` at the row's step, each sample
    table as a wandb.Table under `samples/train` or `samples/eval`."""

    def __init__(self, s: WandbSettings, config: dict[str, Any], run_dir: Path, run_id: str | None):
        wandb = _import("wandb", "logging.wandb")
        self.wandb = wandb
        try:
            self.run = wandb.init(
                project=s.project,
                entity=s.entity,
                name=s.name or run_dir.name,
                mode=s.mode,
                dir=str(run_dir),
                id=run_id,
                resume="allow" if run_id else None,
                config=config,
            )
        except Exception as e:  # wandb's own errors (a refused login, an unknown entity) have no common base
            raise ValueError(f"logging.wandb: cannot start the W&B run ({_said(e)})") from None
        self.run_id = self.run.id

    def log_metrics(self, metrics: dict[str, Any]) -> None:
        self.run.log(_scalars(metrics), step=metrics["step"])

    def log_samples(self, rows: list[dict[str, Any]]) -> None:
        columns = [*rows[0]]
        table = self.wandb.Table(columns=columns, data=[[_cell(r[c]) for c in columns] for r in rows])
        self.run.log({_table_key(rows): table}, step=rows[0]["step"])

    def close(self) -> None:
        run, self.run = self.run, None
        if run is not None:
            run.finish()


def _said(e: Exception) -> str:
    """An error of a tracker's package on one line, cut to 800 characters (some carry a whole response)."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:800]}"


def _cell(v: Any) -> Any:
    """A table cell: token ids and logprobs as JSON text (a W&B table column holds one type)."""
    return json.dumps(v) if isinstance(v, list) else v


def _mlflow_client(s: MlflowSettings):
    _import("mlflow", "logging.mlflow")
    from mlflow.tracking import MlflowClient

    try:
        client = MlflowClient(tracking_uri=s.tracking_uri)
        experiment = client.get_experiment_by_name(s.experiment)
    except Exception as e:  # a store MLflow cannot open: its errors have no common base
        where = f"tracking_uri {s.tracking_uri!r}" if s.tracking_uri else "its default tracking URI"
        raise ValueError(
            f"logging.mlflow: MLflow cannot use {where} ({_said(e)}); "
            f"set logging.mlflow.tracking_uri to a server, a database or a file:// store"
        ) from None
    return client, experiment


class MlflowTracker:
    """An MLflow run: the config as params (dotted keys, once, at the run's start) and as config.json, each
    metrics row as one batch at the row's step, each sample table as samples/<kind>/step_<step>.json."""

    def __init__(self, s: MlflowSettings, config: dict[str, Any], run_dir: Path, run_id: str | None):
        from mlflow.entities import Param

        from exactrl.train.config import dotted

        self.client, experiment = _mlflow_client(s)
        if run_id is not None:  # the resumed run's: it must still be there
            try:
                self.client.get_run(run_id)
                self.client.update_run(run_id, status="RUNNING")
            except Exception as e:  # MLflow's errors have no common base
                raise ValueError(
                    f"logging.mlflow: cannot continue MLflow run {run_id} of {run_dir / 'trackers.json'} "
                    f"({_said(e)}); delete that file to start a new MLflow run"
                ) from None
        else:
            try:
                exp_id = experiment.experiment_id if experiment else self.client.create_experiment(s.experiment)
                run_id = self.client.create_run(exp_id, run_name=s.run_name or run_dir.name).info.run_id
            except Exception as e:
                raise ValueError(f"logging.mlflow: cannot start an MLflow run ({_said(e)})") from None
            params = [Param(k, (v if isinstance(v, str) else json.dumps(v))[:6000]) for k, v in dotted(config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                self.client.log_batch(run_id, params=params[i : i + 100])
        self.client.log_dict(run_id, config, "config.json")  # as this segment of the run was started
        self.run_id = run_id

    def log_metrics(self, metrics: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, metrics["step"]) for k, v in _scalars(metrics).items()]
        for i in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def log_samples(self, rows: list[dict[str, Any]]) -> None:
        table = {c: [r[c] for r in rows] for c in rows[0]}
        path = f"{_table_key(rows)}/step_{rows[0]['step']:06d}.json"
        self.client.log_dict(self.run_id, table, path)  # a redone step (a resume) overwrites its own file

    def close(self) -> None:
        if self.run_id is not None:
            run_id, self.run_id = self.run_id, None
            self.client.set_terminated(run_id)
