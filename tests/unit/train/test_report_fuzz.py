"""Property-based review of `exactrl report`: whatever metrics.jsonl holds, the report plots what it can and
names what it cannot (a note on stderr, or one clean error line), never a traceback.

A crashed run leaves a last line cut short; other tools or hands leave NaN, inf, huge numbers, keys in only
some rows, blank lines, deep nesting and binary junk.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
from fuzzing import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exactrl.cli import main
from exactrl.train.report import INITIAL, PANELS, PLOTTABLE, write_report

PLOTTED = [INITIAL] + [k for _, keys in PANELS for k in keys]
FEW = settings(max_examples=examples(10), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
MANY = settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

values = (
    st.floats(0, 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.floats(-PLOTTABLE, PLOTTABLE)
    | st.integers(-(10**6), 10**6)
    | st.integers(-(10**400), 10**400)
    | st.sampled_from([PLOTTABLE, -PLOTTABLE])
)
rows = st.lists(
    st.fixed_dictionaries(
        {"step": st.integers(-10, 10**6) | st.sampled_from([10**300, -(10**300)])},
        optional={k: values for k in PLOTTED + ["time/step_s", "other"]},
    ),
    min_size=1,
    max_size=12,
)


def _plottable(v) -> bool:
    return (isinstance(v, int) or math.isfinite(v)) and abs(v) <= PLOTTABLE


def _write(run_dir: Path, rows_: list[dict], blank_every: int, cut: int | None) -> None:
    lines = [json.dumps(r) for r in rows_]
    text = "".join(line + "\n" + "\n" * (i % blank_every == 0) for i, line in enumerate(lines))
    if cut is not None:  # a crash while the next row was written: part of a line, no newline
        text += json.dumps({"step": 99, "rollout/reward_mean": 0.5})[:cut]
    (run_dir / "metrics.jsonl").write_text(text)


def _check_report(run_dir: Path, rows_: list[dict]) -> None:
    notes = []
    paths = write_report(run_dir, warn=notes.append)
    assert [p.name for p in paths] == ["summary.png"] + [f"{name}.png" for name, _ in PANELS]
    assert all(p.stat().st_size > 0 for p in paths)
    text = "\n".join(notes)
    for name, keys in PANELS:
        drawn = [
            k
            for k in keys
            if any(k in r and _plottable(r[k]) for r in rows_)
            or (k == "eval/accuracy" and any(INITIAL in r and _plottable(r[INITIAL]) for r in rows_))
        ]
        assert (f"panel {name!r} is empty" in text) == (not drawn)
        for k in keys:
            left_out = any(k in r and not _plottable(r[k]) for r in rows_)
            assert (f"{k} left out of the plot" in text) == left_out or k == "eval/accuracy"


def _run(rows_, blank_every, cut):
    with tempfile.TemporaryDirectory(prefix="report_fuzz_") as d:  # one per example: hypothesis reuses no tmp_path
        _write(Path(d), rows_, blank_every, cut)
        _check_report(Path(d), rows_)


@FEW
@given(rows_=rows, blank_every=st.integers(1, 4), cut=st.none() | st.integers(1, 30))
def test_any_numbers_plot_or_are_named(rows_, blank_every, cut):
    _run(rows_, blank_every, cut)


@pytest.mark.slow
@MANY
@given(rows_=rows, blank_every=st.integers(1, 4), cut=st.none() | st.integers(1, 30))
def test_any_numbers_plot_or_are_named_many(rows_, blank_every, cut):
    _run(rows_, blank_every, cut)


@pytest.mark.parametrize(
    "bad",
    [float("nan"), float("inf"), -float("inf"), 1e308, -1e308, 10**400, -(10**301)],
    ids=["nan", "inf", "-inf", "1e308", "-1e308", "10**400", "-10**301"],
)
def test_a_value_that_cannot_be_drawn_is_left_out_and_named(tmp_path, bad):
    """NaN and inf were drawn as gaps without a word, ±1e308 failed inside matplotlib ("arange: cannot compute
    length"), an integer beyond float range raised OverflowError (a traceback)."""
    _write(
        tmp_path,
        [
            {"step": 1, "rollout/reward_mean": 0.5},
            {"step": 2, "rollout/reward_mean": bad},
            {"step": 3, "rollout/reward_mean": -0.5},
        ],
        10,
        None,
    )
    notes = []
    write_report(tmp_path, warn=notes.append)
    assert any("rollout/reward_mean left out of the plot" in n and "at step 2" in n for n in notes)
    assert not any("panel 'reward' is empty" in n for n in notes)


@FEW
@given(
    data=st.binary(max_size=300)
    | st.text(alphabet='{}[]"step:,0123456789.eE-+NaInfity \n\r\t', max_size=300).map(str.encode)
)
def test_arbitrary_bytes_give_a_report_or_one_clean_error(data, capsys):
    with tempfile.TemporaryDirectory(prefix="report_fuzz_") as run_dir:
        (Path(run_dir) / "metrics.jsonl").write_bytes(data)
        code = main(["report", run_dir])
    err = capsys.readouterr().err
    assert code in (0, 2)
    if code == 2:
        assert err.startswith("exactrl report: error: ") and "metrics.jsonl" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "line", ['{"step": 2, "x": ' + "[" * 100_000 + "]" * 100_000 + "}", '{"step": 2, "x": ' + "7" * 5000 + "}"]
)
def test_lines_json_cannot_read_are_named_by_file_and_line(tmp_path, capsys, line):
    """Deep nesting raised a bare RecursionError (a traceback); a 5000-digit integer gave int()'s message
    about sys.set_int_max_str_digits, without the file."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n\n' + line + "\n")
    assert main(["report", str(tmp_path)]) == 2
    assert f"{tmp_path / 'metrics.jsonl'}:3: " in capsys.readouterr().err


def test_a_step_too_large_to_plot_is_named(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": ' + "9" * 400 + "}\n")
    assert main(["report", str(tmp_path)]) == 2
    assert "row 2: 'step' is 999999999999..., too large to plot" in capsys.readouterr().err


def test_run_dirs_without_metrics_are_clean_errors(tmp_path, capsys):
    cases = {
        tmp_path / "missing": f"run directory {tmp_path / 'missing'} does not exist",
        tmp_path: "has no metrics.jsonl",
    }
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "metrics.jsonl").mkdir()  # a directory where the file should be
    cases[tmp_path / "d"] = f"{tmp_path / 'd' / 'metrics.jsonl'} is a directory, not the run's metrics file"
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "metrics.jsonl").write_text("\n\n  \n")
    cases[tmp_path / "e"] = "has no metrics yet"
    for run_dir, message in cases.items():
        assert main(["report", str(run_dir)]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


def test_keys_in_only_some_rows_and_a_cut_last_line_still_plot(tmp_path):
    rows_ = [
        {"step": 1, "rollout/reward_mean": 0.1, INITIAL: 0.0, "eval/accuracy": 0.2},
        {"step": 2, "rollout/response_len_mean": 7.0},
        {"step": 3, "rollout/accuracy": 1, "train/train_rollout_logprob_abs_diff": 0.0},
    ]
    _write(tmp_path, rows_, 2, 17)
    notes = []
    write_report(tmp_path, warn=notes.append)
    assert notes == []  # every panel has a value, none is left out


@pytest.mark.parametrize(
    "line",
    ['{"step": 2, "x": ' + "[" * 100_000 + "]" * 100_000 + "}", '{"step": 2, "x": ' + "7" * 5000 + "}"],
    ids=["nested", "long-int"],
)
def test_resume_names_the_same_lines(tmp_path, line):
    """metrics.jsonl is read again when a run resumes: the same lines are named there, not a RecursionError."""
    from exactrl.train.logger import MetricsLogger

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n' + line + '\n{"step": 3}\n')
    with pytest.raises(ValueError, match=rf"{tmp_path / 'metrics.jsonl'}:2: "):
        MetricsLogger(tmp_path, tensorboard=False, progress=False, total_steps=5, start_step=1)
