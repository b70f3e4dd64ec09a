"""Run config: YAML + --set overrides, errors that name the key."""

from __future__ import annotations

import re

import pytest

from exactrl.train.config import load_config


def test_defaults_and_overrides(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("max_steps: 5\nmodel:\n  kernels: fast\nalgorithm:\n  loss: gspo\n")
    cfg = load_config(p, ["seed=3", "algorithm.loss_kwargs={eps_low: 0.1, eps_high: 0.3}", "run_dir=/tmp/x"])
    assert (cfg.max_steps, cfg.seed, cfg.model.kernels, cfg.algorithm.loss) == (5, 3, "fast", "gspo")
    assert cfg.algorithm.loss_kwargs == {"eps_low": 0.1, "eps_high": 0.3}
    assert cfg.run_dir == "/tmp/x"
    default = load_config(None, [])
    assert default.model.kernels == "exact" and default.max_steps > 0


@pytest.mark.parametrize(
    "override,needle",
    [
        ("model.kernals=fast", "unknown config key 'model.kernals'"),
        ("max_stepz=3", "unknown config key 'max_stepz'"),
        ("max_steps=-1", "bad value for 'max_steps'"),
        ("max_steps=0", "bad value for 'max_steps'"),  # a new run of 0 steps would leave an empty run dir
        ("model.kernels=turbo", "bad value for 'model.kernels'"),
        ("rollout.top_p=1.5", "bad value for 'rollout.top_p'"),
        ("seed", "--set expects key=value"),
        ("=1", "--set expects key=value with a dotted key, got '=1'"),  # not pydantic's "Extra inputs" for no key
        ("optim..lr=1", "with a dotted key"),
        ("max_steps.x=1", "max_steps"),
        ("optim.lr=true", "bad value for 'optim.lr': Input should be a number, not a boolean"),  # not lr = 1.0
        ("max_steps=true", "bad value for 'max_steps'"),
        ("optim.betas=[true, 0.9]", "bad value for 'optim.betas'"),
        ("rollout_backend.ray.num_engines=false", "bad value for 'rollout_backend.ray.num_engines'"),
        ("run_dir=''", "bad value for 'run_dir': a path must not be empty or only spaces"),  # not the cwd
        ("model.path=''", "bad value for 'model.path'"),  # not the default model
        ("model.tokenizer='  '", "bad value for 'model.tokenizer'"),  # spaces: no directory a user means
        ("task.train_jsonl=' '", "bad value for 'task.train_jsonl'"),
        ("task.module=''", "bad value for 'task.module'"),
        ("rollout_backend.sync_dir=' '", "bad value for 'rollout_backend.sync_dir'"),
        # each refused here, where it would otherwise fail later (as noted) or end in a traceback
        ("rollout.top_k=9223372036854775808", "bad value for 'rollout.top_k'"),  # SamplingParams at step 1
        (
            "rollout_backend.timeout_s=1.0e+10",
            "bad value for 'rollout_backend.timeout_s'",
        ),  # OverflowError, 1st request
        ("task.train_size=100000000000000000000", "bad value for 'task.train_size'"),  # generated until out of memory
        ("task.eval_size=100000000000000000000", "bad value for 'task.eval_size'"),
        (
            "rollout.prompts_per_step=100000000000000000000",
            "bad value for 'rollout.prompts_per_step'",
        ),  # otherwise no step would come
        ("algorithm.loss_kwargs={eps_low: .nan}", "bad value for 'algorithm.loss_kwargs': eps_low is nan"),
        ("task.kwargs={x: !!binary aGVsbG8=}", "bad value for 'task.kwargs': x is a bytes"),  # config.json: TypeError
        ("algorithm.corrections=[{name: token_tis, upper: 2024-01-01}]", "'algorithm.corrections.0': upper is a date"),
        ("algorithm.loss_kwargs={eps_low: 0.1, eps_low: 0.2}", "not valid YAML (the key 'eps_low' appears twice)"),
        (
            "task.kwargs={? [1] : 2}",
            "--set task.kwargs: not valid YAML (while constructing a mapping found unhashable key)",
        ),
        (
            "max_steps=" + "[" * 3000,
            "--set max_steps: not valid YAML (lists or mappings nested too deeply)",
        ),  # RecursionError
        ("task.kwargs={1: 2}", "bad key 1 in 'task.kwargs': a key must be a name (text)"),  # not 'task.kwargs.1.[key]'
    ],
)
def test_bad_overrides_name_the_key(override, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        load_config(None, [override])


def test_a_kv_budget_no_prompt_fits_in_is_refused_before_the_run():
    """Refused before the run, not at the first rollout after the warm start. The pool holds whole pages of 32, so a
    budget of 1 holds 32 tokens: room for an answer of 31 and a prompt of 1, not for 32."""
    with pytest.raises(
        ValueError,
        match=re.escape(
            "engine.kv_budget_tokens=1 (32 tokens in pages of 32) cannot hold a "
            "prompt and rollout.max_tokens=32 answer tokens"
        ),
    ):
        load_config(None, ["engine.kv_budget_tokens=1", "rollout.max_tokens=32"])
    assert load_config(None, ["engine.kv_budget_tokens=1", "rollout.max_tokens=31"]).engine.kv_budget_tokens == 1
    # an external server keeps its own cache: the engine's settings do not apply
    assert (
        load_config(
            None,
            [
                "engine.kv_budget_tokens=1",
                "rollout.max_tokens=32",
                "rollout_backend.kind=openai",
                "rollout_backend.base_url=http://x",
                "rollout_backend.model=m",
            ],
        ).rollout.max_tokens
        == 32
    )


def test_missing_and_malformed_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        load_config(bad)


def test_settings_switched_off_by_others_are_named():
    from exactrl.train.config import ignored_settings

    cfg = load_config(
        None,
        [
            "async.max_staleness=2",
            "algorithm.kl.kind=k1",
            "model.path=/m",
            "sft.steps=3",
            "algorithm.overlong.penalty_factor=0.5",
            "optim.fp32_master_weights=false",
        ],
    )
    assert ignored_settings(cfg) == [
        "async.max_staleness has no effect: async.enabled is false",
        "algorithm.kl.kind has no effect: algorithm.kl.coef is 0",
        "algorithm.overlong.penalty_factor has no effect: algorithm.overlong.buffer_len is 0",
        "optim.fp32_master_weights has no effect: model.dtype is float32",
        "sft.steps has no effect: model.path is set, and the SFT warm start is the default model's",
    ]
    # the same keys with their features on, and the defaults: nothing to say
    on = load_config(
        None,
        [
            "async.enabled=true",
            "async.max_staleness=2",
            "algorithm.kl.coef=0.1",
            "algorithm.kl.kind=k1",
            "sft.steps=3",
            "algorithm.overlong.buffer_len=4",
            "algorithm.overlong.penalty_factor=0.5",
            "model.dtype=bfloat16",
            "optim.fp32_master_weights=false",
        ],
    )
    assert ignored_settings(on) == [] and ignored_settings(load_config()) == []


def test_docs_config_md_lists_every_key_as_the_code_defines_it():
    """docs/config.md is `config_reference()`: regenerate it with
    `python -c "from exactrl.train.config import config_reference; print(config_reference(), end='')" \
    > docs/config.md`."""
    from pathlib import Path

    from exactrl.train.config import config_reference, dotted

    text = config_reference()
    assert (Path(__file__).resolve().parents[3] / "docs" / "config.md").read_text() == text
    for key in dotted(load_config().model_dump(by_alias=True)):  # every leaf key has its row
        assert f"| `{key}` |" in text, key
    assert "| `async.max_staleness` | int | `1` |" in text and "|  |\n" not in text  # each with its meaning
