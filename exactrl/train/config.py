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
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from exactrl.argcheck import PathText, PlainData
from exactrl.envs.settings import TaskSettings
from exactrl.kernels.rowwise import check_temperature
from exactrl.model.settings import ModelSettings
from exactrl.model.transformer import DEFAULT_BLOCK_SIZE
from exactrl.algo.advantages import ADVANTAGES, GROUP_BASELINE
from exactrl.rollout.external import RolloutBackendSettings

_STRICT = ConfigDict(extra="forbid", use_attribute_docstrings=True, populate_by_name=True, allow_inf_nan=False)


class RolloutSettings(BaseModel):
    model_config = _STRICT

    prompts_per_step: int = Field(32, ge=1, le=10**6)
    """Prompts sampled per training step (at most 1e6, as the step's rollouts are held in memory at once)."""
    samples_per_prompt: int = Field(8, ge=1)
    """Group size G: completions per prompt (the engine shares their prefill)."""
    max_tokens: int = Field(8, ge=1)
    """Completion length limit."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature (0 = greedy, else >= 1e-5); the trainer's logprobs use the same one."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus cut-off in (0, 1] (1 = off); logprobs are those of the truncated, renormalised distribution."""
    top_k: int = -1
    """top-k cut-off (-1 = off); logprobs are those of the truncated, renormalised distribution."""
    filter_groups: bool = False
    """DAPO's dynamic sampling (Yu et al. 2025, §3.2): a group whose task rewards are all equal has zero
    advantage under a group baseline (not `reinforce_pp`'s batch one; the KL and overlong shaping come
    after the filter) and only dilutes the batch, so it is set aside and another batch of
    `prompts_per_step` prompts is sampled, up to `max_sampling_rounds` batches in a step, until
    `prompts_per_step` groups with differing rewards are found; a step that runs out of rounds fills up
    with the set-aside groups. Synchronous loop only."""
    max_sampling_rounds: int = Field(3, ge=1)
    """With `filter_groups`: the most batches sampled in one step (verl's `max_num_gen_batches`)."""

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or not -1 <= v < 2**63:  # the engine's rule (SamplingParams), checked before the run starts
            raise ValueError(f"must be -1 (off) or in [1, 2**63), got {v}")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        check_temperature(v)  # the engine's and the trainer's rule, checked before the run starts
        return v


class EngineSettings(BaseModel):
    model_config = _STRICT

    kv_budget_tokens: int = Field(65536, ge=1)
    """KV cache size in tokens, allocated once, in whole pages of 32; one sequence (a prompt and its
    rollout.max_tokens answer) must fit, and more run at once the larger it is."""
    max_num_seqs: int = Field(256, ge=1)
    """Most sequences decoded in one step."""
    max_num_batched_tokens: int = Field(4096, ge=1)
    """Per-step token budget shared by prefill chunks and decodes."""
    decode_graphs: bool = True
    """Replay recorded decode steps (exact fp32 kernels; the same bits, less Python per step); false runs
    every step eagerly, as a model changed with ops a replay cannot repeat needs."""


class KLSettings(BaseModel):
    model_config = _STRICT

    coef: float = Field(0.0, ge=0.0)
    """Weight of KL(π_θ‖π_ref); 0 disables the reference model entirely."""
    kind: Literal["k1", "k2", "k3"] = "k3"
    """Schulman's estimator (rl/kl.py). In the loss, k1's expected gradient is 0, k2's is the reverse KL's,
    k3's the forward KL's; π_ref is taken at the sampling temperature without top-k/top-p."""
    where: Literal["loss", "reward"] = "loss"
    """`loss`: added to the loss per token; `reward`: subtracted from the sequence reward."""


class OverlongSettings(BaseModel):
    model_config = _STRICT

    mask_truncated: bool = False
    """Leave completions cut at `rollout.max_tokens` out of the loss (DAPO's overlong filtering; TRL's
    `mask_truncated_completions`): an unfinished answer teaches nothing either way. They still count in
    their group's advantage baseline and in the rollout metrics."""
    buffer_len: int = Field(0, ge=0)
    """DAPO's soft overlong punishment over the last `buffer_len` tokens before `rollout.max_tokens`
    (rl/rollout.py `overlong_penalty`); 0 = off."""
    penalty_factor: float = Field(1.0, ge=0.0)
    """Penalty at `rollout.max_tokens` tokens; it grows linearly from 0 across the buffer."""


