"""`exactrl export CHECKPOINT --out DIR [--merge] [--base MODEL_DIR]`: a LoRA run's checkpoint as a
directory other tools load.

- `--merge`: the base model with every adapted projection's weight replaced by
  W + (α/r) B A (`lora.merge_lora`, summed in float64, rounded once to the
  run's dtype): a Hugging Face model directory that `exactrl.load_model`,
  `exactrl serve` and transformers read, with no adapters left.
- without it: the adapters alone (adapter_model.safetensors,
  adapter_config.json), a PEFT adapter directory without the optimizer state.

Either way the run's tokenizer files are copied along, and the checkpoint's
file digests (state.json) are checked first. The base is the directory the
adapters name (PEFT's base_model_name_or_path: the run's model.path), or
`--base`; a base whose weights differ from the one trained on is refused. A
full fine-tuning checkpoint needs no export: it is a Hugging Face model
directory already.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from exactrl.model import load_model, save_model
from exactrl.model.lora import merge_lora
from exactrl.model.lora_files import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_metadata,
    is_adapter_dir,
    load_adapters,
    read_adapter_config,
)
from exactrl.train.checkpoint import verify_digests

# what a Hugging Face tokenizer directory holds (copied along when present)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def export_checkpoint(checkpoint, out, merge: bool = False, base=None, log=print) -> Path:
    """Writes `checkpoint` (a LoRA run's step_N directory) to the empty or new directory `out`; returns it."""
    ckpt, out = Path(checkpoint), Path(out)
    if not ckpt.is_dir():
        raise ValueError(f"checkpoint {ckpt} is not a directory")
    if not is_adapter_dir(ckpt):
        if (ckpt / "checkpoints").is_dir():
            fix = f"it is a run directory: give one of its checkpoints ({ckpt / 'checkpoints'}/step_N)"
        elif (ckpt / "model.safetensors").is_file():
            fix = "a full fine-tuning checkpoint is a Hugging Face model directory already (load it as it is)"
        else:
            fix = "give a checkpoint directory of a LoRA run (RUN_DIR/checkpoints/step_N)"
        raise ValueError(f"{ckpt} holds no LoRA adapters ({ADAPTER_CONFIG}): {fix}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not an empty directory: give a new one")
    verify_digests(ckpt)  # a ValueError naming a damaged file
    cfg = read_adapter_config(ckpt)
    base_dir = Path(base) if base is not None else _named_base(ckpt, cfg)
    if not (base_dir / "config.json").is_file():
        raise ValueError(f"the base model directory {base_dir} holds no config.json: give the base with --base DIR")
    if merge:
        model = load_model(base_dir, dtype=adapter_metadata(ckpt).get("exactrl_dtype", "float32"), kernels="fast")
        save_model(merge_lora(load_adapters(model, ckpt)), out)  # `fast`: nothing is computed but the sums
    else:
        out.mkdir(parents=True, exist_ok=True)
        for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
            shutil.copyfile(ckpt / name, out / name)
    tokenizer = _tokenizer_dir(ckpt) or base_dir
    copied = [n for n in TOKENIZER_FILES if (tokenizer / n).is_file()]
    for name in copied:
        shutil.copyfile(tokenizer / name, out / name)
    if not copied:
        log(f"note: no tokenizer files in {tokenizer}; {out} holds none")
    return out


def _named_base(ckpt: Path, cfg: dict) -> Path:
    named = cfg.get("base_model_name_or_path")
    if not isinstance(named, str) or not named:
        raise ValueError(f"{ckpt / ADAPTER_CONFIG} names no base model: give it with --base DIR")
    if not Path(named).is_dir():
        raise ValueError(
            f"the base model {named} that {ckpt / ADAPTER_CONFIG} names is not a directory here: give it with "
            f"--base DIR"
        )
    return Path(named)


def _tokenizer_dir(ckpt: Path) -> Path | None:
    """The run's model.tokenizer, from the checkpoint's state.json (None where it has none)."""
    try:
        config = json.loads((ckpt / "state.json").read_text()).get("config", {})
        tokenizer = config["model"]["tokenizer"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return Path(tokenizer) if isinstance(tokenizer, str) and Path(tokenizer).is_dir() else None
