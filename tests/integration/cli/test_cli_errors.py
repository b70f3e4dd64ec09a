"""User-facing errors of the CLI: one line `exactrl CMD: error: ...` naming the key, file or flag, exit code 2.

Every test goes through `exactrl.cli.main` in process. Runs that train use the default job's tokenizer
and tiny model without the warm start (a few seconds at most); runs that must fail before the warm start
replace it with a function that fails the test.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import pytest
import torch
from conftest import default_job_model

from exactrl import cli
from exactrl.cli import main
from exactrl.train import warmstart
from exactrl.train.config import load_config

TINY = [
    "progress=false",
    "tensorboard=false",
    "task.eval_size=0",
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=2",
    "engine.kv_budget_tokens=2048",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The default job's tokenizer and tiny Qwen3, random weights (no SFT)."""
    return default_job_model(tmp_path_factory, sft_steps=0)


@pytest.fixture
def no_warm_start(monkeypatch, tmp_path):
    """Runs in tmp_path (a default run_dir lands in tmp_path/runs); the warm start must not be reached."""
    monkeypatch.chdir(tmp_path)

    def fail(*_a, **_k):
        raise AssertionError("the warm start ran before the config was checked")

    monkeypatch.setattr(warmstart, "default_model_dir", fail)


def train(*overrides: str, config: str | None = None) -> int:
    return main(["train"] + ([config] if config else []) + [x for o in overrides for x in ("--set", o)])


def error_of(capsys, command: str) -> str:
    """The one-line error the CLI printed (stderr), checked for its form."""
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"exactrl {command}: error: ") and "\n" not in err, err
    return err


# ---------------------------------------------------------------- 1. rollout server errors


def test_unreachable_rollout_server_is_a_one_line_error(model_dir, no_warm_start, tmp_path, capsys):
    server = ["rollout_backend.kind=openai", "rollout_backend.base_url=http://127.0.0.1:1", "rollout_backend.model=x"]
    # disk sync pushes the weights while the run is built; none fails at the first batch, sync or async
    for extra in (["rollout_backend.weight_sync=disk"], [], ["async.enabled=true"]):
        assert train(*TINY, f"model.path={model_dir}", "max_steps=1", *server, *extra) == 2
        assert "cannot reach the rollout server at http://127.0.0.1:1" in error_of(capsys, "train")
        assert not any((tmp_path / "runs").glob("*"))  # the run dir it made (no step done) is gone


# ---------------------------------------------------------------- 3. checked before the run dir and the warm start


@pytest.mark.parametrize(
    "override,needle",
    [
        ("algorithm.advantage=nosuch", "unknown advantage estimator 'nosuch'"),
        ("algorithm.advantage_kwargs={foo: 1}", "advantage estimator 'grpo' got unknown arguments ['foo']"),
        ("algorithm.advantage_kwargs={eps: abc}", "advantage estimator 'grpo' argument eps"),
        ("algorithm.loss=bad", "unknown loss 'bad'"),
        ("task.name=nosuch", "unknown task 'nosuch'"),
        ("algorithm.corrections=[{name: nosuch}]", "unknown correction 'nosuch'"),
        ("task.train_jsonl=/nonexistent.jsonl", "dataset file /nonexistent.jsonl does not exist"),
        ("model.path=/nonexistent", "model.path /nonexistent does not exist"),
        ("model.tokenizer=/nonexistent", "model.tokenizer /nonexistent does not exist"),
        ("task.module=no_such_pkg.tasks", "cannot import task module 'no_such_pkg.tasks'"),
        ("task.module=.tasks", "task module '.tasks' is a relative name"),
        ("rollout.temperature=1.0e-9", "rollout.temperature"),
        ("algorithm.advantage_kwargs={eps: 0}", "algorithm.advantage_kwargs: eps must be a number > 0"),
        ("optim.betas=[1.5, 0.9]", "bad value for 'optim.betas.0'"),
        ("seed=100000000000000000000", "bad value for 'seed'"),
        ("engine.max_num_seqs=2", "rollout.samples_per_prompt=8 exceeds engine.max_num_seqs=2"),
    ],
)
def test_bad_config_fails_before_warm_start_and_leaves_no_run_dir(override, needle, no_warm_start, tmp_path, capsys):
    assert train("progress=false", override) == 2
    assert needle in error_of(capsys, "train")
    assert not (tmp_path / "runs").exists()


