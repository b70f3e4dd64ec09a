"""Ray engine actors as the rollout backend (exactrl/distributed/ray_engines.py).

The claim under test: which engine samples a prompt changes nothing, so Ray
engines give the in-process engine's tokens and logprobs bitwise, and a run
over them logs the in-process run's metrics bitwise. The inverse twin: with
`fast` kernels the same run measures a non-zero mismatch.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket

import pytest
import torch
from conftest import default_job_model, train_rows

import exactrl
from exactrl.distributed import Ranks
from exactrl.engine import Engine, NonFiniteLogitsError, SamplingParams
from exactrl.train.config import load_config
from exactrl.train.setup import build, check_ranks

ray = pytest.importorskip("ray")
from exactrl.distributed.ray_engines import RayEngineError, RayEngines, RayEngineSettings  # noqa: E402

SMALL = [
    "progress=false",
    "tensorboard=false",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "task.eval_size=8",
    "eval_every=2",
    "optim.lr=1e-3",
    "engine.kv_budget_tokens=4096",
    "algorithm.entropy_coef=0.01",
]  # an entropy bonus: the weights move even without reward
RAY = ["rollout_backend.kind=ray", "rollout_backend.ray.num_engines=2"]
# what only says how fast, or which backend counted what, differs between two runs of one job
TIMING = ("time/", "perf/", "ray/", "rollout/preemptions")  # and the in-process engine's own scheduling count


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The default job's model and tokenizer, without the warm start (random weights)."""
    return default_job_model(tmp_path_factory, sft_steps=0)


@pytest.fixture(scope="module")
def cluster():
    """One private Ray instance for the module's tests (starting one takes ~5 s); RayEngines joins it."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


def run(model_dir, run_dir, *overrides) -> list[dict]:
    return train_rows(SMALL, model_dir, run_dir, *overrides)


def results(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def workload(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Mixed prompt lengths, n, temperatures (greedy too), top-k / top-p, one stop token."""
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(3, 24))] for _ in range(9)]
    params = [
        SamplingParams(
            temperature=(1.0, 0.7, 0.0)[k % 3],
            top_k=(-1, 7)[k % 2],
            top_p=(1.0, 0.9)[k % 2],
            max_tokens=10,
            n=1 + k % 3,
            seed=100 + k,
            stop_token_ids=[k],
        )
        for k in range(9)
    ]
    return prompts, params


def fields(outs) -> list:
    return [[(c.token_ids, c.logprobs, c.versions, c.finish_reason) for c in o] for o in outs]


# ---------------------------------------------------------------- config, no Ray needed
def test_config_section_and_errors():
    cfg = load_config(None, [*RAY, "rollout_backend.ray.threads_per_engine=1"])
    assert cfg.rollout_backend.ray == RayEngineSettings(num_engines=2, threads_per_engine=1)
    with pytest.raises(ValueError, match="num_engines"):
        load_config(None, ["rollout_backend.kind=ray", "rollout_backend.ray.num_engines=0"])
    with pytest.raises(
        ValueError,
        match=r"rollout_backend.ray.num_engines=5 exceeds rollout.prompts_per_step=4: "
        r"each engine samples whole prompts, so 1 would never sample",
    ):
        load_config(
            None, ["rollout_backend.kind=ray", "rollout_backend.ray.num_engines=5", "rollout.prompts_per_step=4"]
        )
    with pytest.raises(ValueError, match=r"rollout_backend.ray.\* needs rollout_backend.kind=ray"):
        load_config(None, ["rollout_backend.ray.num_engines=3"])
    with pytest.raises(ValueError, match="samples_per_prompt=8 exceeds engine.max_num_seqs=4"):
        load_config(None, [*RAY, "rollout.samples_per_prompt=8", "engine.max_num_seqs=4"])
    with pytest.raises(ValueError, match="rollout_backend.base_urls needs rollout_backend.kind=openai"):
        load_config(None, ["rollout_backend.kind=ray", "rollout_backend.base_urls=[http://h:8000]"])
    with pytest.raises(ValueError, match="inflight_updates needs rollout_backend.kind=engine: a Ray engine"):
        build(load_config(None, [*RAY, "async.enabled=true", "async.inflight_updates=true"]))
    with pytest.raises(ValueError, match="rollout_backend.kind=ray runs in one process .*ray.num_engines"):
        check_ranks(load_config(None, RAY), Ranks(0, 2))


