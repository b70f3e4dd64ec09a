"""`exactrl train` with on-policy distillation: a teacher directory, a teacher behind `exactrl serve`, and
self-distillation with privileged context; the student's logprobs stay the trainer's bit for bit."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from conftest import default_job_model, train_rows

import exactrl
from exactrl.server.app import ServerThread, build_state, create_app
from exactrl.train.distill import ModelTeacher, ServerTeacher

SMALL = [
    "progress=false",
    "tensorboard=false",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=2",
    "task.eval_size=0",
    "optim.lr=1e-3",
    "max_steps=3",
]
TIMING = ("time/", "perf/tokens_per_s")


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    return default_job_model(tmp_path_factory, sft_steps=5)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return default_job_model(tmp_path_factory, sft_steps=40)  # the same tokenizer, more warm-start steps


@contextlib.contextmanager
def serving(model_dir):
    state = build_state(str(model_dir), kv_budget_tokens=8192)
    with ServerThread(create_app(state)) as thread:
        yield thread.url, state


def check_exact(rows: list[dict]) -> None:
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["train/train_rollout_logprob_abs_diff"] == 0.0 == r["train/train_rollout_logprob_abs_diff_max"]
        assert {"distill/reverse_kl", "distill/teacher_logprob_mean", "distill/student_logprob_mean"} <= set(r)


def test_a_teacher_directory_distils_exactly(student_dir, teacher_dir, tmp_path):
    rows = train_rows(SMALL, student_dir, tmp_path / "run", f"distill.teacher={teacher_dir}")
    check_exact(rows)
    assert rows[0]["distill/reverse_kl"] != 0.0 and rows[0]["train/grad_norm"] > 0


def test_the_students_own_start_as_teacher_gives_zero_reverse_kl(student_dir, tmp_path):
    rows = train_rows(SMALL, student_dir, tmp_path / "run", f"distill.teacher={student_dir}", "distill.reward_coef=1")
    check_exact(rows)
    assert rows[0]["distill/reverse_kl"] == 0.0
    assert rows[0]["distill/teacher_logprob_mean"] == rows[0]["distill/student_logprob_mean"]


def test_a_served_teacher_scores_as_the_teacher_in_process(teacher_dir):
    rng = random.Random(0)
    seqs = [[rng.randrange(1, 200) for _ in range(rng.randint(5, 30))] for _ in range(6)]
    first = [rng.randint(1, len(s)) for s in seqs]
    local = ModelTeacher(exactrl.load_model(teacher_dir)).token_logprobs(seqs, first, 1.0)
    with serving(teacher_dir) as (url, _):
        remote = ServerTeacher(url, None)
        try:
            got = remote.token_logprobs(seqs, first, 1.0)
        finally:
            remote.close()
    assert all(torch.equal(a, b) for a, b in zip(local, got))


def test_a_run_with_a_served_teacher_is_the_run_with_the_teacher_in_process(student_dir, teacher_dir, tmp_path):
    here = train_rows(SMALL, student_dir, tmp_path / "here", f"distill.teacher={teacher_dir}")
    with serving(teacher_dir) as (url, _):
        there = train_rows(SMALL, student_dir, tmp_path / "there", f"distill.teacher_url={url}")
    for a, b in zip(here, there):
        assert {k: v for k, v in a.items() if not k.startswith(TIMING)} == {
            k: v for k, v in b.items() if not k.startswith(TIMING)
        }


@pytest.mark.parametrize("kind", ["reverse_kl", "jsd"])
def test_self_distillation_with_the_reference_answer(student_dir, tmp_path, kind):
    rows = train_rows(
        SMALL,
        student_dir,
        tmp_path / "run",
        "distill.teacher=self",
        f"distill.kind={kind}",
        'distill.privileged_context="{prompt} (the answer is {answer})"',
    )
    check_exact(rows)
    assert rows[0]["distill/reverse_kl"] != 0.0  # the answer in the prompt changes the teacher's view


def test_a_missing_teacher_directory_is_named_before_anything_loads(student_dir, tmp_path, capsys):
    from exactrl.cli import main

    code = main(["train", "--set", f"model.path={student_dir}", "--set", f"distill.teacher={tmp_path / 'nope'}"])
    assert code == 2
    assert "distill.teacher" in capsys.readouterr().err
