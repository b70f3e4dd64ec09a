"""Hugging Face checkpoint load/save: config.json + safetensors (single or sharded).

Tensor names are the HF names (our module tree mirrors HF's), so loading is a
name-for-name copy with strict checks: a missing, unexpected or mis-shaped
tensor is an error that names it. Saving writes the same format, which
transformers loads back (tested).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from exactrl.kernels import BACKENDS, get_kernels
from exactrl.model.config import ModelConfig, check_eos_token_id
from exactrl.model.transformer import DEFAULT_BLOCK_SIZE, CausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name}")
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def _read_json_object(p: Path) -> dict:
    try:
        obj = json.loads(p.read_text())
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError (binary), nesting too deep
        raise ValueError(f"{p} is not valid JSON: {e}; restore the file from the original checkpoint") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{p} must hold a JSON object, got {type(obj).__name__}")
    return obj


def read_config(path: str | Path) -> ModelConfig:
    p = Path(path) / "config.json"
    if not p.is_file():
        raise ValueError(
            f"{p} is a directory, not the model's config file"
            if p.is_dir()
            else f"no config.json in model directory {path!s}"
        )
    hf = _read_json_object(p)
    try:
        cfg = ModelConfig.from_hf(hf)
    except ValueError as e:  # from_hf knows the keys, not the file
        raise ValueError(f"model directory {path!s}: {e}") from None
    gen = Path(path) / "generation_config.json"
    if gen.is_file():
        cfg.generation = _read_json_object(gen)
        check_eos_token_id(str(gen), cfg.generation)
    return cfg


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file() and (path / "model.safetensors").is_file():  # which one is current? refuse to guess
        raise ValueError(
            f"{path!s} holds both model.safetensors and a sharded checkpoint "
            f"(model.safetensors.index.json): remove the stale one"
        )
    if index.is_file():
        weight_map = _read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map' object (tensor name -> shard file)")
        names = set(weight_map.values())
        odd = [s for s in names if not isinstance(s, str) or not s or Path(s).name != s]
        if odd:  # an absolute or relative path would read a checkpoint outside this directory
            raise ValueError(f"{index} names shards that are not file names in {path!s}: {odd[:5]}")
        shards = [path / s for s in sorted(names)]
        absent = [s.name for s in shards if not s.is_file()]
        if absent:
            raise ValueError(f"{index} names shard files that are not in {path!s}: {absent}")
        return shards
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    if any(path.glob("pytorch_model*.bin")):
        raise ValueError(
            f"{path!s} holds a pytorch_model.bin checkpoint; only safetensors are read: convert it with "
            f"transformers.AutoModelForCausalLM.from_pretrained(d).save_pretrained(d) (it writes "
            f"safetensors)"
        )
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path!s}")


def _open_safetensors(f: Path):
    try:
        return safe_open(str(f), framework="pt")
    except SafetensorError as e:  # truncated or corrupt: the header cannot be read
        raise ValueError(f"{f} is not a valid safetensors file ({e}); re-save or re-copy the checkpoint") from None


def init_weights(model: CausalLM, seed: int = 0, std: float = 0.02) -> CausalLM:
    """Random init (normal(0, std) matrices, unit norms, zero biases), seeded."""
    dev = model.device
    g = torch.Generator(device=dev).manual_seed(seed)  # on a GPU its own stream: other bits than the CPU's
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(0.0 if model.config.gemma else 1.0)  # Gemma's norms scale by (1 + w)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g, device=dev) * std)
    return model


def resolve_device(device: str | torch.device = "cpu", backend: str | None = None) -> tuple[torch.device, str]:
    """(device, backend) of a model, checked: `backend` None picks `native` on CPU and `triton` on CUDA.

    `triton` on CPU runs Triton's interpreter (TRITON_INTERPRET=1 must be set); `native` is CPU only.
    What is missing (a GPU, triton, the variable) is named in one ValueError."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}")
    backend = ("native" if dev.type == "cpu" else "triton") if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if dev.type == "cuda":
        if backend != "triton":
            raise ValueError(f"backend={backend!r} runs on CPU tensors only: use backend='triton' (or None) on cuda")
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={str(device)!r}: no CUDA GPU is available (torch {torch.__version__}, "
                f"torch.cuda.is_available() is False)"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={str(device)!r}: only {torch.cuda.device_count()} CUDA device(s)")
    if backend == "triton":
        from exactrl.kernels.triton import check_backend

        check_backend(dev)
    return dev, backend


def build_model(
    cfg: ModelConfig,
    dtype="float32",
    kernels: str = "exact",
    seed: int | None = 0,
    block_size: int = DEFAULT_BLOCK_SIZE,
    device: str | torch.device = "cpu",
    backend: str | None = None,
) -> CausalLM:
    dev, backend = resolve_device(device, backend)
    if backend == "triton":
        _check_triton_shapes(cfg, block_size)
    model = CausalLM(cfg, get_kernels(kernels, backend), block_size).to(dev)
    if seed is not None:
        init_weights(model, seed)
    return model.to(_dtype(dtype))


def _check_triton_shapes(cfg: ModelConfig, block_size: int) -> None:
    """The shapes the Triton kernels take: tl.dot needs dims of at least 16, the rotary kernel a power of 2."""
    d = cfg.head_dim
    if d < 16 or d & (d - 1):
        raise ValueError(f"backend='triton' needs head_dim a power of two >= 16, the config has {d}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"backend='triton' needs a KV block size that is a power of two >= 16, got {block_size}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads={cfg.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={cfg.num_key_value_heads}"
        )


def load_model(
    path: str | Path,
    dtype="float32",
    kernels: str = "exact",
    block_size: int = DEFAULT_BLOCK_SIZE,
    device: str | torch.device = "cpu",
    backend: str | None = None,
) -> CausalLM:
    """Loads a Hugging Face model directory (or a GGUF file: a path ending in .gguf, `exactrl.model.gguf`) into
    the exactrl decoder. Every stored tensor's name, shape and
    dtype is checked against config.json from the file headers before the model is allocated, so a config
    that is wrong (say a vocab_size of 10**13) is a named error, not an allocation failure.

    `device` "cpu" | "cuda" and `backend` "native" | "triton" | None (`resolve_device`): the model lives
    there, the engine and the trainer run there."""
    from exactrl.model.gguf import is_gguf_path

    if is_gguf_path(path):  # a llama.cpp file: exactrl/model/gguf.py
        from exactrl.model.gguf import load_gguf_model

        return load_gguf_model(path, dtype, kernels, block_size, device, backend)
    dev, backend = resolve_device(device, backend)
    path = Path(path)
    if not path.is_dir():
        raise ValueError(
            f"model directory {path!s} "
            + ("is a file: give the directory that holds config.json" if path.exists() else "does not exist")
        )
    cfg = read_config(path)
    stored = _stored_tensors(path, _weight_files(path))
    _check_shapes(path, cfg, stored, kernels, block_size, backend)
    model = build_model(cfg, dtype, kernels, seed=None, block_size=block_size, device=dev, backend=backend)
    params = dict(model.named_parameters())
    stored_head = None  # a tied model's head, if the checkpoint stores it too
    with torch.no_grad():
        for f in sorted({f for f, _ in stored.values()}):
            with _open_safetensors(f) as sf:
                for name in sf.keys():
                    if name.endswith("rotary_emb.inv_freq"):
                        continue  # RoPE's old buffer: recomputed from the config
                    tied = name == "lm_head.weight" and cfg.tie_word_embeddings  # the embedding is the head
                    t = sf.get_tensor(name).to(params[TIED if tied else name].dtype)
                    if not torch.isfinite(t).all():  # a corrupt copy, or beyond the dtype: every logit would be NaN
                        raise ValueError(
                            f"weight {name} holds NaN or infinite values (in {f}, as {dtype}); re-copy the checkpoint"
                        )
                    if tied:
                        stored_head = t  # checked below
                    else:
                        params[name].copy_(t)
        if stored_head is not None:
            _check_tied_head(path, params[TIED], stored_head, TIED in stored)
    return model


FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors' names of the dtypes a weight may be stored in


def _stored_tensors(path: Path, files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Each stored tensor's file and shape, from the headers. A tensor stored twice (which copy is meant?)
    or not in floating point (an int tensor would be cast silently) is refused."""
    stored: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for f in files:
        with _open_safetensors(f) as sf:
            for name in sf.keys():
                if name in stored:
                    raise ValueError(
                        f"checkpoint {path!s} stores tensor {name!r} twice, in {stored[name][0].name} and {f.name}"
                    )
                t = sf.get_slice(name)
                if t.get_dtype() not in FLOAT_DTYPES:
                    raise ValueError(
                        f"tensor {name!r} in {f} has dtype {t.get_dtype()}; weights must be one of "
                        f"{', '.join(FLOAT_DTYPES)}"
                    )
                stored[name] = (f, tuple(t.get_shape()))
    return stored


def _check_shapes(
    path: Path, cfg: ModelConfig, stored: dict, kernels: str, block_size: int, backend: str = "native"
) -> None:
    """The stored tensors are exactly the model's, shape for shape: checked on a meta-device model, which
    allocates nothing (its layers are counted first: a huge num_hidden_layers would take long to build)."""
    layers = {int(n.split(".")[2]) for n in stored if n.startswith("model.layers.") and n.split(".")[2].isdigit()}
    if cfg.num_hidden_layers > len(layers):
        raise ValueError(
            f"checkpoint {path!s}: config.json gives num_hidden_layers={cfg.num_hidden_layers}, "
            f"but the safetensors files hold {len(layers)} layers"
        )
    with torch.device("meta"):
        params = {
            n: tuple(p.shape) for n, p in CausalLM(cfg, get_kernels(kernels, backend), block_size).named_parameters()
        }
    if cfg.tie_word_embeddings:
        params["lm_head.weight"] = params[TIED]  # stored too, maybe: the same matrix (checked at load)
    for name, (f, shape) in stored.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # older checkpoints saved RoPE's buffer; it is recomputed from the config
        if name not in params:
            raise ValueError(f"unexpected tensor {name!r} in {f} for a {cfg.model_type} model")
        if shape != params[name]:
            raise ValueError(f"tensor {name!r} in {f} has shape {shape}, expected {params[name]} from config.json")
    expected = set(params)
    if cfg.tie_word_embeddings:  # one matrix, stored as either name (or both)
        expected -= {"lm_head.weight"} | ({TIED} if "lm_head.weight" in stored else set())
    missing = sorted(expected - set(stored))
    if missing:
        raise ValueError(
            f"checkpoint {path!s} is missing tensors: {missing[:5]}"
            + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        )


TIED = "model.embed_tokens.weight"  # a tied model's one matrix: embedding and LM head


def _check_tied_head(path: Path, embed: torch.Tensor, head: torch.Tensor, embed_stored: bool) -> None:
    """A tied checkpoint that stores `lm_head.weight` as well: the same matrix, or the embedding itself when
    only the head is stored (transformers ties them that way). A head that differs is refused: transformers
    5 then unties them and uses it, 4.x ties them and drops it, so no single model is meant."""
    if tuple(head.shape) != tuple(embed.shape):
        raise ValueError(f"tensor 'lm_head.weight' has shape {tuple(head.shape)}, expected {tuple(embed.shape)}")
    head = head.to(embed.dtype)
    if not embed_stored:
        embed.copy_(head)
    elif not torch.equal(head, embed):
        raise ValueError(
            f"checkpoint {path!s}: config.json says tie_word_embeddings=true, but its lm_head.weight "
            f"differs from model.embed_tokens.weight; set tie_word_embeddings to false if the head is "
            f"its own matrix"
        )


def _remove_shards(path: Path) -> None:
    """Deletes a sharded checkpoint's index and the shard files it names."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return
    try:
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
    except (json.JSONDecodeError, AttributeError):
        shards = set()
    for name in shards:
        if isinstance(name, str) and Path(name).name == name and name != "model.safetensors":
            (path / name).unlink(missing_ok=True)
    index.unlink()


def save_model(model: CausalLM, path: str | Path, tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Writes config.json + model.safetensors in the Hugging Face layout; `tensors`: the weights to write
    instead of the model's own (a sharded model's, gathered whole)."""
    if model.lora is not None:  # its adapters are no Hugging Face tensors; a base saved alone would drop them
        raise ValueError(
            "the model carries LoRA adapters: save them with exactrl.model.lora_files.save_adapters (PEFT's "
            "format), or save exactrl.model.lora.merge_lora(model) as one model"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_hf()
    cfg["torch_dtype"] = cfg["dtype"] = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[model.dtype]
    named = model.named_parameters() if tensors is None else tensors.items()
    tensors = {n: p.detach().to("cpu", copy=True).contiguous() for n, p in named}
    _remove_shards(path)  # saving over a sharded checkpoint: its index would otherwise win at load
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    if model.config.generation:
        (path / "generation_config.json").write_text(json.dumps(model.config.generation, indent=2))
