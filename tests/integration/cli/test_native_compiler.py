"""The CLI without a C compiler: each command that loads a model stops there with the named problem (exit 2, no
traceback), in a subprocess whose CC names no compiler and whose kernel cache is empty."""

from __future__ import annotations


def test_a_missing_compiler_stops_the_cli_in_one_line_as_the_model_loads(qwen3_dir, tmp_path):
    """`exactrl parity` (as train) loads an exact model, `serve` builds an engine: without a compiler each
    stops there with the named problem, exit 2, no traceback (not a server that starts and fails every request)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "CC": "no-such-compiler-exactrl", "EXACTRL_CACHE": str(tmp_path / "empty-cache")}
    done = subprocess.run(
        [sys.executable, "-m", "exactrl", "parity", "--model", str(qwen3_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "error: exactrl's exact kernels are compiled on first use and need a C compiler" in done.stderr
    # fast kernels too: the engine's KV cache is written by C code in either mode
    from conftest import make_hf_model

    from exactrl.model.tokenizer import build_tokenizer, load_tokenizer

    served = tmp_path / "served"
    build_tokenizer(served, ["1 + 2 = 3, hello world"] * 20)
    tok = load_tokenizer(served)
    make_hf_model(
        served, "qwen3", vocab_size=tok.vocab_size, eos_token_id=tok.end_of_turn_id, pad_token_id=tok.pad_token_id
    )
    done = subprocess.run(
        [sys.executable, "-m", "exactrl", "serve", "--model", str(served), "--kernels", "fast", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "error: exactrl's exact kernels are compiled on first use and need a C compiler" in done.stderr
