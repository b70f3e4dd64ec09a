"""The trackers (train/trackers.py) without processes: MLflow on a local file store, read back with its own
client; a missing package, a bad tracking URI and a damaged trackers.json named by their keys. W&B starts
a service process, so its tests are in tests/integration/train/test_trackers_run.py."""

from __future__ import annotations

import json
import sys

import pytest

from exactrl.train.config import load_config
from exactrl.train.logger import MetricsLogger
from exactrl.train.trackers import check_trackers, open_trackers


@pytest.fixture
def file_store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 takes a file store only when asked to
    return f"file://{tmp_path / 'mlruns'}"


def _mlflow(uri: str, *more: str):
    return load_config(None, ["logging.mlflow.enabled=true", f"logging.mlflow.tracking_uri={uri}", *more])


def _rows():
    return [
        {"step": 1, "rollout/reward_mean": 0.25, "train/loss": -0.5, "note": "text is not a metric"},
        {"step": 2, "rollout/reward_mean": 0.75, "train/loss": -0.25, "eval/accuracy": 0.5},
    ]


def _sample(step: int, kind: str, k: int) -> dict:
    return {
        "step": step,
        "kind": kind,
        "prompt": f"p{k}",
        "prompt_ids": [1, 2],
        "completion": f"c{k}",
        "completion_ids": [3],
        "logprobs": [-0.5],
        "reward": 1.0,
        "finish_reason": "stop",
    }


def test_mlflow_gets_every_metric_the_config_and_the_sample_tables(tmp_path, file_store):
    from mlflow.tracking import MlflowClient

    cfg = _mlflow(file_store, "logging.mlflow.experiment=exp", "seed=5")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    trackers = open_trackers(cfg.logging, cfg.model_dump(), run_dir)
    log = MetricsLogger(run_dir, False, False, 2, 0, trackers=trackers, samples=2)
    for row in _rows():
        log.log_samples([_sample(row["step"], "train", k) for k in range(2)])
        log.log(row)
    log.close()

    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(file_store)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert client.get_experiment(run.info.experiment_id).name == "exp"
    for key in ("rollout/reward_mean", "train/loss"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert history == [(r["step"], r[key]) for r in _rows()]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "eval/accuracy")] == [(2, 0.5)]
    assert "note" not in run.data.metrics and "step" not in run.data.metrics
    assert run.data.params["seed"] == "5" and run.data.params["logging.mlflow.experiment"] == "exp"
    files = {f.path for f in client.list_artifacts(run_id)} | {
        f.path for f in client.list_artifacts(run_id, "samples/train")
    }
    assert {"config.json", "samples/train/step_000001.json", "samples/train/step_000002.json"} <= files
    table = json.loads(open(client.download_artifacts(run_id, "samples/train/step_000002.json")).read())
    assert table["completion"] == ["c0", "c1"] and table["logprobs"] == [[-0.5], [-0.5]] and table["step"] == [2, 2]


def test_a_resumed_run_continues_its_mlflow_run(tmp_path, file_store):
    from mlflow.tracking import MlflowClient

    cfg = _mlflow(file_store)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = open_trackers(cfg.logging, cfg.model_dump(), run_dir)
    first[0].log_metrics(_rows()[0])
    first[0].close()
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    cfg = _mlflow(file_store, "max_steps=99")  # a resume may change max_steps: params keep the run's start
    again = open_trackers(cfg.logging, cfg.model_dump(), run_dir)
    assert again[0].run_id == run_id and MlflowClient(file_store).get_run(run_id).info.status == "RUNNING"
    again[0].log_metrics(_rows()[1])
    again[0].close()
    assert [m.step for m in MlflowClient(file_store).get_metric_history(run_id, "train/loss")] == [1, 2]
    assert len(MlflowClient(file_store).search_runs([MlflowClient(file_store).get_run(run_id).info.experiment_id])) == 1

    (run_dir / "trackers.json").write_text('{"mlflow": "0123456789abcdef0123456789abcdef"}')
    with pytest.raises(ValueError, match=r"logging.mlflow: cannot continue MLflow run 0123.*delete that file"):
        open_trackers(cfg.logging, cfg.model_dump(), run_dir)
    (run_dir / "trackers.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"trackers.json is not readable JSON .*fix or delete it"):
        open_trackers(cfg.logging, cfg.model_dump(), run_dir)


def test_a_tracking_uri_mlflow_cannot_use_is_named_before_the_run(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(ValueError, match=r"logging.mlflow: MLflow cannot use tracking_uri 'nosuch://x'"):
        check_trackers(_mlflow("nosuch://x").logging)


def test_a_missing_package_names_the_key_and_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` finds when it is not installed
    monkeypatch.setitem(sys.modules, "mlflow", None)
    cfg = load_config(None, ["logging.wandb.enabled=true"])
    with pytest.raises(ValueError, match=r"logging.wandb.enabled needs the wandb package .*exactrl\[wandb\]"):
        check_trackers(cfg.logging)
    with pytest.raises(ValueError, match=r"logging.mlflow.enabled needs the mlflow package .*exactrl\[mlflow\]"):
        check_trackers(_mlflow("file:///x").logging)


def test_tracker_keys_are_checked():
    from exactrl.train.config import ignored_settings

    assert ignored_settings(load_config(None, ["logging.mlflow.experiment=x"])) == [
        "logging.mlflow.experiment has no effect: logging.mlflow.enabled is false"
    ]
    with pytest.raises(ValueError, match=r"'logging.wandb.mode'"):
        load_config(None, ["logging.wandb.mode=sometimes"])
    with pytest.raises(ValueError, match=r"unknown config key 'logging.mlflow.uri'"):
        load_config(None, ["logging.mlflow.uri=file:///x"])