# ---------------------------------------------------------------- engines
def test_ray_missing_or_no_cluster_at_the_address_is_a_value_error(qwen3_dir, monkeypatch):
    import sys

    model = exactrl.load_model(qwen3_dir)
    if ray.is_initialized():
        pytest.skip("a Ray instance already runs in this process: the address is not used")
    with pytest.raises(ValueError, match=r"no Ray cluster at rollout_backend.ray.address='auto'"):
        RayEngines(RayEngineSettings(num_engines=1, address="auto"), model, {}, log=lambda *a: None)
    # a port where nothing listens: refused at once (ray.init alone retried it for over 5 minutes)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(
        ValueError,
        match=rf"no Ray cluster at rollout_backend.ray.address='{free}' \(nothing "
        r"accepts a connection there.*leave the address unset",
    ):
        RayEngines(RayEngineSettings(num_engines=1, address=free), model, {}, log=lambda *a: None)
    with pytest.raises(ValueError, match=r"no Ray cluster at rollout_backend.ray.address='h:p:q' \(Invalid address"):
        RayEngines(RayEngineSettings(num_engines=1, address="h:p:q"), model, {}, log=lambda *a: None)
    monkeypatch.setenv("RAY_ADDRESS", free)  # the address came from the environment: the message says so
    with pytest.raises(ValueError, match=r"at the environment variable RAY_ADDRESS='127.*unset RAY_ADDRESS"):
        RayEngines(RayEngineSettings(num_engines=1), model, {}, log=lambda *a: None)
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(ValueError, match=r"needs Ray: pip install 'exactrl\[ray\]'"):
        RayEngines(RayEngineSettings(num_engines=1), model, {}, log=lambda *a: None)


@pytest.mark.slow  # whole runs over Ray engines: `make test-slow` (CI)
def test_a_private_ray_instance_is_started_for_the_engines_and_stopped_after(qwen3_dir):
    if ray.is_initialized():  # runs before the module's `cluster` in file order; in another order it cannot
        pytest.skip("a Ray instance already runs in this process (the module's cluster): no private one to see")
    model = exactrl.load_model(qwen3_dir)
    engines = RayEngines(
        RayEngineSettings(num_engines=1, threads_per_engine=1), model, {"kv_budget_tokens": 2048}, log=lambda *a: None
    )  # one of the instance's 2 CPUs: `joined` takes the other
    joined = None
    try:
        assert ray.is_initialized() and all("float32, exact kernels, 1 thread(s)" in p for p in engines.places)
        prompts, params = workload(model.config.vocab_size)
        assert fields(engines.generate(prompts, params)) == fields(
            Engine(model, kv_budget_tokens=2048).generate(prompts, params)
        )
        joined = RayEngines(
            RayEngineSettings(num_engines=1, threads_per_engine=1), model, {}, log=lambda *a: None
        )  # the engines' instance is running: these join it
    finally:
        engines.close()
    assert not ray.is_initialized()
    joined.close()  # its actors went with the instance: nothing to stop (their stale handles do not raise)
    engines.close()  # again: nothing to do
    for e in (engines, joined):  # no engine left: refused, not an empty answer or a version bumped for nothing
        with pytest.raises(RayEngineError, match=r"the Ray engines are closed"):
            e.generate(prompts, params)
        with pytest.raises(RayEngineError, match=r"the Ray engines are closed"):
            e.update_weights(model.state_dict())
        assert e.version == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ray_engines_sample_what_the_in_process_engine_does_bitwise(cluster, qwen3_dir, dtype):
    model = exactrl.load_model(qwen3_dir, dtype=dtype)
    prompts, params = workload(model.config.vocab_size)
    engines = RayEngines(
        RayEngineSettings(num_engines=2), model, {"kv_budget_tokens": 2048}, [5], version=3, log=lambda *a: None
    )
    try:
        assert all(f"{dtype}, exact kernels" in p for p in engines.places)
        local = Engine(model, stop_token_ids=[5], kv_budget_tokens=2048)
        local.version = 3
        got = engines.generate(prompts, params)
        assert fields(got) == fields(local.generate(prompts, params))
        assert {v for o in got for c in o for v in c.versions} == {3}
        for o, p, sp in zip(got, prompts, params):  # and the trainer's forward agrees (docs/design.md §1)
            lp = exactrl.sequence_logprobs(model, [p + o[0].token_ids], sp.temperature or 1.0, sp.top_k, sp.top_p)[0]
            assert o[0].logprobs == lp[len(p) - 1 :].tolist()
        assert fields(engines.generate(prompts[:1], params[:1])) == fields(got[:1])  # an engine left idle

        new = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
        assert engines.update_weights(new, version=7) == 7 and local.update_weights(new, version=7) == 7
        got = engines.generate(prompts, params)
        assert fields(got) == fields(local.generate(prompts, params))
        assert {v for o in got for c in o for v in c.versions} == {7}
        assert engines.stats()["engine/version"] == 7 and engines.stats()["ray/weight_syncs"] == 1

        # the batch is checked whole before any engine samples: the index is the batch's
        with pytest.raises(ValueError, match=r"prompts\[1\]: prompt_token_ids is empty"):
            engines.generate([prompts[0], [], []], params[:3])
        with pytest.raises(ValueError, match="version must be an int above the current version 7"):
            engines.update_weights(new, version=7)
        with pytest.raises(ValueError, match="version must be an int above the current version 7, got True"):
            engines.update_weights(new, version=True)
        # what the in-process engine says of a bad state dict, not an AttributeError of the wrapper
        with pytest.raises(ValueError, match="state_dict must be a mapping of parameter name -> tensor, got list"):
            engines.update_weights(list(new.values()))
        with pytest.raises(ValueError, match=r"state_dict\['model.norm.weight'\] is a float, not a tensor"):
            engines.update_weights({**new, "model.norm.weight": 1.0})
        with pytest.raises(ValueError, match=r"state_dict\['model.norm.weight'\] has shape \(3,\), expected"):
            engines.update_weights({**new, "model.norm.weight": torch.zeros(3, dtype=new["model.norm.weight"].dtype)})
        with pytest.raises(ValueError, match="prompts must be a list of prompts"):
            engines.generate(None, params[:1])
        assert engines.version == 7
        assert fields(engines.generate(prompts[:2], params[:2])) == fields(got[:2])  # still serving, old weights

        # diverged weights: the engine's own error (named as divergence by `exactrl train`), its message once
        engines.update_weights({k: v * float("nan") for k, v in new.items()})
        with pytest.raises(
            NonFiniteLogitsError,
            match=r"^non-finite logits \(NaN or inf\) for request\(s\) "
            r"\['req-\d+'.*\]: the model's weights .* were aborted$",
        ):
            engines.generate(prompts, params)
        engines.update_weights(new)

        ray.kill(engines.actors[1])
        with pytest.raises(RayEngineError, match=r"(?s)Ray engine 1 \(.*\) died while sampling.*resume=true"):
            engines.generate(prompts, params)
    finally:
        engines.close()
    assert ray.is_initialized()  # the engines joined the module's instance: it stays


