"""The prepared device check of the CUDA backend: exactness on real model shapes, a GRPO run, benchmarks.

Run on a machine with one GPU through `benchmarks/cuda_check.sh` (which installs carried wheels first).
Every section runs even when an earlier one fails; the last thing printed is one summary table, and the
figures go to $OUT/cuda_check.json when OUT is set. Random-weight models only: nothing is downloaded.

Sections: env, decode graphs (replays == eager), pytest -m cuda, parity (Qwen3-0.6B, Qwen2.5-1.5B,
Llama-3.2-1B shapes, bf16, exact and fast), engine vs trainer over 256 sequences, a 20-step GRPO run (exact
and fast), linear vs cuBLAS, attention vs SDPA, engine decode vs transformers `generate`, a GRPO step exact
vs fast.
"""

from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys
import time
import traceback

import torch

import exactrl
from exactrl.model import ModelConfig, build_model
from exactrl.model.logprobs import token_logprobs

ROWS: list[tuple[str, str, str]] = []  # (section, result, detail)
FIGURES: dict[str, object] = {}
QUICK = "--quick" in sys.argv

SHAPES = {  # the published configs' shapes (RoPE scaling left out: a random-weight parity needs none)
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
}


def section(name):
    def wrap(fn):
        def run():
            t0 = time.time()
            print(f"\n=== {name}", flush=True)
            try:
                fn()
            except Exception as e:  # every section runs; the table says which failed
                traceback.print_exc()
                ROWS.append((name, "FAIL", f"{type(e).__name__}: {str(e)[:160]}"))
            print(f"=== {name}: {time.time() - t0:.1f} s", flush=True)

        return run

    return wrap


def model_of(shape: str, kernels: str, seed: int = 0):
    cfg = ModelConfig.from_hf(SHAPES[shape])
    return build_model(cfg, dtype="bfloat16", kernels=kernels, seed=seed, device="cuda")


def engine_vs_trainer(model, prompts, params) -> tuple[float, float, int]:
    """(mean over sequences of mean |Δ|, max |Δ|, sequences) of engine logprobs vs `sequence_logprobs`."""
    eng = exactrl.Engine(model, kv_budget_tokens=65536, max_num_seqs=256, max_num_batched_tokens=8192)
    outs = eng.generate(prompts, params)
    seqs, got, first = [], [], []
    for p, cs in zip(prompts, outs):
        for c in cs:
            seqs.append(p + c.token_ids), got.append(torch.tensor(c.logprobs)), first.append(len(p))
    means, worst = [], 0.0
    for a in range(0, len(seqs), 32):
        lps, _ = token_logprobs(
            model, seqs[a : a + 32], params.temperature, params.top_k, params.top_p, first=first[a : a + 32]
        )
        for lp, g in zip(lps, got[a : a + 32]):
            d = (lp - g).abs()
            means.append(d.mean().item())
            worst = max(worst, d.max().item())
    return sum(means) / len(means), worst, len(seqs)


def prompts_of(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@section("env")
def env():
    import triton

    p = torch.cuda.get_device_properties(0)
    FIGURES["gpu"] = torch.cuda.get_device_name(0)
    ROWS.append(
        (
            "env",
            "ok",
            f"{FIGURES['gpu']}, {p.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}",
        )
    )


@section("decode graphs")
def graphs():
    """CUDA-graph replays == the eager engine, bit for bit, through shrinking buckets. Should they fail, the
    sections after run with graphs off, so that one run still measures everything else."""
    model = model_of("qwen3-0.6b", "exact", seed=2)
    prompts = prompts_of(12, 5, 200, model.config.vocab_size, 4)
    params = [exactrl.SamplingParams(max_tokens=8 + 4 * i, n=2, seed=i, ignore_eos=True) for i in range(12)]
    runs, ok = [], False
    try:
        for on in (True, False):
            eng = exactrl.Engine(model, kv_budget_tokens=16384, max_num_seqs=32, decode_graphs=on)
            outs = eng.generate(prompts, params)
            runs.append([(c.token_ids, c.logprobs) for o in outs for c in o])
            if on:
                g = eng._graphs
                counts = f"{g.num_captures} captures, {g.num_replays} replays"
        ok = runs[0] == runs[1]
        ROWS.append(("decode graphs == eager", "ok" if ok else "FAIL", f"24 seqs, {counts}"))
    finally:
        if not ok:
            from exactrl.engine import engine

            engine.TritonDecodeGraphs.supported = staticmethod(lambda model: False)
            ROWS.append(("decode graphs", "info", "off for the sections below"))


CUDA_TESTS = "tests/unit/kernels/test_cuda.py"


@section("pytest -m cuda")
def cuda_tests():
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", CUDA_TESTS],
        capture_output=True,
        text=True,
        timeout=240,
    )
    print(r.stdout[-3000:], r.stderr[-2000:])
    last = [ln for ln in r.stdout.splitlines() if ln.strip()][-1:] or ["no output"]
    ROWS.append(("pytest -m cuda", "ok" if r.returncode == 0 else "FAIL", last[0][:120]))


