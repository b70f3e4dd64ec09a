"""Engine API: bad input (ValueError naming the field, engine keeps serving), abort, step outputs."""
from __future__ import annotations

import random

import pytest
import torch

import exactrl
from exactrl import Engine, SamplingParams
from exactrl.engine import Completion, RequestOutput
from engine_helpers import all_pages_free, mismatches

V = 211


@pytest.fixture(scope="module")
def model(qwen3_dir):
    return exactrl.load_model(qwen3_dir)


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"), (dict(top_k=0), "top_k"),
    (dict(top_k=-2), "top_k"), (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"),
    (dict(n=1.5), "n"), (dict(max_tokens=True), "max_tokens"), (dict(seed="x"), "seed"),
    (dict(stop_token_ids=[1, "a"]), "stop_token_ids"),
])
def test_sampling_params_rejects(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt,params,field", [
    ([], SamplingParams(), "prompt_token_ids"),
    ([1, V], SamplingParams(), "prompt_token_ids"),
    ([1, -1], SamplingParams(), "prompt_token_ids"),
    ([1, 2.0], SamplingParams(), "prompt_token_ids"),
    (7, SamplingParams(), "prompt_token_ids"),
    ([1] * 500, SamplingParams(max_tokens=13), "max_model_len"),  # 513 > max_position_embeddings=512
    ([1] * 10, SamplingParams(max_tokens=95), "max_model_len"),  # engine max_model_len=100
    ([1] * 10, SamplingParams(stop_token_ids=[V + 3]), "stop_token_ids"),
    ([1] * 10, SamplingParams(n=9), "max_num_seqs"),
    ([1] * 10, {"temperature": 1.0}, "SamplingParams"),
])
def test_bad_request_is_rejected_and_engine_keeps_serving(model, prompt, params, field):
    engine = Engine(model, max_model_len=100, max_num_seqs=8, max_num_batched_tokens=20)
    rng = random.Random(0)
    good = [[rng.randrange(V) for _ in range(n)] for n in (5, 40)]
    sp = SamplingParams(max_tokens=8, n=2, seed=3)
    ids = [engine.add_request(p, sp) for p in good]
    engine.step()
    engine.step()
    state = (len(engine._requests), [s.seq_id for s in engine.scheduler.waiting],
             [s.seq_id for s in engine.scheduler.running], engine.pool.num_free)
    with pytest.raises(ValueError, match=field):
        engine.add_request(prompt, params)
    assert state == (len(engine._requests), [s.seq_id for s in engine.scheduler.waiting],
                     [s.seq_id for s in engine.scheduler.running], engine.pool.num_free)
    with pytest.raises(ValueError, match=field):  # generate checks every prompt before queueing any
        engine.generate([[1, 2, 3], prompt], [SamplingParams(), params])
    assert len(engine._requests) == state[0]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.completions for o in engine.step() if o.finished})
    assert not mismatches(model, [(p, c, sp) for p, i in zip(good, ids) for c in done[i]])
    assert all_pages_free(engine)


def test_kv_budget_and_duplicate_id_rejected(model):
    engine = Engine(model, kv_budget_tokens=64)
    with pytest.raises(ValueError, match="kv_budget_tokens"):
        engine.add_request([1] * 60, SamplingParams(max_tokens=5))
    engine.add_request([1, 2], SamplingParams(max_tokens=5), request_id="a")
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request([1, 2], SamplingParams(max_tokens=5), request_id="a")
    with pytest.raises(ValueError, match="stop_token_ids"):
        Engine(model, stop_token_ids=[V])
    with pytest.raises(ValueError, match="max_model_len"):
        Engine(model, max_model_len=10_000)
    with pytest.raises(ValueError, match="KV budget"):
        Engine(model, kv_budget_tokens=0)


def test_step_streams_cumulative_outputs(model):
    engine = Engine(model)
    assert engine.step() == [] and not engine.has_unfinished()
    rid = engine.add_request([3, 1, 4, 1, 5], SamplingParams(max_tokens=4, n=2, ignore_eos=True), request_id="pi")
    seen = []
    while engine.has_unfinished():
        (out,) = engine.step()
        assert isinstance(out, RequestOutput) and out.request_id == rid == "pi"
        assert all(isinstance(c, Completion) for c in out.completions)
        seen.append([len(c.token_ids) for c in out.completions])
    assert seen == [[1, 1], [2, 2], [3, 3], [4, 4]]
    assert out.finished and all(c.finish_reason == "length" for c in out.completions)
    assert out.prompt_token_ids == [3, 1, 4, 1, 5]
    st = engine.stats()
    assert st["engine/num_running"] == st["engine/num_requests"] == 0 and st["engine/kv_usage"] == 0.0


def test_abort_frees_pages_and_others_finish(model):
    engine = Engine(model, kv_budget_tokens=256)
    sp = SamplingParams(max_tokens=30, n=3, ignore_eos=True)
    a = engine.add_request(list(range(50)), sp)
    b = engine.add_request(list(range(20)), sp)
    c = engine.add_request(list(range(70)), sp)  # waits: not enough pages
    for _ in range(3):
        engine.step()
    assert engine.abort(a) and engine.abort(c)
    assert not engine.abort(a) and not engine.abort("nope")
    outs = [o for _ in range(100) if engine.has_unfinished() for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == [b]
    assert all_pages_free(engine)


def test_generate_keeps_other_requests_outputs_for_step(model):
    engine = Engine(model)
    other = engine.add_request([7, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    outs = engine.generate([[1, 2]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(outs[0][0].token_ids) == 6
    later = engine.step()
    assert [o.request_id for o in later if o.finished] == [other]


def test_generate_per_prompt_params(model):
    sps = [SamplingParams(temperature=0, max_tokens=3), SamplingParams(max_tokens=5, n=2, top_k=3)]
    outs = Engine(model).generate([[1, 2, 3], [4, 5]], sps)
    assert [len(o) for o in outs] == [1, 2]
    with pytest.raises(ValueError, match="SamplingParams"):
        Engine(model).generate([[1]], sps)


def test_update_weights_rejects_mismatched_state_dict(model):
    engine = Engine(model)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    name = next(iter(sd))
    with pytest.raises(ValueError, match="missing"):
        engine.update_weights({k: v for k, v in sd.items() if k != name})
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights({**sd, name: torch.zeros(3)})
    assert engine.version == 0
    assert engine.update_weights(sd) == 1
