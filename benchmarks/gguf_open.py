"""exactrl bench gguf_open: time to open a GGUF file with a large vocabulary, the `gguf` package's GGUFReader
against exactrl's reader (exactrl/model/gguf_reader.py), both in one run on one file.

The file is written here by the `gguf` package's GGUFWriter as llama.cpp's converter writes a byte-level BPE
vocabulary: `--vocab` random token strings (1-16 characters, some outside ASCII, all distinct),
tokenizer.ggml.token_type, `--merges` random "left right" merges, and one small F32 tensor. The defaults are
Llama 3's counts (128256 tokens, 280147 merges).

- open_s: constructing the reader (`gguf.GGUFReader(path)`; `exactrl.model.gguf.open_gguf(path)`).
- vocab_s: open, then the Python values of tokenizer.ggml.tokens, token_type and merges (GGUFReader:
  `fields[key].contents()`; exactrl: `metadata[key]`, parsed at open), what `load_tokenizer` reads.
- each figure is the best of `--repeat` rounds; in each round both readers run one after the other, so a change
  in the machine's load falls on both. The values both give are checked equal once.

With `--files A.gguf B.gguf ...` the given files are measured instead (open_s each, best of `--repeat`), and
every metadata value and tensor's bytes are checked equal between the two readers (an array of arrays
flattened, as GGUFReader gives it).

Ratios are GGUFReader / exactrl. The 1-minute load average at start and end is in the output.

    exactrl bench gguf_open [--quick] [--vocab 128256] [--merges 280147] [--repeat 2] [--files F.gguf ...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import apply_quick, positive_int  # noqa: E402

from exactrl.model.gguf import open_gguf  # noqa: E402

KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;!?'\"-_()[]{}<>/\\ĠĊäöüéßçñ中文字😀"


def write_file(path: Path, vocab: int, merges: int, seed: int = 0) -> None:
    """A GGUF file of a random byte-level vocabulary (module doc), written by the `gguf` package."""
    import gguf
    import numpy as np

    rng = random.Random(seed)
    tokens: dict[str, None] = {}
    while len(tokens) < vocab:
        tokens["".join(rng.choices(ALPHABET, k=rng.randint(1, 16)))] = None
    names = list(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(names)
    w.add_token_types([rng.choice((1, 1, 1, 3, 4)) for _ in names])
    w.add_token_merges([f"{rng.choice(names)} {rng.choice(names)}" for _ in range(merges)])
    w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _old(path: Path, values: bool):
    import gguf

    r = gguf.GGUFReader(str(path), "r")
    return [r.fields[k].contents() for k in KEYS] if values else r


def _new(path: Path, values: bool):
    f = open_gguf(path)
    return [f.metadata[k] for k in KEYS] if values else f


def _timed(fn, *args) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t, out


def measure(a) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "vocab.gguf"
        t_write, _ = _timed(write_file, path, a.vocab, a.merges)
        load0 = os.getloadavg()[0]
        best = {f"{who}_{what}_s": float("inf") for who in ("ggufreader", "exactrl") for what in ("open", "vocab")}
        for _ in range(a.repeat):
            for what, values in (("open", False), ("vocab", True)):
                t_old, old = _timed(_old, path, values)
                t_new, new = _timed(_new, path, values)
                best[f"ggufreader_{what}_s"] = min(best[f"ggufreader_{what}_s"], t_old)
                best[f"exactrl_{what}_s"] = min(best[f"exactrl_{what}_s"], t_new)
                if values and old != new:
                    raise AssertionError("GGUFReader and exactrl's reader give different tokenizer values")
        size = path.stat().st_size
    return {
        "vocab": a.vocab,
        "merges": a.merges,
        "file_mb": round(size / 2**20, 1),
        "write_s": round(t_write, 2),
        **{k: round(v, 4) for k, v in best.items()},
        "open_ratio": round(best["ggufreader_open_s"] / best["exactrl_open_s"], 1),
        "vocab_ratio": round(best["ggufreader_vocab_s"] / best["exactrl_vocab_s"], 1),
        "loadavg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],
    }


def _flat(v):
    return [y for x in v for y in _flat(x)] if isinstance(v, list) else [v]


def _same(path: Path, old, new) -> bool:
    """Every metadata value (arrays of arrays flattened) and every tensor's bytes equal in both readers."""
    fields = {k: f.contents() for k, f in old.fields.items() if not k.startswith("GGUF.")}
    meta = {k: _flat(v) if isinstance(v, list) else v for k, v in new.metadata.items()}
    tensors = all(new.tensor_data(new.tensors[t.name]).tobytes() == t.data.tobytes() for t in old.tensors)
    return fields == meta and [t.name for t in old.tensors] == list(new.tensors) and tensors


def measure_files(paths: list[Path], repeat: int) -> list[dict]:
    rows = []
    for path in paths:
        t_old = t_new = float("inf")
        for _ in range(repeat):
            dt, old = _timed(_old, path, False)
            t_old = min(t_old, dt)
            dt, new = _timed(_new, path, False)
            t_new = min(t_new, dt)
        tokens = new.metadata.get("tokenizer.ggml.tokens", [])
        rows.append(
            {
                "file": path.name,
                "tokens": len(tokens),
                "ggufreader_open_s": round(t_old, 4),
                "exactrl_open_s": round(t_new, 4),
                "open_ratio": round(t_old / t_new, 1),
                "same": _same(path, old, new),
            }
        )
    return rows


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="exactrl bench gguf_open")
    p.add_argument("--vocab", type=positive_int, default=128256, help="tokens in the vocabulary (Llama 3's)")
    p.add_argument("--merges", type=positive_int, default=280147, help="BPE merges (Llama 3's)")
    p.add_argument("--repeat", type=positive_int, default=2, help="timed rounds (best of)")
    p.add_argument("--quick", action="store_true", help="a 4096-token vocabulary (smoke test)")
    p.add_argument("--files", type=Path, nargs="+", default=None, help="measure these GGUF files instead")
    a = p.parse_args(argv)
    if a.files:
        load0 = os.getloadavg()[0]
        rows = measure_files(a.files, a.repeat)
        print(json.dumps({"files": rows, "loadavg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)]}, indent=2))
        return
    if a.quick:
        apply_quick(p, a, vocab=4096, merges=8000, repeat=1)
    print(json.dumps(measure(a), indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
