"""Shared fixtures: tiny random Hugging Face models built and saved locally (no hub).

tests/unit: fast, in one process, no server; tests/integration: servers, ranks, Ray, end-to-end runs.
Helper modules shared by both live in tests/helpers (on sys.path here).
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))

from fuzzing import FULL, examples  # noqa: E402

TINY = dict(
    vocab_size=211,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)

# tiny mixtures of experts: 4 experts, 2 per token (Qwen2-MoE with a shared expert)
MOE = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "qwen2_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48
    ),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32, eos_token_id=None, pad_token_id=None),
}


def make_hf_model(path, arch: str = "qwen3", seed: int = 0, **over):
    """Builds a randomly initialised transformers model of `arch` and saves it to `path`."""
    import transformers

    kw = {**TINY, **over}
    cls = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[arch]
    if arch == "llama":
        kw.setdefault("attention_bias", True)
    for k, v in MOE.get(arch, {}).items():
        kw.setdefault(k, v)
    torch.manual_seed(seed)
    cfg = cls[0](**kw)
    model = cls[1](cfg).eval()
    with torch.no_grad():  # HF inits biases and norms to trivial values; make them matter
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
            elif n.endswith(".gate.weight"):  # a router: logits far enough apart that routing varies by token
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3")
    make_hf_model(d, "qwen3")
    return d


def default_job_model(tmp_path_factory, sft_steps: int):
    """The default job's tokenizer and tiny Qwen3 after `sft_steps` warm-start steps, built once per test run
    in a cache that every worker of the run shares (the warm start writes each model whole, by rename, under
    its config's hash). Tests read these models; a test that changes one copies it first."""
    from exactrl.train import warmstart
    from exactrl.train.config import load_config

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "default-job-models"
    saved, warmstart.ARTIFACTS = warmstart.ARTIFACTS, root
    try:
        return warmstart.default_model_dir(load_config(None, [f"sft.steps={sft_steps}"]), log=lambda *a: None)
    finally:
        warmstart.ARTIFACTS = saved


def train_args(settings: list[str], model_dir, run_dir, *overrides: str) -> list[str]:
    """`exactrl train` argv: a test's settings, the model and the run dir, then `overrides`, each a --set."""
    return ["train"] + [
        x for o in [*settings, f"model.path={model_dir}", f"run_dir={run_dir}", *overrides] for x in ("--set", o)
    ]


def train_rows(settings: list[str], model_dir, run_dir, *overrides: str) -> list[dict]:
    """Runs `exactrl train` in this process (it must succeed); the rows of its metrics.jsonl."""
    import json

    from exactrl.cli import main

    assert main(train_args(settings, model_dir, run_dir, *overrides)) == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def random_sequences(rng: random.Random, n: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# property tests that name no count draw hypothesis's 100 examples under EXACTRL_FUZZ=full, 20 otherwise
settings.register_profile("short", max_examples=examples(100))
settings.load_profile("default" if FULL else "short")


@pytest.fixture(scope="session")
def onednn_dir(tmp_path_factory):
    """Wide weights (q/o, the MLP, the LM head): packed for the exact linear (kernels/linear.py): native fp32
    panels, and in bf16 the oneDNN path with its big-tile products."""
    d = tmp_path_factory.mktemp("onednn")
    make_hf_model(
        d,
        "qwen3",
        hidden_size=512,
        intermediate_size=512,
        vocab_size=512,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
    )
    return d


def pytest_collection_modifyitems(items):
    """Slow tests (`make test-all`) get an hour as their hang guard instead of pyproject's default, unless they
    name their own; property tests (Hypothesis) are marked `fuzz`, so `make test-slow` reruns them at their
    full example counts (tests/helpers/fuzzing.py)."""
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(3600))
        if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
            item.add_marker(pytest.mark.fuzz)


def load_benchmark(name: str):
    """benchmarks/NAME.py as a module (the folder is not a package: `exactrl bench` loads it the same way)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"exactrl_bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
