#!/usr/bin/env bash
# The CUDA backend's prepared device check (benchmarks/cuda_check.py), for a GPU machine with python3, torch,
# triton and transformers but without pydantic/fastapi/uvicorn and without internet: the wheels that
# benchmarks/device_wheels.sh downloaded into .whl/ are installed into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
exec python3 benchmarks/cuda_check.py "$@"
