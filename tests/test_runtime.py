"""The allocator setting of the CLI: applied on glibc, skipped on request."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

CODE = "from exactrl.runtime import tune_allocator; print(tune_allocator())"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_tune_allocator_applies_and_can_be_turned_off():
    run = lambda env: subprocess.run([sys.executable, "-c", CODE], env={**os.environ, **env}, capture_output=True,
                                     text=True, check=True).stdout.strip()
    assert run({"EXACTRL_MALLOC": ""}) == "True"
    assert run({"EXACTRL_MALLOC": "default"}) == "False"
