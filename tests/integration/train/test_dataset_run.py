"""`exactrl train` on a dataset file: a Parquet file of chats with a column mapping, its extra columns in
the reward's `problem.meta`, a reward function from a file, and evaluation on its held-out rows."""

from __future__ import annotations

import pytest
from conftest import default_job_model, train_args, train_rows

from exactrl.cli import main

SMALL = [
    "progress=false",
    "tensorboard=false",
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=2",
    "engine.kv_budget_tokens=4096",
    "eval_every=1",
    "task.eval_size=3",
]

REWARD = """
def weighted(problem, completion):
    return problem.meta["weight"]
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return default_job_model(tmp_path_factory, sft_steps=0)


def test_a_run_trains_on_a_parquet_dataset_of_chats_with_a_reward_file(model_dir, tmp_path, capsys):
    """...and an edited reward file is another run: a resume is refused."""
    import datasets

    rows = [
        {"chat": [{"role": "user", "content": f"{a}+{b}="}], "sol": a + b, "weight": 0.25}
        for a in range(6)
        for b in range(5)
    ]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    (tmp_path / "reward.py").write_text(REWARD)
    got = train_rows(
        SMALL,
        model_dir,
        tmp_path / "run",
        f"task.dataset={tmp_path / 'd.parquet'}",
        "task.columns={messages: chat, answer: sol}",
        f"task.reward={tmp_path / 'reward.py'}:weighted",
        "max_steps=2",
    )
    assert [r["step"] for r in got] == [1, 2]
    assert all(r["rollout/reward_mean"] == 0.25 for r in got)  # the file's reward, from the meta column
    assert all(r["eval/accuracy"] == 0.0 for r in got)  # 0.25 is no correct answer
    args = [f"task.dataset={tmp_path / 'd.parquet'}", "task.columns={messages: chat, answer: sol}"]
    args.append(f"task.reward={tmp_path / 'reward.py'}:weighted")
    (tmp_path / "reward.py").write_text(REWARD.replace('["weight"]', '["weight"] * 2'))  # another reward
    assert main(train_args(SMALL, model_dir, tmp_path / "run", *args, "max_steps=3", "resume=true")) == 2
    assert "task.module_sha256" in capsys.readouterr().err


def test_a_bad_row_stops_the_run_before_it_starts(model_dir, tmp_path, capsys):
    (tmp_path / "d.jsonl").write_text('{"q": "1+1=", "a": "2"}\n{"q": "2+2=", "a": "four"}\n')
    argv = train_args(
        SMALL,
        model_dir,
        tmp_path / "run",
        f"task.dataset={tmp_path / 'd.jsonl'}",
        "task.columns={prompt: q, answer: a}",
    )
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "task.dataset: " in err and "d.jsonl:2: arithmetic problem '2+2=' has a non-integer answer 'four'" in err
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_from_before_the_dataset_keys_resumes(model_dir, tmp_path):
    import json

    from exactrl.train.checkpoint import latest_checkpoint

    d = tmp_path / "old"
    train_rows(SMALL, model_dir, d, "max_steps=1", "save_every=1", "task.eval_size=0")
    state_path = latest_checkpoint(d) / "state.json"
    state = json.loads(state_path.read_text())
    for key in ("dataset", "columns", "reward"):  # as a checkpoint written before the keys existed
        del state["config"]["task"][key]
    state_path.write_text(json.dumps(state))
    rows = train_rows(SMALL, model_dir, d, "max_steps=2", "resume=true", "task.eval_size=0")
    assert [r["step"] for r in rows] == [1, 2]