class AlgorithmSettings(BaseModel):
    model_config = _STRICT

    advantage: str = "grpo"
    """grpo | dr_grpo | rloo | reinforce_pp | reinforce_pp_baseline."""
    advantage_kwargs: PlainData = Field(default_factory=dict)
    """e.g. {normalize_std: false} for GRPO without std normalisation."""
    loss: str = "ppo"
    """ppo | gspo | cispo | reinforce | sapo | topr."""
    loss_kwargs: PlainData = Field(default_factory=dict)
    """e.g. {eps_low: 0.2, eps_high: 0.28, dual_clip: 3.0} for PPO."""
    agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant-normalised"] = "token-mean"
    """How per-token losses become one number (rl/aggregation.py), over the step's whole batch: `token-mean`
    divides by its loss-mask tokens, `seq-mean-token-mean` averages each sequence over its own tokens and
    divides by its sequences, `seq-mean-token-sum` divides by its sequences, `constant-normalised` (Dr.GRPO)
    by rollout.max_tokens x its sequences."""
    kl: KLSettings = Field(default_factory=KLSettings)
    entropy_coef: float = 0.0
    """Entropy bonus weight (subtracted from the loss)."""
    corrections: list[PlainData] = Field(default_factory=list)
    """Off-policy corrections, each {name: ..., **kwargs}; empty for synchronous exact training."""
    overlong: OverlongSettings = Field(default_factory=OverlongSettings)
    """What a completion that hits the length limit gets: by default its task reward, like any other."""
    bypass: bool = False
    """Take the loss ratio against μ (the engine's logprobs) instead of π_old: π_θ/μ, no proximal policy."""


class OptimSettings(BaseModel):
    model_config = _STRICT

    lr: float = Field(5e-5, gt=0)
    """AdamW learning rate (after `warmup_steps`)."""
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.99)
    """AdamW's (β1, β2), each in [0, 1)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW's decoupled weight decay."""
    grad_clip: float = Field(1.0, gt=0)
    """Max global gradient norm."""
    micro_batch_size: int = Field(64, ge=1)
    """Sequences per forward/backward; gradients accumulate over the step's batch."""
    max_tokens_per_micro_batch: int | None = Field(None, ge=1)
    """Micro-batches by tokens instead of sequences: consecutive sequences while their prompt + completion
    tokens fit this budget (`micro_batch_size` then has no effect); a sequence longer than the budget is
    a micro-batch of its own. The loss denominators are the whole batch's either way (rl/trainer.py
    `micro_batches`). null: `micro_batch_size` sequences per micro-batch."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute activations in the backward instead of keeping them (rl/activation_ckpt.py): `full`
    checkpoints every decoder layer, `selective` every layer's MLP (its 3 x [tokens, intermediate]
    tensors). The same loss and gradients bit for bit, less peak memory, one more forward (`full`) or
    MLP forward (`selective`) per step. The engine never recomputes."""
    share_prompts: bool = True
    """Lay the prompt of a micro-batch's samples of one prompt out once in the trainer's forward (its
    whole KV pages; `model/logprobs.py` `pack_shared`): the same logprob bits, fewer rows to compute."""
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear learning-rate warm-up from 0 (0 = none)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """The learning rate after the warm-up: `constant`, or decaying from `lr` towards `min_lr_ratio` x
    `lr` at `max_steps` (rl/setup.py `scheduled_lr`; as Hugging Face's schedulers, the last step's is
    still above it). A resume with another `max_steps` takes the new length's schedule from its next
    step on (the rate jumps to it)."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Where `linear` and `cosine` decay to, as a fraction of `lr` (verl's `min_lr_ratio`)."""
    fp32_master_weights: bool = True
    """With `model.dtype: bfloat16`: AdamW steps fp32 copies of the weights and rounds them into the bf16
    model after each step (rl/master_weights.py; the engine and trainer still share the bf16 bits). false
    steps the bf16 weights themselves, where an update under half a bf16 spacing is lost (most of them
    at RL's learning rates). The default job's SFT warm start follows it too. No effect in float32."""
    shard_state: bool = False
    """Data-parallel runs (`--nproc N`): each rank keeps the AdamW moments of its share of the
    parameters only (ZeRO stage 1; 2x the parameters' memory split over the ranks). The weights are
    bitwise those of the unsharded run and checkpoints are the same; no effect in one process."""