def test_a_training_file_row_the_task_cannot_score_fails_at_the_start(no_warm_start, tmp_path, capsys):
    """A row with a non-integer answer stops the run before the run dir and the warm start, not at the step
    that first draws it (where a resume would stop again), naming the file and its line (not "problem 6 of the
    file", which blank lines make another line than the 6th)."""
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n\n" for a in range(5))
        + json.dumps({"prompt": "2+1=", "answer": "3.0"})
        + "\n"
    )
    assert train("progress=false", f"task.train_jsonl={data}") == 2
    assert f"task.train_jsonl: {data}:11: arithmetic problem '2+1=' has a non-integer answer" in error_of(
        capsys, "train"
    )
    assert not (tmp_path / "runs").exists()


def test_max_tokens_beyond_the_models_context_fails_before_the_run_dir(model_dir, tmp_path, capsys):
    assert (
        train(
            *TINY,
            f"model.path={model_dir}",
            f"run_dir={tmp_path / 'r'}",
            "rollout.max_tokens=100000",
            "engine.kv_budget_tokens=200000",
        )
        == 2
    )  # (a smaller budget is refused first, by the config)
    assert "rollout.max_tokens=100000 leaves no room for a prompt" in error_of(capsys, "train")
    assert not (tmp_path / "r").exists()


