"""`exactrl eval` end to end on the default job's tiny model: pass@k and mean@k of the task's held-out
problems and of a dataset, the same figures through `exactrl serve`, and bad input named in one line."""

from __future__ import annotations

import json

import pytest
from conftest import default_job_model

from exactrl.cli import main
from exactrl.envs import ArithmeticTask, Problem
from exactrl.envs.dataset import held_out_problems
from exactrl.train.evaluate import pass_at_k

FLAGS = ["--k", "2", "--n", "3", "--size", "12", "--max-tokens", "6"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return default_job_model(tmp_path_factory, sft_steps=5)


def run_eval(tmp_path, *argv: str, name: str = "out.json") -> dict:
    out = tmp_path / name
    assert main(["eval", *argv, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_eval_scores_the_held_out_problems_and_does_not_depend_on_the_batch(model_dir, tmp_path, capsys):
    result = run_eval(tmp_path, "--model", str(model_dir), *FLAGS)
    task = ArithmeticTask()
    problems = held_out_problems(task, 12, 0)  # a training run's evaluation set with seed 0, eval_size 12
    assert [p["prompt"] for p in result["per_problem"]] == [p.prompt for p in problems]
    assert result["problems"] == len(problems) and result["k"] == 2 and result["n"] == 3
    for row, p in zip(result["per_problem"], problems):
        assert len(row["completions"]) == 3
        assert row["rewards"] == [task.reward(p, text) for text in row["completions"]]
    correct = [sum(r >= 1.0 for r in row["rewards"]) for row in result["per_problem"]]
    assert result["pass@1"] == pytest.approx(sum(c / 3 for c in correct) / len(correct))
    assert result["pass@2"] == pytest.approx(sum(pass_at_k(3, c, 2) for c in correct) / len(correct))
    assert result["mean@2"] == pytest.approx(sum(sum(r["rewards"]) / 3 for r in result["per_problem"]) / len(correct))
    table = capsys.readouterr().out
    assert "pass@1" in table and "pass@2" in table and "mean@2" in table and f"{result['pass@2']:.4f}" in table
    again = run_eval(tmp_path, "--model", str(model_dir), *FLAGS, "--batch", "5", name="again.json")
    assert again == result


REWARD = """
def first_char(problem, completion):
    return completion.strip()[:1] == problem.answer[:1]
"""


def test_eval_on_a_parquet_dataset_with_columns_and_a_reward_file(model_dir, tmp_path):
    import datasets

    from exactrl.envs.dataset import held_out

    rows = [{"q": f"{a}+{b}=", "sol": str(a + b), "src": "t"} for a in range(5) for b in range(3)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    (tmp_path / "r.py").write_text(REWARD)
    argv = [
        "--model",
        str(model_dir),
        "--k",
        "2",
        "--n",
        "3",
        "--max-tokens",
        "6",
        "--dataset",
        str(tmp_path / "d.parquet"),
    ]
    argv += ["--columns", "prompt=q", "--columns", "answer=sol"]
    result = run_eval(tmp_path, *argv)  # every row
    assert [r["prompt"] for r in result["per_problem"]] == [r["q"] for r in rows]
    custom = run_eval(tmp_path, *argv, "--size", "12", "--reward", f"{tmp_path}/r.py:first_char", name="c.json")
    assert len(custom["per_problem"]) == 12
    for row, src in zip(custom["per_problem"], rows):
        assert row["rewards"] == [float(t.strip()[:1] == src["sol"][:1]) for t in row["completions"]]
    held = run_eval(tmp_path, *argv, "--held-out", name="h.json")
    expected = [r["q"] for r in rows if held_out(Problem(r["q"], r["sol"]), ArithmeticTask())]
    assert [r["prompt"] for r in held["per_problem"]] == expected and expected


def test_eval_through_a_server_gives_the_in_process_figures(model_dir, tmp_path):
    from exactrl.server.app import ServerThread, build_state, create_app

    state = build_state(str(model_dir), kv_budget_tokens=4096)
    thread = ServerThread(create_app(state)).start()
    try:
        served = run_eval(tmp_path, "--server", thread.url, "--model", str(model_dir), *FLAGS, name="s.json")
    finally:
        thread.stop()
    local = run_eval(tmp_path, "--model", str(model_dir), *FLAGS, name="l.json")
    assert {k: v for k, v in served.items() if k != "server"} == {k: v for k, v in local.items() if k != "server"}


def test_eval_of_a_run_directory_takes_its_latest_checkpoint(model_dir, tmp_path):
    import shutil

    step = tmp_path / "run" / "checkpoints" / "step_000001"
    shutil.copytree(model_dir, step)
    (step / "state.json").write_text("{}")
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_000001\n")
    result = run_eval(tmp_path, "--model", str(tmp_path / "run"), *FLAGS)
    assert result == run_eval(tmp_path, "--model", str(model_dir), *FLAGS, name="m.json") | {
        "model": str(tmp_path / "run")
    }


@pytest.mark.parametrize(
    "argv, match",
    [
        ([], r"give --model \(a model or run directory\) or --server URL"),
        (["--model", "{model}", "--k", "4", "--n", "2"], "--n 2 samples per problem cannot give pass@4"),
        (["--model", "{tmp}"], r"neither a model directory \(config.json\) nor a run directory"),
        (["--model", "{model}", "--task", "nope"], "unknown task 'nope'"),
        (["--model", "{model}", "--task-kwargs", "[1]"], "--task-kwargs must be a JSON object"),
        (["--model", "{model}", "--dataset", "{tmp}/none.jsonl"], "dataset .*none.jsonl does not exist"),
        (["--model", "{model}", "--dataset", "{tmp}/d.jsonl", "--columns", "prompt"], "--columns takes ROLE=COLUMN"),
        (
            ["--model", "{model}", "--dataset", "{tmp}/d.jsonl"],
            r"d.jsonl:1: no column for prompt \(column 'prompt'\); the columns are \['answer', 'question'\]",
        ),
        (["--model", "{model}", "--held-out"], "--held-out needs --dataset"),
        (["--model", "{model}", "--task", "math"], "task 'math' has no problem generator"),
        (["--server", "http://127.0.0.1:9", "--model", "{model}"], "--server"),
        (["--server", "http://127.0.0.1:9"], "--server needs a tokenizer"),
        (
            ["--model", "{model}", "--max-tokens", "253"],
            r"--max-tokens 253: the longest prompt \(\d+ tokens\) leaves \d+ of",
        ),
        (["--model", "{model}", "--task-kwargs", '{{"max_value": "x"}}'], "task 'arithmetic'.*max_value"),
        (["--model", "{model}", "--reward", "{tmp}/r.py:f"], "task.reward: task module file .*r.py does not exist"),
        (["--model", "{model}", "--temperature", "-1"], "temperature"),
    ],
)
def test_bad_input_is_one_line_with_exit_code_2(model_dir, tmp_path, capsys, argv, match):
    import re

    (tmp_path / "d.jsonl").write_text('{"question": "1+1=", "answer": "2"}\n')
    argv = [a.format(model=model_dir, tmp=tmp_path) for a in argv]
    extra = [] if "--max-tokens" in argv else ["--max-tokens", "4"]
    assert main(["eval", *argv, "--size", "2", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("exactrl eval: error: ") and "\n" not in err
    assert re.search(match, err), err


def test_the_default_max_tokens_is_what_the_context_leaves_after_the_longest_prompt(model_dir, tmp_path):
    from exactrl.envs.prompts import prompt_ids
    from exactrl.model.tokenizer import load_tokenizer

    result = run_eval(tmp_path, "--model", str(model_dir), "--k", "1", "--size", "3")
    tok, task = load_tokenizer(model_dir), ArithmeticTask()
    longest = max(len(prompt_ids(tok, task, Problem(r["prompt"], r["answer"]))) for r in result["per_problem"])
    assert result["max_tokens"] == min(256, 256 - longest)  # the tiny model's context is 256 tokens
