"""Property-based fuzz of the run config and the `train` command line.

Bad input is a ValueError naming the config key (or the file), and `exactrl train` prints it on one line
and exits 2, with no traceback and no run directory; a config that is accepted round-trips: its dump
(as a run's config.json holds it) read back as a config file is the same config.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import yaml
from fuzzing import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exactrl.algo.corrections import CORRECTIONS
from exactrl.algo.losses import LOSSES
from exactrl.cli import main
from exactrl.train import warmstart
from exactrl.train.config import RunConfig, dotted, ignored_settings, load_config

HSET = settings(max_examples=examples(250), deadline=None, suppress_health_check=list(HealthCheck))
CLI = settings(max_examples=examples(40), deadline=None, suppress_health_check=list(HealthCheck))

LEAVES = sorted(dotted(load_config().model_dump(by_alias=True)))  # every --set key, free-form dicts too
SECTIONS = sorted({k.rsplit(".", 1)[0] for k in LEAVES if "." in k})
FS_KEYS = ("run_dir", "model.path", "model.tokenizer", "task.module", "task.train_jsonl", "rollout_backend.sync_dir")


def _typo(key: str, i: int, c: str) -> str:
    i %= len(key)
    return key[:i] + c + key[i + 1 :]


keys = st.one_of(
    st.sampled_from(LEAVES + SECTIONS + ["async_.enabled"]),
    st.builds(_typo, st.sampled_from(LEAVES), st.integers(0, 40), st.sampled_from("xz_.0 ")),
    st.builds(
        lambda k, s: k + s,
        st.sampled_from(LEAVES + SECTIONS),
        st.sampled_from([".", "..", ".x", ".0", ".0.name", "[0]", ".a.b", " "]),
    ),
    st.builds(lambda s, k: s + k, st.sampled_from([".", " ", "x."]), st.sampled_from(LEAVES)),
    st.sampled_from(
        [
            "algorithm.loss_kwargs.eps_low",
            "algorithm.corrections.0.name",
            "optim.betas.0",
            "task.kwargs.max_value",
            "a..b",
            "",
            " ",
            ".",
        ]
    ),
    st.text("abcdefghijklmnopqrstuvwxyz_.[]0", min_size=1, max_size=12),
)

YAMLISH = [
    "",
    " ",
    "null",
    "~",
    "true",
    "no",
    "yes",
    "0",
    "1",
    "-1",
    "2",
    "1.0",
    "0.5",
    "1e-3",
    "1.0e-3",
    "1e400",
    "-1e400",
    ".nan",
    ".inf",
    "-.inf",
    "NaN",
    "9" * 30,
    "-" + "9" * 30,
    str(2**63),
    str(2**63 - 1),
    "0x10",
    "1_000",
    "1:30",
    "2024-01-01",
    "2024-01-01T10:00:00",
    "'5'",
    '"x"',
    "''",
    "[]",
    "{}",
    "[1, 2]",
    "[0.9, 0.99]",
    "[true, 0.9]",
    "[[1]]",
    "{a: 1}",
    "{eps_low: .nan}",
    "{1: 2}",
    "{null: 1}",
    "{? [1] : 2}",
    "[{name: token_tis}]",
    "[{}]",
    "[1,",
    "{a: ",
    "]",
    "}",
    "'",
    '"',
    "!!python/object:os.system x",
    "!!python/name:os.system",
    "!!binary aGVsbG8=",
    "!!set {a}",
    "&a 1",
    "*a",
    "%YAML 1.1",
    "---",
    "...",
    "a: b: c",
    "- 1",
    "\t",
    "#comment",
    "x #c",
    "@",
    "`",
    "|",
    ">",
    "fast",
    "exact",
    "openai",
    "ray",
    "disk",
    "k1",
    "loss",
    "reward",
    "token-mean",
    "bfloat16",
    "grpo",
    "gspo",
    "/nonexistent",
    "http://h:1",
    "[" * 2000 + "]" * 2000,
    "{a: " * 2000 + "1" + "}" * 2000,
]
values = st.one_of(
    st.sampled_from(YAMLISH),
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=8),
    st.recursive(
        st.none() | st.booleans() | st.integers(-5, 300) | st.floats() | st.text(max_size=3),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c, max_size=3),
        max_leaves=6,
    ).map(lambda v: yaml.safe_dump(v, default_flow_style=True).strip()),
)


def where_wrong(key: str) -> str:
    """The prefix of a dotted key up to the part that leaves the config's sections (an unknown name or a leaf
    field): what an error about it must name."""
    from pydantic import BaseModel

    node, parts = RunConfig, key.split(".")
    for i, part in enumerate(parts):
        field = next((f for n, f in node.model_fields.items() if part in (n, f.alias)), None)
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return ".".join(parts[: i + 1])
        node = field.annotation
    return key


def names_the_key(msg: str, key: str) -> bool:
    """The message names the key, or its prefix where it goes wrong, or (a rule across keys names its
    section) a prefix of two or more parts of it."""
    key = key.strip()
    parts = key.split(".")
    need = min(2, len(where_wrong(key).split(".")))
    return any(".".join(parts[:i]) in msg for i in range(need, len(parts) + 1))


def round_trips(cfg: RunConfig, tmp: Path) -> None:
    """The config as a run's config.json holds it, read back as a config file, is the same config."""
    saved = json.dumps(cfg.model_dump(by_alias=True), indent=2)
    (tmp / "config.json").write_text(saved)
    again = load_config(tmp / "config.json")
    assert json.dumps(again.model_dump(by_alias=True), indent=2) == saved
    ignored_settings(again)


