"""Shared helpers for the benchmarks: model sizes, timing, machine peak."""

from __future__ import annotations

import argparse
import resource
import time

import torch

# name -> HF Qwen3 config overrides; parameter counts are printed by the benchmarks
SIZES = {
    "20M": dict(
        vocab_size=16384,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    "100M": dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    ),
}


CONTEXT = 2048  # max_position_embeddings of every model a benchmark builds


def positive_float(text: str) -> float:
    """argparse type: a finite float > 0 (a NaN learning rate was named by torch only after the model was built)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return v


def check_context(parser: argparse.ArgumentParser, what: str, tokens: int, limit: int = CONTEXT) -> None:
    """Exits naming the flags `what` when `tokens` do not fit the benchmark models' context (checked before a
    model is built; the engine's own message names its request fields, not the flags)."""
    if tokens > limit:
        parser.error(f"{what} = {tokens} tokens exceeds the benchmark models' context of {limit} tokens")


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def seed_int(text: str) -> int:
    """argparse type: a seed in 0..2**32-1, numpy's range (TRL seeds it): `--seed -1` failed in TRL's setup,
    after the model was built, naming no flag."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= v < 2**32:
        raise argparse.ArgumentTypeError(f"must be in 0..{2**32 - 1}, got {v}")
    return v


def positive_ints(text: str) -> list[int]:
    """argparse type: comma-separated ints >= 1 ("1,32")."""
    return [positive_int(x) for x in text.split(",")]


def size_names(text: str) -> list[str]:
    """argparse type: comma-separated model sizes of SIZES ("20M,100M")."""
    names = text.split(",")
    bad = [n for n in names if n not in SIZES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown size {bad[0]!r}; choose from {sorted(SIZES)}")
    return names


def apply_quick(parser: argparse.ArgumentParser, args: argparse.Namespace, **values) -> None:
    """`--quick`'s smoke-run settings, each where the command line left the default: an explicit
    argument wins (`--quick --new 32` runs the tiny model with 32 new tokens)."""
    defaults = vars(parser.parse_args([]))
    for dest, value in values.items():
        if getattr(args, dest) == defaults[dest]:
            setattr(args, dest, value)


def qwen3_config(size: str, max_positions: int = CONTEXT):
    from exactrl.model import ModelConfig

    hf = {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "max_position_embeddings": max_positions,
        "hidden_act": "silu",
        **SIZES[size],
    }
    return ModelConfig.from_hf(hf)


def timeit(fn, repeat: int = 3, warmup: int = 1) -> float:
    """Best-of-`repeat` wall time in seconds (best-of filters noise from the other core)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def matmul_peak_gflops(n: int = 1024, dtype=torch.float32) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    t = timeit(lambda: a @ b, repeat=5)
    return 2 * n**3 / t / 1e9


def linear_weights(hf_model) -> list[torch.Tensor]:
    """Every matmul weight a token passes through in a transformers causal LM, the LM head last."""
    body = [m.weight for name, m in hf_model.model.named_modules() if isinstance(m, torch.nn.Linear)]
    return body + [hf_model.lm_head.weight]


def gemm_floor_s(weights: list[torch.Tensor], rows: int, repeat: int = 5) -> float:
    """Best-of-`repeat` wall time of `rows` rows through every weight, with the fastest GEMM at hand.

    A forward step is these matmuls plus everything else (attention, norms,
    sampling, Python), so `rows / gemm_floor_s` bounds the tokens/s of any
    implementation using these GEMMs on this machine. Up to three are timed:
    plain `F.linear`; oneDNN with the weights packed beforehand
    (`mkldnn._linear_pointwise`, vLLM's CPU backend, and exactrl's exact bf16
    tiles), up to 2-3x faster for a few rows; and for fp32 exactrl's native
    linear on packed weights (`native/gemm.c`).
    """
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights}
    with torch.inference_mode():
        best = timeit(lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in weights], repeat=repeat)
        from exactrl.kernels.linear import ONEDNN_DTYPES, USE_ONEDNN

        if USE_ONEDNN and all(w.dtype in {torch.float32, *ONEDNN_DTYPES} for w in weights):
            packed = [(xs[w.shape[1]], torch.ops.mkldnn._reorder_linear_weight(w, rows)) for w in weights]
            best = min(
                best,
                timeit(
                    lambda: [torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], "") for x, pw in packed],
                    repeat=repeat,
                ),
            )
        if all(w.dtype == torch.float32 for w in weights):
            from exactrl.kernels import native

            mine = [(xs[w.shape[1]], native.PackedLinearWeight(w)) for w in weights]
            best = min(best, timeit(lambda: [native.linear(x, pw) for x, pw in mine], repeat=repeat))
    return best


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
