"""Property-based review of the command line: invalid and edge-case argv for every command.

Each property holds for any argv hypothesis draws: a non-zero exit, a one-line error that names the flag
(or the value, the file), no traceback, nothing left behind, and nothing expensive (a model load, the warm
start, a benchmark's model) done first. All in process: argparse errors are a SystemExit(2).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import socket

import pytest
from fuzzing import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import exactrl
from exactrl import cli
from exactrl.cli import main
from exactrl.train import warmstart

FUZZ = settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def run(argv: list[str]) -> tuple[int, str]:
    """(exit code, stderr) of `exactrl argv`; an argparse error is its SystemExit code."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def failed(argv: list[str], command: str) -> str:
    """The last stderr line of a failed `exactrl argv`, checked: code 2, `exactrl CMD: error: `, no traceback."""
    code, err = run(argv)
    assert code == 2, (argv, code, err)
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"exactrl {command}: error: "), err
    return last


@pytest.fixture
def nothing_expensive(monkeypatch, tmp_path):
    """Runs in tmp_path; a model load or the warm start fails the test (the argv must be refused first)."""
    monkeypatch.chdir(tmp_path)

    def fail(*_a, **_k):
        raise AssertionError("expensive work ran before the arguments were checked")

    monkeypatch.setattr(exactrl, "load_model", fail)
    monkeypatch.setattr(warmstart, "default_model_dir", fail)
    return tmp_path


not_an_int = st.one_of(
    st.sampled_from(["", " ", "nan", "inf", "-inf", "1e3", "1.5", "0x10", "--", "١٢x", "∞", "1,x", "None"]),
    st.text(st.characters(blacklist_categories=("Nd", "Cs"), blacklist_characters=","), min_size=1, max_size=8).filter(
        lambda s: s.strip()
    ),
)  # no comma: "1,2" is a fine value of the list flags (--batches)
blank = st.text(" \t\n\r", max_size=3)

# (command argv before the flag, the flag, the smallest value it takes, the largest or None)
INT_FLAGS = [
    (["parity", "--model", "m"], "--length", 1, None),
    (["parity", "--model", "m", "--server", "http://h:1"], "--prompts", 1, 100_000),  # 10**14 built for minutes
    (["parity", "--model", "m", "--server", "http://h:1"], "--max-tokens", 1, None),
    (["serve", "--model", "m"], "--port", 0, 65535),
    (["serve", "--model", "m"], "--kv-budget-tokens", 1, None),
    (["serve", "--model", "m"], "--max-num-seqs", 1, None),
    (["serve", "--model", "m"], "--session-ttl", 0, None),
    (["train"], "--nproc", 1, None),
]


@pytest.mark.parametrize("head,flag,lo,hi", INT_FLAGS, ids=[f[1] for f in INT_FLAGS])
@FUZZ
@given(data=st.data())
def test_integer_flags_refuse_non_integers_and_out_of_range_values(head, flag, lo, hi, data, nothing_expensive):
    out_of_range = st.integers(max_value=lo - 1) | (st.integers(min_value=hi + 1) if hi is not None else st.nothing())
    value = data.draw(not_an_int | out_of_range.map(str))
    err = failed([*head, f"{flag}={value}"], head[0])  # `--length -inf` would read -inf as a flag
    assert f"argument {flag}: " in err and (repr(value) in err or value.strip() in err or value == "--"), err
    assert not any(nothing_expensive.iterdir())


PATH_ARGS = [
    (["serve"], "--model"),
    (["serve", "--model", "m"], "--tokenizer"),
    (["parity"], "--model"),
    (["parity", "--model", "m"], "--server"),
    (["parity", "--model", "m", "--server", "http://h:1"], "--served-model"),
]


@pytest.mark.parametrize("head,flag", PATH_ARGS, ids=[" ".join(h[:1] + [f]) for h, f in PATH_ARGS])
@FUZZ
@given(value=blank)
def test_empty_paths_are_named_not_read_as_the_current_directory(head, flag, value, nothing_expensive):
    """`--model ''` (an unset shell variable) is named, not read as '.' ('no config.json in model directory
    .'); `--server ''` is named, not taken as no server at all."""
    argv = [*head, f"{flag}={value}"] + (["--model", "m"] if flag == "--model" and head == ["serve"] else [])
    if head[0] == "parity" and flag == "--model":
        argv = ["parity", f"--model={value}"]
    assert f"argument {flag}: must not be empty or only spaces, got {value!r}" in failed(argv, head[0])


