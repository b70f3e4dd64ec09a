"""The run config: a tree of the sections that sit next to their components.

Loaded from YAML, then `--set a.b=c` overrides (values parsed as YAML; a
number or date given to a string field keeps its text), then validated; an
unknown key or a bad value is an error naming the dotted key.
`exactrl train` with no file runs the defaults below: the default job.
"""

from __future__ import annotations

from collections.abc import Hashable
from datetime import date
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from exactrl.algo.advantages import ADVANTAGES, GROUP_BASELINE
from exactrl.argcheck import PathText
from exactrl.envs.settings import TaskSettings
from exactrl.model.settings import ModelSettings
from exactrl.model.transformer import DEFAULT_BLOCK_SIZE
from exactrl.rollout.external import RolloutBackendSettings
from exactrl.train.distill import DistillSettings
from exactrl.train.logger import ProgressSettings
from exactrl.train.settings import (  # noqa: F401 (re-exported)
    _STRICT,
    AlgorithmSettings,
    AsyncSettings,
    DistributedSettings,
    EngineSettings,
    KLSettings,
    OptimSettings,
    OverlongSettings,
    RolloutSettings,
    SFTSettings,
)
from exactrl.train.trackers import LoggingSettings


class RunConfig(BaseModel):
    model_config = _STRICT

    max_steps: int = Field(60, ge=1)
    """RL steps to run."""
    seed: int = Field(0, ge=-(2**63), lt=2**63)
    """Seeds data order, sampling and the default model's initialisation."""
    run_dir: PathText | None = None
    """Output directory; None creates runs/<timestamp>."""
    resume: bool = False
    """Continue from the latest checkpoint in run_dir (required if run_dir has checkpoints)."""
    save_every: int = Field(20, ge=1)
    """Checkpoint every this many steps, and at the last."""
    keep_checkpoints: int = Field(2, ge=1)
    """Newest checkpoints kept in run_dir/checkpoints (older ones are pruned)."""
    eval_every: int = Field(10, ge=1)
    """Score the held-out problems every this many steps, at the last, and once before the first."""
    progress: ProgressSettings = Field(default_factory=ProgressSettings)
    """What the run prints as it goes; `progress: false` (or true) is short for `progress: {enabled: false}`."""
    tensorboard: bool = True
    """Also write the metrics as TensorBoard events in run_dir."""
    logging: LoggingSettings = Field(default_factory=LoggingSettings)
    """Where else the metrics go besides metrics.jsonl and TensorBoard (W&B, MLflow), and the samples logged."""
    model: ModelSettings = Field(default_factory=ModelSettings)
    task: TaskSettings = Field(default_factory=TaskSettings)
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    rollout_backend: RolloutBackendSettings = Field(default_factory=RolloutBackendSettings)
    """Who samples the rollouts: the in-process engine (exact) or an external OpenAI-compatible server."""
    algorithm: AlgorithmSettings = Field(default_factory=AlgorithmSettings)
    optim: OptimSettings = Field(default_factory=OptimSettings)
    sft: SFTSettings = Field(default_factory=SFTSettings)
    distill: DistillSettings = Field(default_factory=DistillSettings)
    """On-policy distillation: teachers score the student's samples (exactrl/train/distill.py)."""
    async_: AsyncSettings = Field(default_factory=AsyncSettings, alias="async")
    """Asynchronous rollouts (config key `async`)."""
    distributed: DistributedSettings = Field(default_factory=DistributedSettings)
    """How data-parallel ranks (`exactrl train --nproc N`) share the model: replicated or fully sharded."""

    @field_validator("progress", mode="before")
    @classmethod
    def _progress_switch(cls, v: Any) -> Any:
        if isinstance(v, bool):
            return {"enabled": v}
        if not isinstance(v, (dict, ProgressSettings)):
            raise ValueError("must be true, false or a section of enabled and samples")
        return v

    @model_validator(mode="after")
    def _samples_fit_the_engine(self) -> RunConfig:
        # the n samples of a prompt share its prefill and run together: the engine must hold them at once
        exactrl_engines = self.rollout_backend.kind in ("engine", "ray")  # built from `engine`'s settings
        if exactrl_engines and self.rollout.samples_per_prompt > self.engine.max_num_seqs:
            raise ValueError(
                f"rollout.samples_per_prompt={self.rollout.samples_per_prompt} exceeds "
                f"engine.max_num_seqs={self.engine.max_num_seqs}: raise engine.max_num_seqs"
            )
        pages = -(-self.engine.kv_budget_tokens // DEFAULT_BLOCK_SIZE)  # the pool holds whole pages
        if exactrl_engines and pages * DEFAULT_BLOCK_SIZE <= self.rollout.max_tokens:  # no prompt would ever fit
            raise ValueError(
                f"engine.kv_budget_tokens={self.engine.kv_budget_tokens} ({pages * DEFAULT_BLOCK_SIZE} "
                f"tokens in pages of {DEFAULT_BLOCK_SIZE}) cannot hold a prompt and "
                f"rollout.max_tokens={self.rollout.max_tokens} answer tokens: raise engine.kv_budget_tokens"
            )
        ray = self.rollout_backend.ray
        if self.rollout_backend.kind == "ray" and ray.num_engines > self.rollout.prompts_per_step:
            # an engine samples whole prompts (all n samples of one): the extra engines would hold CPUs, idle
            raise ValueError(
                f"rollout_backend.ray.num_engines={ray.num_engines} exceeds rollout.prompts_per_step="
                f"{self.rollout.prompts_per_step}: each engine samples whole prompts, so "
                f"{ray.num_engines - self.rollout.prompts_per_step} would never sample; lower "
                f"num_engines or raise prompts_per_step"
            )
        if self.resume and self.run_dir is None:
            raise ValueError(
                "resume=true needs run_dir: the directory of the run to continue (--set run_dir=runs/<its name>)"
            )
        a, rb = self.async_, self.rollout_backend
        if a.enabled and rb.kind == "openai" and rb.weight_sync == "none" and self.max_steps > a.max_staleness + 1:
            # every token of a server that keeps its starting weights is version 0: from step max_staleness + 2
            # on, drop_stale finds every sample too stale and the run would stop there, half done
            raise ValueError(
                f"async.enabled with rollout_backend.weight_sync=none: the server keeps its starting "
                f"weights, so from step {a.max_staleness + 2} every sample is staler than "
                f"async.max_staleness={a.max_staleness} and the run would stop there, short of "
                f"max_steps={self.max_steps}; use rollout_backend.weight_sync=disk, or the synchronous "
                f"loop (async.enabled=false)"
            )
        if self.rollout.filter_groups and self.rollout.samples_per_prompt == 1:
            raise ValueError(
                "rollout.filter_groups with rollout.samples_per_prompt=1: a group of one sample has "
                "no rewards to differ, so every group would be set aside; raise samples_per_prompt"
            )
        reward_free = self.distill.enabled and self.distill.reward_coef == 0  # the teacher's advantages alone
        if self.rollout.samples_per_prompt == 1 and self.algorithm.advantage in GROUP_BASELINE and not reward_free:
            working = sorted(set(ADVANTAGES) - GROUP_BASELINE)
            raise ValueError(
                f"rollout.samples_per_prompt=1 with algorithm.advantage={self.algorithm.advantage}: "
                f"its baseline is the sample's own group, so every advantage, the loss and its "
                f"gradient would be 0 and nothing would train; raise samples_per_prompt, or use an "
                f"estimator that works with one sample per prompt ({', '.join(working)})"
            )
        if self.rollout.filter_groups and a.enabled:
            raise ValueError(
                "rollout.filter_groups with async.enabled: the asynchronous loop's rollout thread "
                "samples fixed batches ahead; use the synchronous loop (async.enabled=false)"
            )
        if self.algorithm.overlong.buffer_len > self.rollout.max_tokens:
            raise ValueError(
                f"algorithm.overlong.buffer_len={self.algorithm.overlong.buffer_len} exceeds "
                f"rollout.max_tokens={self.rollout.max_tokens}: the buffer is the last tokens before it"
            )
        return self

    @model_validator(mode="after")
    def _verifiers_episodes(self) -> RunConfig:
        """What `task.kind: verifiers` (whole episodes through a server over the in-process engine) excludes."""
        if self.task.kind != "verifiers":
            return self
        a = self.algorithm
        refused = [
            (self.rollout_backend.kind != "engine", "rollout_backend.kind=engine: its server runs on that engine"),
            (self.async_.enabled, "async.enabled=false: the episodes of a step run in the synchronous loop"),
            (self.distill.enabled, "distill.enabled=false: a teacher scores single completions"),
            (a.kl.coef > 0 and a.kl.where == "reward", "algorithm.kl.where=loss: an episode's reward is its own"),
            (a.overlong.buffer_len > 0 or a.overlong.mask_truncated, "algorithm.overlong off: it reads one completion"),
            (self.rollout.ignore_eos, "rollout.ignore_eos=false: the harness sets its episodes' sampling arguments"),
        ]
        for bad, need in refused:
            if bad:
                raise ValueError(f"task.kind=verifiers needs {need}")
        return self


Config = TypeVar("Config", bound=BaseModel)


SWITCHED_SECTIONS = ("progress",)  # sections a bool stands for: `progress: false` is `progress: {enabled: false}`


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    if len(keys) > 1 and isinstance(tree.get(keys[0]), bool) and keys[0] in SWITCHED_SECTIONS:
        tree[keys[0]] = {"enabled": tree[keys[0]]}  # `progress: false` in the file, `--set progress.samples=3`
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ValueError(f"config key {dotted!r}: {k!r} is not a section")
    node[keys[-1]] = value


def _is_str_field(dotted: str, schema: type[BaseModel] = RunConfig) -> bool:
    """Whether the dotted key names a `str` or `str | None` field, PathText too (keys inside free-form dicts do not)."""
    node: Any = schema
    for k in dotted.split("."):
        if not (isinstance(node, type) and issubclass(node, BaseModel)):
            return False
        field = next((f for n, f in node.model_fields.items() if k in (n, f.alias)), None)
        if field is None:
            return False
        node = field.annotation
    kinds = {
        get_args(a)[0] if get_origin(a) is Annotated else a  # PathText is an Annotated str
        for a in (get_args(node) if get_origin(node) in (Union, UnionType) else (node,))
    }
    return bool(kinds) and kinds <= {str, type(None)} and str in kinds


def _parse_override(key: str, raw: str, schema: type[BaseModel] = RunConfig) -> Any:
    """A --set value parsed as YAML; for a string field, a number or date keeps the text as typed.

    So `run_dir=2024-01-01` and `rollout_backend.model=007` mean what they say. true/false and
    null are not turned into text: a string field refuses a bool, and null means None.
    """
    try:
        value = _yaml_load(raw)
    except yaml.YAMLError as e:
        raise ValueError(
            f"--set {key}: not valid YAML ({_yaml_problem(e)}): {raw!r:.80}; quote the value if it is meant as text"
        ) from None
    if isinstance(value, (int, float, date)) and not isinstance(value, bool) and _is_str_field(key, schema):
        return raw.strip()
    return value


def _yaml_problem(e: yaml.YAMLError) -> str:
    """yaml's own description of the error, on one line and without its position (the caller gives that)."""
    what = " ".join(str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x) or str(e)
    return " ".join(what.split())


def _load_file(p: Path) -> dict:
    if p.is_dir():
        raise ValueError(f"config file {p} is a directory: pass a YAML file")
    if not p.exists():
        raise ValueError(f"config file {p} does not exist")
    if not p.is_file():
        raise ValueError(f"config file {p} is not a regular file: pass a YAML file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"config file {p} is not UTF-8 text (byte {e.start})") from None
    try:
        tree = _yaml_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)  # an error at the end of the stream points at the last line
        where = f"line {min(mark.line + 1, len(text.splitlines()))}: " if mark is not None else ""
        raise ValueError(f"config file {p}: {where}not valid YAML ({_yaml_problem(e)})") from None
    if tree is None:  # an empty file (or only comments): the defaults
        return {}
    if not isinstance(tree, dict):
        raise ValueError(
            f"config file {p} must hold a mapping of settings at the top level, got {type(tree).__name__} {tree!r:.40}"
        )
    return tree


def _yaml_load(text: str) -> Any:
    """YAML's safe load with `_UniqueKeyLoader`; nesting deeper than Python's recursion limit (`[[[[...`) is a
    YAMLError like any other malformed input, not a RecursionError."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except RecursionError:
        raise yaml.YAMLError("lists or mappings nested too deeply") from None
    except ValueError as e:  # PyYAML's scanner lets some bad escapes through as ValueError ("\\U00110000": chr())
        raise yaml.YAMLError(f"a bad escape in a quoted string ({e})") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):  # `? [a, b]`: yaml's own check refuses it ("found unhashable key")
                break
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} appears twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_config(path: str | Path | None = None, overrides: list[str] = (), schema: type[Config] = RunConfig) -> Config:
    """YAML file (optional) + `key=value` overrides -> validated RunConfig (or another `schema`: `exactrl sft`'s)."""
    tree = _load_file(Path(path)) if path is not None else {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        if any(not part.strip() for part in key.split(".")):  # "=1", "a..b", "a.": no key to name
            raise ValueError(f"--set expects key=value with a dotted key, got {item!r}")
        _set_dotted(tree, key.strip(), _parse_override(key.strip(), raw, schema))
    _no_bools_for_numbers(tree, schema)
    try:
        return schema.model_validate(tree)
    except ValidationError as e:
        msgs = []
        for err in e.errors():
            key = ".".join(str(x) for x in err["loc"])
            # a validator's own ValueError, without pydantic's "Value error, " in front
            msg = str(err["ctx"]["error"]) if "error" in err.get("ctx", {}) else err["msg"]
            if not key:  # a rule across keys: its message names them
                msgs.append(msg)
                continue
            if err["type"] == "invalid_key" or err["loc"][-1] == "[key]":  # `1: x`, `null: x`, a date as a key
                where = ".".join(str(x) for x in err["loc"][: -2 if err["loc"][-1] == "[key]" else -1])
                msgs.append(
                    f"bad key {err['input']!r} {f'in {where!r}' if where else 'at the top level'}: a key "
                    f"must be a name (text); quote it in YAML to pass it as text"
                )
                continue
            what = "unknown config key" if err["type"] == "extra_forbidden" else "bad value for"
            msgs.append(
                f"{what} {key!r}: {msg}"
                + ("" if err["type"] == "extra_forbidden" else f" (got {err.get('input')!r})")
                + ("; quote it in YAML to pass it as text" if err["type"] == "string_type" else "")
            )
        raise ValueError("; ".join(msgs)) from None


def _no_bools_for_numbers(tree: dict, model: type[BaseModel], prefix: str = "") -> None:
    """pydantic reads YAML's `true` as 1 for a number field: `lr: true` is a mistake, not lr = 1.0."""
    for key, value in tree.items():
        field = model.model_fields.get(key) or next((f for f in model.model_fields.values() if f.alias == key), None)
        if field is None:
            continue  # an unknown key: validation names it
        ann = field.annotation
        if isinstance(value, dict) and isinstance(ann, type) and issubclass(ann, BaseModel):
            _no_bools_for_numbers(value, ann, f"{prefix}{key}.")
            continue
        items = value if isinstance(value, (list, tuple)) and get_origin(ann) in (tuple, list) else [value]
        if any(isinstance(v, bool) for v in items) and _numeric(ann):
            raise ValueError(f"bad value for {prefix + key!r}: Input should be a number, not a boolean (got {value!r})")


def _numeric(ann: Any) -> bool:
    """A number field (int, float, their optional forms, tuples or lists of them) that takes no bool."""
    if ann in (int, float):
        return True
    args = [a for a in get_args(ann) if a is not type(None) and a is not Ellipsis]
    if get_origin(ann) is Annotated:
        return _numeric(args[0])
    if get_origin(ann) in (Union, tuple, list) or type(ann).__name__ == "UnionType":
        return bool(args) and bool not in args and all(_numeric(a) for a in args)
    return False


def dotted(tree: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}, "c": {}} -> {"a.b": 1, "c": {}}: config keys as `--set` names them."""
    out = {}
    for k, v in tree.items():
        out |= dotted(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v}
    return out


def ignored_settings(cfg: RunConfig) -> list[str]:
    """Keys given (in the file or with `--set`) that another setting switches off, each with the reason:
    the run goes on without them and says so, instead of leaving a typo'd plan silently unapplied."""

    def given(section: BaseModel, prefix: str, names: tuple[str, ...], why: str) -> list[str]:
        return [f"{prefix}.{n} has no effect: {why}" for n in names if n in section.model_fields_set]

    out = []
    if not cfg.async_.enabled:
        out += given(
            cfg.async_, "async", ("max_staleness", "inflight_updates", "recompute_behaviour"), "async.enabled is false"
        )
    elif cfg.async_.max_staleness == 0:  # batch k starts once version k - 1 is out; version k needs batch k
        out += given(
            cfg.async_,
            "async",
            ("inflight_updates",),
            "async.max_staleness is 0, so no new weights come out while a batch is sampled",
        )
    if cfg.algorithm.kl.coef == 0:
        out += given(cfg.algorithm.kl, "algorithm.kl", ("kind", "where"), "algorithm.kl.coef is 0")
    if cfg.algorithm.overlong.buffer_len == 0:
        out += given(
            cfg.algorithm.overlong, "algorithm.overlong", ("penalty_factor",), "algorithm.overlong.buffer_len is 0"
        )
    if cfg.model.dtype == "float32":
        out += given(cfg.optim, "optim", ("fp32_master_weights",), "model.dtype is float32")
    if not cfg.rollout.filter_groups:
        out += given(cfg.rollout, "rollout", ("max_sampling_rounds",), "rollout.filter_groups is false")
    if cfg.optim.max_tokens_per_micro_batch is not None:
        out += given(cfg.optim, "optim", ("micro_batch_size",), "optim.max_tokens_per_micro_batch is set")
    if cfg.distributed.strategy == "ddp":
        out += given(cfg.distributed, "distributed", ("checkpoint",), "distributed.strategy is ddp")
    elif cfg.optim.shard_state:
        out.append("optim.shard_state has no effect: distributed.strategy is fsdp (AdamW's state is sharded)")
    if cfg.optim.lr_schedule == "constant":
        out += given(cfg.optim, "optim", ("min_lr_ratio",), "optim.lr_schedule is constant")
    if cfg.task.kind == "verifiers":
        out += given(cfg.task, "task", ("train_size",), "task.kind is verifiers: its taskset's tasks are the prompts")
    for name, tracker in (("wandb", cfg.logging.wandb), ("mlflow", cfg.logging.mlflow)):
        if not tracker.enabled:
            keys = tuple(n for n in type(tracker).model_fields if n != "enabled")
            out += given(tracker, f"logging.{name}", keys, f"logging.{name}.enabled is false")
    if cfg.model.path is not None:
        out += given(
            cfg.sft,
            "sft",
            ("steps", "batch_size", "lr", "echo_frac"),
            "model.path is set, and the SFT warm start is the default model's",
        )
    return out


from exactrl.train.config_docs import config_reference  # noqa: E402,F401  (docs/config.md's generator)