@section("parity")
def parity():
    params = exactrl.SamplingParams(max_tokens=24, n=2, seed=3, temperature=1.0, ignore_eos=True)
    for shape in SHAPES:
        for kernels in ("exact", "fast"):
            model = model_of(shape, kernels)
            mean, worst, n = engine_vs_trainer(model, prompts_of(8, 5, 300, model.config.vocab_size, 1), params)
            FIGURES[f"parity/{shape}/{kernels}"] = {"mean": mean, "max": worst}
            ok = (worst == 0.0) if kernels == "exact" else (worst > 0.0)
            ROWS.append(
                (f"parity {shape} {kernels}", "ok" if ok else "FAIL", f"{n} seqs, mean {mean:.3g}, max {worst:.3g}")
            )
            del model
            gc.collect()
            torch.cuda.empty_cache()


@section("engine vs trainer, 256 sequences")
def many():
    model = model_of("qwen3-0.6b", "exact", seed=1)
    for params in (
        exactrl.SamplingParams(max_tokens=96, n=4, seed=5, temperature=1.0),
        exactrl.SamplingParams(max_tokens=64, n=2, seed=6, temperature=0.7, top_p=0.9, top_k=50),
    ):
        prompts = prompts_of(64 if params.n == 4 else 32, 3, 400, model.config.vocab_size, params.seed)
        mean, worst, n = engine_vs_trainer(model, prompts, params)
        FIGURES[f"many/T{params.temperature}"] = {"mean": mean, "max": worst, "seqs": n}
        ROWS.append(
            (
                f"engine==trainer T={params.temperature} top_p={params.top_p}",
                "ok" if worst == 0.0 else "FAIL",
                f"{n} seqs, mean {mean:.3g}, max {worst:.3g}",
            )
        )


def train_run(kernels: str, steps: int) -> list[dict]:
    run_dir = f"/tmp/cuda_check_run_{kernels}"
    subprocess.run(["rm", "-rf", run_dir])
    cmd = [
        sys.executable,
        "-m",
        "exactrl",
        "train",
        "--set",
        "model.device=cuda",
        "--set",
        f"model.kernels={kernels}",
        "--set",
        f"max_steps={steps}",
        "--set",
        f"run_dir={run_dir}",
        "--set",
        "eval_every=10",
    ]
    r = subprocess.run(
        cmd, capture_output=True, text=True, timeout=420, env={**os.environ, "EXACTRL_MALLOC": "default"}
    )
    print(r.stdout[-2500:], r.stderr[-2500:])
    if r.returncode != 0:
        raise RuntimeError(f"exactrl train exited {r.returncode}: {r.stderr.strip().splitlines()[-1:]}")
    return [json.loads(ln) for ln in open(f"{run_dir}/metrics.jsonl")]


@section("GRPO 20 steps")
def grpo():
    rows = train_run("exact", 20)
    diffs = [r["train/train_rollout_logprob_abs_diff"] for r in rows]
    maxes = [r["train/train_rollout_logprob_abs_diff_max"] for r in rows]
    FIGURES["grpo/exact"] = {"steps": len(rows), "diff": diffs, "reward": [r["rollout/reward_mean"] for r in rows]}
    ok = len(rows) == 20 and all(d == 0.0 for d in diffs + maxes)
    ROWS.append(
        (
            "GRPO exact 20 steps",
            "ok" if ok else "FAIL",
            f"{len(rows)} steps, max diff {max(maxes):.3g}, reward {rows[0]['rollout/reward_mean']:.2f}"
            f" -> {rows[-1]['rollout/reward_mean']:.2f}",
        )
    )
    rows = train_run("fast", 3)
    d = max(r["train/train_rollout_logprob_abs_diff_max"] for r in rows)
    FIGURES["grpo/fast"] = {"diff_max": d}
    ROWS.append(("GRPO fast 3 steps", "ok" if d > 0 else "FAIL", f"max diff {d:.3g} (must be > 0)"))


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


