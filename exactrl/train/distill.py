"""On-policy distillation in a run (config section `distill`): teachers score the student's own samples.

    student samples (engine, exact)  ->  teacher logprobs of every sampled token  ->
        reverse_kl: a per-token advantage coef·(log π_t − log π_s) + reward_coef·A_seq  (algo/distill.py)
        forward_kl | jsd: coef × a divergence over the vocabulary in the loss, + reward_coef·A_seq

The student's logprob of a sampled token is μ, which in exact mode is π_old bit for bit. A teacher in the
process scores through the trainer's exact path (`token_logprobs`), so its scores do not depend on how the
sequences were batched; a teacher behind a URL is asked with `/v1/completions` (`echo`, `logprobs=0`), as
vLLM, SGLang and `exactrl serve` answer it.

Teachers: a model directory (any family `load_model` reads, sharing the student's vocabulary), `initial`
(the student's starting weights), `self` (the student itself, frozen for the step), or one directory per
task or per problem field (`teachers`, MOPD). `privileged_context` gives the teacher another user message
built from the problem's fields (self-distillation with the reference answer, OPSD); the student's sampled
tokens are scored after that prompt instead of the student's.
"""

from __future__ import annotations

import copy
import string
from dataclasses import dataclass
from typing import Literal, Protocol

import httpx
import torch
from pydantic import BaseModel, Field, model_validator

from exactrl.algo.distill import reverse_kl_advantages, vocab_divergence
from exactrl.argcheck import PathText
from exactrl.distributed import Ranks
from exactrl.envs.base import Problem
from exactrl.model.logprobs import completion_log_probs, token_logprobs
from exactrl.model.transformer import CausalLM
from exactrl.train.settings import _STRICT
from exactrl.train.trainer import TrainBatch

SPECIAL_TEACHERS = ("initial", "self")


class DistillSettings(BaseModel):
    model_config = _STRICT

    teacher: PathText | None = None
    """The teacher: a model directory (any family `load_model` reads; it may be larger than the student, and
    must share its vocabulary), `initial` (the student's starting weights) or `self` (the student, frozen for
    each step; with `privileged_context` this is self-distillation, OPSD). None and no `teacher_url` or
    `teachers`: no distillation."""
    teacher_url: str | None = None
    """An OpenAI-compatible server that scores the sampled tokens (`/v1/completions` with `echo` and
    `logprobs`); `reverse_kl` only. It must serve a model with the student's tokenizer."""
    teacher_model: str | None = None
    """The model name sent to `teacher_url`; None takes the first one its `/v1/models` lists."""
    teachers: dict[str, PathText] = Field(default_factory=dict)
    """Several teachers (MOPD): a model directory per value of `teacher_by`."""
    teacher_by: str = "task"
    """What picks a teacher from `teachers`: `task` (the run's task name) or the name of a problem field
    (a key of the problem's `meta`, e.g. a dataset column)."""
    kind: Literal["reverse_kl", "forward_kl", "jsd"] = "reverse_kl"
    """`reverse_kl`: per-token advantage log π_t − log π_s on the sampled token; `forward_kl`: KL(π_t‖π_s)
    over the vocabulary at each sampled position, in the loss; `jsd`: the generalised Jensen-Shannon
    divergence with `beta` (algo/distill.py)."""
    beta: float = Field(0.5, gt=0.0, lt=1.0)
    """`jsd`'s weight of the teacher in the mixture m = β π_t + (1 − β) π_s."""
    top_k: int | None = Field(None, ge=1)
    """`forward_kl`/`jsd`: only the teacher's k most likely tokens at each position, renormalised; None: the
    whole vocabulary."""
    coef: float = Field(1.0, ge=0.0)
    """Weight of the distillation term."""
    reward_coef: float = Field(0.0, ge=0.0)
    """Weight of the task reward's advantage: 0 = pure distillation (no reward needed); both > 0 = GRPO with
    distillation added (dGRPO)."""
    privileged_context: str | None = None
    """The user message the teacher sees instead of the prompt, as a template over the problem's fields:
    `{prompt}`, `{answer}` and every key of its `meta`, e.g. "{prompt}\\n(The answer is {answer}.)"."""

    @property
    def enabled(self) -> bool:
        return self.teacher is not None or self.teacher_url is not None or bool(self.teachers)

    @model_validator(mode="after")
    def _one_teacher(self) -> DistillSettings:
        given = [k for k in ("teacher", "teacher_url", "teachers") if getattr(self, k)]
        if len(given) > 1:
            raise ValueError(
                "set one of distill.teacher, distill.teacher_url and distill.teachers, got "
                + " and ".join(f"distill.{k}" for k in given)
            )
        if self.teacher_url is not None and self.kind != "reverse_kl":
            raise ValueError(
                f"distill.kind={self.kind} needs the teacher's whole next-token distribution, which a server "
                f"does not return: use distill.teacher (a model directory) or distill.kind=reverse_kl"
            )
        if self.top_k is not None and self.kind == "reverse_kl":
            raise ValueError("distill.top_k applies to forward_kl and jsd; reverse_kl scores the sampled token")
        if self.enabled and self.coef == 0 and self.reward_coef == 0:
            raise ValueError("distill.coef and distill.reward_coef are both 0: the step would train on nothing")
        if self.privileged_context is not None:
            try:
                fields = [f for _, f, _, _ in string.Formatter().parse(self.privileged_context) if f is not None]
            except ValueError as e:
                raise ValueError(f"distill.privileged_context is not a valid template: {e}") from None
            if any(not f.isidentifier() for f in fields):
                raise ValueError(
                    f"distill.privileged_context: fields must be plain names like {{answer}}, got {fields}"
                )
        return self


