"""POST /update_weights_from_disk swaps the served weights: off (403 naming the flag) unless
--enable-weight-updates; with --weights-root, only checkpoints under it, and one message for any other path,
whatever it is (no filesystem oracle)."""

from __future__ import annotations

import shutil

import httpx
import pytest
from serving import model_dir
from test_auth import serve_args

from exactrl.server.app import ServerThread, access_of, build_state, create_app
from exactrl.server.guard import Access


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    d = tmp_path_factory.mktemp("weights")
    shutil.copytree(model_dir(), d / "ckpt")
    return d


def serving(access: Access):
    state = build_state(str(model_dir()), kv_budget_tokens=1024, access=access)
    return state, ServerThread(create_app(state))


def test_the_route_is_off_by_default():
    assert access_of(serve_args()).weight_updates is False
    state, thread = serving(Access())
    with thread:
        for body in ({"model_path": str(model_dir())}, {"model_path": 5}, {}):
            r = httpx.post(thread.url + "/update_weights_from_disk", json=body, timeout=60)
            assert r.status_code == 403, r.text
            err = r.json()["error"]
            assert "--enable-weight-updates" in err["message"] and err["code"] == "weight_updates_disabled"
        assert state.engine.version == 0


def test_the_flag_turns_it_on():
    assert access_of(serve_args("--enable-weight-updates")).weight_updates is True
    state, thread = serving(Access(weight_updates=True))
    with thread:
        r = httpx.post(thread.url + "/update_weights_from_disk", json={"model_path": str(model_dir())}, timeout=60)
        assert r.status_code == 200 and r.json()["version"] == 1


def test_a_weights_root_allows_only_paths_under_it_with_one_message_for_the_rest(root, tmp_path):
    state, thread = serving(Access(weight_updates=True, weights_root=str(root)))
    (tmp_path / "file").write_text("x")
    (tmp_path / "noconfig").mkdir()
    (root / "escape").symlink_to(tmp_path)
    outside = [
        tmp_path / "missing",
        tmp_path / "file",
        tmp_path / "noconfig",
        model_dir(),
        "/etc",
        "../",
        root / ".." / root.name / ".." / "x",
        root / "escape" / "noconfig",
        "a\0b",
    ]
    with thread:
        post = lambda p: httpx.post(thread.url + "/update_weights_from_disk", json={"model_path": str(p)}, timeout=60)
        messages = set()
        for p in outside:
            r = post(p)
            assert r.status_code == 400, (p, r.text)
            messages.add(r.json()["error"]["message"])
        assert messages == {"model_path must name a checkpoint directory under this server's --weights-root"}
        assert state.engine.version == 0
        for p in (root / "ckpt", "ckpt"):  # absolute, or relative to the root
            assert post(p).status_code == 200
        r = post(root / "nothing")  # under the root: named as before
        assert r.status_code == 400 and "nothing" in r.json()["error"]["message"]
    assert state.engine.version == 2


def test_weights_root_needs_the_flag_and_a_directory(tmp_path):
    with pytest.raises(ValueError, match="--enable-weight-updates"):
        access_of(serve_args("--weights-root", str(tmp_path)))
    with pytest.raises(ValueError, match="not a directory"):
        access_of(serve_args("--enable-weight-updates", "--weights-root", str(tmp_path / "no")))


def test_a_checkpoint_with_flipped_bytes_is_refused_naming_the_file_and_an_intact_one_loads(tmp_path):
    import torch

    import exactrl
    from exactrl.train.checkpoint import save_checkpoint

    model = exactrl.load_model(model_dir())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    intact = save_checkpoint(tmp_path / "run", 1, model, opt, {"prompts": {}}, keep=2)
    damaged = save_checkpoint(tmp_path / "run", 2, model, opt, {"prompts": {}}, keep=2)
    data = bytearray((damaged / "model.safetensors").read_bytes())
    data[-1] ^= 0x5A  # tensor data: the safetensors header stays intact and the file loads
    (damaged / "model.safetensors").write_bytes(bytes(data))
    state, thread = serving(Access(weight_updates=True, weights_root=str(tmp_path)))
    with thread:
        post = lambda p: httpx.post(thread.url + "/update_weights_from_disk", json={"model_path": str(p)}, timeout=60)
        r = post(damaged)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "model_path" and "model.safetensors" in err["message"], err
        assert "sha256" in err["message"] and state.engine.version == 0
        r = post(intact)
        assert r.status_code == 200 and r.json()["version"] == 1, r.text
