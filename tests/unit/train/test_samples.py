"""Sample logging (train/samples.py): which samples a step logs, samples.jsonl on resume, the printed lines,
and the `progress` key in both its forms (a bool, a section with `samples`)."""

from __future__ import annotations

import json

import pytest

from exactrl.envs.base import Problem
from exactrl.rollout.groups import Rollout
from exactrl.train.config import load_config
from exactrl.train.logger import MetricsLogger
from exactrl.train.samples import SamplesFile, read_samples, sample_rows


class _Tokens:
    """A tokenizer of one character per id (chr), enough to decode prompts."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def _groups(P: int, G: int) -> list[list[Rollout]]:
    return [
        [
            Rollout(
                Problem(f"q{p}", str(p)),
                [ord("a") + p, ord("?")],
                [100 + g, 2],
                [-0.5 - g, -0.25],
                [0, 0],
                "stop",
                f"answer {p}.{g}",
                float(g == 0),
            )
            for g in range(G)
        ]
        for p in range(P)
    ]


def test_rows_take_one_sample_per_prompt_before_a_second_of_any():
    rows = sample_rows(_groups(3, 2), 4, 7, "train", _Tokens())
    assert [r["completion"] for r in rows] == ["answer 0.0", "answer 1.0", "answer 2.0", "answer 0.1"]
    assert rows[3] == {
        "step": 7,
        "kind": "train",
        "prompt": "a?",
        "prompt_ids": [97, 63],
        "completion": "answer 0.1",
        "completion_ids": [101, 2],
        "logprobs": [-1.5, -0.25],
        "reward": 0.0,
        "finish_reason": "stop",
    }
    assert len(sample_rows(_groups(2, 2), 10, 1, "eval", _Tokens())) == 4  # fewer than asked: all of them
    assert sample_rows(_groups(2, 2), 0, 1, "eval", _Tokens()) == []


def test_logger_writes_the_first_samples_and_prints_its_own_count(tmp_path, capsys):
    log = MetricsLogger(tmp_path, False, False, 3, 0, samples=2, print_samples=3)
    log.log_samples(sample_rows(_groups(4, 1), 3, 1, "train", _Tokens()))
    log.flush()
    assert [r["completion"] for r in read_samples(tmp_path)] == ["answer 0.0", "answer 1.0"]
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3 and printed[2] == "  [train step 1] reward 1.000  'c?' -> 'answer 2.0'"
    log.close()
    off = MetricsLogger(tmp_path / "off", False, False, 3, 0, samples=0)
    off.log_samples(sample_rows(_groups(4, 1), 3, 1, "train", _Tokens()))
    assert not (tmp_path / "off" / "samples.jsonl").exists() and capsys.readouterr().out == ""


@pytest.mark.parametrize(("start", "kept"), [(2, [0, 1, 2]), (0, [])])
def test_resume_drops_the_redone_steps_and_from_step_0_the_initial_evaluation(tmp_path, start, kept):
    """Rows past the checkpoint are redone, as metrics.jsonl's; a run resumed from step 0 redoes its
    initial evaluation (step 0) too. A row torn by a crash goes; a bad row elsewhere is named."""
    p = tmp_path / "samples.jsonl"
    p.write_text("".join(json.dumps({"step": s, "kind": "train"}) + "\n" for s in range(4)) + '{"step": 4, "ki')
    SamplesFile(tmp_path, start)
    assert [r["step"] for r in read_samples(tmp_path)] == kept
    p.write_text('{"step": 0}\n["not a row"]\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"samples.jsonl:2: not a row of samples with an integer step"):
        SamplesFile(tmp_path, 1)


def test_progress_takes_a_bool_or_a_section(tmp_path):
    assert load_config(None, ["progress=false"]).progress.enabled is False
    assert load_config(None, []).progress.model_dump() == {"enabled": True, "samples": 0}
    cfg = load_config(None, ["progress.samples=3"])
    assert (cfg.progress.enabled, cfg.progress.samples) == (True, 3)
    f = tmp_path / "c.yaml"
    f.write_text("progress: false\n")
    cfg = load_config(f, ["progress.samples=2"])  # the file's switch, then a key of its section
    assert (cfg.progress.enabled, cfg.progress.samples) == (False, 2)
    assert load_config(None, ["progress={enabled: false, samples: 1}"]).progress.samples == 1
    with pytest.raises(ValueError, match=r"'progress': must be true, false or a section of enabled and samples"):
        load_config(None, ["progress=3"])
    with pytest.raises(ValueError, match=r"'progress.samples'"):
        load_config(None, ["progress.samples=-1"])
    with pytest.raises(ValueError, match=r"unknown config key 'progress.sample'"):
        load_config(None, ["progress.sample=1"])
    assert load_config(None, []).logging.samples == 4
    with pytest.raises(ValueError, match=r"'logging.samples'"):
        load_config(None, ["logging.samples=-2"])
