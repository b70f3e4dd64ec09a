"""The default model's cache (`artifacts/default-<hash>/`): concurrent builds, broken entries, unwritable."""

from __future__ import annotations

import threading

import pytest

import exactrl
from exactrl.train import warmstart
from exactrl.train.config import load_config

CFG = ["sft.steps=1", "sft.batch_size=2"]


@pytest.fixture
def artifacts(tmp_path, monkeypatch):
    monkeypatch.setattr(warmstart, "ARTIFACTS", tmp_path / "artifacts")
    return tmp_path / "artifacts"


def build(log=lambda *a: None):
    return warmstart.default_model_dir(load_config(None, CFG), log=log)


def test_two_runs_building_the_same_model_at_once_both_get_it(artifacts, monkeypatch):
    """They wrote into one scratch directory, and the second to start deleted the first's half-built model."""
    from transformers import AutoTokenizer  # noqa: F401 - imported once here: two threads importing it at once fail

    both_building = threading.Barrier(2, timeout=120)
    sft = warmstart.supervised_finetune

    def meet_then_train(*args, **kwargs):
        both_building.wait()  # each has its tokenizer written and its model built
        sft(*args, **kwargs)

    monkeypatch.setattr(warmstart, "supervised_finetune", meet_then_train)
    got, errors = [], []

    def run():
        try:
            got.append(build())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert got[0] == got[1] and [p.name for p in artifacts.iterdir()] == [got[0].name]  # no scratch left
    exactrl.load_model(got[0])


def test_an_entry_missing_its_weights_is_rebuilt(artifacts):
    out = build()
    (out / "model.safetensors").unlink()
    assert build() == out
    exactrl.load_model(out)
    assert [p.name for p in artifacts.iterdir()] == [out.name]


def test_a_failed_build_leaves_no_scratch_and_no_entry(artifacts, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(warmstart, "supervised_finetune", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        build()
    assert list(artifacts.iterdir()) == []


def test_an_unwritable_cache_is_named(tmp_path, monkeypatch):
    """It was a bare '[Errno 20] Not a directory: .../.tmp-default-...'."""
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(warmstart, "ARTIFACTS", tmp_path / "file")
    with pytest.raises(
        ValueError,
        match=r"cannot write the default model's cache in .*file \(a file, not a "
        r"directory\): point EXACTRL_ARTIFACTS at a writable directory",
    ):
        build()
    monkeypatch.setattr(warmstart, "ARTIFACTS", tmp_path / "file" / "below")
    with pytest.raises(ValueError, match=r"cache in .*below \(Not a directory\): point EXACTRL_ARTIFACTS"):
        build()
