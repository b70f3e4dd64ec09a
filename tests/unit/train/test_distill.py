"""On-policy distillation in the trainer (exactrl/train/distill.py): teacher scores, advantages, settings.

A teacher equal to the student gives zero reverse KL and zero advantage, bit for bit, on samples of the
exact engine; the teacher's scores do not depend on how the sequences are batched (with a `fast` twin that
shows they would); the vocabulary term equals the objective computed directly; bad settings are named.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from conftest import make_hf_model

import exactrl
from exactrl.algo.distill import vocab_divergence
from exactrl.distributed import Ranks
from exactrl.envs.base import Problem
from exactrl.model.logprobs import completion_log_probs
from exactrl.train.config import load_config
from exactrl.train.distill import Distiller, DistillSettings, ModelTeacher, build_distiller
from exactrl.train.trainer import TrainBatch


@pytest.fixture(scope="module")
def student(qwen3_dir):
    return exactrl.load_model(qwen3_dir).requires_grad_(False)


def rollouts(model, n_prompts=3, n=2, seed=0):
    """Rollout-shaped samples of the exact engine: problem, prompt ids, completion ids, μ."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 200) for _ in range(rng.randint(3, 7))] for _ in range(n_prompts)]
    engine = exactrl.Engine(model)
    try:
        outs = engine.generate(prompts, exactrl.SamplingParams(temperature=1.0, max_tokens=6, n=n, seed=seed))
    finally:
        engine.close()
    return [
        [
            SimpleNamespace(
                problem=Problem(f"p{k}", "a", {"source": "even" if k % 2 == 0 else "odd"}),
                prompt_ids=p,
                completion_ids=list(c.token_ids),
                behav_logprobs=list(c.logprobs),
            )
            for c in group
        ]
        for k, (p, group) in enumerate(zip(prompts, outs))
    ]


def batch_of(groups) -> TrainBatch:
    flat = [r for g in groups for r in g]
    return TrainBatch(
        prompt_ids=[r.prompt_ids for r in flat],
        completion_ids=[r.completion_ids for r in flat],
        behav_logprobs=[r.behav_logprobs for r in flat],
        advantages=[0.5] * len(flat),
    )


def distiller(model, **settings) -> Distiller:
    s = DistillSettings(teacher="self", **settings)
    task = SimpleNamespace(system_prompt=None, name="t")
    return build_distiller(s, model, None, task, 1.0, load=None)


def test_a_teacher_equal_to_the_student_gives_zero_reverse_kl_and_zero_advantage(student):
    groups = rollouts(student)
    batch, m = distiller(student).apply(groups, batch_of(groups), Ranks())
    assert m["distill/reverse_kl"] == 0.0
    assert m["distill/teacher_logprob_mean"] == m["distill/student_logprob_mean"] < 0
    assert all(a == 0.0 for row in batch.token_advantages for a in row)
    assert batch.advantages == [0.0] * len(batch)  # reward_coef 0: pure distillation


def test_reverse_kl_advantages_are_coef_times_teacher_minus_student(qwen3_dir, student, tmp_path):
    make_hf_model(tmp_path, "qwen3", seed=1)  # another teacher of the same shape
    teacher = exactrl.load_model(tmp_path).requires_grad_(False)
    groups = rollouts(student)
    d = Distiller(
        DistillSettings(teacher=str(tmp_path), coef=2.0, reward_coef=0.5),
        {"": ModelTeacher(teacher)},
        None,
        None,
        "t",
        1.0,
    )
    batch, m = d.apply(groups, batch_of(groups), Ranks())
    flat = [r for g in groups for r in g]
    for r, adv in zip(flat, batch.token_advantages):
        t, _ = exactrl.model.logprobs.token_logprobs(
            teacher, [r.prompt_ids + r.completion_ids], first=[len(r.prompt_ids)]
        )
        assert adv == (2.0 * (t[0] - torch.tensor(r.behav_logprobs))).tolist()
    assert batch.advantages == [0.25] * len(flat)
    assert m["distill/reverse_kl"] != 0.0


@pytest.mark.parametrize("kernels", ["exact", "fast"])
def test_teacher_scores_do_not_depend_on_the_batch(qwen3_dir, kernels):
    """Short sequences scored alone and among longer ones: the same bits in exact mode; the fast twin shows
    the batch changes them (its GEMM depends on the row count)."""
    teacher = ModelTeacher(exactrl.load_model(qwen3_dir, kernels=kernels).requires_grad_(False))
    rng = random.Random(0)
    same = []
    for _ in range(10):
        target = [rng.randrange(211) for _ in range(3)]
        others = [[rng.randrange(211) for _ in range(rng.randint(20, 60))] for _ in range(3)]
        alone = teacher.token_logprobs([target], [1], 1.0)[0]
        among = teacher.token_logprobs(others + [target], [1, 1, 1, 1], 1.0)[-1]
        same.append(torch.equal(alone, among))
    assert all(same) if kernels == "exact" else not all(same)


