"""Settings under which a run would train nothing, or end without a word, are refused by name."""

from __future__ import annotations

import re

import pytest
from conftest import default_job_model

from exactrl.algo.advantages import ADVANTAGES, GROUP_BASELINE
from exactrl.cli import main
from exactrl.train.config import load_config


@pytest.mark.parametrize("advantage", sorted(GROUP_BASELINE))
def test_one_sample_per_prompt_under_a_group_baseline_is_refused(advantage):
    """Each sample's advantage is its reward minus its own group's: with one sample, 0, so the loss and its
    gradient are 0 every step."""
    with pytest.raises(
        ValueError,
        match=rf"rollout.samples_per_prompt=1 with algorithm.advantage={advantage}: .*"
        rf"nothing would train.*one sample per prompt \(reinforce_pp\)",
    ):
        load_config(None, ["rollout.samples_per_prompt=1", f"algorithm.advantage={advantage}"])


def test_one_sample_per_prompt_is_accepted_where_the_baseline_is_the_batch():
    assert set(ADVANTAGES) - GROUP_BASELINE == {"reinforce_pp"}
    cfg = load_config(None, ["rollout.samples_per_prompt=1", "algorithm.advantage=reinforce_pp"])
    assert cfg.rollout.samples_per_prompt == 1


TINY = [
    "progress=false",
    "tensorboard=false",
    "task.eval_size=0",
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=2",
    "engine.kv_budget_tokens=2048",
    "max_steps=1",
]


@pytest.mark.parametrize(
    "body, words",
    [
        ("import sys\nsys.exit(0)\n", r"called sys.exit\(0\) while it was imported"),
        (
            "import sys\nsys.exit('usage: tasks.py N')\n",
            r"called sys.exit\('usage: tasks.py N'\) while it was imported",
        ),
        ("raise KeyError('NEEDED_ENV')\n", r"failed while it was imported \(KeyError: 'NEEDED_ENV'\)"),
    ],
)
def test_a_task_module_that_exits_or_fails_at_import_is_named(tmp_path_factory, tmp_path, capsys, body, words):
    model_dir = default_job_model(tmp_path_factory, sft_steps=0)
    module = tmp_path / "tasks.py"
    module.write_text(body)
    sets = [*TINY, f"model.path={model_dir}", f"run_dir={tmp_path / 'r'}", f"task.module={module}"]
    assert main(["train"] + [x for s in sets for x in ("--set", s)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"exactrl train: error: task module {module} ") and "\n" not in err, err
    assert re.search(words, err), err
    assert not (tmp_path / "r").exists()
