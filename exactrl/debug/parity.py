"""Checks the exactness contract on a model and names the first op that breaks it.

Each check computes the logits of one target sequence along two paths that
must agree bitwise (docs/design.md §1):

  batch    alone  vs  packed inside a batch of other sequences (at an offset)
  padded   alone  vs  padded inside a batch
  decode   one full forward  vs  token-by-token decode against a paged cache
  chunked  one full forward  vs  chunked prefill (odd chunk sizes, shuffled pages)
  threads  1 thread  vs  2 threads

On a mismatch, forward hooks on every module record the target's rows on both
paths and the first module (in execution order) whose outputs differ is named.

Legend: N tokens, V vocabulary, L target length.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from exactrl.kernels import TokenLayout
from exactrl.model.logprobs import pack_layout
from exactrl.model.transformer import CausalLM
from exactrl.seeds import derive_seed


@dataclass
class CheckResult:
    name: str
    exact: bool
    max_abs_diff: float
    first_divergent_op: str | None = None  # module name, e.g. "model.layers.0.self_attn.o_proj"
    op_diff: float = 0.0


@dataclass
class _Recorder:
    """Collects, per module, the target's rows of every forward call."""

    rows: torch.Tensor | None = None  # rows of the current forward call that belong to the target
    outputs: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)

    def hook(self, name):
        return lambda _module, _inp, out: self.note(name, out)

    def note(self, name: str, out) -> None:
        if self.rows is None or not isinstance(out, torch.Tensor) or out.dim() == 0:
            return
        if name not in self.outputs:
            self.outputs[name] = []
            self.order.append(name)
        self.outputs[name].append(out.detach()[self.rows].clone())


def _forward(
    model: CausalLM, tokens: list[int], layout: TokenLayout, kv, rec: _Recorder | None, rows: torch.Tensor
) -> torch.Tensor:
    if rec is not None:
        rec.rows = rows
    hidden = model(torch.tensor(tokens, dtype=torch.int64), layout, kv)
    # the head over every row, the other sequences' beside the target's, as in the trainer's batches; it
    # is no module call (a tied head is the embedding), so it is noted by name
    logits = model.logits(hidden)
    if rec is not None:
        rec.note("logits", logits)
    return logits[rows]


def full_path(model, target, others=(), offset=0, pad_to=None, rec=None):
    """Target laid out with other sequences (packed) or alone; pad_to extends every sequence."""
    seqs = list(others[:offset]) + [list(target)] + list(others[offset:])
    if pad_to is not None:
        seqs = [s + [0] * (pad_to - len(s)) for s in seqs]
    lay, pages = pack_layout([len(s) for s in seqs], model.block_size)
    start = sum(len(s) for s in seqs[:offset])
    rows = torch.arange(start, start + len(target))
    return _forward(model, [t for s in seqs for t in s], lay, model.new_kv(pages), rec, rows)


