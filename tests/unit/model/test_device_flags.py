"""`device` and `backend` where users give them: the CLI flags and config keys, refused by name where they
cannot run (this machine has no GPU; tests/unit/kernels/test_cuda.py runs them on one)."""

from __future__ import annotations

import pytest
import torch

from exactrl.cli import main
from exactrl.model.checkpoint import resolve_device

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")


@no_gpu
@pytest.mark.parametrize(
    "argv",
    [
        ["parity", "--model", "{d}", "--device", "cuda"],
        ["serve", "--model", "{d}", "--device", "cuda", "--port", "0"],
        ["bench", "engine", "--device", "cuda", "--quick", "--no-hf"],
        ["train", "--set", "model.device=cuda", "--set", "run_dir={d}/run"],
    ],
)
def test_cuda_without_a_gpu_is_one_line_naming_it(argv, qwen3_dir, capsys):
    assert main([a.replace("{d}", str(qwen3_dir)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU is available" in err and "Traceback" not in err


def test_bad_devices_and_backends_are_named(qwen3_dir, capsys):
    assert main(["parity", "--model", str(qwen3_dir), "--device", "gpu"]) == 2
    assert "device must be 'cpu' or 'cuda'" in capsys.readouterr().err
    assert main(["train", "--set", "model.device=tpu"]) == 2
    assert "model.device" in capsys.readouterr().err
    with pytest.raises(ValueError, match="CPU tensors only"):
        resolve_device("cuda", "native")


def test_a_gpu_run_refuses_several_ranks(capsys):
    assert main(["train", "--nproc", "2", "--set", "model.device=cuda"]) == 2
    assert "one rank" in capsys.readouterr().err


def test_the_defaults_stay_on_the_native_cpu_backend():
    assert resolve_device() == (torch.device("cpu"), "native")
