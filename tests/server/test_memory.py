"""`exactrl serve` gives back the memory of large requests: its resident size after a few 5 MB requests is
back near its idle level (the CLI keeps freed memory in the heap for training, not for serving, and the
server trims the heap after a large body)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from serving import model_dir

pytestmark = pytest.mark.slow


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_resident_memory_returns_near_idle_after_large_requests(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("EXACTRL_MALLOC", "EXACTRL_API_KEY")}
    proc = subprocess.Popen([sys.executable, "-m", "exactrl", "serve", "--model", str(model_dir()), "--port",
                             str(port), "--kv-budget-tokens", "1024"], env=env, stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "serve.log", "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # a hang guard for the start
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.5)
        small = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        for _ in range(5):  # warm: every path a small request takes
            assert httpx.post(url + "/v1/chat/completions", json=small, timeout=120).status_code == 200
            assert httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4},
                              timeout=120).status_code == 200
        idle = rss_mb(proc.pid)
        text = "the quick brown fox jumps " * (5_000_000 // 26)  # 5 MB
        for k in range(6):
            path, body = (("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": text}]})
                          if k % 2 else ("/v1/completions", {"model": model, "prompt": [text[:2000]] * 2500}))
            r = httpx.post(url + path, json=body | {"max_tokens": 1}, timeout=300)
            assert r.status_code == 400, r.text  # too long / too many sequences: the work is done, then refused
        after = rss_mb(proc.pid)
        assert after <= idle * 1.2 + 20, (idle, after)
    finally:
        proc.terminate()
        proc.wait(60)
