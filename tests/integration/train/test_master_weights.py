"""fp32 master weights for bf16 training (train/master_weights.py, `optim.fp32_master_weights`).

The optimizer steps fp32 copies exactly as AdamW steps fp32 weights given the bf16 gradients, and the
model holds their bf16 rounding; small updates that plain bf16 AdamW loses add up. In a run, the engine
and trainer still agree bitwise, the checkpoint holds the copies, and a resume is the uninterrupted run.
(bf16's inverse twin, fast kernels showing a difference, needs longer sequences than these runs sample:
tests/unit/engine/test_engine_fast_twin.py `test_bf16_long_chunked_prefill`; with the default job's short
answers bf16 fast kernels happen to agree too.)
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import default_job_model, train_args, train_rows

import exactrl
from exactrl.cli import main as cli_main
from exactrl.train.checkpoint import latest_checkpoint
from exactrl.train.master_weights import MasterWeights

SMALL = [
    "progress=false",
    "tensorboard=false",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "task.eval_size=0",
    "engine.kv_budget_tokens=4096",
    "model.dtype=bfloat16",
]
TIMING = ("time/", "perf/tokens_per_s")


def grads(step: int, shape) -> torch.Tensor:
    """Positive, so the updates of the steps add up (as a persistent signal's do)."""
    return (torch.randn(shape, generator=torch.Generator().manual_seed(step)).abs() + 0.1).to(torch.bfloat16)


def test_master_weights_step_as_fp32_adamw_would_and_the_model_holds_their_rounding():
    w16 = torch.nn.Parameter(torch.randn(64, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16))
    ref32 = torch.nn.Parameter(w16.detach().float())
    opt = MasterWeights([w16], lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    ref = torch.optim.AdamW([ref32], lr=1e-4)
    plain16 = torch.nn.Parameter(w16.detach().clone())
    plain = torch.optim.AdamW([plain16], lr=1e-4)
    for step in range(30):
        g = grads(step, w16.shape)
        opt.zero_grad()
        w16.grad = g.clone()
        opt.step()
        ref32.grad = g.float()
        ref.step()
        plain16.grad = g.clone()
        plain.step()
        assert torch.equal(opt.master[0], ref32.detach())  # bitwise the fp32 run
        assert torch.equal(w16.detach(), ref32.detach().to(torch.bfloat16))
    start = ref32.detach().to(torch.bfloat16)  # (compared below with the weights before any step)
    before = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    moved, moved_plain = (w16 != before).float().mean().item(), (plain16 != before).float().mean().item()
    # 30 steps of ~1e-4 on weights of ~1 (half a bf16 spacing: ~2e-3): plain bf16 AdamW moves almost none
    # of them (3% here), the master copy adds the updates up (68%)
    assert moved_plain < 0.1 and moved > 0.5, (moved_plain, moved)
    assert torch.equal(w16.detach(), start)


def test_a_resumed_optimizer_continues_bit_for_bit_and_a_plain_adamw_state_loads():
    def fresh():
        w = torch.nn.Parameter(torch.randn(16, 8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16))
        return w, MasterWeights([w], lambda ps: torch.optim.AdamW(ps, lr=1e-3))

    def steps(w, opt, rng):
        for s in rng:
            opt.zero_grad()
            w.grad = grads(s, w.shape)
            opt.step()

    w_full, full = fresh()
    steps(w_full, full, range(6))
    w_a, a = fresh()
    steps(w_a, a, range(3))
    state = a.state_dict()
    assert set(state) == {"inner", "master"} and state["master"][0].dtype == torch.float32
    w_b, b = fresh()
    with torch.no_grad():
        w_b.copy_(w_a)
    b.load_state_dict(state)
    steps(w_b, b, range(3, 6))
    assert torch.equal(w_b, w_full) and torch.equal(b.master[0], full.master[0])
    # a plain AdamW state (a checkpoint from before master weights): the moments load, the copy is the weights
    w_c, c = fresh()
    plain = torch.optim.AdamW([torch.nn.Parameter(w_c.detach().float())], lr=1e-3)
    c.load_state_dict(plain.state_dict())
    assert torch.equal(c.master[0], w_c.detach().float())
    with pytest.raises(ValueError, match="master weights .* do not fit"):
        c.load_state_dict({"inner": plain.state_dict(), "master": [torch.zeros(3)]})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return default_job_model(tmp_path_factory, sft_steps=20)


def run(model_dir, run_dir, *overrides) -> list[dict]:
    return train_rows(SMALL, model_dir, run_dir, *overrides)


def test_a_bf16_run_with_master_weights_is_exact_saves_them_and_resumes_bit_for_bit(model_dir, tmp_path):
    full = run(model_dir, tmp_path / "full", "max_steps=3", "save_every=1", "optim.lr=1e-5")
    assert all(r["train/train_rollout_logprob_abs_diff_max"] == 0.0 for r in full)
    opt_state = torch.load(latest_checkpoint(tmp_path / "full") / "optimizer.pt", weights_only=False)
    assert opt_state["master"][0].dtype == torch.float32
    part = tmp_path / "part"
    run(model_dir, part, "max_steps=1", "save_every=1", "optim.lr=1e-5")
    resumed = run(model_dir, part, "max_steps=3", "save_every=1", "optim.lr=1e-5", "resume=true")
    for x, y in zip(full, resumed):
        assert {k: v for k, v in x.items() if not k.startswith(TIMING)} == {
            k: v for k, v in y.items() if not k.startswith(TIMING)
        }
    # at lr 1e-5 the bf16 weights themselves barely move; with the master copy they add the updates up
    plain = run(
        model_dir, tmp_path / "plain", "max_steps=3", "save_every=1", "optim.lr=1e-5", "optim.fp32_master_weights=false"
    )
    assert plain[0]["train/loss"] == full[0]["train/loss"]  # the same first step: only the update differs

    def moved(run_dir) -> float:
        start = exactrl.load_model(model_dir, dtype="bfloat16").state_dict()
        now = exactrl.load_model(latest_checkpoint(run_dir), dtype="bfloat16").state_dict()
        return sum((now[k] != v).sum().item() for k, v in start.items()) / sum(v.numel() for v in start.values())

    assert moved(tmp_path / "plain") < moved(tmp_path / "full"), (moved(tmp_path / "plain"), moved(tmp_path / "full"))


def test_a_bf16_run_from_before_the_key_resumes_as_it_ran_and_is_told_what_changing_it_means(
    model_dir, tmp_path, capsys
):
    """A checkpoint whose config has no optim.fp32_master_weights trained the bf16 weights themselves: resuming it
    with the default (true) would change the run, so it is refused naming the key; with false it goes on."""
    d = tmp_path / "old"
    run(model_dir, d, "max_steps=1", "save_every=1", "optim.fp32_master_weights=false")
    state_path = latest_checkpoint(d) / "state.json"
    state = json.loads(state_path.read_text())
    del state["config"]["optim"]["fp32_master_weights"]  # as a checkpoint written before the key existed
    state_path.write_text(json.dumps(state))
    assert cli_main(train_args(SMALL, model_dir, d, "max_steps=2", "resume=true")) == 2
    assert "optim.fp32_master_weights: False -> True" in capsys.readouterr().err
    rows = run(model_dir, d, "max_steps=2", "resume=true", "optim.fp32_master_weights=false")
    assert [r["step"] for r in rows] == [1, 2]


def test_in_float32_the_key_changes_nothing_not_even_what_a_resume_accepts(model_dir, tmp_path):
    """No effect in float32: the checkpoint is a plain AdamW state, and a run resumes with either value (as
    the uninterrupted run, bitwise), as it does from a checkpoint written before the key existed."""
    fp32 = [o for o in SMALL if not o.startswith("model.dtype")]

    def run32(run_dir, *overrides):
        return train_rows(fp32, model_dir, run_dir, "save_every=1", *overrides)

    full = run32(tmp_path / "full", "max_steps=2", "optim.fp32_master_weights=false")
    d = tmp_path / "part"
    run32(d, "max_steps=1")
    opt_state = torch.load(latest_checkpoint(d) / "optimizer.pt", weights_only=False)
    assert set(opt_state) == {"state", "param_groups"}
    resumed = run32(d, "max_steps=2", "resume=true", "optim.fp32_master_weights=false")
    for x, y in zip(full, resumed):
        assert {k: v for k, v in x.items() if not k.startswith(TIMING)} == {
            k: v for k, v in y.items() if not k.startswith(TIMING)
        }


def test_the_bf16_warm_start_steps_through_master_weights_and_its_cache_key_says_so(model_dir):
    """The default job's supervised warm start in bf16 (train/warmstart.py) uses the same fp32 master copies:
    at a small learning rate most bf16 weights move with them and few without, and the flag enters the
    bf16 warm start's cache key (not the fp32 one, whose cached models stay valid)."""
    from exactrl.envs import get_task
    from exactrl.model import load_model
    from exactrl.model.tokenizer import load_tokenizer
    from exactrl.train import warmstart
    from exactrl.train.config import load_config

    tok, task = load_tokenizer(model_dir), get_task("arithmetic")
    moved = {}
    for master in (True, False):
        model = load_model(model_dir, dtype="bfloat16")
        before = [p.detach().clone() for p in model.parameters()]
        warmstart.supervised_finetune(
            model, tok, task, steps=8, batch_size=4, lr=5e-6, seed=0, log=lambda *a: None, fp32_master_weights=master
        )
        changed = sum(int((p != b).sum()) for p, b in zip(model.parameters(), before))
        moved[master] = changed / sum(b.numel() for b in before)
    assert moved[True] > 0.15 and moved[False] < 0.5 * moved[True], moved  # 0.197 and 0.074 here

    def key(*sets):
        return warmstart._hash(load_config(None, list(sets)))

    assert key("model.dtype=bfloat16") != key("model.dtype=bfloat16", "optim.fp32_master_weights=false")
    assert key() == key("optim.fp32_master_weights=false")