def incremental_path(model, target, chunks, rec=None, seed=0):
    """Prefill in the given chunk sizes, then decode one token at a time, on shuffled pages."""
    B = model.block_size
    nb = -(-len(target) // B)
    pages = list(range(nb + 4))
    random.Random(seed).shuffle(pages)
    table = torch.tensor([pages[:nb]])
    kv = model.new_kv(nb + 4)
    out, i, sizes = [], 0, list(chunks)
    while i < len(target):
        c = min(sizes.pop(0) if sizes else 1, len(target) - i)
        lay = TokenLayout(torch.zeros(c, dtype=torch.int64), torch.arange(i, i + c), table)
        out.append(_forward(model, target[i : i + c], lay, kv, rec, torch.arange(c)))
        i += c
    return torch.cat(out)


def _first_divergence(a: _Recorder, b: _Recorder) -> tuple[str | None, float]:
    for name in a.order:
        if name not in b.outputs:
            continue
        x, y = torch.cat(a.outputs[name]), torch.cat(b.outputs[name])
        if x.shape == y.shape and not torch.equal(x, y):
            return name, (x.float() - y.float()).abs().max().item()
    return None, 0.0


def _record(model, path) -> _Recorder:
    rec = _Recorder()
    handles = [m.register_forward_hook(rec.hook(n)) for n, m in model.named_modules() if n]
    try:
        path(rec)
    finally:
        for h in handles:
            h.remove()
    return rec


def _compare(model, name, path_a, path_b) -> CheckResult:
    with torch.no_grad():
        la, lb = path_a(None), path_b(None)
        if torch.equal(la, lb):
            return CheckResult(name, True, 0.0)
        op, op_diff = _first_divergence(_record(model, path_a), _record(model, path_b))
        return CheckResult(name, False, (la - lb).abs().max().item(), op, op_diff)


def _threads(n, fn):
    def run(rec):
        old = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            return fn(rec)
        finally:
            torch.set_num_threads(old)

    return run


def run_parity(model: CausalLM, length: int = 80, seed: int = 0) -> list[CheckResult]:
    """Runs every check on random token sequences of the model's vocabulary."""
    if length < 1:
        raise ValueError(f"parity length must be >= 1, got {length}")
    rng = random.Random(seed)
    V = model.config.vocab_size
    length = min(length, model.config.context_length)
    target = [rng.randrange(V) for _ in range(length)]
    longer = min(length + 17, model.config.context_length)  # companions fit the context too
    others = [[rng.randrange(V) for _ in range(rng.randint(1, longer))] for _ in range(3)]
    short = target[:3]
    longest = max(len(o) for o in others + [target])
    with torch.no_grad():
        bad = int((~full_path(model, target).isfinite()).sum())
    if bad:  # NaN != NaN: every check said DIFFERS (max |Δ| nan), naming the first op that made a NaN
        raise ValueError(
            f"the model's logits are not finite ({bad} of {length * V} NaN or infinite on a random "
            f"sequence, in {str(model.dtype).removeprefix('torch.')}): its weights overflow, and "
            f"parity compares finite numbers"
        )
    checks = [
        ("batch", lambda r: full_path(model, target, rec=r), lambda r: full_path(model, target, others, 2, rec=r)),
        ("batch_short", lambda r: full_path(model, short, rec=r), lambda r: full_path(model, short, others, 1, rec=r)),
        (
            "padded",
            lambda r: full_path(model, target, rec=r),
            lambda r: full_path(model, target, others, 1, pad_to=longest, rec=r),
        ),
        ("decode", lambda r: full_path(model, target, rec=r), lambda r: incremental_path(model, target, [1], r)),
        (
            "chunked",
            lambda r: full_path(model, target, rec=r),
            lambda r: incremental_path(model, target, [5, 33, 17, 2], r, seed=1),
        ),
        (
            "threads",
            _threads(1, lambda r: full_path(model, target, others, 1, rec=r)),
            _threads(2, lambda r: full_path(model, target, others, 1, rec=r)),
        ),
    ]
    return [_compare(model, name, a, b) for name, a, b in checks]


def server_settings(base_url: str, served_model: str):
    """The external rollout backend's settings for `parity --server URL`; a ValueError naming --server when
    the URL is not a server root. Cheap: the CLI calls it before it loads the model."""
    from pydantic import ValidationError

    from exactrl.rollout.external import RolloutBackendSettings

    if base_url.rstrip("/").endswith("/v1"):
        raise ValueError(f"--server must be the server's root URL, without /v1: got {base_url!r}")
    try:
        return RolloutBackendSettings(kind="openai", base_url=base_url, model=served_model)
    except ValidationError as e:  # its message names rollout_backend's keys: here they are --server's
        raise ValueError(
            f"--server {base_url!r}: "
            + "; ".join(
                err["msg"].removeprefix("Value error, ").replace("rollout_backend.base_url", "it") for err in e.errors()
            )
        ) from None


def server_mismatch(
    model: CausalLM,
    base_url: str,
    served_model: str,
    prompts: int = 8,
    length: int = 32,
    max_tokens: int = 32,
    temperature: float = 1.0,
    seed: int = 0,
) -> dict[str, float]:
    """How far a rollout server's logprobs are from this trainer's, on the same weights (docs/design.md §9).

    `prompts` random token-id prompts of `length` tokens go to `base_url`'s /v1/completions (the
    external rollout backend's one dialect, rollout/external.py); the trainer scores the returned tokens
    with `sequence_logprobs` under the same sampling distribution. Returns the training loop's own
    mismatch keys (`train/train_rollout_logprob_abs_diff` and `_max`, `mismatch/k3`, `mismatch/ess`,
    ...) plus `parity/tokens`: 0.0 differences from an `exactrl serve --kernels exact` over the same
    weights, non-zero from any other engine (vLLM, SGLang, `--kernels fast`).
    """
    from exactrl.algo.diagnostics import logprob_diff_metrics, mismatch_metrics
    from exactrl.engine import SamplingParams
    from exactrl.model.logprobs import sequence_logprobs
    from exactrl.rollout.external import ExternalEngine

    if prompts < 1 or length < 1 or max_tokens < 1:
        raise ValueError(f"prompts, length and max_tokens must be >= 1, got {prompts}, {length}, {max_tokens}")
    if length + max_tokens > model.config.context_length:
        raise ValueError(
            f"length + max_tokens = {length + max_tokens} exceeds the model's context of "
            f"{model.config.context_length} tokens"
        )
    rng = random.Random(seed)
    V = model.config.vocab_size
    batch = [[rng.randrange(V) for _ in range(length)] for _ in range(prompts)]
    # prompt k samples with derive_seed(seed, k) (exactrl/seeds.py): any --seed fits the sampler
    params = [
        SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=derive_seed(seed, k), ignore_eos=True)
        for k in range(prompts)
    ]
    engine = ExternalEngine(server_settings(base_url, served_model))
    try:
        outs = [o[0] for o in engine.generate(batch, params)]
    finally:
        engine.close()
    bad = next((t for o in outs for t in o.token_ids if not 0 <= t < V), None)
    if bad is not None:  # the server holds another model (or vocabulary) than --model
        raise ValueError(
            f"--server {base_url!r} returned token id {bad}, outside --model's vocabulary [0, {V}): "
            f"it does not serve the weights given as --model"
        )
    seqs = [p + o.token_ids for p, o in zip(batch, outs)]
    trainer = sequence_logprobs(model, seqs, temperature or 1.0)
    T = max(1, max(len(o.token_ids) for o in outs))
    old_BT, behav_BT, mask_BT = torch.zeros(prompts, T), torch.zeros(prompts, T), torch.zeros(prompts, T)
    for k, (o, lp) in enumerate(zip(outs, trainer)):
        n = len(o.token_ids)
        old_BT[k, :n] = lp[length - 1 : length - 1 + n]
        behav_BT[k, :n] = torch.tensor(o.logprobs, dtype=torch.float32)
        mask_BT[k, :n] = 1.0
    return (
        logprob_diff_metrics(old_BT, behav_BT, mask_BT)
        | mismatch_metrics(old_BT, behav_BT, mask_BT)
        | {"parity/tokens": float(mask_BT.sum())}
    )
