"""`exactrl serve` gives back the memory of large requests: its resident size after 5 MB requests, sent one
at a time and then four at once, is back near its idle level (the CLI keeps freed memory in the heap for
training, not for serving; the server decodes few large bodies at a time and trims the heap after them).

Prints the resident sizes (run with -s): docs/performance.md records them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from serving import model_dir

pytestmark = pytest.mark.slow

CONCURRENT = 4


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def settled_rss_mb(url: str, pid: int) -> float:
    """The resident size once the server has finished with the requests answered so far: the trim after a
    large request runs after its answer is sent, so a small request is answered first."""
    assert httpx.get(url + "/health", timeout=60).status_code == 200
    return rss_mb(pid)


def large_request(url: str, model: str, k: int) -> None:
    """k odd: a 5 MB chat (refused: longer than the context); even: a 5 MB completion (2500 prompts tokenized,
    then refused: too many sequences)."""
    text = "the quick brown fox jumps " * (5_000_000 // 26)
    path, body = (
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": text}]})
        if k % 2
        else ("/v1/completions", {"model": model, "prompt": [text[:2000]] * 2500})
    )
    r = httpx.post(url + path, json=body | {"max_tokens": 1}, timeout=300)
    assert r.status_code == 400, r.text  # too long / too many sequences: the work is done, then refused


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_resident_memory_returns_near_idle_after_large_requests(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("EXACTRL_MALLOC", "EXACTRL_API_KEY")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "exactrl",
            "serve",
            "--model",
            str(model_dir()),
            "--port",
            str(port),
            "--kv-budget-tokens",
            "1024",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "serve.log", "w"),
    )
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
            assert (
                httpx.post(
                    url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4}, timeout=120
                ).status_code
                == 200
            )
        idle = settled_rss_mb(url, proc.pid)
        for k in range(6):
            large_request(url, model, k)
        sequential = settled_rss_mb(url, proc.pid)
        with ThreadPoolExecutor(CONCURRENT) as pool:
            for _ in range(2):  # two rounds, each four at once
                list(pool.map(lambda k: large_request(url, model, 2 * k), range(CONCURRENT)))
        concurrent = settled_rss_mb(url, proc.pid)
        print(
            f"\nserve RSS: idle {idle:.0f} MB, after 6 sequential 5 MB requests {sequential:.0f} MB, "
            f"after 2x{CONCURRENT} concurrent {concurrent:.0f} MB"
        )
        assert sequential <= idle * 1.2, (idle, sequential)
        assert concurrent <= idle * 1.2, (idle, concurrent)
    finally:
        proc.terminate()
        proc.wait(60)
