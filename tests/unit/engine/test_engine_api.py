"""Engine API: bad input (ValueError naming the field, engine keeps serving), abort, step outputs."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import all_pages_free, mismatches

import exactrl
from exactrl import Engine, SamplingParams
from exactrl.engine import Completion, RequestOutput

V = 211


@pytest.fixture(scope="module")
def model(qwen3_dir):
    return exactrl.load_model(qwen3_dir)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=-2), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n"),
        (dict(n=1.5), "n"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(seed="x"), "seed"),
        (dict(stop_token_ids=[1, "a"]), "stop_token_ids"),
        (dict(stop_token_ids=5), "stop_token_ids"),
        (dict(temperature=1e-39), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature="1"), "temperature"),
    ],
)
def test_sampling_params_rejects(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "prompt,params,field",
    [
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
    ],
)
def test_bad_request_is_rejected_and_engine_keeps_serving(model, prompt, params, field):
    engine = Engine(model, max_model_len=100, max_num_seqs=8, max_num_batched_tokens=20)
    rng = random.Random(0)
    good = [[rng.randrange(V) for _ in range(n)] for n in (5, 40)]
    sp = SamplingParams(max_tokens=8, n=2, seed=3)
    ids = [engine.add_request(p, sp) for p in good]
    engine.step()
    engine.step()
    state = (
        len(engine._requests),
        [s.seq_id for s in engine.scheduler.waiting],
        [s.seq_id for s in engine.scheduler.running],
        engine.pool.num_free,
    )
    with pytest.raises(ValueError, match=field):
        engine.add_request(prompt, params)
    assert state == (
        len(engine._requests),
        [s.seq_id for s in engine.scheduler.waiting],
        [s.seq_id for s in engine.scheduler.running],
        engine.pool.num_free,
    )
    with pytest.raises(ValueError, match=field):  # generate checks every prompt before queueing any
        engine.generate([[1, 2, 3], prompt], [SamplingParams(), params])
    assert len(engine._requests) == state[0]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.completions for o in engine.step() if o.finished})
    assert not mismatches(model, [(p, c, sp) for p, i in zip(good, ids) for c in done[i]])
    assert all_pages_free(engine)


def _poison_first_row(monkeypatch, at_call: int):
    """Makes the engine's `at_call`-th sampling call (`Kernels.sample`) return NaN for its first row; returns
    the real method."""
    from exactrl.kernels import Kernels

    real, calls = Kernels.sample, []

    def poisoned(self, logits_RV, rows):
        calls.append(1)
        if len(calls) == at_call:
            logits_RV = logits_RV.clone()
            logits_RV[0] = float("nan")
        return real(self, logits_RV, rows)

    monkeypatch.setattr(Kernels, "sample", poisoned)
    return real


def test_a_generate_that_raises_leaves_none_of_its_requests_behind(model, monkeypatch):
    """NaN logits for one prompt: generate raises, and its other prompt does not run on unseen."""
    import exactrl.engine.engine as engine_mod

    engine = Engine(model)
    real = _poison_first_row(monkeypatch, at_call=2)
    with pytest.raises(engine_mod.NonFiniteLogitsError):
        engine.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_tokens=20, ignore_eos=True))
    assert not engine.has_unfinished() and engine.pool.num_free == engine.pool.num_pages
    monkeypatch.setattr(exactrl.kernels.Kernels, "sample", real)
    assert engine.generate([[9, 9]], SamplingParams(max_tokens=2, ignore_eos=True))[0][0].token_ids
    assert engine.step() == []  # nothing was left to deliver


def test_an_eos_id_outside_the_vocabulary_names_config_json(model):
    import copy

    bad = copy.deepcopy(model)
    bad.config.hf["eos_token_id"] = [5, V + 89]
    with pytest.raises(ValueError, match=r"eos_token_id \(config.json / generation_config.json\) holds 300"):
        Engine(bad)


def test_eos_ids_of_generation_config_json_stop_too_and_are_saved(qwen3_dir, tmp_path):
    """Chat checkpoints (Qwen2.5-Instruct, Llama 3) list end-of-turn ids in generation_config.json only."""
    import json
    import shutil

    d = tmp_path / "m"
    shutil.copytree(qwen3_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9], "temperature": 0.7}))
    m = exactrl.load_model(d)
    assert {7, 9} <= Engine(m).stop_token_ids
    assert not {7, 9} & Engine(exactrl.load_model(qwen3_dir)).stop_token_ids
    exactrl.save_model(m, tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "generation_config.json").read_text())["eos_token_id"] == [7, 9]


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
    for kw in (
        dict(kv_budget_tokens=0),
        dict(kv_budget_tokens=100.5),
        dict(max_num_batched_tokens=2.5),
        dict(max_num_batched_tokens=None),
        dict(max_num_seqs=True),
        dict(max_model_len=100.0),
    ):
        with pytest.raises(ValueError, match=f"Engine {next(iter(kw))} must be an int >= 1"):
            Engine(model, **kw)


def test_one_caller_drives_the_engine_at_a_time(model):
    """generate from inside generate's on_step is refused by name (its steps would take the outer call's
    requests, which would then fail as 'aborted'); two threads' generate calls take turns and get what each
    would get alone."""
    import threading

    e = Engine(model)
    with pytest.raises(RuntimeError, match="already driving the engine"):
        e.generate(
            [[1, 2, 3]],
            SamplingParams(max_tokens=5),
            on_step=lambda: e.generate([[4, 5, 6]], SamplingParams(max_tokens=3)),
        )
    assert all_pages_free(e)
    work = {k: ([[k + 1] * (10 + 7 * k), [3, 4, 5]], SamplingParams(max_tokens=30, n=2, seed=k)) for k in range(2)}
    got, errors = {}, []

    def run(k):
        try:
            got[k] = e.generate(*work[k])
        except Exception as ex:  # noqa: BLE001 - reported below
            errors.append(repr(ex))

    threads = [threading.Thread(target=run, args=(k,)) for k in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for k, (prompts, params) in work.items():
        alone = Engine(model).generate(prompts, params)
        assert [[c.token_ids for c in o] for o in got[k]] == [[c.token_ids for c in o] for o in alone]


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


@pytest.mark.parametrize("kernels", ["exact", "fast"])
def test_abort_one_sample_frees_it_and_the_others_are_unchanged(qwen3_dir, kernels):
    """`abort(request_id, index)` (a server's stop string): that sample stops and gives its pages back at
    once; the others draw exactly what they would have, with the trainer's logprobs in exact mode (the
    batch shrank under them: fast kernels show a difference); the request ends when they do."""
    model = exactrl.load_model(qwen3_dir, kernels=kernels)
    sp = SamplingParams(max_tokens=40, n=3, ignore_eos=True, seed=5)
    ref = Engine(model).generate([list(range(30))], sp)[0]
    engine = Engine(model, kv_budget_tokens=512)
    rid = engine.add_request(list(range(30)), sp)
    with pytest.raises(ValueError, match="index must be a sample of request"):
        engine.abort(rid, 3)
    with pytest.raises(ValueError, match="index must be a sample of request"):
        engine.abort(rid, True)
    engine.step()  # the prefill: sample 0's prompt is computed, the others are forked from it
    for _ in range(20):
        engine.step()
    free = engine.pool.num_free
    assert engine.abort(rid, 1) and not engine.abort(rid, 1)
    assert engine.pool.num_free > free  # its own pages (beyond the shared prompt's) are back
    outs = [o for _ in range(100) if engine.has_unfinished() for o in engine.step() if o.finished]
    (out,) = outs
    assert [c.finish_reason for c in out.completions] == ["length", "abort", "length"]
    assert [c.token_ids for c in out.completions[::2]] == [c.token_ids for c in ref[::2]]
    assert ref[1].token_ids[: len(out.completions[1].token_ids)] == out.completions[1].token_ids
    assert bool(mismatches(model, [(list(range(30)), c, sp) for c in out.completions])) == (kernels == "fast")
    assert all_pages_free(engine)
    # the last running sample aborted ends the request, and the next step returns it; sample 0 before its
    # prefill is kept (the others need it)
    rid = engine.add_request(list(range(30)), sp)
    assert not engine.abort(rid, 0) and engine.abort(rid, 2)
    engine.step()
    assert engine.abort(rid, 0) and engine.abort(rid, 1)
    assert engine.pool.num_free == engine.pool.num_pages and engine.has_unfinished()  # its output is due
    (out,) = engine.step()
    assert all_pages_free(engine)
    assert out.request_id == rid and out.finished and [c.finish_reason for c in out.completions] == ["abort"] * 3
    # and a generate() whose request ends so returns it (it does not raise "request ... was aborted")
    steps = []

    def abort_all_by_the_third_step():
        steps.append(None)
        if len(steps) == 3:
            rid = next(iter(engine._requests))
            assert all(engine.abort(rid, i) for i in (0, 1, 2))

    (comps,) = engine.generate([list(range(30))], sp, on_step=abort_all_by_the_third_step)
    assert [c.finish_reason for c in comps] == ["abort"] * 3 and len({len(c.token_ids) for c in comps}) == 1
    assert all_pages_free(engine)


def test_generate_keeps_other_requests_outputs_for_step(model):
    engine = Engine(model)
    other = engine.add_request([7, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    outs = engine.generate([[1, 2]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(outs[0][0].token_ids) == 6
    assert engine.has_unfinished()  # `other` finished inside generate: step returns it
    later = engine.step()
    assert [o.request_id for o in later if o.finished] == [other] and not engine.has_unfinished()


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
    with pytest.raises(ValueError, match="not be bitwise"):  # a cast is not the bitwise copy exactness needs
        engine.update_weights({**sd, name: sd[name].bfloat16()})
    with pytest.raises(ValueError, match="not a tensor"):
        engine.update_weights({**sd, name: sd[name].tolist()})
    with pytest.raises(ValueError, match="mapping"):
        engine.update_weights(list(sd.items()))
    with pytest.raises(ValueError, match="dense tensor on cpu"):
        engine.update_weights({**sd, name: torch.empty(sd[name].shape, device="meta")})
    with pytest.raises(ValueError, match="dense tensor on cpu"):
        engine.update_weights({**sd, name: sd[name].to_sparse()})
    with pytest.raises(ValueError, match="version"):
        engine.update_weights(sd, version=True)
    assert engine.version == 0
    assert engine.update_weights(sd) == 1


def test_a_failed_weight_copy_stops_sampling_until_a_whole_update(model, monkeypatch):
    """A copy that fails halfway leaves some weights new and some old: the running requests are preempted
    and no step runs until update_weights succeeds; then the results are exact again."""
    engine = Engine(model, kv_budget_tokens=512)
    sp = SamplingParams(max_tokens=8, seed=4, ignore_eos=True)
    rid = engine.add_request([1, 2, 3, 4], sp)
    engine.step()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    real, calls = torch.Tensor.copy_, []

    def failing_copy(self, src, *a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("disk gone")
        return real(self, src, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "copy_", failing_copy)
    with pytest.raises(RuntimeError, match="disk gone"):
        engine.update_weights(sd)
    monkeypatch.setattr(torch.Tensor, "copy_", real)
    assert engine.version == 0 and all(s.num_computed == 0 for s in engine._requests[rid].seqs)
    with pytest.raises(RuntimeError, match="partly updated"):
        engine.step()
    assert engine.update_weights(sd) == 1
    outs = [o for _ in range(20) if engine.has_unfinished() for o in engine.step() if o.finished]
    comp = outs[0].completions[0]
    assert len(comp.token_ids) == 8 and not mismatches(model, [([1, 2, 3, 4], comp, sp)])
    assert all_pages_free(engine)


def test_a_finished_output_goes_out_while_the_weights_are_broken(model, monkeypatch):
    """Nothing left to compute but an output due (its last sample aborted): `step` returns it even after a
    failed update_weights, so a server's loop (`while has_unfinished(): step()`) does not spin on errors."""
    engine = Engine(model, kv_budget_tokens=512)
    rid = engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=8, n=2, seed=4, ignore_eos=True))
    engine.step()
    assert engine.abort(rid, 0) and engine.abort(rid, 1)
    real = torch.Tensor.copy_

    def failing_copy(self, src, *a, **kw):
        raise RuntimeError("disk gone")

    monkeypatch.setattr(torch.Tensor, "copy_", failing_copy)
    with pytest.raises(RuntimeError, match="disk gone"):
        engine.update_weights({k: v.clone() for k, v in model.state_dict().items()})
    monkeypatch.setattr(torch.Tensor, "copy_", real)
    (out,) = engine.step()
    assert out.request_id == rid and out.finished and not engine.has_unfinished()
    engine.add_request([1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="partly updated"):  # work to compute: refused until fixed
        engine.step()


def test_generate_raises_when_one_of_its_requests_is_aborted(model):
    engine = Engine(model)
    steps = []

    def on_step():
        steps.append(1)
        if len(steps) == 3:
            engine.abort(next(iter(engine._requests)))

    with pytest.raises(RuntimeError, match="was aborted"):
        engine.generate([[1, 2], [3, 4]], SamplingParams(max_tokens=20, ignore_eos=True), on_step=on_step)
    assert len(steps) == 3 and not engine.has_unfinished() and all_pages_free(engine)  # raised at once


def test_request_id_must_be_a_string(model):
    engine = Engine(model)
    with pytest.raises(ValueError, match="request_id must be a str"):
        engine.add_request([1, 2], request_id=["a"])
    assert not engine.has_unfinished()


def test_smallest_temperature_is_finite_and_exact(model):
    """At the smallest allowed temperature z / T stays finite; the logprobs are still the trainer's."""
    params = SamplingParams(temperature=1e-5, max_tokens=6, seed=3)
    prompt = [5, 6, 7]
    comp = Engine(model).generate([prompt], params)[0][0]
    assert all(torch.isfinite(torch.tensor(comp.logprobs))) and not mismatches(model, [(prompt, comp, params)])
    with pytest.raises(ValueError, match="temperature"):
        exactrl.sequence_logprobs(model, [[1, 2, 3]], temperature=1e-39)


def test_non_finite_logits_abort_only_their_request_and_the_rest_is_exact(model, monkeypatch):
    """A row that cannot be sampled (NaN) fails its request alone; the step's other work is redone, bits unchanged."""
    prompts, params = [[3, 4, 5], [9, 8, 7, 6]], SamplingParams(max_tokens=5, seed=1, ignore_eos=True)
    want = Engine(model).generate(prompts, params)
    engine = Engine(model)
    ids = [engine.add_request(p, params) for p in prompts]
    _poison_first_row(monkeypatch, at_call=3)  # the third sampling call: the first request's row turns NaN
    outs, raised = {}, []
    while engine.has_unfinished():
        try:
            for o in engine.step():
                outs[o.request_id] = o
        except exactrl.engine.NonFiniteLogitsError as e:
            raised.append(e.request_ids)
    assert raised == [[ids[0]]]
    assert ids[0] not in outs or not outs[ids[0]].finished  # aborted, never finished
    assert outs[ids[1]].completions[0].token_ids == want[1][0].token_ids
    assert outs[ids[1]].completions[0].logprobs == want[1][0].logprobs
    assert all_pages_free(engine)


def test_nan_weights_are_named_and_the_engine_recovers(model):
    import copy

    engine = Engine(copy.deepcopy(model))  # its weights turn NaN: not the shared fixture's
    good = {k: v.clone() for k, v in model.state_dict().items()}
    engine.update_weights({k: v * float("nan") for k, v in good.items()})
    with pytest.raises(exactrl.engine.NonFiniteLogitsError, match="not finite"):
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished() and all_pages_free(engine)
    engine.update_weights(good)
    assert len(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))[0][0].token_ids) == 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_start_runs_the_short_row_checks_so_no_step_waits_for_them(qwen3_dir, monkeypatch, dtype):
    """`Kernels.prepare`: an exact bf16 engine checks at creation which short products give a tile's bits
    (`short_rows`) for every weight of its model; a fast one, or fp32 (the native linear has no tiles),
    has nothing to check."""
    from exactrl.kernels import linear as linear_mod

    for kernels in ("fast", "exact"):
        monkeypatch.setattr(linear_mod, "_SHORT_OK", {})
        m = exactrl.load_model(qwen3_dir, kernels=kernels, dtype=dtype)
        Engine(m)
        checked = {(shape, dtype) for _, shape, dtype, _ in linear_mod._SHORT_OK}
        shapes = {(tuple(w.shape), w.dtype) for w in m.linear_weights()}
        assert checked == (shapes if kernels == "exact" and dtype == "bfloat16" else set())
