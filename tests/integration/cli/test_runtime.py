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
    run = lambda env: subprocess.run(
        [sys.executable, "-c", CODE], env={**os.environ, **env}, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert run({"EXACTRL_MALLOC": ""}) == "True"
    assert run({"EXACTRL_MALLOC": "default"}) == "False"


EXEC = (
    "import os, sys; from exactrl.runtime import exec_with_huge_pages; exec_with_huge_pages(); "
    "print(os.environ.get('GLIBC_TUNABLES'), sys.argv[1:])"
)


@pytest.mark.slow  # about 27 s: `make test-slow` (CI)
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_the_program_runs_itself_again_with_huge_pages_keeping_its_arguments_and_the_users_tunables():
    from exactrl.runtime import HUGE_PAGES_TUNABLE, huge_pages_env

    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "EXACTRL_MALLOC")}
    run = lambda env: subprocess.run(
        [sys.executable, "-c", EXEC, "a", "b c"], env={**base, **env}, capture_output=True, text=True, check=True
    ).stdout.strip()
    if huge_pages_env(base) is None:
        pytest.skip("no huge pages here (glibc < 2.35 or transparent huge pages off)")
    assert run({}) == f"{HUGE_PAGES_TUNABLE} ['a', 'b c']"
    assert (
        run({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
        == f"glibc.malloc.arena_max=2:{HUGE_PAGES_TUNABLE} ['a', 'b c']"
    )
    assert run({"EXACTRL_MALLOC": "default"}) == "None ['a', 'b c']"
    # a user's own choice of the tunable is theirs: no second exec, nothing changed
    assert run({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == "glibc.malloc.hugetlb=0 ['a', 'b c']"


def test_huge_pages_are_not_asked_for_without_a_glibc_that_has_the_tunable(monkeypatch):
    from exactrl import runtime

    monkeypatch.setattr(runtime.platform, "libc_ver", lambda: ("glibc", "2.31"))
    assert runtime.huge_pages_env({}) is None
    monkeypatch.setattr(runtime.platform, "libc_ver", lambda: ("", ""))
    assert runtime.huge_pages_env({}) is None