@FUZZ
@given(value=blank)
def test_empty_positional_paths_are_named(value, nothing_expensive):
    assert f"argument config: must not be empty or only spaces, got {value!r}" in failed(["train", value], "train")
    assert f"argument run_dir: must not be empty or only spaces, got {value!r}" in failed(["report", value], "report")
    assert not any(nothing_expensive.iterdir())


@FUZZ
@given(
    temperature=st.one_of(
        st.sampled_from(["nan", "inf", "-inf", "-1", "1e-9", "1e39"]), st.floats(max_value=-1e-300).map(repr)
    )
)
def test_parity_server_temperature_is_named_before_the_model_loads(temperature, nothing_expensive):
    err = failed(["parity", "--model", "m", "--server", "http://127.0.0.1:1", f"--temperature={temperature}"], "parity")
    assert f"--temperature {float(temperature)}: temperature must be 0 (greedy) or a number in" in err


@FUZZ
@given(
    url=st.one_of(
        st.sampled_from(
            ["x", "ftp://h", "http://", "http://:8000", "https:///x", "h:8000", "http://h:1/v1", "http://h:1/v1/"]
        ),
        st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=10).filter(
            lambda s: s.strip() and "://" not in s
        ),
    )
)
def test_parity_server_url_is_named_before_the_model_loads(url, nothing_expensive):
    err = failed(["parity", "--model", "m", f"--server={url}"], "parity")
    assert "--server" in err and repr(url) in err, err


@FUZZ
@given(
    flags=st.lists(
        st.sampled_from([("--prompts", "3"), ("--max-tokens", "5"), ("--temperature", "0.5"), ("--served-model", "x")]),
        min_size=1,
        max_size=4,
        unique=True,
    )
)
def test_server_only_flags_without_a_server_are_all_named(flags, nothing_expensive):
    err = failed(["parity", "--model", "m", *[x for f in flags for x in f]], "parity")
    assert all(f in err for f, _ in flags) and "only apply with --server URL" in err


def test_serve_refuses_a_port_in_use_before_loading_the_model(nothing_expensive):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        err = failed(["serve", "--model", "m", "--port", str(port)], "serve")
    assert f"cannot listen on --host '127.0.0.1' --port {port}" in err


@FUZZ
@given(
    host=st.one_of(
        st.sampled_from(["", "\x00", "é", "256.0.0.1", "-", "a b", "::g"]),
        st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=6).filter(lambda s: not s.isascii()),
    )
)
def test_serve_names_a_host_it_cannot_listen_on(host, nothing_expensive):
    assert f"cannot listen on --host {host!r} --port 0" in failed(
        ["serve", "--model", "m", "--host", host, "--port", "0"], "serve"
    )


# ---------------------------------------------------------------- train --set


INT_KEYS = [
    "max_steps",
    "rollout.prompts_per_step",
    "rollout.samples_per_prompt",
    "rollout.max_tokens",
    "engine.max_num_seqs",
    "engine.kv_budget_tokens",
    "save_every",
]


@FUZZ
@given(
    key=st.sampled_from(INT_KEYS),
    value=st.one_of(
        st.sampled_from([".nan", ".inf", "-.inf", "abc", "[1]", "{a: 1}", "true", "1.5", "~x"]),
        st.integers(max_value=-1).map(str),
    ),
)
def test_set_with_a_bad_integer_names_the_key_and_leaves_no_run_dir(key, value, nothing_expensive):
    err = failed(["train", "--set", "progress=false", "--set", f"{key}={value}"], "train")
    assert f"'{key}'" in err, err
    assert not any(nothing_expensive.iterdir())


@FUZZ
@given(
    item=st.one_of(
        st.text(max_size=8).filter(lambda s: "=" not in s),
        st.text(st.characters(whitelist_categories=("Zs", "P")), max_size=3).map(lambda k: f"{k}=1"),
        st.sampled_from(["=1", ".=1", "a..b=1", "rollout.=1", ".max_steps=1"]),
    )
)
def test_set_without_a_dotted_key_is_named(item, nothing_expensive):
    err = failed(["train", "--set", item], "train")
    assert "--set" in err or "config key" in err, err
    assert not any(nothing_expensive.iterdir())