@section("linear vs cuBLAS")
def linear_bench():
    from exactrl.kernels.triton import ops

    m = 64 * 768
    worst = 9.0
    for name, n, k in (
        ("qkv", 4096, 1024),
        ("o", 1024, 2048),
        ("gate/up", 3072, 1024),
        ("down", 1024, 3072),
        ("head", 151936, 1024),
    ):
        rows = 8192 if name == "head" else m
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        t_ex = bench(lambda: ops.linear(x, w))
        t_cb = bench(lambda: torch.nn.functional.linear(x, w))
        ratio = t_cb / t_ex
        worst = min(worst, ratio)
        tf = 2 * rows * n * k / t_ex / 1e9
        FIGURES[f"linear/{name}"] = {"rows": rows, "exact_ms": t_ex, "cublas_ms": t_cb, "ratio": ratio, "tflops": tf}
        ROWS.append(
            (
                f"linear {name} {rows}x{k}->{n}",
                "ok" if ratio >= 0.6 else "MISS",
                f"exact {t_ex:.3f} ms ({tf:.0f} TFLOP/s), cuBLAS {t_cb:.3f} ms: {ratio:.2f}x",
            )
        )


@section("attention vs SDPA")
def attention_bench():
    from exactrl.kernels.triton import TritonKernels
    from exactrl.model.logprobs import pack_layout

    for S, L in ((64, 768), (8, 4096)):
        lay, pages = pack_layout([L] * S, 32)
        H, Hk, D = 16, 8, 128
        n = S * L
        q = torch.randn(n, H, D, device="cuda", dtype=torch.bfloat16)
        kp = torch.randn(pages, Hk, 32, D, device="cuda", dtype=torch.bfloat16)
        vp = torch.randn(pages, Hk, 32, D, device="cuda", dtype=torch.bfloat16)
        ex = TritonKernels("exact")
        pe = ex.plan_attention(lay, H, Hk, 32, torch.device("cuda"))
        t_ex = bench(lambda: ex.attention(q, kp, vp, pe, D**-0.5))
        qs = torch.randn(S, H, L, D, device="cuda", dtype=torch.bfloat16)
        ks = torch.randn(S, Hk, L, D, device="cuda", dtype=torch.bfloat16)
        t_sd = bench(
            lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, ks, is_causal=True, enable_gqa=True)
        )
        FIGURES[f"attention/{S}x{L}"] = {"exact_ms": t_ex, "sdpa_causal_ms": t_sd}
        ROWS.append(
            (
                f"attention {S}x{L} prefill",
                "info",
                f"exact {t_ex:.2f} ms, SDPA (flash, causal) {t_sd:.2f} ms: {t_sd / t_ex:.2f}x",
            )
        )


def engine_tok_s(model, batch: int, new: int, graphs: bool = True) -> float:
    eng = exactrl.Engine(
        model, kv_budget_tokens=batch * (new + 64) + 4096, max_num_seqs=max(batch, 1), decode_graphs=graphs
    )
    prompts = prompts_of(batch, 32, 32, model.config.vocab_size, 9)
    params = exactrl.SamplingParams(max_tokens=new, seed=0, ignore_eos=True)
    eng.generate(prompts, exactrl.SamplingParams(max_tokens=3, seed=0, ignore_eos=True))  # compile, record
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.generate(prompts, params)
    torch.cuda.synchronize()
    return batch * new / (time.perf_counter() - t0)