def test_engines_get_the_models_kernels_and_settings_and_bad_ones_are_a_value_error(cluster, qwen3_dir):
    fast = exactrl.load_model(qwen3_dir, kernels="fast")
    engines = RayEngines(RayEngineSettings(num_engines=1, threads_per_engine=2), fast, {}, log=lambda *a: None)
    try:
        assert "float32, fast kernels, 2 thread(s)" in engines.places[0]
    finally:
        engines.close()
    with pytest.raises(ValueError, match=r"stop_token_ids holds 1000000, not a token id"):  # not "died"
        RayEngines(RayEngineSettings(num_engines=1), fast, {}, [10**6], log=lambda *a: None)
    fast.model.norm.to(torch.bfloat16)  # one bf16 weight in an fp32 model: loading it would cast
    with pytest.raises(ValueError, match="share one dtype"):
        RayEngines(RayEngineSettings(num_engines=1), fast, {}, log=lambda *a: None)


@pytest.mark.slow  # whole runs over Ray engines: `make test-slow` (CI)
def test_engines_that_cannot_be_placed_are_refused_and_held_cpus_time_out(cluster, qwen3_dir):
    model = exactrl.load_model(qwen3_dir)
    with pytest.raises(
        ValueError,
        match=r"num_engines=3 engines of 1 thread\(s\) each do not fit the Ray "
        r"cluster's machines \(2 CPUs\)",
    ):
        RayEngines(RayEngineSettings(num_engines=3), model, {}, log=lambda *a: None)
    holder = RayEngines(RayEngineSettings(num_engines=2), model, {}, log=lambda *a: None)  # both CPUs
    try:
        with pytest.raises(
            RayEngineError,
            match=r"1 of 1 Ray engines did not start within "
            r"rollout_backend.ray.start_timeout_s=2 s; the cluster has 0 CPUs",
        ):
            RayEngines(
                RayEngineSettings(num_engines=1, threads_per_engine=1, start_timeout_s=2),
                model,
                {},
                log=lambda *a: None,
            )
    finally:
        holder.close()