@FUZZ
@given(config=st.sampled_from(["missing.yaml", "a_dir", "a_dir/", "file.yaml/x.yaml"]))
def test_config_paths_that_are_not_a_yaml_file_are_named(config, nothing_expensive):
    (nothing_expensive / "a_dir").mkdir(exist_ok=True)
    (nothing_expensive / "file.yaml").write_text("max_steps: 1\n")
    err = failed(["train", config], "train")
    assert f"config file {config.rstrip('/')}" in err or f"config file {config}" in err, err
    assert sorted(p.name for p in nothing_expensive.iterdir()) == ["a_dir", "file.yaml"]


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--model", "m", "--port=--"],
        ["parity", "--model=--"],
        ["train", "--set=--"],
        ["train", "--nproc=--"],
        ["bench", "engine", "--repeat=--"],
    ],
)
def test_a_flag_given_only_dashes_is_named(argv, nothing_expensive):
    """Python 3.11's argparse read `--port=--` as a port of [] (then 'Int or String expected' from the socket),
    and `bench engine --repeat=--` ran the benchmark with repeat []."""
    flag = argv[-1][:-3]
    assert f"argument {flag}: expected one argument, got '--'" in failed(argv, argv[0])


def test_a_value_that_ends_in_dashes_is_kept(monkeypatch):
    """`--set=k=--` sets k to '--' (argparse drops only a value that is '--' itself); it is not refused as
    'argument --set=k: expected one argument'."""
    seen = []
    monkeypatch.setattr(cli, "_train", lambda args: seen.append(args.set) or 0)
    assert main(["train", "--set=run_name=--"]) == 0 and seen == [["run_name=--"]]


def test_nproc_under_torchrun_is_refused(monkeypatch, nothing_expensive):
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, err = run(["train", "--nproc", "2"])
    assert code == 2 and err.startswith(
        "exactrl train (rank ?): error: --nproc 2 starts its own ranks, but WORLD_SIZE=2"
    ), err


# ---------------------------------------------------------------- report


