"""`exactrl train` with samples.jsonl, W&B offline and an MLflow file store, read back with their own formats:
every metrics row in each tracker, the config, the sample tables; a resumed run continues its tracker runs
and writes the samples the uninterrupted run wrote."""

from __future__ import annotations

import json
import struct

import pytest
from conftest import default_job_model, train_rows

SMALL = [
    "progress=false",
    "tensorboard=false",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "task.eval_size=8",
    "eval_every=2",
    "optim.lr=1e-3",
    "engine.kv_budget_tokens=4096",
    "logging.samples=3",
    "progress.samples=1",
    "logging.wandb.enabled=true",
    "logging.wandb.mode=offline",
    "logging.mlflow.enabled=true",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return default_job_model(tmp_path_factory, sft_steps=5)


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline with its own files in tmp; MLflow's file store allowed (MLflow 3 refuses it unless asked)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return f"logging.mlflow.tracking_uri=file://{tmp_path / 'mlruns'}"


def wandb_records(path) -> list:
    """The records of a .wandb file: W&B's transaction log, a 7-byte header (":W&B", magic, version) then
    LevelDB's log format (32 KiB blocks of chunks, each with crc32c, length and kind: 1 whole, 2 first,
    3 middle, 4 last; a block's tail under 7 bytes is padding), each record a wandb_internal Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pos, payload = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload += data[pos + 7 : pos + 7 + length] if kind else b""
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(payload)
            records.append(record)
            payload = b""
    return records


def wandb_history(run_dir) -> tuple[dict[int, dict], dict]:
    """({step: {key: value}} of every offline W&B run in run_dir, the last run's config)."""
    steps, config = {}, {}
    for f in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for r in wandb_records(f):
            if r.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                items["_dir"] = f.parent
                steps.setdefault(r.history.step.num, {}).update(items)
            elif r.WhichOneof("record_type") == "run":
                config = {i.key: json.loads(i.value_json) for i in r.run.config.update if i.key != "_wandb"}
    return steps, config


def metric_keys(rows: list[dict]) -> set[str]:
    return {k for r in rows for k, v in r.items() if k != "step" and isinstance(v, (int, float))}


def test_a_run_logs_samples_and_every_metric_to_wandb_and_mlflow(model_dir, tmp_path, offline, capsys):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    rows = train_rows(SMALL, model_dir, run_dir, "max_steps=3", offline)
    out = capsys.readouterr().out

    # samples.jsonl: the initial evaluation (step 0), 3 train samples a step, an evaluation at 2 and 3
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["kind"]) for s in samples] == [
        (0, "eval"),
        (0, "eval"),
        (0, "eval"),
        *[(1, "train")] * 3,
        *[(2, "eval")] * 3,
        *[(2, "train")] * 3,
        *[(3, "eval")] * 3,
        *[(3, "train")] * 3,
    ]
    for s in samples:
        assert len(s["logprobs"]) == len(s["completion_ids"]) >= 1 and all(lp <= 0 for lp in s["logprobs"])
        assert s["prompt_ids"] and s["prompt"].endswith("assistant\n") and s["reward"] in (0.0, 1.0)
    assert len({s["prompt"] for s in samples if s["step"] == 1}) == 3  # one sample per prompt first
    printed = [line for line in out.splitlines() if line.startswith("  [")]
    assert [line.split("]")[0] for line in printed] == [
        "  [eval step 0",
        "  [train step 1",
        "  [eval step 2",
        "  [train step 2",
        "  [eval step 3",
        "  [train step 3",
    ]

    # W&B: every metric of every row at its step, the config, a table of each step's samples
    history, config = wandb_history(run_dir)
    for row in rows:
        logged = history[row["step"]]
        assert {k: logged[k] for k in metric_keys([row])} == {k: row[k] for k in metric_keys([row])}
        table = json.loads((logged["_dir"] / "files" / logged["samples/train/path"]).read_text())
        mine = [s for s in samples if s["step"] == row["step"] and s["kind"] == "train"]
        assert [dict(zip(table["columns"], d))["completion"] for d in table["data"]] == [s["completion"] for s in mine]
    assert history[0]["samples/eval/nrows"] == 3 and "samples/eval/nrows" not in history[1]
    assert config["seed"] == 0 and config["rollout"]["prompts_per_step"] == 4 and config["progress"]["samples"] == 1

    # MLflow: every metric's history, the config as params and config.json
    ids = json.loads((run_dir / "trackers.json").read_text())
    client = MlflowClient(offline.split("=", 1)[1])
    run = client.get_run(ids["mlflow"])
    assert run.info.status == "FINISHED" and run.data.params["rollout.prompts_per_step"] == "4"
    for key in metric_keys(rows):
        history = sorted((m.step, m.value) for m in client.get_metric_history(ids["mlflow"], key))
        assert history == [(r["step"], float(r[key])) for r in rows if key in r], key
    eval_tables = {f.path for f in client.list_artifacts(ids["mlflow"], "samples/eval")}
    assert eval_tables == {f"samples/eval/step_{s:06d}.json" for s in (0, 2, 3)}