def _finite_leaves(cfg: RunConfig) -> None:
    """Every number of the typed config is finite (free-form kwargs are checked by their component)."""
    for k, v in dotted(cfg.model_dump(by_alias=True)).items():
        if isinstance(v, float) and not k.startswith(
            ("algorithm.loss_kwargs", "algorithm.advantage_kwargs", "algorithm.corrections", "task.kwargs")
        ):
            assert math.isfinite(v), (k, v)


# ---------------------------------------------------------------- 1. --set key=value


@HSET
@given(key=keys, raw=values)
def test_set_is_accepted_and_round_trips_or_refused_naming_the_key(key, raw, tmp_path_factory):
    item = f"{key}={raw}"
    try:
        cfg = load_config(None, [item])
    except ValueError as e:
        msg = str(e)
        assert msg and "Traceback" not in msg
        assert names_the_key(msg, key) or "--set expects key=value" in msg, (item, msg)
        return
    _finite_leaves(cfg)
    round_trips(cfg, tmp_path_factory.mktemp("rt"))


@HSET
@given(items=st.lists(st.tuples(st.sampled_from(LEAVES), values), min_size=2, max_size=4))
def test_several_sets_are_accepted_or_one_of_their_keys_is_named(items, tmp_path_factory):
    try:
        cfg = load_config(None, [f"{k}={v}" for k, v in items])
    except ValueError as e:
        assert any(names_the_key(str(e), k) for k, _ in items), (items, str(e))
        return
    _finite_leaves(cfg)
    round_trips(cfg, tmp_path_factory.mktemp("rt"))


class _ReachedWarmStart(Exception):
    """The config passed every check made before the warm start."""


@pytest.fixture
def in_tmp(monkeypatch, tmp_path):
    """Runs in tmp_path (a default run_dir lands in tmp_path/runs); the warm start is where a run stops."""
    monkeypatch.chdir(tmp_path)

    def stop(*_a, **_k):
        raise _ReachedWarmStart

    monkeypatch.setattr(warmstart, "default_model_dir", stop)
    return tmp_path


def train(capsys, *argv: str) -> tuple[int | None, str]:
    """(exit code, the one-line error) of `exactrl train argv`; code None: it reached the warm start."""
    capsys.readouterr()
    try:
        code = main(["train", *argv])
    except _ReachedWarmStart:
        return None, ""
    err = capsys.readouterr().err.strip()
    assert code == 2, (argv, code, err)
    assert err.startswith("exactrl train: error: ") and "\n" not in err and "Traceback" not in err, err
    return code, err


@CLI
@given(key=keys.filter(lambda k: not k.strip().startswith(FS_KEYS)), raw=values)
def test_cli_set_is_one_line_naming_the_key_with_nothing_written(key, raw, in_tmp, capsys):
    code, err = train(capsys, "--set", "progress=false", "--set", f"{key}={raw}")
    if code is not None:
        parts = key.strip().split(".")
        words = {w for p in parts for w in (p, p.removesuffix("_kwargs"), p.removesuffix("s")) if len(w) >= 3}
        assert names_the_key(err, key) or "--set" in err or any(w in err for w in words), err
    assert sorted(p.name for p in in_tmp.iterdir()) == [], "a refused or unstarted run wrote something"


# ---------------------------------------------------------------- 2. config files


