"""metrics.jsonl on resume: rows past the checkpoint go, a row cut short by a crash goes, other damage is named."""
from __future__ import annotations

import json

import pytest

from exactrl.rl.logger import _keep_steps_up_to


def _rows(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_rows_after_the_checkpoint_and_a_torn_last_row_are_dropped(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": s, "x": 1.0}) + "\n" for s in range(4)) + '{"step": 4, "x"')
    _keep_steps_up_to(p, 2)
    assert _rows(p) == [0, 1, 2]


def test_a_bad_row_before_the_last_is_named(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 0}\n{"step": 1\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not valid JSON"):
        _keep_steps_up_to(p, 2)
    assert p.read_text() == '{"step": 0}\n{"step": 1\n{"step": 2}\n'  # left as it was