def test_a_failed_start_keeps_an_existing_run_dir(no_warm_start, tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    assert train("progress=false", "run_dir=mine", "algorithm.loss=bad") == 2
    assert (tmp_path / "mine" / "notes.txt").read_text() == "x"


def test_a_bad_advantage_does_not_spoil_the_run_dir(model_dir, tmp_path, capsys):
    run_dir = tmp_path / "r"
    base = [*TINY, "task.eval_size=4", f"model.path={model_dir}", f"run_dir={run_dir}", "max_steps=1"]
    assert train(*base, "algorithm.advantage=nosuch") == 2
    assert not run_dir.exists()  # the step-0 eval never ran
    capsys.readouterr()
    assert train(*base) == 0  # the corrected command reuses the run_dir


def test_run_dir_that_is_a_file(no_warm_start, tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert train("run_dir=f") == 2
    assert "run_dir f is a file" in error_of(capsys, "train")


# ---------------------------------------------------------------- 4. malformed YAML


def test_malformed_yaml_in_set_names_the_key(capsys):
    assert train("rollout.max_tokens=[1,") == 2
    assert "--set rollout.max_tokens: not valid YAML" in error_of(capsys, "train")


def test_malformed_yaml_file_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_steps: 1\nrollout:\n  max_tokens: [1,\n")
    assert train(config=str(bad)) == 2
    assert f"config file {bad}: line 3: not valid YAML" in error_of(capsys, "train")
    bad.write_text("a: b: c\n")
    assert train(config=str(bad)) == 2
    assert f"config file {bad}: line 1: not valid YAML" in error_of(capsys, "train")


def test_config_path_that_is_a_directory(tmp_path, capsys):
    assert train(config=str(tmp_path)) == 2
    assert f"config file {tmp_path} is a directory" in error_of(capsys, "train")


# ---------------------------------------------------------------- 6. warm-start cache key


def test_warm_start_key_ignores_task_fields_it_does_not_use():
    default = warmstart._hash(load_config(None, []))
    assert default == "db305121dee7"  # artifacts/default-db305121dee7 is cached on machines: keep it
    unused = ["task.train_jsonl=x.jsonl", "task.eval_size=0", "task.train_size=7", "max_steps=1", "run_dir=r"]
    assert warmstart._hash(load_config(None, unused)) == default
    for used in ("task.kwargs={max_value: 50}", "seed=1", "sft.steps=3", "model.dtype=bfloat16"):
        assert warmstart._hash(load_config(None, [used])) != default, used


def test_warm_start_key_follows_the_code_of_a_task_file(tmp_path):
    """Editing a user's task file is a new warm start, not the cached model of the old task."""
    f = tmp_path / "my_task.py"
    f.write_text("# version 1\n")
    first = warmstart._hash(load_config(None, [f"task.module={f}"]))
    assert first == warmstart._hash(load_config(None, [f"task.module={f}"]))
    f.write_text("# version 2\n")
    assert warmstart._hash(load_config(None, [f"task.module={f}"])) != first
    assert warmstart._hash(load_config(None, ["task.module=json"])) != warmstart._hash(load_config(None, []))


# ---------------------------------------------------------------- 10, 11. bench


def test_bench_outside_a_source_checkout(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "BENCH_DIR", tmp_path / "site" / "benchmarks")
    assert main(["bench", "kernels", "--quick"]) == 2
    assert "benchmarks run from a source checkout of exactrl" in error_of(capsys, "bench")


def test_bench_without_a_name_lists_them(capsys):
    assert main(["bench"]) == 0
    out = capsys.readouterr().out
    assert "available benchmarks:" in out and "kernels" in out and "engine" in out
    assert main(["bench", "nosuch"]) == 2
    assert "unknown benchmark 'nosuch'; available: [" in error_of(capsys, "bench")


def test_bench_serve_names_why_its_server_did_not_start(qwen3_dir, capsys):
    """A model dir without a tokenizer: the server's own error is named, not a RuntimeError's traceback."""
    assert main(["bench", "serve", "--quick", "--model", str(qwen3_dir)]) == 2
    err = error_of(capsys, "bench")
    assert f"the server did not start (exactrl serve --model {qwen3_dir}): exactrl serve: error: " in err
    assert "holds no tokenizer files" in err


def test_bench_serve_refuses_a_size_beside_its_model(capsys):
    """--size beside --model is refused: it would be ignored, and the figures would be --model's."""
    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--model", "m", "--size", "tiny"])
    assert e.value.code == 2
    assert "argument --size: not allowed with argument --model" in capsys.readouterr().err


# ---------------------------------------------------------------- 11. small ones


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["parity", "--model", "m", "--length", "0"], "argument --length: must be >= 1, got 0"),
        (["parity", "--model", "m", "--length", "-5"], "argument --length: must be >= 1, got -5"),
        (["serve", "--model", "m", "--port", "99999"], "argument --port: must be in 0..65535, got 99999"),
        (["serve", "--model", "m", "--port", "-1"], "argument --port: must be in 0..65535, got -1"),
        (["serve", "--model", "m", "--port", "x"], "argument --port: invalid int value: 'x'"),
    ],
)
def test_integer_flags_are_range_checked(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_bypass_with_a_weighing_correction_is_refused(no_warm_start, capsys):
    """The bypass ratio π_θ/μ already is ρ: token_tis on top would weigh each token by ρ²."""
    assert train(*TINY, "algorithm.bypass=true", "algorithm.corrections=[{name: token_tis}]") == 2
    assert "would apply that ratio twice" in error_of(capsys, "train")


def test_server_only_flags_are_refused_without_their_server(capsys):
    """Checked before anything loads (the model path does not exist): named, not ignored."""
    assert main(["parity", "--model", "nosuch", "--prompts", "3", "--temperature", "0.5"]) == 2
    assert "--prompts, --temperature only apply with --server URL" in error_of(capsys, "parity")


def test_serve_names_a_host_it_cannot_listen_on_before_loading_the_model(capsys):
    assert main(["serve", "--model", "nosuch", "--host", "nosuch.invalid", "--port", "0"]) == 2
    assert "cannot listen on --host 'nosuch.invalid' --port 0" in error_of(capsys, "serve")


def test_run_parity_refuses_a_length_below_one(model_dir):
    import exactrl
    from exactrl.debug.parity import run_parity

    with pytest.raises(ValueError, match="parity length must be >= 1, got 0"):
        run_parity(exactrl.load_model(model_dir), length=0)


def test_parity_names_a_model_whose_logits_are_not_finite(tmp_path, capsys):
    """Finite weights whose logits overflow: NaN != NaN, and every check said DIFFERS (max|Δlogit|=nan), naming
    `logits` as the first divergent op, with exit code 1 as for a kernel that breaks the contract."""
    from conftest import make_hf_model
    from safetensors.torch import load_file, save_file

    make_hf_model(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.norm.weight"] = torch.full_like(weights["model.norm.weight"], 3e38)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()  # transformers' progress bar
    assert main(["parity", "--model", str(tmp_path), "--length", "5"]) == 2
    assert "the model's logits are not finite (" in error_of(capsys, "parity")
    assert capsys.readouterr().out == ""


def test_report_names_file_and_line_of_a_bad_metrics_row(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n\n{"step": 2\n')
    assert main(["report", str(tmp_path)]) == 2
    assert f"{tmp_path / 'metrics.jsonl'}:3: not valid JSON" in error_of(capsys, "report")


def test_report_given_the_metrics_file_asks_for_its_directory(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["report", str(tmp_path / "metrics.jsonl")]) == 2
    assert "metrics.jsonl is a file: give the run directory" in error_of(capsys, "report")


def test_report_refuses_empty_metrics_and_rows_without_a_step(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("")
    assert main(["report", str(tmp_path)]) == 2
    assert "has no metrics yet" in error_of(capsys, "report")
    assert not (tmp_path / "report").exists()  # no blank plots
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"loss": 2}\n')
    assert main(["report", str(tmp_path)]) == 2
    assert "row 2 has no integer 'step'" in error_of(capsys, "report")


def test_report_names_a_metric_that_is_not_a_number_and_a_report_path_it_cannot_use(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "rollout/reward_mean": 0.5}\n{"step": 2, "rollout/reward_mean": {"mean": 1}}\n'
    )
    assert main(["report", str(tmp_path)]) == 2
    assert "row 2: 'rollout/reward_mean' is {'mean': 1}, not a number" in error_of(capsys, "report")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "rollout/reward_mean": 0.5}\n')
    (tmp_path / "report").write_text("a file where the plots go")
    assert main(["report", str(tmp_path)]) == 2
    assert f"cannot write the plots to {tmp_path / 'report'}" in error_of(capsys, "report")


def test_report_skips_a_last_row_cut_while_written(tmp_path, capsys):
    """A run killed while it wrote a row leaves half a line without its newline: resume drops it, so does the
    report (a broken line anywhere else is still named)."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "rollout/reward_mean": 0.5}\n{"step": 2, "rollout/rew')
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "report" / "summary.png").stat().st_size > 0


def test_set_keeps_the_text_of_numbers_and_dates_for_string_fields():
    cfg = load_config(
        None,
        [
            "run_dir=123",
            "rollout_backend.kind=openai",
            "rollout_backend.base_url=http://h:1",
            "rollout_backend.model=007",
            "model.path=1.10",
            "algorithm.advantage=2024-01-01",
            "algorithm.loss_kwargs={eps_low: 0.1}",
        ],
    )
    assert (cfg.run_dir, cfg.rollout_backend.model, cfg.model.path) == ("123", "007", "1.10")
    assert cfg.algorithm.advantage == "2024-01-01"
    assert cfg.algorithm.loss_kwargs == {"eps_low": 0.1}  # free-form dicts keep YAML's types
    assert load_config(None, ["run_dir=null", "seed=3"]).run_dir is None
    with pytest.raises(ValueError, match=r"bad value for 'run_dir'.*got True\); quote it"):
        load_config(None, ["run_dir=true"])  # a bool is not silently a directory name
    with pytest.raises(ValueError, match="bad value for 'task.name'"):
        load_config(None, ["task.name=null"])


@pytest.mark.parametrize("command", ["serve", "parity", "report"])
def test_help_describes_every_option(command):
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    assert all(a.help for a in sub._actions), [a.dest for a in sub._actions if not a.help]


def test_serve_help_describes_monotonicity():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    mono = next(a for a in sub._actions if a.dest == "monotonicity").help
    assert all(w in mono for w in ("raise", "split", "truncate"))


def test_resuming_a_finished_run_says_there_is_nothing_to_do(model_dir, tmp_path, capsys):
    base = [*TINY, f"model.path={model_dir}", f"run_dir={tmp_path / 'r'}", "max_steps=1"]
    assert train(*base) == 0
    rows = (tmp_path / "r" / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert train(*base, "resume=true") == 0
    assert f"nothing to do: run {tmp_path / 'r'} is already at step 1 (max_steps=1)" in capsys.readouterr().out
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == rows
    assert json.loads(rows.splitlines()[-1])["step"] == 1
    # a run stopped after its last checkpoint, before its report: the resume that finds nothing to do writes it
    import shutil

    shutil.rmtree(tmp_path / "r" / "report")
    assert train(*base, "resume=true") == 0
    assert "report: " in capsys.readouterr().out and (tmp_path / "r" / "report" / "summary.png").is_file()


def test_a_failed_write_says_what_the_run_kept_and_how_to_go_on(model_dir, tmp_path, capsys, monkeypatch):
    """A full disk when a metrics row is written (not inside the checkpoint save, which says so itself)."""
    import errno

    from exactrl.train.logger import MetricsLogger

    real, calls = MetricsLogger.log, []

    def full(self, metrics):
        calls.append(metrics["step"])
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, metrics)

    monkeypatch.setattr(MetricsLogger, "log", full)
    run = tmp_path / "r"
    assert train(*TINY, f"model.path={model_dir}", f"run_dir={run}", "max_steps=3", "save_every=1") == 2
    err = error_of(capsys, "train")
    assert f"No space left on device; run {run} is kept and its last checkpoint step_000001 is intact" in err
    assert f"continue it with exactrl train --set run_dir={run} --set resume=true" in err


def test_warm_start_cache_location_follows_exactrl_artifacts(tmp_path):
    """One cache for runs started from any directory: EXACTRL_ARTIFACTS, else ./artifacts."""
    import os
    import subprocess
    import sys

    code = "from exactrl.train import warmstart; print(warmstart.ARTIFACTS)"
    env = {**os.environ, "EXACTRL_ARTIFACTS": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(tmp_path / "cache")
    env.pop("EXACTRL_ARTIFACTS")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "artifacts"


def test_run_dir_that_holds_something_else_or_cannot_be_made_is_refused_first(tmp_path):
    """A model directory given as run_dir (its config.json would be overwritten by the run's), a path under a file,
    a dangling link: each is named before anything is loaded."""
    from exactrl.train.run_dir import check_run_dir as _run_dir
    from exactrl.train.run_dir import make_dir as _make_dir

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"holds config.json but no exactrl run \(a model directory\?\)"):
        _run_dir(load_config(None, [f"run_dir={model}"]))
    (tmp_path / "empty").mkdir()
    assert _run_dir(load_config(None, [f"run_dir={tmp_path / 'empty'}"])) == tmp_path / "empty"
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match=f"cannot be created: {tmp_path / 'f'} is not a directory"):
        _run_dir(load_config(None, [f"run_dir={tmp_path / 'f' / 'sub'}"]))
    (tmp_path / "dl").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="is a symbolic link to nothing"):
        _run_dir(load_config(None, [f"run_dir={tmp_path / 'dl' / 'run'}"]))
    with pytest.raises(ValueError, match="run_dir /proc/exactrl-run cannot be created"):
        _make_dir(Path("/proc/exactrl-run"))
    if os.access("/proc", os.W_OK):  # root: os.access says yes, every mkdir says no; named before the warm start
        with pytest.raises(
            ValueError, match=r"run_dir /proc/exactrl-run cannot be created: a directory cannot be made"
        ):
            _run_dir(load_config(None, ["run_dir=/proc/exactrl-run"]))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".exactrl-probe")]  # the probes are gone


def test_non_finite_settings_are_refused_naming_the_key():
    for key in (
        "algorithm.entropy_coef",
        "algorithm.kl.coef",
        "optim.lr",
        "optim.weight_decay",
        "rollout_backend.timeout_s",
        "algorithm.overlong.penalty_factor",
    ):
        with pytest.raises(ValueError, match=f"bad value for '{key}': Input should be a finite number"):
            load_config(None, [f"{key}=.nan"])


def test_a_diverged_run_and_a_ctrl_c_before_training_are_named_without_a_traceback(monkeypatch, capsys):
    def diverged(args):
        raise FloatingPointError("gradient norm is nan: refusing to step (check lr / data)")

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: _with_fn(parser, "train", diverged))
    assert main(["train"]) == 2
    assert "gradient norm is nan" in (err := error_of(capsys, "train")) and "checkpoints are kept" in err

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", lambda: _with_fn(parser, "report", interrupted))
    assert main(["report", "x"]) == 130
    assert "exactrl report: interrupted" in capsys.readouterr().err


def _with_fn(parser, command, fn):
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    sub.set_defaults(fn=fn)
    return parser


def test_a_kv_budget_beyond_memory_is_named(qwen3_dir):
    import exactrl

    with pytest.raises(ValueError, match="KV budget of .* tokens does not fit in memory .*lower kv_budget_tokens"):
        exactrl.Engine(exactrl.load_model(qwen3_dir), kv_budget_tokens=10**12)


def test_config_files_that_are_not_a_mapping_of_unique_utf8_keys_are_named(tmp_path):
    cases = {
        "list.yaml": (b"[]\n", "must hold a mapping of settings at the top level, got list"),
        "zero.yaml": (b"0\n", "got int 0"),
        "twice.yaml": (b"optim:\n  lr: 1\n  lr: 2\n", "line 3: not valid YAML (the key 'lr' appears twice)"),
        "latin1.yaml": (b"run_dir: caf\xe9\n", "is not UTF-8 text (byte 12)"),
        "listkey.yaml": (
            b"optim:\n  ? [1]\n  : 2\n",
            "line 2: not valid YAML (while constructing a mapping found unhashable key)",
        ),  # not a TypeError
        "deep.yaml": (b"[" * 3000, "not valid YAML (lists or mappings nested too deeply)"),  # not a RecursionError
        "nullkey.yaml": (b"null: 1\n", "bad key None at the top level: a key must be a name (text)"),
    }
    for name, (content, words) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=re.escape(words)):
            load_config(tmp_path / name)
    (tmp_path / "comments.yaml").write_text("# nothing set\n")
    assert load_config(tmp_path / "comments.yaml") == load_config(None)


def test_resume_without_a_run_dir_is_refused():
    with pytest.raises(ValueError, match="resume=true needs run_dir"):
        load_config(None, ["resume=true"])


def test_sigterm_stops_a_run_as_ctrl_c_does(model_dir, tmp_path):
    """A job manager's stop (SLURM, Kubernetes send SIGTERM): the run keeps what it saved, says how to go on,
    and exits 143, not dying at once without a word."""
    import signal
    import subprocess
    import sys
    import time

    run = tmp_path / "r"
    sets = [*TINY, f"model.path={model_dir}", f"run_dir={run}", "max_steps=1000", "save_every=1"]
    cmd = [sys.executable, "-m", "exactrl", "train"] + [x for o in sets for x in ("--set", o)]
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    try:
        t0 = time.monotonic()
        while not (run / "checkpoints" / "latest").is_file():  # a step saved, the loop running
            assert p.poll() is None and time.monotonic() - t0 < 120, p.communicate()
            time.sleep(0.1)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 143, err
    assert f"terminated (SIGTERM): run {run} is kept and its last checkpoint is step_" in err
    assert f"--set run_dir={run} --set resume=true" in err
    assert (run / "checkpoints" / "latest").is_file()


def test_version_is_the_installed_packages(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"exactrl {version('exactrl')}"


def test_a_message_and_its_newline_are_one_write(monkeypatch):
    """The ranks of a run and their launcher share one stderr: with PYTHONUNBUFFERED, `print` writes a message and
    its newline apart, and another process's line can land between them; `stderr_line` writes them together."""
    import sys

    from exactrl.console import stderr_line

    writes = []

    class Recorder:
        def write(self, s):
            writes.append(s)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Recorder())
    stderr_line("exactrl train (rank 0): error: another rank left the run")
    print("the same with print", file=sys.stderr)
    assert writes[0] == "exactrl train (rank 0): error: another rank left the run\n"
    assert writes[1:] == ["the same with print", "\n"]  # what the rule guards against