documents = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=5)
    | st.sampled_from(LEAVES + SECTIONS),
    lambda c: (
        st.lists(c, max_size=3)
        | st.dictionaries(st.sampled_from(LEAVES + SECTIONS) | st.text(max_size=4), c, max_size=4)
    ),
    max_leaves=12,
)


def _config_text(doc) -> str:
    """A document as YAML, with dotted keys nested as sections (so many keys are real ones)."""
    if isinstance(doc, dict):
        tree: dict = {}
        for k, v in doc.items():
            node = tree
            for part in k.split(".")[:-1] if k.strip(".") and ".." not in k else []:
                node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else {}
            node[k.split(".")[-1] if k.strip(".") and ".." not in k else k] = v
        doc = tree
    return yaml.safe_dump(doc, allow_unicode=True)


RAW = [
    b"",
    b"\n",
    b"# only a comment\n",
    b"---\n...\n",
    b"\xff\xfe\x00",
    b"run_dir: caf\xe9\n",
    b"\xef\xbb\xbfseed: 1\n",
    b"\x00",
    b"seed: \x07\n",
    b"[" * 3000,
    b"a: " * 2000 + b"1",
    b"- " * 2000 + b"1",
    b"? [a, b]\n: 1\n",
    b"? {a: 1}\n: 1\n",
    b"optim:\n  ? [1]\n  : 2\n",
    b"task: {kwargs: {? [1] : 2}}\n",
    b"? !!set {a}\n: 1\n",
    b"seed: 1\nseed: 2\n",
    b"optim: {lr: 1, lr: 2}\n",
    b"<<: {seed: 1}\n",
    b"!!python/object:os.system {}\n",
    b"seed: !!python/name:os.system\n",
    b"seed: 1\n---\nseed: 2\n",
    b"seed: 1\n\t- x\n",
    b"1: 2\n",
    b"null: 1\n",
    b"2024-01-01: 1\n",
    b"optim:\n",
    b"optim: 3\n",
    b"model: {path: null}\n",
    b"async: {enabled: 1}\n",
    b"rollout: {top_k: 99999999999999999999}\n",
    b"rollout_backend: {timeout_s: 1.0e+300}\n",
    b"rollout_backend: {ray: {call_timeout_s: 1.0e+300}}\n",
    b"seed: &a 1\nmax_steps: *a\n",
    b"'text'\n",
    b"3.5\n",
]


def _check_file(p: Path, tmp: Path, top_keys=()) -> None:
    try:
        cfg = load_config(p)
    except ValueError as e:
        msg = str(e)
        assert str(p) in msg or any(str(k) in msg for k in top_keys) or "config key" in msg, msg
        return
    _finite_leaves(cfg)
    round_trips(cfg, tmp)


