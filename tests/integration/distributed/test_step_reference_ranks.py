"""Two real data-parallel ranks (gloo) give the gradient of one process over the whole batch, as the float64
step reference computes it (tests/helpers/step_reference.py)."""

from __future__ import annotations

import pytest
import torch
from step_reference import (  # noqa: F401 (models, ref_dir: fixtures)
    BASE,
    CONFIGS,
    F64,
    G_RTOL,
    GROUPS,
    MAX_TOKENS,
    _forward,
    _Keep,
    _whitened,
    advantages,
    assert_grads_close,
    components,
    grpo_advantages,
    kl_token,
    make_groups,
    models,
    ref_dir,
    reference,
    reference_rows,
    step_grads,
)

import exactrl
from exactrl.distributed import Ranks
from exactrl.rollout.groups import to_train_batch
from exactrl.train.config import load_config
from exactrl.train.trainer import train_step


def _rank_step(rank: int, port: int, dirs, name: str, out) -> None:
    """Rank `rank` of 2 over gloo (torch.multiprocessing): one `train_step` on its share of the batch."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    model, ref_model = exactrl.load_model(dirs[0]), exactrl.load_model(dirs[1]).requires_grad_(False)
    cfg = load_config(None, BASE + CONFIGS[name])
    groups = make_groups(model, cfg.rollout.temperature)
    a = cfg.algorithm
    batch = to_train_batch(groups, a.advantage, a.advantage_kwargs, a.overlong.mask_truncated)
    c = components(model, ref_model, cfg, micro_batch_size=2, ranks=Ranks(rank, 2))
    m = train_step(
        model, c.policy.optimizer, c.policy.loss_fn, batch, c.policy.step_settings, c.policy.ref_model, c.ranks
    )
    out.put((rank, [g.numpy() for g in step_grads(model)], m))  # numpy: a tensor would go by shared memory
    dist.destroy_process_group()


def test_two_real_ranks_give_the_one_process_gradient(models, qwen3_dir, ref_dir):
    """`Ranks.sum_grads` and the metric gather over gloo, against the reference (the simulated ranks above
    check the normalisation; this checks the collectives carry it)."""
    import socket

    import torch.multiprocessing as mp

    name = "seq-mean-token-mean mask_truncated, k3 in the loss"
    model, ref_model = models
    cfg = load_config(None, BASE + CONFIGS[name])
    want, want_m = reference(model, ref_model, make_groups(model, cfg.rollout.temperature), cfg)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    dirs = (str(qwen3_dir), str(ref_dir))
    procs = [ctx.Process(target=_rank_step, args=(r, port, dirs, name, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = {r: ([torch.from_numpy(x) for x in g], m) for r, g, m in (q.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(60)
    for g, m in got.values():
        assert_grads_close(g, want)
        for k, v in want_m.items():
            assert m[k] == pytest.approx(v, rel=2e-6, abs=1e-7), k
    assert all(torch.equal(a, b) for a, b in zip(got[0][0], got[1][0]))  # every rank the same bits
