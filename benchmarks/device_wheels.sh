#!/usr/bin/env bash
# Downloads, into .whl/ (git-ignored), the wheels `benchmarks/cuda_check.sh` installs on a GPU machine that has
# Python 3.12, torch, triton and transformers but not exactrl's server and config dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  pydantic pydantic-core annotated-types typing-inspection fastapi starlette uvicorn