class AsyncSettings(BaseModel):
    model_config = _STRICT

    enabled: bool = False
    """Generate the next batches on a second thread while the trainer trains (rl/async_loop.py)."""
    max_staleness: int = Field(1, ge=0)
    """Largest policy-version lag of a trained token; the rollout thread runs at most this many steps
    ahead. 0 reproduces the synchronous loop bit for bit. Above 0, a resumed run's first batches are
    fresher than the uninterrupted run's (the batches sampled ahead are not saved): it goes on from the
    trained data position, not bit for bit."""
    inflight_updates: bool = False
    """Apply new weights between engine steps, inside a batch (tokens of one sequence may then come
    from several versions, each recorded)."""
    recompute_behaviour: bool = True
    """Keep the weights of the versions in the staleness window and recompute μ with them
    (`async/behaviour_recompute_abs_diff_max`: 0.0 in exact mode). Costs one forward per version."""


class SFTSettings(BaseModel):
    model_config = _STRICT

    steps: int = Field(300, ge=0)
    """Supervised warm-start steps for the default job's model (cached by config hash)."""
    batch_size: int = Field(64, ge=1)
    """Demonstrations per SFT step."""
    lr: float = Field(1e-3, gt=0)
    """SFT learning rate (AdamW)."""
    echo_frac: float = Field(0.55, ge=0.0, le=1.0)
    """Fraction of demonstrations that restate the question before the answer ("3+9=12"). The reward
    takes the first integer, so an echo scores 0: the warm-started model knows the sums but often
    answers in the wrong form, and GRPO has to find the form that is rewarded (RL sharpens what
    the model can already do, as in RL from verifiable rewards on a pretrained model)."""


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
    progress: bool = True
    """A live progress bar on a terminal; with stdout a pipe or a file, one plain line of figures per step.
    false: each step's figures as one line of JSON."""
    tensorboard: bool = True
    """Also write the metrics as TensorBoard events in run_dir."""
    model: ModelSettings = Field(default_factory=ModelSettings)
    task: TaskSettings = Field(default_factory=TaskSettings)
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    rollout_backend: RolloutBackendSettings = Field(default_factory=RolloutBackendSettings)
    """Who samples the rollouts: the in-process engine (exact) or an external OpenAI-compatible server."""
    algorithm: AlgorithmSettings = Field(default_factory=AlgorithmSettings)
    optim: OptimSettings = Field(default_factory=OptimSettings)
    sft: SFTSettings = Field(default_factory=SFTSettings)
    async_: AsyncSettings = Field(default_factory=AsyncSettings, alias="async")
    """Asynchronous rollouts (config key `async`)."""

    @model_validator(mode="after")
    def _samples_fit_the_engine(self) -> "RunConfig":
        # the n samples of a prompt share its prefill and run together: the engine must hold them at once
        exactrl_engines = self.rollout_backend.kind in ("engine", "ray")  # built from `engine`'s settings
        if exactrl_engines and self.rollout.samples_per_prompt > self.engine.max_num_seqs:
            raise ValueError(f"rollout.samples_per_prompt={self.rollout.samples_per_prompt} exceeds "
                             f"engine.max_num_seqs={self.engine.max_num_seqs}: raise engine.max_num_seqs")
        pages = -(-self.engine.kv_budget_tokens // DEFAULT_BLOCK_SIZE)  # the pool holds whole pages
        if exactrl_engines and pages * DEFAULT_BLOCK_SIZE <= self.rollout.max_tokens:  # no prompt would ever fit
            raise ValueError(f"engine.kv_budget_tokens={self.engine.kv_budget_tokens} ({pages * DEFAULT_BLOCK_SIZE} "
                             f"tokens in pages of {DEFAULT_BLOCK_SIZE}) cannot hold a prompt and "
                             f"rollout.max_tokens={self.rollout.max_tokens} answer tokens: raise engine.kv_budget_tokens")
        ray = self.rollout_backend.ray
        if self.rollout_backend.kind == "ray" and ray.num_engines > self.rollout.prompts_per_step:
            # an engine samples whole prompts (all n samples of one): the extra engines would hold CPUs, idle
            raise ValueError(f"rollout_backend.ray.num_engines={ray.num_engines} exceeds rollout.prompts_per_step="
                             f"{self.rollout.prompts_per_step}: each engine samples whole prompts, so "
                             f"{ray.num_engines - self.rollout.prompts_per_step} would never sample; lower "
                             f"num_engines or raise prompts_per_step")
        if self.resume and self.run_dir is None:
            raise ValueError("resume=true needs run_dir: the directory of the run to continue "
                             "(--set run_dir=runs/<its name>)")
        a, rb = self.async_, self.rollout_backend
        if a.enabled and rb.kind == "openai" and rb.weight_sync == "none" and self.max_steps > a.max_staleness + 1:
            # every token of a server that keeps its starting weights is version 0: from step max_staleness + 2
            # on, drop_stale finds every sample too stale and the run would stop there, half done
            raise ValueError(f"async.enabled with rollout_backend.weight_sync=none: the server keeps its starting "
                             f"weights, so from step {a.max_staleness + 2} every sample is staler than "
                             f"async.max_staleness={a.max_staleness} and the run would stop there, short of "
                             f"max_steps={self.max_steps}; use rollout_backend.weight_sync=disk, or the synchronous "
                             f"loop (async.enabled=false)")
        if self.rollout.filter_groups and self.rollout.samples_per_prompt == 1:
            raise ValueError("rollout.filter_groups with rollout.samples_per_prompt=1: a group of one sample has "
                             "no rewards to differ, so every group would be set aside; raise samples_per_prompt")
        if self.rollout.samples_per_prompt == 1 and self.algorithm.advantage in GROUP_BASELINE:
            working = sorted(set(ADVANTAGES) - GROUP_BASELINE)
            raise ValueError(f"rollout.samples_per_prompt=1 with algorithm.advantage={self.algorithm.advantage}: "
                             f"its baseline is the sample's own group, so every advantage, the loss and its "
                             f"gradient would be 0 and nothing would train; raise samples_per_prompt, or use an "
                             f"estimator that works with one sample per prompt ({', '.join(working)})")
        if self.rollout.filter_groups and a.enabled:
            raise ValueError("rollout.filter_groups with async.enabled: the asynchronous loop's rollout thread "
                             "samples fixed batches ahead; use the synchronous loop (async.enabled=false)")
        if self.algorithm.overlong.buffer_len > self.rollout.max_tokens:
            raise ValueError(f"algorithm.overlong.buffer_len={self.algorithm.overlong.buffer_len} exceeds "
                             f"rollout.max_tokens={self.rollout.max_tokens}: the buffer is the last tokens before it")
        return self


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ValueError(f"config key {dotted!r}: {k!r} is not a section")
    node[keys[-1]] = value


def _is_str_field(dotted: str) -> bool:
    """Whether the dotted key names a `str` or `str | None` field, PathText too (keys inside free-form dicts do not)."""
    node: Any = RunConfig
    for k in dotted.split("."):
        if not (isinstance(node, type) and issubclass(node, BaseModel)):
            return False
        field = next((f for n, f in node.model_fields.items() if k in (n, f.alias)), None)
        if field is None:
            return False
        node = field.annotation
    kinds = {get_args(a)[0] if get_origin(a) is Annotated else a  # PathText is an Annotated str
             for a in (get_args(node) if get_origin(node) in (Union, UnionType) else (node,))}
    return bool(kinds) and kinds <= {str, type(None)} and str in kinds


def _parse_override(key: str, raw: str) -> Any:
    """A --set value parsed as YAML; for a string field, a number or date keeps the text as typed.

    So `run_dir=2024-01-01` and `rollout_backend.model=007` mean what they say. true/false and
    null are not turned into text: a string field refuses a bool, and null means None.
    """
    try:
        value = _yaml_load(raw)
    except yaml.YAMLError as e:
        raise ValueError(f"--set {key}: not valid YAML ({_yaml_problem(e)}): {raw!r:.80}; "
                         f"quote the value if it is meant as text") from None
    if isinstance(value, (int, float, date)) and not isinstance(value, bool) and _is_str_field(key):
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
        raise ValueError(f"config file {p} must hold a mapping of settings at the top level, got "
                         f"{type(tree).__name__} {tree!r:.40}")
    return tree


def _yaml_load(text: str) -> Any:
    """YAML's safe load with `_UniqueKeyLoader`; nesting deeper than Python's recursion limit (`[[[[...`) is a
    YAMLError like any other malformed input, not a RecursionError."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except RecursionError:
        raise yaml.YAMLError("lists or mappings nested too deeply") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):  # `? [a, b]`: yaml's own check refuses it ("found unhashable key")
                break
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} appears twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """YAML file (optional) + `key=value` overrides -> validated RunConfig."""
    tree = _load_file(Path(path)) if path is not None else {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        if any(not part.strip() for part in key.split(".")):  # "=1", "a..b", "a.": no key to name
            raise ValueError(f"--set expects key=value with a dotted key, got {item!r}")
        _set_dotted(tree, key.strip(), _parse_override(key.strip(), raw))
    _no_bools_for_numbers(tree, RunConfig)
    try:
        return RunConfig.model_validate(tree)
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
                where = ".".join(str(x) for x in err["loc"][:-2 if err["loc"][-1] == "[key]" else -1])
                msgs.append(f"bad key {err['input']!r} {f'in {where!r}' if where else 'at the top level'}: a key "
                            f"must be a name (text); quote it in YAML to pass it as text")
                continue
            what = "unknown config key" if err["type"] == "extra_forbidden" else "bad value for"
            msgs.append(f"{what} {key!r}: {msg}" + ("" if err["type"] == "extra_forbidden"
                                                         else f" (got {err.get('input')!r})")
                        + ("; quote it in YAML to pass it as text" if err["type"] == "string_type" else ""))
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
        out += given(cfg.async_, "async", ("max_staleness", "inflight_updates", "recompute_behaviour"),
                     "async.enabled is false")
    elif cfg.async_.max_staleness == 0:  # batch k starts once version k - 1 is out; version k needs batch k
        out += given(cfg.async_, "async", ("inflight_updates",),
                     "async.max_staleness is 0, so no new weights come out while a batch is sampled")
    if cfg.algorithm.kl.coef == 0:
        out += given(cfg.algorithm.kl, "algorithm.kl", ("kind", "where"), "algorithm.kl.coef is 0")
    if cfg.algorithm.overlong.buffer_len == 0:
        out += given(cfg.algorithm.overlong, "algorithm.overlong", ("penalty_factor",),
                     "algorithm.overlong.buffer_len is 0")
    if cfg.model.dtype == "float32":
        out += given(cfg.optim, "optim", ("fp32_master_weights",), "model.dtype is float32")
    if not cfg.rollout.filter_groups:
        out += given(cfg.rollout, "rollout", ("max_sampling_rounds",), "rollout.filter_groups is false")
    if cfg.optim.max_tokens_per_micro_batch is not None:
        out += given(cfg.optim, "optim", ("micro_batch_size",), "optim.max_tokens_per_micro_batch is set")
    if cfg.optim.lr_schedule == "constant":
        out += given(cfg.optim, "optim", ("min_lr_ratio",), "optim.lr_schedule is constant")
    if cfg.model.path is not None:
        out += given(cfg.sft, "sft", ("steps", "batch_size", "lr", "echo_frac"),
                     "model.path is set, and the SFT warm start is the default model's")
    return out


from exactrl.train.config_docs import config_reference  # noqa: E402,F401  (docs/config.md's generator)
