"""`config_reference()`: every run config key (and `exactrl sft`'s) with its type, default and docstring, as Markdown
(`docs/config.md` is its text; a test keeps the two the same). Re-exported by `exactrl.train.config`."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel


def config_reference() -> str:
    """Every config key with its type, default and docstring, as Markdown (`docs/config.md` is this text;
    a test keeps the two the same)."""
    lines = [
        "# Run config keys",
        "",
        "Generated from `exactrl/train/config.py` (`config_reference()`); set any key in a YAML file or with",
        "`exactrl train --set key=value`. `exactrl train` with no file runs these defaults: the default job.",
        "",
    ]

    def section(model: type[BaseModel], prefix: str, heading: str = "") -> None:
        rows, subs = [], []
        for name, f in model.model_fields.items():
            key = prefix + (f.alias or name)
            if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
                subs.append((f.annotation, key, f.description))
                continue
            default = f.default_factory() if f.default_factory is not None else f.default
            text = " ".join((f.description or "").split()).replace("|", "\\|")
            rows.append(f"| `{key}` | {_type_text(f.annotation)} | `{json.dumps(default)}` | {text} |")
        if rows:
            lines.extend(["| key | type | default | meaning |", "|---|---|---|---|", *rows, ""])
        for sub, key, doc in subs:
            lines.extend([f"## {heading}`{key}`", ""] + ([" ".join(doc.split()), ""] if doc else []))
            section(sub, key + ".", heading)

    from exactrl.train.config import RunConfig
    from exactrl.train.sft import SFTConfig

    section(RunConfig, "")
    lines.extend(
        [
            "# `exactrl sft` config keys",
            "",
            "Generated from `exactrl/train/sft.py` (`SFTConfig`); `exactrl sft CONFIG.yaml --set key=value`. A file of",
            "its own: `model.path` and `data.train_jsonl` are required (docs/training.md).",
            "",
        ]
    )
    section(SFTConfig, "", "sft: ")
    return "\n".join(lines)


def _type_text(ann: Any) -> str:
    origin, args = get_origin(ann), get_args(ann)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin is Annotated:
        return _type_text(args[0])
    if origin in (Union, tuple, list, dict) or type(ann).__name__ == "UnionType":
        parts = [_type_text(a) for a in args if a is not Ellipsis]
        if origin in (Union, None) or type(ann).__name__ == "UnionType":
            return " or ".join("null" if p == "NoneType" else p for p in parts)
        return f"{origin.__name__}[{', '.join(parts)}]"
    return getattr(ann, "__name__", str(ann))
