"""LoRA adapters in PEFT's file format: adapter_model.safetensors + adapter_config.json.

PEFT names a tensor `base_model.model.` + the module path + `.lora_A.weight`
(or `.lora_B.weight`), which is `PEFT_PREFIX` + exactrl's own parameter name;
`peft.PeftModel.from_pretrained(transformers_model, DIR)` loads the directory
onto the base model (tested against its logits). The config holds the fields
PEFT reads (r, lora_alpha, target_modules, ...) with PEFT's values for what
exactrl does not vary: no dropout, no bias, no rsLoRA or DoRA.

The safetensors header's metadata also records the digest of the base weights
the adapters were trained on (`lora.base_digest`) and their dtype: loading
adapters onto another base is refused, since the same adapters on other
weights are another model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from exactrl.model.lora import TARGETS, adapter_weights, add_lora
from exactrl.model.transformer import CausalLM

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def save_adapters(model: CausalLM, path: str | Path) -> None:
    """Writes a LoRA model's adapters to `path` in PEFT's format (the directory is created if needed)."""
    spec = model.lora
    if spec is None:
        raise ValueError("the model carries no LoRA adapters to save (save_model writes a whole model)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {PEFT_PREFIX + n: p.detach().to("cpu", copy=True).contiguous() for n, p in adapter_weights(model).items()}
    meta = {"format": "pt", "exactrl_base_sha256": spec.base_sha256, "exactrl_dtype": _DTYPES[model.dtype]}
    save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata=meta)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": spec.base,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(spec.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))


# fields whose other values change what the adapters compute, and the value exactrl computes with
_FIXED = {
    "peft_type": "LORA",
    "bias": "none",
    "fan_in_fan_out": False,
    "use_rslora": False,
    "use_dora": False,
    "modules_to_save": None,
    "layers_to_transform": None,
    "rank_pattern": {},
    "alpha_pattern": {},
}


def read_adapter_config(path: str | Path) -> dict:
    """adapter_config.json of a PEFT LoRA directory, checked: r, lora_alpha and target_modules as exactrl runs
    them, and nothing it does not compute (DoRA, rsLoRA, biases, per-module ranks) — each a named ValueError."""
    p = Path(path) / ADAPTER_CONFIG
    if not p.is_file():
        raise ValueError(f"no {ADAPTER_CONFIG} in {path}: not a PEFT adapter directory")
    try:
        cfg = json.loads(p.read_text())
    except (ValueError, OSError) as e:
        raise ValueError(f"{p} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{p} must hold a JSON object")
    for key, want in _FIXED.items():
        if key in cfg and cfg[key] != want and not (want in ({}, None) and not cfg[key]):
            raise ValueError(f"{p}: {key}={cfg[key]!r} is not supported (exactrl's LoRA runs {key}={want!r})")
    targets = cfg.get("target_modules")
    if not (isinstance(targets, list) and targets and all(t in TARGETS for t in targets)):
        raise ValueError(f"{p}: target_modules must be a list of names from {list(TARGETS)}, got {targets!r}")
    if type(cfg.get("r")) is not int or cfg["r"] < 1:
        raise ValueError(f"{p}: r must be an int >= 1, got {cfg.get('r')!r}")
    alpha = cfg.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(f"{p}: lora_alpha must be a number > 0, got {alpha!r}")
    return cfg


def adapter_metadata(path: str | Path) -> dict[str, str]:
    """The safetensors header metadata of a directory's adapter weights ({} where the file has none)."""
    f = Path(path) / ADAPTER_WEIGHTS
    if not f.is_file():
        raise ValueError(f"no {ADAPTER_WEIGHTS} in {path}")
    try:
        with safe_open(str(f), framework="pt") as sf:
            return sf.metadata() or {}
    except SafetensorError as e:
        raise ValueError(f"{f} is not a valid safetensors file ({e})") from None


@torch.no_grad()
def load_adapters(model: CausalLM, path: str | Path, seed: int = 0) -> CausalLM:
    """Loads a PEFT LoRA directory's adapters onto `model`: attached first (`add_lora`, with the directory's
    rank, alpha and targets) if the model has none, else checked to be the same. Every tensor's name and shape
    is checked, and a base whose weights differ from the one the adapters were trained on (their digest, where
    the file records one) is refused. Returns `model`."""
    cfg = read_adapter_config(path)
    meta = adapter_metadata(path)
    if model.lora is None:
        add_lora(
            model, cfg["r"], float(cfg["lora_alpha"]), cfg["target_modules"], seed, cfg.get("base_model_name_or_path")
        )
    spec = model.lora
    if (spec.rank, spec.alpha, set(spec.targets)) != (cfg["r"], float(cfg["lora_alpha"]), set(cfg["target_modules"])):
        raise ValueError(
            f"the adapters in {path} (r={cfg['r']}, lora_alpha={cfg['lora_alpha']}, "
            f"targets={sorted(cfg['target_modules'])}) are not the model's (rank={spec.rank}, alpha={spec.alpha}, "
            f"targets={sorted(spec.targets)})"
        )
    want = meta.get("exactrl_base_sha256")
    if want is not None and want != spec.base_sha256:
        raise ValueError(
            f"the adapters in {path} were trained on a base model whose weights differ from this one's "
            f"(sha256 {want[:12]}… vs {spec.base_sha256[:12]}…): load them onto the base they were trained on "
            f"({cfg.get('base_model_name_or_path')}), in the dtype they were saved from "
            f"({meta.get('exactrl_dtype', 'unknown')})"
        )
    params = {PEFT_PREFIX + n: p for n, p in adapter_weights(model).items()}
    f = Path(path) / ADAPTER_WEIGHTS
    with safe_open(str(f), framework="pt") as sf:
        stored = set(sf.keys())
        missing, unexpected = sorted(set(params) - stored), sorted(stored - set(params))
        if missing or unexpected:
            raise ValueError(f"{f} does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
        for name in sorted(stored):
            t = sf.get_tensor(name)
            if tuple(t.shape) != tuple(params[name].shape):
                raise ValueError(f"{f}: {name} has shape {tuple(t.shape)}, expected {tuple(params[name].shape)}")
            if not torch.isfinite(t).all():
                raise ValueError(f"{f}: {name} holds NaN or infinite values")
            params[name].copy_(t.to(params[name].dtype))
    return model