def hf_tok_s(batch: int, new: int) -> float:
    import transformers

    cfg = transformers.Qwen3Config(**{k: v for k, v in SHAPES["qwen3-0.6b"].items() if k != "architectures"})
    torch.manual_seed(0)
    m = transformers.Qwen3ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    ids = torch.tensor(prompts_of(batch, 32, 32, cfg.vocab_size, 9), device="cuda")
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=True, pad_token_id=0)
    m.generate(ids[:1], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    m.generate(ids, **kw)
    torch.cuda.synchronize()
    return batch * new / (time.perf_counter() - t0)


@section("engine decode vs transformers")
def engine_bench():
    new = 64 if QUICK else 128
    for batch in (64, 1):
        exact = model_of("qwen3-0.6b", "exact")
        ex = engine_tok_s(exact, batch, new)  # decode steps replayed as CUDA graphs
        eager = engine_tok_s(exact, batch, new, graphs=False)
        fa = engine_tok_s(model_of("qwen3-0.6b", "fast"), batch, new)  # fast decodes eagerly
        hf = hf_tok_s(batch, new)
        FIGURES[f"engine/b{batch}"] = {"exact": ex, "exact_eager": eager, "fast": fa, "transformers": hf}
        ok = ex >= 0.7 * fa and ex >= 3 * hf if batch == 64 else True
        ROWS.append(
            (
                f"engine qwen3-0.6b batch {batch}",
                ("ok" if ok else "MISS") if batch == 64 else "info",
                f"exact {ex:.0f} tok/s (eager {eager:.0f}), fast {fa:.0f}, transformers {hf:.0f}: "
                f"{ex / fa:.2f}x fast (eager {eager / fa:.2f}x), {ex / hf:.2f}x transformers",
            )
        )
        torch.cuda.empty_cache()


@section("GRPO step exact vs fast")
def step_bench():
    times = {}
    for kernels in ("exact", "fast"):
        model = model_of("qwen3-0.6b", kernels)
        eng = exactrl.Engine(model, kv_budget_tokens=64 * 800, max_num_seqs=64, max_num_batched_tokens=8192)
        prompts = prompts_of(8, 256, 256, model.config.vocab_size, 2)
        params = exactrl.SamplingParams(max_tokens=512, n=8, seed=0, ignore_eos=True)
        eng.generate(prompts[:1], exactrl.SamplingParams(max_tokens=2, seed=0, ignore_eos=True))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = eng.generate(prompts, params)
        torch.cuda.synchronize()
        t_roll = time.perf_counter() - t0
        seqs = [p + c.token_ids for p, cs in zip(prompts, outs) for c in cs]
        first = [256] * len(seqs)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        t_train = []
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for a in range(0, 64, 16):  # micro-batches of 16 sequences
                lps, _ = token_logprobs(model, seqs[a : a + 16], first=first[a : a + 16])
                loss = -sum(lp.sum() for lp in lps) / 16
                loss.backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            t_train.append(time.perf_counter() - t0)
        times[kernels] = (t_roll, min(t_train))
        FIGURES[f"step/{kernels}"] = {
            "rollout_s": t_roll,
            "train_s": min(t_train),
            "peak_gb": torch.cuda.max_memory_allocated() / 2**30,
        }
        del model, eng, opt
        torch.cuda.empty_cache()
    ex, fa = sum(times["exact"]), sum(times["fast"])
    ROWS.append(
        (
            "GRPO step 64x(256+512) qwen3-0.6b",
            "ok" if fa / ex >= 0.7 else "MISS",
            f"exact {ex:.1f} s (rollout {times['exact'][0]:.1f}, train {times['exact'][1]:.1f}), fast {fa:.1f} s "
            f"(rollout {times['fast'][0]:.1f}, train {times['fast'][1]:.1f}): {fa / ex:.2f}x",
        )
    )


def main():
    t0 = time.time()
    sections = dict(
        env=env,
        graphs=graphs,
        tests=cuda_tests,
        parity=parity,
        many=many,
        grpo=grpo,
        linear=linear_bench,
        attention=attention_bench,
        engine=engine_bench,
        step=step_bench,
    )
    only = next((a.split("=", 1)[1].split(",") for a in sys.argv[1:] if a.startswith("--only=")), list(sections))
    for name in ["env"] + [n for n in only if n != "env"]:
        sections[name]()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "cuda_check.json"), "w") as f:
            json.dump({"rows": ROWS, "figures": FIGURES}, f, indent=1, default=str)
    print(f"\nexactrl CUDA check, {FIGURES.get('gpu', '?')}, {time.time() - t0:.0f} s")
    w = max(len(r[0]) for r in ROWS)
    for name, res, detail in ROWS:
        print(f"{name:<{w}}  {res:<4}  {detail}")
    sys.exit(0 if all(r[1] in ("ok", "info") for r in ROWS) else 1)


if __name__ == "__main__":
    main()