@FUZZ
@given(
    content=st.one_of(
        st.binary(max_size=40),
        st.lists(
            st.dictionaries(
                st.sampled_from(["step", "rollout/reward_mean", "x"]),
                st.one_of(st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=3), st.none(), st.booleans()),
                max_size=3,
            ),
            max_size=4,
        ).map(lambda rs: "".join(json.dumps(r) + "\n" for r in rs).encode()),
    )
)
def test_report_of_any_metrics_file_plots_or_names_the_problem(content, tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    (d / "metrics.jsonl").write_bytes(content)
    code, err = run(["report", str(d)])
    assert "Traceback" not in err
    if code:
        assert code == 2 and err.startswith("exactrl report: error: ") and err.count("\n") == 1, err
        assert not (d / "report").exists() or not any((d / "report").iterdir())


# ---------------------------------------------------------------- bench (the benchmarks' own flags)


def bench_main(name: str):
    spec = importlib.util.spec_from_file_location(f"exactrl_bench_{name}", cli.BENCH_DIR / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


BENCH_INT_FLAGS = (
    [("kernels", f) for f in ("--train-batch", "--train-seq", "--ctx", "--repeat", "--decode-batches")]
    + [("engine", f) for f in ("--batches", "--prompt", "--new", "--repeat")]
    + [("train", f) for f in ("--prompts", "--group", "--prompt", "--new", "--steps")]
    + [("serve", f) for f in ("--clients", "--requests", "--max-tokens")]
)


@pytest.mark.parametrize("name,flag", BENCH_INT_FLAGS, ids=[" ".join(b) for b in BENCH_INT_FLAGS])
@FUZZ
@given(value=not_an_int | st.integers(max_value=0).map(str))
def test_bench_integer_flags_are_refused_naming_the_flag(name, flag, value, nothing_expensive):
    err = failed(["bench", name, f"{flag}={value}"], "bench" if value == "--" else f"bench {name}")
    assert f"argument {flag}: " in err, err


@pytest.mark.parametrize(
    "argv,needle",
    [
        (
            ["engine", "--prompt", "2041", "--new", "8"],
            "--prompt 2041 + --new 8 = 2049 tokens exceeds the benchmark models' context of 2048 tokens",
        ),
        (["train", "--prompt", "2000", "--new", "49"], "--prompt 2000 + --new 49 = 2049 tokens exceeds"),
        (["kernels", "--ctx", "2048"], "--ctx 2048 + the decoded token = 2049 tokens exceeds"),
        (["kernels", "--train-seq", "100000"], "--train-seq 100000 = 100000 tokens exceeds"),
    ],
)
def test_bench_lengths_beyond_the_context_are_named_before_a_model_is_built(argv, needle, nothing_expensive):
    """Each is named by its flag before a model is built, not after it in the engine's words
    (`prompts[0]: prompt_token_ids ...`, `position 2048 is beyond max_position_embeddings`)."""
    assert needle in failed(["bench", *argv], f"bench {argv[0]}")
    assert not any(nothing_expensive.iterdir())


@FUZZ
@given(seed=st.one_of(st.integers(max_value=-1), st.integers(min_value=2**32)).map(str) | not_an_int)
def test_bench_train_seed_is_one_numpy_takes(seed, nothing_expensive):
    """`--seed -1` (or 2**32) is refused naming the flag, not in TRL's setup after the model is built
    (`Seed must be between 0 and 2**32 - 1`, naming no flag)."""
    assert "argument --seed: " in failed(
        ["bench", "train", f"--seed={seed}"], "bench" if seed == "--" else "bench train"
    )


@FUZZ
@given(lr=st.sampled_from(["nan", "inf", "-inf", "0", "-1", "1e400", "x", ""]))
def test_bench_train_lr_must_be_a_finite_positive_number(lr, nothing_expensive):
    """--lr nan is refused naming the flag, not by torch's AdamW after the model is built (`Invalid learning
    rate: nan`)."""
    assert "argument --lr: " in failed(["bench", "train", f"--lr={lr}"], "bench train")


# ---------------------------------------------------------------- past argparse: the engine and the server


@settings(max_examples=examples(15), deadline=None)
@given(tokens=st.integers(min_value=2**40, max_value=10**40))
def test_a_kv_budget_beyond_any_memory_is_named_not_a_type_error(tokens, qwen3_dir):
    """`serve --kv-budget-tokens 99999999999999999999999` is named, not a TypeError from torch.zeros (the size
    overflows int64) with a C++ stack in the message."""
    model = _model(qwen3_dir)
    with pytest.raises(
        ValueError,
        match=r"KV budget of \d+ tokens does not fit in memory \(.* GiB of KV cache, "
        r"the machine has .* GiB\): lower kv_budget_tokens",
    ):
        exactrl.Engine(model, kv_budget_tokens=tokens)


_MODELS: dict = {}


def _model(path):
    if path not in _MODELS:
        _MODELS[path] = exactrl.load_model(path)
    return _MODELS[path]


@pytest.mark.parametrize("ttl", [10**400, 2**1024, -1, math.nan])
def test_a_session_ttl_no_float_holds_is_refused(ttl):
    """`--session-ttl` beyond every float is refused, not accepted to fail the first request that sweeps
    sessions (ttl / 100: OverflowError, an HTTP 500)."""
    from exactrl.server.app import ServerConfig

    with pytest.raises(ValueError, match=r"session_ttl_s \(--session-ttl\) must be >= 0 seconds"):
        ServerConfig("m", session_ttl_s=ttl)
    assert ServerConfig("m", session_ttl_s=2**1023).session_ttl_s == 2**1023  # large but a float: kept


def test_a_tokenizer_path_that_is_a_file_is_named_as_a_file(tmp_path):
    from exactrl.model.tokenizer import load_tokenizer

    (tmp_path / "tok.json").write_text("{}")
    with pytest.raises(ValueError, match=f"tokenizer directory {tmp_path / 'tok.json'} is a file"):
        load_tokenizer(tmp_path / "tok.json")
    with pytest.raises(ValueError, match="tokenizer directory .*nowhere does not exist"):
        load_tokenizer(tmp_path / "nowhere")
