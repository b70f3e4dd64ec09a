"""exactrl bench serve: requests/s and generated tokens/s of the OpenAI-compatible server.

The server runs as `exactrl serve` in its own process (its own GIL, as in
production); this process is the load: C concurrent clients using the
official `openai` AsyncOpenAI client, each sending R chat requests one after
another (short prompt, `max_tokens` new tokens with `ignore_eos`, so every
request generates the same number of tokens). Figures per C:
requests/s and generated tokens/s over the wall time of the whole level,
request latency p50/p90, and the engine's busy fraction (time in
`engine.step` / wall, from /metrics), which shows how much of the wall time
is HTTP, JSON and tokenization rather than the model.

The model is a random Qwen3 of the `--size` shape with the project tokenizer
(its vocabulary replaces the size's), or `--model DIR`.

    exactrl bench serve [--quick] [--model DIR | --size 20M] [--clients 1,8,32] [--requests 4]
                        [--max-tokens 64] [--kernels exact] [--dtype float32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SIZES, apply_quick, positive_int, positive_ints  # noqa: E402

PROMPTS = ["Compute 12*7", "hello world", "the quick brown fox jumps over the lazy dog", "and 3+4?"]


def build_model_dir(out: Path, size: str, seed: int = 0) -> dict:
    from exactrl.envs import ArithmeticTask
    from exactrl.model import ModelConfig, build_model, save_model
    from exactrl.model.tokenizer import build_tokenizer, default_tokenizer_corpus, load_tokenizer

    texts = default_tokenizer_corpus([ArithmeticTask()], 300, seed) + [" ".join(PROMPTS)] * 20
    build_tokenizer(out, texts, vocab_size=512)
    tok = load_tokenizer(out)
    hf = {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "max_position_embeddings": 2048,
        **SIZES[size],
        "vocab_size": tok.vocab_size,
        "eos_token_id": tok.end_of_turn_id,
        "pad_token_id": tok.pad_token_id,
    }
    model = build_model(ModelConfig.from_hf(hf), seed=seed)
    save_model(model, out)
    return {"size": size, "params": sum(p.numel() for p in model.parameters()), "vocab_size": tok.vocab_size}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, port: int, kernels: str, dtype: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "exactrl.cli",
        "serve",
        "--model",
        model_dir,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--kernels",
        kernels,
        "--dtype",
        dtype,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ))
    t0 = time.time()
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() - t0 > 120:
            proc.kill()
            # its one-line error (`exactrl serve: error: ...`, a model dir without a tokenizer) or a traceback's
            # last line: the CLI names it in one line, as its own errors
            lines = [x for x in proc.stderr.read().decode(errors="replace").splitlines() if x.strip()]
            why = lines[-1] if proc.returncode is not None and lines else "no answer on /health within 120 s"
            raise ValueError(f"the server did not start (exactrl serve --model {model_dir}): {why}")
        time.sleep(0.2)


async def run_level(url: str, model: str, clients: int, requests: int, max_tokens: int) -> dict:
    import openai

    latencies: list[float] = []
    tokens = 0

    async def client_loop(c: int, client):
        nonlocal tokens
        for r in range(requests):
            t = time.perf_counter()
            resp = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": PROMPTS[(c + r) % len(PROMPTS)]}],
                max_tokens=max_tokens,
                temperature=1.0,
                seed=c * 1000 + r,
                extra_body={"ignore_eos": True},
            )
            latencies.append(time.perf_counter() - t)
            tokens += resp.usage.completion_tokens

    m0 = httpx.get(f"{url}/metrics").json()
    limits = httpx.Limits(max_connections=clients + 4)
    async with openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="bench", max_retries=0, http_client=httpx.AsyncClient(limits=limits, timeout=600)
    ) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(c, client) for c in range(clients)))
        wall = time.perf_counter() - t0
    m1 = httpx.get(f"{url}/metrics").json()
    latencies.sort()
    n = len(latencies)
    return {
        "clients": clients,
        "requests": n,
        "generated_tokens": tokens,
        "wall_s": round(wall, 3),
        "requests_per_s": round(n / wall, 2),
        "gen_tokens_per_s": round(tokens / wall, 1),
        "latency_p50_s": round(latencies[n // 2], 3),
        "latency_p90_s": round(latencies[min(n - 1, int(n * 0.9))], 3),
        "engine_busy_frac": round((m1["engine/busy_s"] - m0["engine/busy_s"]) / wall, 3),
        "engine_steps": m1["engine/steps"] - m0["engine/steps"],
    }


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="exactrl bench serve", description=__doc__.splitlines()[0])
    model = p.add_mutually_exclusive_group()  # --size with --model was ignored: the figures of another model
    model.add_argument("--model", default=None, help="model dir (with tokenizer); default: a random --size model")
    model.add_argument("--size", default="20M", choices=sorted(SIZES))
    p.add_argument("--clients", type=positive_ints, default="1,8,32", help="comma-separated concurrency levels")
    p.add_argument("--requests", type=positive_int, default=4, help="requests per client per level")
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--kernels", default="exact", choices=["exact", "fast"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, 1 request per client, 16 tokens")
    a = p.parse_args(argv)
    if a.quick:
        apply_quick(p, a, size="tiny", requests=1, max_tokens=16)
    if a.model is not None and not (Path(a.model) / "config.json").is_file():
        p.error(f"--model {a.model}: no config.json there (a Hugging Face model directory, with its tokenizer)")
    import openai

    levels = a.clients
    with tempfile.TemporaryDirectory(prefix="exactrl-bench-serve-") as tmp:
        info = {"model_dir": a.model}
        if a.model is None:
            info = build_model_dir(Path(tmp), a.size)
        model_dir = a.model or tmp
        port = free_port()
        proc = start_server(model_dir, port, a.kernels, a.dtype)
        url = f"http://127.0.0.1:{port}"
        try:
            name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            asyncio.run(run_level(url, name, 1, 1, 4))  # warm-up
            try:
                results = [asyncio.run(run_level(url, name, c, a.requests, a.max_tokens)) for c in levels]
            except openai.BadRequestError as e:  # the server's message says what (a --max-tokens beyond the context)
                raise ValueError(f"the server refused a request of --max-tokens {a.max_tokens}: {e.message}") from None
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    import torch

    print(
        json.dumps(
            {
                "benchmark": "serve",
                "model": info,
                "kernels": a.kernels,
                "dtype": a.dtype,
                "max_tokens": a.max_tokens,
                "requests_per_client": a.requests,
                "cpu_threads": os.cpu_count(),
                # the server inherits this process's environment, so torch picks it the same thread count
                "server_torch_threads": torch.get_num_threads(),
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