@HSET
@given(doc=documents)
def test_config_files_are_accepted_and_round_trip_or_refused_naming_file_or_key(doc, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("f")
    p = tmp / "run.yaml"
    text = _config_text(doc)
    p.write_text(text)
    top = [k for k in yaml.safe_load(text)] if isinstance(yaml.safe_load(text), dict) else []
    _check_file(p, tmp, top)


@HSET
@given(doc=documents, cut=st.integers(0, 200), junk=st.binary(max_size=4))
def test_broken_config_files_are_refused_naming_the_file_or_key(doc, cut, junk, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("f")
    p = tmp / "run.yaml"
    data = _config_text(doc).encode()
    p.write_bytes(data[:cut] + junk + data[cut:])
    try:
        top = list(yaml.safe_load(p.read_bytes().decode("utf-8")) or {})
    except Exception:  # noqa: BLE001 - anything unreadable: the error must name the file
        top = []
    _check_file(p, tmp, [str(k) for k in top])


@pytest.mark.parametrize("content", RAW, ids=range(len(RAW)))
def test_odd_config_files_through_the_cli(content, in_tmp, capsys):
    p = in_tmp / "run.yaml"
    p.write_bytes(content)
    code, err = train(capsys, str(p), "--set", "progress=false")
    if code is not None:
        assert str(p) in err or re.search(r"'\w[\w.]*'", err) or "error: bad key " in err, err
    assert sorted(q.name for q in in_tmp.iterdir()) == ["run.yaml"]


@pytest.mark.parametrize("make", ["missing", "directory", "fifo", "unreadable", "dangling"])
def test_config_paths_that_are_no_file(make, in_tmp, capsys):
    p = in_tmp / "run.yaml"
    if make == "directory":
        p.mkdir()
    elif make == "fifo":
        os.mkfifo(p)
    elif make == "unreadable":
        p.write_text("seed: 1\n")
        p.chmod(0)
        if os.access(p, os.R_OK):
            pytest.skip("root reads any file")
    elif make == "dangling":
        p.symlink_to(in_tmp / "nowhere.yaml")
    code, err = train(capsys, str(p))
    assert code == 2 and f"config file {p}" in err, err
    assert not (in_tmp / "runs").exists()


# ---------------------------------------------------------------- 3. rules across keys


@HSET
@given(
    spp=st.integers(1, 300),
    seqs=st.integers(1, 300),
    kind=st.sampled_from(["engine", "ray", "openai"]),
    buf=st.integers(0, 40),
    max_tokens=st.integers(1, 40),
    resume=st.booleans(),
    run_dir=st.booleans(),
    top_k=st.sampled_from([-2, -1, 0, 1, 5, 2**63 - 1, 2**63, 10**30]),
)
def test_rules_across_keys_are_checked_when_the_config_is_read(
    spp, seqs, kind, buf, max_tokens, resume, run_dir, top_k
):
    over = [
        f"rollout.samples_per_prompt={spp}",
        f"engine.max_num_seqs={seqs}",
        f"rollout_backend.kind={kind}",
        f"algorithm.overlong.buffer_len={buf}",
        f"rollout.max_tokens={max_tokens}",
        f"resume={resume}",
        f"rollout.top_k={top_k}",
    ]
    over += ["run_dir=r"] * run_dir + ["rollout_backend.base_url=http://h:1", "rollout_backend.model=m"] * (
        kind == "openai"
    )
    # one sample per prompt under the default grpo: every advantage would be 0
    broken = {
        "rollout.samples_per_prompt": (spp > seqs and kind != "openai") or spp == 1,
        "resume": resume and not run_dir,
        "algorithm.overlong.buffer_len": buf > max_tokens,
        "rollout.top_k": not (top_k == -1 or 1 <= top_k < 2**63),
    }
    try:
        cfg = load_config(None, over)
    except ValueError as e:
        assert any(broken.values()), str(e)
        assert any(k in str(e) for k, bad in broken.items() if bad), str(e)
        return
    assert not any(broken.values()), broken
    assert cfg.rollout.top_k == top_k


junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 5),
    st.sampled_from([0.0, 0.2, 1.0, 1.5, 3.0, -1.0, 1e308]),
    st.sampled_from([".nan", ".inf", "abc", "[1]", "{a: 1}", "1e-3", "token", "sequence", "k2", "nope"]),
)


def _arg_names(factory) -> list[str]:
    import inspect

    return [n for n in inspect.signature(factory).parameters if n not in ("self", "rewards_PG")]


@CLI
@given(data=st.data())
def test_component_kwargs_are_checked_before_the_warm_start(data, in_tmp, capsys):
    """A loss, a correction or an advantage estimator with random arguments: refused at once naming it,
    or built (the run goes on to the warm start)."""
    from exactrl.algo.advantages import ADVANTAGES

    what = data.draw(st.sampled_from(["loss", "correction", "advantage"]))
    table = {"loss": LOSSES, "correction": CORRECTIONS, "advantage": ADVANTAGES}[what]
    name = data.draw(st.sampled_from(sorted(table)))
    args = _arg_names(table[name]) + ["nosuch"]
    kwargs = data.draw(st.dictionaries(st.sampled_from(args), junk, max_size=3))
    flow = "{" + ", ".join(f"{k}: {v if isinstance(v, str) else json.dumps(v)}" for k, v in kwargs.items()) + "}"
    sets = {
        "loss": [f"algorithm.loss={name}", f"algorithm.loss_kwargs={flow}"],
        "correction": [f"algorithm.corrections=[{{name: {name}{', ' + flow[1:-1] if kwargs else ''}}}]"],
        "advantage": [f"algorithm.advantage={name}", f"algorithm.advantage_kwargs={flow}"],
    }[what]
    sets += data.draw(
        st.lists(
            st.sampled_from(
                [
                    "algorithm.bypass=true",
                    "async.enabled=true",
                    "async.inflight_updates=true",
                    "rollout_backend.kind=ray",
                ]
            ),
            unique=True,
            max_size=2,
        )
    )
    code, err = train(capsys, *[x for s in ["progress=false", *sets] for x in ("--set", s)])
    if code is not None:
        assert (
            f"{what} {name!r}" in err
            or f"{what}s[0] ({name!r})" in err
            or "algorithm." in err
            or "rollout_backend" in err
        ), err
    assert sorted(p.name for p in in_tmp.iterdir()) == []