def test_a_resumed_run_continues_its_tracker_runs_and_samples(model_dir, tmp_path, offline):
    """A crash after step 3's rows but before its checkpoint: the resumed run redoes step 3 in the same
    tracker runs, and samples.jsonl ends as the uninterrupted run's."""
    import shutil

    from mlflow.tracking import MlflowClient

    whole = tmp_path / "whole"
    full = train_rows(SMALL, model_dir, whole, "max_steps=3", offline)
    parts = tmp_path / "parts"
    train_rows(SMALL, model_dir, parts, "max_steps=3", "save_every=2", offline)
    first = json.loads((parts / "trackers.json").read_text())
    shutil.rmtree(parts / "checkpoints" / "step_000003")  # as if killed between logging step 3 and saving it
    (parts / "checkpoints" / "latest").write_text("step_000002\n")
    rows = train_rows(SMALL, model_dir, parts, "max_steps=3", "save_every=2", "resume=true", offline)
    assert json.loads((parts / "trackers.json").read_text()) == first  # the same W&B and MLflow runs

    assert (parts / "samples.jsonl").read_text() == (whole / "samples.jsonl").read_text()
    assert [r["rollout/reward_mean"] for r in rows] == [r["rollout/reward_mean"] for r in full]
    client = MlflowClient(offline.split("=", 1)[1])
    history = [(m.step, m.value) for m in client.get_metric_history(first["mlflow"], "rollout/reward_mean")]
    expected = [(r["step"], r["rollout/reward_mean"]) for r in full]
    assert sorted(history) == sorted(expected + expected[-1:])  # MLflow keeps the redone step's point too
    assert client.get_run(first["mlflow"]).info.status == "FINISHED"
    experiment = client.get_run(first["mlflow"]).info.experiment_id
    whole_run = json.loads((whole / "trackers.json").read_text())["mlflow"]
    assert {r.info.run_id for r in client.search_runs([experiment])} == {whole_run, first["mlflow"]}
    wandb_runs = sorted((parts / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 2 and all(d.name.endswith(first["wandb"]) for d in wandb_runs)
    history, _ = wandb_history(parts)
    assert history[3]["rollout/reward_mean"] == full[-1]["rollout/reward_mean"]


def test_a_tracker_that_cannot_start_stops_the_run_before_its_first_step(model_dir, tmp_path, offline, capsys):
    from conftest import train_args

    from exactrl.cli import main

    code = main(train_args(SMALL, model_dir, tmp_path / "run", "logging.mlflow.tracking_uri=nosuch://x"))
    assert code == 2 and "logging.mlflow: MLflow cannot use tracking_uri 'nosuch://x'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # named before the run dir was made


def test_a_wandb_login_refused_at_the_start_is_named_and_leaves_no_run_dir(model_dir, tmp_path, monkeypatch, capsys):
    """Online W&B without an API key (no WANDB_API_KEY, no ~/.netrc): W&B refuses when the run starts, after
    the run dir was made; the error names the key and the new dir is removed."""
    from conftest import train_args

    from exactrl.cli import main

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    settings = [s for s in SMALL if not s.startswith(("logging.mlflow", "logging.wandb.mode"))]
    code = main(train_args(settings, model_dir, tmp_path / "run", "max_steps=1"))
    assert code == 2 and "logging.wandb: cannot start the W&B run" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
