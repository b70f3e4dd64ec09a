"""Long rollouts end to end: 8,192-token completions through a KV budget that cannot hold them all at once.

The default job's tiny Qwen3 (its context widened: RoPE has no learned positions) samples two
completions of a prompt (1,024 tokens; 8,192 in the slow tier) with `rollout.ignore_eos`, so both run to
`rollout.max_tokens`. The KV pool holds one whole sequence and an eighth more, so the younger one is
preempted mid-answer and resumed by recomputing its prompt and tokens so far in chunks of
`engine.max_num_batched_tokens` (an eighth of the length); the trainer takes each sequence as a
micro-batch of its own (`optim.max_tokens_per_micro_batch`) with activation checkpointing. The step's
logprobs must still equal the engine's bit for bit.
"""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import default_job_model, train_rows

from exactrl.engine import scheduler as S

LONG = 8192


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("long-context")
    shutil.copytree(default_job_model(tmp_path_factory, sft_steps=20), d, dirs_exist_ok=True)
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 2 * LONG
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize(
    "length",
    [
        1024,  # the same path at a length the fast tier affords
        pytest.param(LONG, marks=[pytest.mark.slow, pytest.mark.timeout(1200)]),  # about 2 minutes on two cores
    ],
)
def test_long_completions_run_through_preemption_and_chunked_prefill(long_model_dir, tmp_path, monkeypatch, length):
    chunks = []  # (length, whether it reached the sequence's last token) of every scheduled chunk
    schedule = S.Scheduler.schedule

    def spy(self):
        out = schedule(self)
        chunks.extend((c.length, c.samples) for c in out.chunks)
        return out

    monkeypatch.setattr(S.Scheduler, "schedule", spy)
    step_tokens = length // 8
    rows = train_rows(
        [
            "progress=false",
            "tensorboard=false",
            "logging.samples=0",
            "task.eval_size=0",
            "max_steps=1",
            "rollout.prompts_per_step=1",
            "rollout.samples_per_prompt=2",
            f"rollout.max_tokens={length}",
            "rollout.ignore_eos=true",
            f"engine.kv_budget_tokens={length + step_tokens}",  # one whole sequence, not two
            f"engine.max_num_batched_tokens={step_tokens}",
            f"optim.max_tokens_per_micro_batch={length + 256}",  # one sequence per micro-batch
            "optim.activation_checkpointing=full",
        ],
        long_model_dir,
        tmp_path / "run",
    )
    (row,) = [r for r in rows if r["step"] == 1]
    assert row["rollout/response_len_mean"] == row["rollout/response_len_max"] == length  # every completion
    assert row["rollout/truncated_frac"] == 1.0
    assert row["rollout/preemptions"] >= 1
    assert row["train/train_rollout_logprob_abs_diff"] == 0.0
    assert row["train/train_rollout_logprob_abs_diff_max"] == 0.0
    # a resumed sequence's tokens so far came back in prefill chunks of the step's budget
    assert sum(1 for n, samples in chunks if n == step_tokens and not samples) >= 2
