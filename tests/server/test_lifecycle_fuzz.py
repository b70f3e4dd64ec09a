"""The server's weight and session lifecycle on its edge paths: updates refused by name with the old weights
serving on bitwise, updates landing while requests run or are queued (every token's version and logprob),
concurrent updates, and sessions whose requests meet an update.

Its own server (weights change here; the shared one of serving.py stays as it was built).
"""
from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import httpx
import pytest
import torch

from conftest import make_hf_model
from exactrl.server.app import ServerThread, build_state, create_app
from serving import model_dir


@pytest.fixture(scope="module")
def srv():
    state = build_state(str(model_dir()), kv_budget_tokens=4096)
    with ServerThread(create_app(state)) as t:
        yield SimpleNamespace(url=t.url, state=state, model=state.config.model_name)


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """A checkpoint of the served model's configuration with other weights."""
    d = shutil.copytree(model_dir(), tmp_path_factory.mktemp("ckpt") / "other")
    cfg = json.loads((d / "config.json").read_text())
    make_hf_model(d, "qwen3", seed=1, vocab_size=cfg["vocab_size"], eos_token_id=cfg["eos_token_id"],
                  pad_token_id=cfg.get("pad_token_id"))
    return d


def update(srv, path) -> httpx.Response:
    return httpx.post(srv.url + "/update_weights_from_disk", json={"model_path": str(path)}, timeout=60)


def bits(state) -> dict:
    """The served weights' bits (torch.equal would call -0.0 and 0.0 equal)."""
    return {k: v.detach().view(torch.int32).clone() for k, v in state.engine.model.named_parameters()}


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def sample(srv) -> dict:
    body = {"model": srv.model, "prompt": "hello world", "max_tokens": 8, "ignore_eos": True, "seed": 5, "n": 2}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return [(c["generation_token_ids"], c["generation_log_probs"]) for c in r.json()["choices"]]


def refused(srv, path, *words) -> dict:
    """An update from `path` is a 400 naming model_path and `words`; the old weights serve on, bitwise."""
    before, version, answer = bits(srv.state), srv.state.engine.version, sample(srv)
    r = update(srv, path)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "model_path" and all(w in err["message"] for w in words), err
    assert srv.state.engine.version == version and same_bits(bits(srv.state), before)
    assert sample(srv) == answer  # bitwise the same tokens and logprobs
    return err


# ---------------------------------------------------------------- refused updates
@pytest.mark.parametrize("change, words", [
    ({"rope_parameters": {"rope_theta": 30000.0, "rope_type": "default"}}, ["rope_theta is 30000.0 there"]),
    ({"rms_norm_eps": 0.5}, ["rms_norm_eps is 0.5 there"]),
    ({"max_position_embeddings": 64}, ["max_position_embeddings is 64 there, 512 here"])])
def test_a_checkpoint_of_another_configuration_is_refused_naming_the_key(srv, tmp_path, change, words):
    """Its weights have the served shapes, but loaded under the served configuration they would not be the
    checkpoint's model: the trainer holding it would compute other logprobs than the server samples with."""
    d = shutil.copytree(model_dir(), tmp_path / "cfg")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | change))
    refused(srv, d, "does not match the model served", *words)


def test_a_checkpoint_of_another_architecture_is_refused_naming_what_differs(srv, tmp_path):
    cfg = json.loads((model_dir() / "config.json").read_text())
    make_hf_model(tmp_path / "llama", "llama", vocab_size=cfg["vocab_size"])
    refused(srv, tmp_path / "llama", "model_type is 'llama' there, 'qwen3' here")


def test_a_model_path_the_filesystem_refuses_is_a_400_naming_it(srv, tmp_path):
    """An OSError (here a name too long for the filesystem) was a 500 quoting the whole path."""
    err = refused(srv, tmp_path / ("a" * 300) / "b", "File name too long")
    assert len(err["message"]) < 1000


def test_an_empty_model_path_is_refused_not_read_as_the_servers_working_directory(srv, other, monkeypatch):
    """Path("") is ".": the server loaded whatever checkpoint its working directory held."""
    monkeypatch.chdir(other)
    refused(srv, "", "empty")