class Teacher(Protocol):
    def token_logprobs(self, seqs: list[list[int]], first: list[int], temperature: float) -> list[torch.Tensor]:
        """log π_t of seqs[k][first[k]:], each given its prefix."""


@dataclass
class ModelTeacher:
    """A teacher in this process: the trainer's exact path, so its scores do not depend on the batch."""

    model: CausalLM

    def token_logprobs(self, seqs, first, temperature):
        with torch.no_grad():
            return token_logprobs(self.model, seqs, temperature, -1, 1.0, first=first)[0]

    def vocab_log_probs(self, seqs, first, temperature):
        with torch.no_grad():
            return completion_log_probs(self.model, seqs, first, temperature)


class ServerTeacher:
    """A teacher behind an OpenAI-compatible `/v1/completions`: each sequence sent as token ids with `echo`,
    `logprobs=0` and one generated token; the prompt part of the answer's `token_logprobs` is the score."""

    def __init__(self, url: str, model: str | None, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.client = httpx.Client(timeout=timeout_s)
        try:
            self.model = model or self._first_model()
        except BaseException:
            self.client.close()
            raise

    def _get(self, path: str, body: dict | None = None) -> dict:
        try:
            r = self.client.post(self.url + path, json=body) if body is not None else self.client.get(self.url + path)
        except httpx.HTTPError as e:
            raise ValueError(
                f"distill.teacher_url {self.url}: cannot reach the teacher ({type(e).__name__}: {e})"
            ) from None
        if r.status_code != 200:
            raise ValueError(f"distill.teacher_url {self.url}{path} answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def _first_model(self) -> str:
        models = self._get("/v1/models").get("data") or []
        if not models:
            raise ValueError(f"distill.teacher_url {self.url} lists no model: set distill.teacher_model")
        return models[0]["id"]

    def token_logprobs(self, seqs, first, temperature):
        out = []
        for ids, f in zip(seqs, first):
            body = {
                "model": self.model,
                "prompt": list(ids),
                "max_tokens": 1,
                "echo": True,
                "logprobs": 0,
                "temperature": temperature,
                "top_p": 1.0,
            }
            got = (self._get("/v1/completions", body).get("choices") or [{}])[0].get("logprobs") or {}
            lps = got.get("token_logprobs") or []
            scored = lps[f : len(ids)]
            if len(lps) < len(ids) or any(not isinstance(x, (int, float)) for x in scored):
                raise ValueError(
                    f"distill.teacher_url {self.url}: the answer does not score every token of the sequence "
                    f"({len(lps)} logprobs for {len(ids)} tokens): the server must support `echo` with `logprobs`"
                )
            out.append(torch.tensor(scored, dtype=torch.float32))
        return out

    def close(self) -> None:
        self.client.close()


@dataclass
class Distiller:
    """The run's teachers and what they turn a batch into (`apply`), and the vocabulary loss term."""

    s: DistillSettings
    teachers: dict[str, Teacher]  # by teacher key ("" for a single teacher)
    tokenizer: object
    system_prompt: str | None
    task_name: str
    temperature: float

    def close(self) -> None:
        for t in self.teachers.values():
            if hasattr(t, "close"):
                t.close()

    def key(self, problem: Problem) -> str:
        if not self.s.teachers:
            return ""
        key = self.task_name if self.s.teacher_by == "task" else problem.meta.get(self.s.teacher_by)
        if key not in self.s.teachers:
            raise ValueError(
                f"distill.teachers has no teacher for {self.s.teacher_by}={key!r} (problem {problem.prompt!r:.60}): "
                f"it has {sorted(self.s.teachers)}"
            )
        return key

    def teacher_prompt(self, problem: Problem, prompt_ids: list[int]) -> list[int]:
        """The prompt the teacher scores the completion after: the student's, or the privileged one."""
        if self.s.privileged_context is None:
            return list(prompt_ids)
        try:
            text = self.s.privileged_context.format(prompt=problem.prompt, answer=problem.answer, **problem.meta)
        except (KeyError, IndexError) as e:
            raise ValueError(
                f"distill.privileged_context names {e} but problem {problem.prompt!r:.60} has only prompt, answer"
                f"{''.join(', ' + k for k in problem.meta)}"
            ) from None
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return self.tokenizer.apply_chat_template(
            msgs + [{"role": "user", "content": text}], add_generation_prompt=True
        )

    def score(self, rollouts: list, ranks: Ranks) -> tuple[list[torch.Tensor], list[list[int]], list[str]]:
        """(log π_t of each rollout's completion tokens, each one's teacher prompt, each one's teacher key); each
        rank scores its share and every rank gets every score."""
        prompts = [self.teacher_prompt(r.problem, r.prompt_ids) for r in rollouts]
        keys = [self.key(r.problem) for r in rollouts]
        mine = ranks.shard(len(rollouts))
        scores: dict[int, torch.Tensor] = {}
        for key in sorted({keys[k] for k in mine}):
            idx = [k for k in mine if keys[k] == key]
            seqs = [prompts[k] + list(rollouts[k].completion_ids) for k in idx]
            lps = self.teachers[key].token_logprobs(seqs, [len(prompts[k]) for k in idx], self.temperature)
            scores |= {k: lp.detach().float().clone() for k, lp in zip(idx, lps)}
        local = [scores[k] for k in mine]
        return ranks.gather_sharded(len(rollouts), local), prompts, keys

    def apply(self, groups: list[list], batch: TrainBatch, ranks: Ranks) -> tuple[TrainBatch, dict[str, float]]:
        """The batch with the distillation advantages (and the teacher's prompts for the vocabulary term), and
        the `distill/…` metrics over the sampled tokens."""
        flat = [r for g in groups for r in g]
        teacher, prompts, keys = self.score(flat, ranks)
        student = [torch.tensor(r.behav_logprobs, dtype=torch.float32) for r in flat]
        for k, (t, s) in enumerate(zip(teacher, student)):
            if t.shape != s.shape:
                raise ValueError(f"the teacher scored {len(t)} tokens of rollout {k}, which has {len(s)}")
        if self.s.kind == "reverse_kl":
            token_adv = [(self.s.coef * reverse_kl_advantages(t, s)).tolist() for t, s in zip(teacher, student)]
        else:
            token_adv = [[0.0] * len(s) for s in student]
        batch.advantages = [self.s.reward_coef * a for a in batch.advantages]
        batch.token_advantages = token_adv
        batch.teacher_prompt_ids = prompts
        batch.teacher_keys = keys
        t_all, s_all = torch.cat(teacher).double(), torch.cat(student).double()
        n = max(len(t_all), 1)
        return batch, {
            "distill/reverse_kl": float((s_all - t_all).sum() / n),
            "distill/teacher_logprob_mean": float(t_all.sum() / n),
            "distill/student_logprob_mean": float(s_all.sum() / n),
        }

    def vocab_term(self, model: CausalLM, batch: TrainBatch, idx: list[int], T: int) -> torch.Tensor:
        """[B, T] per-token `forward_kl` / `jsd` of the micro-batch `idx`, with the student's gradient."""
        first = [len(batch.prompt_ids[k]) for k in idx]
        seqs = [list(batch.prompt_ids[k]) + list(batch.completion_ids[k]) for k in idx]
        out = torch.zeros(len(idx), T)
        live = [r for r, k in enumerate(idx) if batch.completion_ids[k]]
        if not live:
            return out
        student = completion_log_probs(model, [seqs[r] for r in live], [first[r] for r in live], self.temperature)
        rows = dict(zip(live, student))
        keys = batch.teacher_keys or [""] * len(batch)
        for key in sorted({keys[idx[r]] for r in live}):
            mine = [r for r in live if keys[idx[r]] == key]
            tprompts = [batch.teacher_prompt_ids[idx[r]] for r in mine]
            tseqs = [tp + list(batch.completion_ids[idx[r]]) for tp, r in zip(tprompts, mine)]
            vocab = self.teachers[key].vocab_log_probs(tseqs, [len(tp) for tp in tprompts], self.temperature)
            for r, t_NV in zip(mine, vocab):
                d = vocab_divergence(rows[r], t_NV, self.s.kind, self.s.beta, self.s.top_k)
                out[r, : len(d)] = d
        return out


def build_distiller(
    s: DistillSettings, student: CausalLM, tokenizer, task, temperature: float, load, initial: CausalLM | None = None
) -> Distiller:
    """The run's Distiller. `load(path, where)` loads a teacher directory as the run loads its model (dtype,
    kernels, device); every teacher's vocabulary must be the student's. `initial`: the student's starting
    weights, frozen (the `initial` teacher; a copy of `student` when not given)."""
    teachers: dict[str, Teacher] = {}
    if s.teacher_url is not None:
        teachers[""] = ServerTeacher(s.teacher_url, s.teacher_model)
    elif s.teacher == "self":
        teachers[""] = ModelTeacher(student)
    elif s.teacher == "initial":
        teachers[""] = ModelTeacher(initial if initial is not None else copy.deepcopy(student).requires_grad_(False))
    else:
        named = {"": s.teacher} if s.teacher is not None else dict(s.teachers)
        for key, path in named.items():
            where = "distill.teacher" if key == "" else f"distill.teachers.{key}"
            model = load(path, where).requires_grad_(False)
            if model.config.vocab_size != student.config.vocab_size:
                raise ValueError(
                    f"{where} {path} has a vocabulary of {model.config.vocab_size} tokens but the student's has "
                    f"{student.config.vocab_size}: a teacher must share the student's tokenizer"
                )
            teachers[key] = ModelTeacher(model)
    return Distiller(s, teachers, tokenizer, task.system_prompt, task.name, temperature)