def test_a_call_that_outlasts_its_timeout_is_an_error_naming_the_engine(cluster, qwen3_dir):
    """A stalled engine does not hang the run: the call stops with an error after call_timeout_s."""
    model = exactrl.load_model(qwen3_dir)
    engines = RayEngines(RayEngineSettings(num_engines=1, call_timeout_s=0.001), model, {}, log=lambda *a: None)
    try:
        prompts, _ = workload(model.config.vocab_size)
        with pytest.raises(
            RayEngineError,
            match=r"Ray engine 0 \(.*\) did not finish (checking the batch|sampling) within "
            r"rollout_backend.ray.call_timeout_s=0.001 s",
        ):
            engines.generate(prompts, SamplingParams(max_tokens=64, n=4, seed=0))
    finally:
        engines.close()


def test_an_engine_that_dies_is_named_at_once_while_another_still_works(cluster, qwen3_dir):
    """The first engine to fail ends the wait: engine 1's death is not reported only once engine 0 (here
    stopped, so it never answers) has finished, which without this took up to call_timeout_s."""
    model = exactrl.load_model(qwen3_dir)
    engines = RayEngines(
        RayEngineSettings(num_engines=2, threads_per_engine=1, call_timeout_s=120), model, {}, log=lambda *a: None
    )
    stopped = int(re.search(r"pid (\d+)", engines.places[0]).group(1))  # this machine's process
    os.kill(stopped, signal.SIGSTOP)
    try:
        ray.kill(engines.actors[1])
        with pytest.raises(RayEngineError, match=r"Ray engine 1 \(.*\) died while loading weights"):
            engines.update_weights(model.state_dict())
        assert engines.version == 0
    finally:
        os.kill(stopped, signal.SIGCONT)
        engines.close()


# ---------------------------------------------------------------- training runs
@pytest.mark.slow  # whole runs over Ray engines: `make test-slow` (CI)
def test_a_run_over_ray_engines_logs_the_in_process_runs_metrics_bitwise(cluster, model_dir, tmp_path):
    local = run(model_dir, tmp_path / "local", "max_steps=3")
    over_ray = run(model_dir, tmp_path / "ray", "max_steps=3", *RAY)
    assert results(over_ray) == results(local)
    assert all(r["train/train_rollout_logprob_abs_diff_max"] == 0.0 and r["train/grad_norm"] > 0 for r in over_ray)
    assert [(r["engine/version"], r["ray/engines"], r["ray/weight_syncs"]) for r in over_ray] == [
        (1, 2, 1),
        (2, 2, 2),
        (3, 2, 3),
    ]
    assert "eval/accuracy" in over_ray[-1]  # greedy evaluation over the engines too


def test_fast_kernels_over_ray_engines_measure_a_mismatch(cluster, model_dir, tmp_path):
    """The inverse twin: engines with `fast` kernels differ from the trainer's forward."""
    rows = run(model_dir, tmp_path / "run", "max_steps=1", "task.eval_size=0", "model.kernels=fast", *RAY)
    assert rows[0]["train/train_rollout_logprob_abs_diff"] > 0


@pytest.mark.slow  # whole runs over Ray engines: `make test-slow` (CI)
def test_an_async_run_over_ray_engines_logs_the_in_process_async_runs_metrics_bitwise(cluster, model_dir, tmp_path):
    same = ("max_steps=3", "task.eval_size=0", "async.enabled=true", "async.max_staleness=0")
    local = run(model_dir, tmp_path / "local", *same)
    over_ray = run(model_dir, tmp_path / "ray", *same, *RAY)
    drop = lambda rows: [{k: v for k, v in r.items() if k != "engine/version"} for r in results(rows)]  # noqa: E731
    assert drop(over_ray) == drop(local)
    assert all(r["train/train_rollout_logprob_abs_diff_max"] == 0.0 for r in over_ray)
    # the version the engines held when each batch was done, and their counters (read on the rollout thread)
    assert [(r["engine/version"], r["ray/engines"]) for r in over_ray] == [(0, 2), (1, 2), (2, 2)]


@pytest.mark.slow  # whole runs over Ray engines: `make test-slow` (CI)
def test_a_run_moves_from_the_in_process_engine_to_ray_engines_on_resume_and_logs_the_uninterrupted_run(
    cluster, model_dir, tmp_path
):
    whole = run(model_dir, tmp_path / "whole", "max_steps=3", "task.eval_size=0", *RAY)
    run(model_dir, tmp_path / "cut", "max_steps=2", "task.eval_size=0")  # in process, then Ray engines
    resumed = run(model_dir, tmp_path / "cut", "max_steps=3", "task.eval_size=0", "resume=true", *RAY)
    assert results(resumed) == results(whole)