def test_the_privileged_prompt_is_the_template_over_the_problems_fields(student, tmp_path):
    tok = SimpleNamespace(apply_chat_template=lambda msgs, add_generation_prompt: [len(m["content"]) for m in msgs])
    d = Distiller(
        DistillSettings(teacher="self", privileged_context="{prompt} (answer: {answer}, {source})"),
        {},
        tok,
        "sys",
        "t",
        1.0,
    )
    p = Problem("2+2=", "4", {"source": "book"})
    assert d.teacher_prompt(p, [1, 2]) == [3, len("2+2= (answer: 4, book)")]
    with pytest.raises(ValueError, match=r"names 'level' but problem .* has only prompt, answer, source"):
        Distiller(
            DistillSettings(teacher="self", privileged_context="{level}"), {}, tok, None, "t", 1.0
        ).teacher_prompt(p, [1])


def test_several_teachers_are_picked_by_a_problem_field(student):
    a, b = ModelTeacher(student), ModelTeacher(student)
    d = Distiller(
        DistillSettings(teachers={"even": "x", "odd": "y"}, teacher_by="source"),
        {"even": a, "odd": b},
        None,
        None,
        "t",
        1.0,
    )
    groups = rollouts(student)
    assert [d.key(g[0].problem) for g in groups] == ["even", "odd", "even"]
    with pytest.raises(ValueError, match=r"no teacher for source='other'.*\['even', 'odd'\]"):
        d.key(Problem("q", "a", {"source": "other"}))


@pytest.mark.parametrize("kind", ["forward_kl", "jsd"])
def test_the_vocabulary_term_is_the_divergence_of_the_two_distributions(qwen3_dir, student, tmp_path, kind):
    make_hf_model(tmp_path, "qwen3", seed=2)
    teacher = exactrl.load_model(tmp_path).requires_grad_(False)
    groups = rollouts(student, n_prompts=2)
    d = Distiller(
        DistillSettings(teacher=str(tmp_path), kind=kind, top_k=7, beta=0.3),
        {"": ModelTeacher(teacher)},
        None,
        None,
        "t",
        1.0,
    )
    batch, _ = d.apply(groups, batch_of(groups), Ranks())
    T = max(len(c) for c in batch.completion_ids)
    got = d.vocab_term(student, batch, list(range(len(batch))), T)
    for k in range(len(batch)):
        seq, first = batch.prompt_ids[k] + batch.completion_ids[k], [len(batch.prompt_ids[k])]
        s = completion_log_probs(student, [seq], first)[0]
        t = completion_log_probs(teacher, [seq], first)[0]
        want = vocab_divergence(s, t, kind, 0.3, 7)
        assert torch.allclose(got[k, : len(want)], want, atol=1e-6)
        assert (got[k, len(want) :] == 0).all()
        assert (want > 0).any()


@pytest.mark.parametrize(
    "overrides, words",
    [
        (
            ["distill.teacher=initial", "distill.teacher_url=http://x"],
            "set one of distill.teacher, distill.teacher_url and distill.teachers, got distill.teacher and "
            "distill.teacher_url",
        ),
        (["distill.teacher_url=http://x", "distill.kind=jsd"], "needs the teacher's whole next-token distribution"),
        (["distill.teacher=initial", "distill.top_k=5"], "top_k applies to forward_kl and jsd"),
        (["distill.teacher=initial", "distill.coef=0"], "both 0"),
        (["distill.teacher=initial", "distill.privileged_context=see {0}"], "plain names"),
        (["distill.teacher=initial", "distill.beta=1"], "beta"),
    ],
)
def test_bad_distill_settings_are_named(overrides, words):
    with pytest.raises(ValueError, match=words):
        load_config(None, overrides)


def test_pure_distillation_takes_one_sample_per_prompt():
    load_config(None, ["distill.teacher=initial", "rollout.samples_per_prompt=1"])
    with pytest.raises(ValueError, match="samples_per_prompt=1"):
        load_config(None, ["distill.teacher=initial", "distill.reward_coef=1", "rollout.samples_per_prompt=1"])


def test_a_teacher_with_another_vocabulary_is_refused_naming_both(student, tmp_path):
    make_hf_model(tmp_path, "qwen3", vocab_size=300)
    s = DistillSettings(teacher=str(tmp_path))
    task = SimpleNamespace(system_prompt=None, name="t")
    with pytest.raises(ValueError, match=r"distill.teacher .* 300 tokens but the student's has 211"):
        build_distiller(s, student, None, task, 1.0, lambda path, where: exactrl.load_model(path))
