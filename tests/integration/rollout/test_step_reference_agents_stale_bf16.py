"""More paths of one training step against the float64 reference of test_step_reference.py.

1. Agent rollouts (rollout/agents.py): trajectories whose completion interleaves generated turns (loss mask
   1, engine logprobs) with template and tool tokens (mask 0, logprob 0.0), several per episode (branches),
   one without any generated token. `agent_train_batch` -> `train_step` trains exactly the generated tokens
   with μ on the token it belongs to (exact μ: the mismatch is 0.0 bit for bit), the episode's advantage on
   each of its trajectories, every denominator, KL and entropy figure over the generated tokens; its
   gradient is the reference's, computed from the trajectories directly. Once through a live server too: a
   2-turn episode with a tool result between the turns, via `agent_train_step`. A KL term in the settings
   with no reference model is refused (it was left out silently).
2. The asynchronous loop's `drop_stale` before `train_on`: the step is the reference step of the kept groups
   alone (advantages within each, denominators over the kept batch), and the staleness metrics count the
   kept tokens' ages and the dropped samples.
3. bf16: the step in bf16 against the reference (see `test_a_bf16_step_*` for the tolerances and what was
   measured).

Legend: P problems, G episodes per problem.
"""

from __future__ import annotations

import copy
import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from step_reference import (  # noqa: F401
    BASE,
    CONFIGS,
    advantages,
    assert_grads_close,
    components,
    make_groups,
    models,  # (models, ref_dir: fixtures)
    ref_dir,
    reference,
    reference_rows,
    step_grads,
)

import exactrl
from exactrl.chat.trajectory import Trajectory
from exactrl.envs.base import Problem
from exactrl.rollout.agents import AgentRollout, agent_train_batch
from exactrl.train.async_loop import drop_stale
from exactrl.train.config import load_config
from exactrl.train.loop import train_on
from exactrl.train.trainer import train_step

# ------------------------------------------------------------------ 1. agent trajectories
# per problem, per episode: (reward, [trajectory: [(tokens, generated?), ...] after the shared prompt]); a
# branch repeats its episode's earlier turns (the server gives each branch whole); one trajectory is a
# prompt alone, with nothing generated
EPISODES = [
    [
        (1.0, [[(4, 1), (3, 0), (2, 1)]]),
        (0.0, [[(3, 1), (5, 0), (4, 1), (2, 0), (1, 1)], [(3, 1), (5, 0), (6, 1)]]),  # two branches
        (0.5, [[(7, 1)]]),
    ],
    [
        (0.0, [[(2, 1), (4, 0), (3, 1)], []]),  # a trajectory with no generated token
        (1.0, [[(5, 1), (2, 0), (5, 1)]]),
        (1.0, [[(1, 1), (6, 0), (2, 1), (3, 0), (2, 1)]]),
    ],
]


def agent_groups(model, exact: bool = False) -> list[list[AgentRollout]]:
    """EPISODES with random tokens. μ at a generated token is the model's logprob of it in its whole context
    (earlier turns and tool tokens included), 0.3 nat off on every third generated token of every other
    trajectory unless `exact`; 0.0 at a masked token, as the server records it."""
    rng = random.Random(11)
    groups, k = [], 0
    for p, episodes in enumerate(EPISODES):
        prompt = [rng.randrange(3, 200) for _ in range(4 + p)]
        group = []
        for reward, trajs in episodes:
            out, turns = [], {}  # a branch's earlier turns: the same tokens as its sibling's
            for layout in trajs:
                comp, mask = [], []
                for j, (n, gen) in enumerate(layout):
                    turns.setdefault((j, n, gen), [rng.randrange(3, 200) for _ in range(n)])
                    comp += turns[(j, n, gen)] if j < len(layout) - 1 else [rng.randrange(3, 200) for _ in range(n)]
                    mask += [gen] * n
                with torch.no_grad():
                    lp = exactrl.sequence_logprobs(model, [prompt + comp], 1.0)[0][len(prompt) - 1 :].tolist()
                behav, at = [], 0
                for x, m in zip(lp, mask):
                    off = 0.3 * (-1) ** at if m and not exact and k % 2 and at % 3 == 0 else 0.0
                    behav.append(x + off if m else 0.0)
                    at += m
                out.append(
                    Trajectory(
                        prompt,
                        comp,
                        mask,
                        behav,
                        [0 if m else -1 for m in mask],
                        num_turns=sum(g for _, g in layout),
                        sampling=[[1.0, -1, 1.0]],
                    )
                )
                k += 1
            group.append(AgentRollout(Problem("q", "a"), reward, out, None))
        groups.append(group)
    return groups


def agent_rows(groups, advantage: str, kwargs: dict) -> list[SimpleNamespace]:
    """Each trajectory with a generated token, with its episode's advantage: generated = trained = its mask."""
    adv = advantages([r.reward for g in groups for r in g], [len(g) for g in groups], advantage, kwargs)
    return [
        SimpleNamespace(
            prompt_ids=t.prompt_ids,
            completion_ids=t.completion_ids,
            behav_logprobs=t.behav_logprobs,
            A=A,
            generated=t.loss_mask,
            trained=t.loss_mask,
        )
        for r, A in zip((r for g in groups for r in g), adv)
        for t in r.trajectories
        if any(t.loss_mask)
    ]


AGENT_BASE = BASE + ["rollout.max_tokens=24"]  # constant-normalised's constant
AGENT_CONFIGS = {
    "token-mean ppo bypass, kl k3 in the loss, entropy": [
        "algorithm.bypass=true",
        "algorithm.loss_kwargs={eps_low: 0.1, eps_high: 0.1}",
        "algorithm.kl.coef=0.3",
        "algorithm.entropy_coef=0.05",
    ],
    "seq-mean-token-mean cispo bypass, token_mask_is, rloo": [
        "algorithm.agg_mode=seq-mean-token-mean",
        "algorithm.loss=cispo",
        "algorithm.bypass=true",
        "algorithm.loss_kwargs={eps_low_is: 0.2, eps_high_is: 0.1}",
        "algorithm.advantage=rloo",
        "algorithm.corrections=[{name: token_mask_is, upper: 1.2}]",
    ],
    "seq-mean-token-sum gspo bypass, kl k2 in the loss": [
        "algorithm.agg_mode=seq-mean-token-sum",
        "algorithm.loss=gspo",
        "algorithm.bypass=true",
        "algorithm.loss_kwargs={eps_low: 0.03, eps_high: 0.04}",
        "algorithm.kl.coef=0.2",
        "algorithm.kl.kind=k2",
    ],
    "constant-normalised topr bypass, token_tis, reinforce_pp_baseline": [
        "algorithm.agg_mode=constant-normalised",
        "algorithm.loss=topr",
        "algorithm.bypass=true",
        "algorithm.loss_kwargs={upper: 0.9}",
        "algorithm.advantage=reinforce_pp_baseline",
        "algorithm.corrections=[{name: token_tis, upper: 1.2}]",
    ],
}


def agent_step(model, ref_model, cfg, groups, mbs):
    a = cfg.algorithm
    c = components(model, ref_model, cfg, mbs)
    batch = agent_train_batch(groups, a.advantage, a.advantage_kwargs)
    model.zero_grad(set_to_none=True)
    return batch, train_step(
        model, c.policy.optimizer, c.policy.loss_fn, batch, c.policy.step_settings, c.policy.ref_model
    )


@pytest.mark.parametrize("name", list(AGENT_CONFIGS))
def test_an_agent_step_trains_the_generated_tokens_only(models, name):
    model, ref_model = models
    cfg = load_config(None, AGENT_BASE + AGENT_CONFIGS[name])
    groups = agent_groups(model)
    rows = agent_rows(groups, cfg.algorithm.advantage, cfg.algorithm.advantage_kwargs)
    want, want_m = reference_rows(model, ref_model, rows, cfg)
    for mbs in (1, 3, 64):  # 3: an episode's branches in different micro-batches
        batch, m = agent_step(model, ref_model, cfg, groups, mbs)
        assert [(p, c, mk) for p, c, mk in zip(batch.prompt_ids, batch.completion_ids, batch.loss_mask)] == [
            (r.prompt_ids, r.completion_ids, r.trained) for r in rows
        ]  # the empty trajectory left out
        assert batch.advantages == pytest.approx([r.A for r in rows], rel=1e-6, abs=1e-7)
        assert_grads_close(step_grads(model), want)
        for k, v in want_m.items():
            assert m[k] == pytest.approx(v, rel=2e-6, abs=1e-7), (k, mbs)


def test_agent_behaviour_logprobs_sit_on_their_tokens(models):
    """μ as the server records it (the engine's logprob at each generated token, 0.0 at the others): the
    trainer's π_old equals it bit for bit at every trained token, and nothing is read elsewhere."""
    model, ref_model = models
    cfg = load_config(None, AGENT_BASE)
    groups = agent_groups(model, exact=True)
    batch, m = agent_step(model, ref_model, cfg, groups, 4)
    assert m["train/train_rollout_logprob_abs_diff"] == 0.0 and m["train/train_rollout_logprob_abs_diff_max"] == 0.0
    assert m["loss/ratio_mean"] == 1.0 and m["loss/clip_frac_low"] == m["loss/clip_frac_high"] == 0.0
    # shifted by one token (μ of the token before), the figures would not be 0: the check can fail
    shifted = copy.deepcopy(groups)
    for g in shifted:
        for r in g:
            for t in r.trajectories:
                t.behav_logprobs[:] = [
                    t.behav_logprobs[i + 1] if i + 1 < len(t.loss_mask) and t.loss_mask[i + 1] else t.behav_logprobs[i]
                    for i in range(len(t.loss_mask))
                ]
    _, m = agent_step(model, ref_model, cfg, shifted, 4)
    assert m["train/train_rollout_logprob_abs_diff"] > 0.1


def test_the_agent_reference_sees_what_it_tests(models):
    model, ref_model = models
    groups = agent_groups(model)
    trajs = [t for g in groups for r in g for t in r.trajectories]
    assert sum(t.num_turns > 1 for t in trajs) >= 5 and any(not t.loss_mask for t in trajs)
    cfg = load_config(None, AGENT_BASE + AGENT_CONFIGS["seq-mean-token-mean cispo bypass, token_mask_is, rloo"])
    _, m = agent_step(model, ref_model, cfg, groups, 64)
    assert 0 < m["correction/token_mask_is/mask_frac"] < 0.5 and m["loss/clip_frac_low"] > 0  # μ off both ways
    rows = agent_rows(groups, "grpo", {})
    assert len({round(r.A, 6) for r in rows}) >= 4  # advantages of several values, shared by branches


def test_a_kl_term_without_its_reference_model_is_refused(models):
    """StepSettings with kl_coef > 0 and the KL in the loss asks for that term: a step without the reference
    model trained without it, silently (and `agent_train_step` passed none)."""
    from exactrl.rollout.agents import agent_train_step

    model, ref_model = models
    cfg = load_config(None, AGENT_BASE + AGENT_CONFIGS["token-mean ppo bypass, kl k3 in the loss, entropy"])
    c = components(model, ref_model, cfg)
    batch = agent_train_batch(agent_groups(model), "grpo")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="kl_coef=0.3 .* no ref_model"):
        train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), c.policy.loss_fn, batch, c.policy.step_settings)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="kl_coef=0.3 .* no ref_model"):  # before any episode runs
        agent_train_step(
            model,
            c.policy.optimizer,
            c.policy.loss_fn,
            c.policy.step_settings,
            None,
            "http://127.0.0.1:1",
            None,
            [],
            2,
            0,
            1,
        )
    c.policy.step_settings.kl_in_loss = False  # the KL in the reward: the agent path shapes no reward
    with pytest.raises(ValueError, match="KL in the reward"):
        agent_train_step(
            model,
            c.policy.optimizer,
            c.policy.loss_fn,
            c.policy.step_settings,
            None,
            "http://127.0.0.1:1",
            None,
            [],
            2,
            0,
            1,
            ref_model=ref_model,
        )


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A tiny model with the project's tokenizer and chat template, served in process, and a trainer copy."""
    from conftest import make_hf_model

    from exactrl.engine import Engine
    from exactrl.envs.tool_use import CalculatorTask
    from exactrl.model.tokenizer import build_tokenizer, default_tokenizer_corpus
    from exactrl.server.app import ServerConfig, ServerState, ServerThread, create_app

    d = tmp_path_factory.mktemp("agent_model")
    build_tokenizer(d, default_tokenizer_corpus([CalculatorTask()], 50, 0), vocab_size=400)
    tok = exactrl.load_tokenizer(d)
    make_hf_model(
        d, "qwen3", seed=0, vocab_size=tok.vocab_size, eos_token_id=tok.end_of_turn_id, pad_token_id=tok.pad_token_id
    )
    model = exactrl.load_model(d)
    rng = random.Random(3)
    problems = [CalculatorTask().generate(rng) for _ in range(2)]
    sft(model, tok, problems, steps=100)  # it calls the tool at temperature 0.7, then answers
    ref_model = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    engine = Engine(
        copy.deepcopy(model).requires_grad_(False), stop_token_ids=sorted(tok.stop_token_ids), kv_budget_tokens=4096
    )
    state = ServerState(engine, tok, ServerConfig("agent"))
    with ServerThread(create_app(state)) as srv:
        yield SimpleNamespace(model=model, ref_model=ref_model, tok=tok, state=state, url=srv.url, problems=problems)


def sft(model, tok, problems, steps: int) -> None:
    """Supervised steps on the ideal calculator transcripts (tests/helpers/serving.py's warm start)."""
    from exactrl.envs.tool_use import ideal_transcript, sft_example
    from exactrl.model.logprobs import token_logprobs

    examples = [sft_example(tok, ideal_transcript(p)) for p in problems]
    masks = [torch.tensor(m[1:], dtype=torch.float32) for _, m in examples]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        lps, _ = token_logprobs(model, [ids for ids, _ in examples])
        loss = -sum((lp * m).sum() for lp, m in zip(lps, masks)) / sum(m.sum() for m in masks)
        opt.zero_grad()
        loss.backward()
        opt.step()


async def tool_episode(base_url, problem, *, seed, seen):
    """Two turns with a tool result between them; keeps the session's trajectories in `seen[seed]`. The reward
    is the episode's index in its group (seed: agent_rollout's episode seeds), so every group learns."""
    import httpx
    import openai

    from exactrl.envs.tool_use import CALCULATOR_TOOL, first_messages
    from exactrl.rollout.agents import TURN_SEEDS

    kw = dict(model="agent", tools=[CALCULATOR_TOOL], temperature=0.7, max_tokens=48)
    messages = first_messages(problem)
    async with openai.AsyncOpenAI(base_url=base_url, api_key="t", max_retries=0) as client:
        m1 = (await client.chat.completions.create(messages=messages, seed=seed, **kw)).choices[0].message
        (call,) = m1.tool_calls
        messages += [m1.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "42"}]
        await client.chat.completions.create(messages=messages, seed=seed + 1, **kw)
    async with httpx.AsyncClient() as http:
        r = await http.get(base_url.removesuffix("/v1") + "/trajectories")
    seen[seed] = [Trajectory(**t) for t in r.json()["trajectories"]]
    return float(seed // TURN_SEEDS % 2)


def test_a_live_tool_episode_step_is_the_reference_step(live):
    """`agent_train_step` over a live server: the recorded 2-turn trajectories (tool and template tokens
    masked between the turns) train as the reference computed from them says, with μ the trainer's bitwise."""
    from exactrl.rollout.agents import TURN_SEEDS, agent_train_step
    from exactrl.seeds import derive_seed

    cfg = load_config(
        None,
        AGENT_BASE + AGENT_CONFIGS["token-mean ppo bypass, kl k3 in the loss, entropy"] + ["rollout.temperature=0.7"],
    )
    c = components(live.model, live.ref_model, cfg, micro_batch_size=3)
    problems, seen = live.problems, {}
    live.model.zero_grad(set_to_none=True)
    m = agent_train_step(
        live.model,
        c.policy.optimizer,
        c.policy.loss_fn,
        c.policy.step_settings,
        live.state,
        live.url,
        tool_episode,
        problems,
        group_size=2,
        seed=0,
        step=1,
        env_kwargs=dict(seen=seen),
        ref_model=live.ref_model,
    )
    groups = [
        [AgentRollout(p, float(j), seen[derive_seed(0, 1, k, j) * TURN_SEEDS], None) for j in range(2)]
        for k, p in enumerate(problems)
    ]
    for g in groups:
        for r in g:
            (t,) = r.trajectories
            runs = "".join(map(str, t.loss_mask)).split("0")
            assert t.num_turns == 2 and len([x for x in runs if x]) == 2 and t.loss_mask[0] == 1  # gen, tool, gen
            tool = [x for x, k in zip(t.completion_ids, t.loss_mask) if not k]
            assert "<tool_response>\n42\n</tool_response>" in live.tok.decode(tool)
            assert all(lp == 0.0 for lp, k in zip(t.behav_logprobs, t.loss_mask) if not k)
    want, want_m = reference_rows(live.model, live.ref_model, agent_rows(groups, "grpo", {}), cfg)
    assert m["train/train_rollout_logprob_abs_diff"] == 0.0 and m["train/train_rollout_logprob_abs_diff_max"] == 0.0
    # a tensor of the warm-started model (layer 1's q_norm) gets a gradient of ~2.5e-6, its fp32 rounding (6e-11)
    # is 3e-5 of that
    assert_grads_close(step_grads(live.model), want, floor=1e-7)
    for k, v in want_m.items():
        assert m[k] == pytest.approx(v, rel=2e-6, abs=1e-7), k
    assert m["rollout/turns_mean"] == 2.0 and m["rollout/masked_tokens_mean"] > 10


# ------------------------------------------------------------------ 2. the asynchronous loop's stale groups
@pytest.mark.parametrize(
    "name",
    [
        "kl k1 in the reward, overlong shaping and masking",
        "topr bypass, reinforce_pp, kl k1 in the reward, token_mask_is",
        "seq-mean-token-mean kl k3 in the loss, entropy",
    ],
)
def test_stale_groups_leave_the_step_whole(models, name):
    """As the trainer thread of `train_async` does at step 6 with max_staleness 2: `drop_stale` at version 5,
    then `train_on`. Groups 1 and 2 hold a token 3 and 4 versions old: the step is the reference step of
    groups 0 and 3 alone (their shaping, their advantages, reinforce_pp's batch whitening over them only, the
    denominators of their 6 sequences)."""
    model, ref_model = models
    cfg = load_config(None, BASE + CONFIGS[name])
    groups = make_groups(model, cfg.rollout.temperature)
    versions = [lambda t: 5 - t % 3, lambda t: 2 if t == 1 else 5, lambda t: 1 if t == 0 else 5, lambda t: 4]
    groups = [
        [replace(r, versions=[v(t) for t in range(len(r.completion_ids))]) for r in g] for g, v in zip(groups, versions)
    ]
    kept, m = drop_stale(groups, version=5, max_staleness=2)
    assert kept == [groups[0], groups[3]]
    ages = [5 - v for g in kept for r in g for v in r.versions]
    assert m == {
        "async/staleness_mean": pytest.approx(sum(ages) / len(ages), rel=1e-15),
        "async/staleness_max": 2.0,
        "async/dropped_samples": 6.0,
    }
    want, want_m = reference(model, ref_model, kept, cfg)
    model.zero_grad(set_to_none=True)
    got = train_on(components(model, ref_model, cfg, micro_batch_size=4), 6, kept)
    assert_grads_close(step_grads(model), want)
    for k, v in want_m.items():
        assert got[k] == pytest.approx(v, rel=2e-6, abs=1e-7), k
    want_all, _ = reference(model, ref_model, groups, cfg)  # (the dropped groups would have changed the step)
    assert not all(torch.allclose(a, b, rtol=1e-3) for a, b in zip(want, want_all))


# ------------------------------------------------------------------ 3. bf16
@pytest.fixture(scope="module")
def bf16_models(qwen3_dir, ref_dir):
    """The policy and reference in bf16, and fp32 copies of the same (bf16-rounded) weights."""
    m16, ref16 = exactrl.load_model(qwen3_dir, dtype="bfloat16"), exactrl.load_model(ref_dir, dtype="bfloat16")
    m32, ref32 = exactrl.load_model(qwen3_dir), exactrl.load_model(ref_dir)
    with torch.no_grad():
        for a, b in zip([*m32.parameters(), *ref32.parameters()], [*m16.parameters(), *ref16.parameters()]):
            a.copy_(b.float())
    return m16, ref16.requires_grad_(False), m32, ref32.requires_grad_(False)


class _Seen:
    """A loss that notes the dtypes of what it is given."""

    def __init__(self, loss_fn):
        self.loss_fn, self.dtypes = loss_fn, set()

    def __call__(self, inp, agg_mode, norm):
        self.dtypes |= {(k, v.dtype) for k, v in inp._named().items()}
        return self.loss_fn(inp, agg_mode, norm)


@pytest.mark.parametrize(
    "name",
    [
        "token-mean ppo",
        "seq-mean-token-mean kl k3 in the loss, entropy",
        "sapo bypass, dr_grpo, seq-mean-token-mean",
        "kl k1 in the reward, overlong shaping and masking",
    ],
)
def test_a_bf16_step_is_the_reference_step_to_bf16_rounding(bf16_models, name):
    """bf16 weights and activations (`model.dtype`), logprobs and loss arithmetic in fp32, gradients in bf16.

    The forward's logprobs are bitwise those of one sequence alone in bf16 (the exactness contract holds in
    bf16), so every metric but `train/grad_norm` agrees with the bf16 reference to fp32 rounding (measured
    ≤ 5e-6 relative; asserted 2e-5). `train/grad_norm` is torch's clip_grad_norm_ over bf16 gradients: a
    bf16 number (measured ≤ 2.7e-3 off; asserted 8e-3). The gradients carry bf16's rounding of the backward:
    max |Δg| / max |g| per tensor ≤ 1.9e-2 against the bf16 reference and ≤ 3.4e-2 against the fp32 model
    on the same weights (measured over every CONFIGS entry, micro-batches of 1 and 64; asserted 4e-2 and
    6e-2), where fp32 gives 1e-6."""
    m16, ref16, m32, ref32 = bf16_models
    cfg = load_config(None, BASE + CONFIGS[name])
    groups = make_groups(m16, cfg.rollout.temperature)
    want16, want_m = reference(m16, ref16, groups, cfg)
    want32, _ = reference(m32, ref32, groups, cfg)
    for mbs in (1, 64):
        c = components(m16, ref16, cfg, mbs)
        c.policy.loss_fn = _Seen(c.policy.loss_fn)
        m16.zero_grad(set_to_none=True)
        m = train_on(c, 1, groups)
        assert {d for _, d in c.policy.loss_fn.dtypes} == {torch.float32}  # no loss input left in bf16
        got = step_grads(m16)
        assert {g.dtype for g in got} == {torch.bfloat16}
        assert_grads_close(got, want16, rtol=4e-2)
        assert_grads_close(got, want32, rtol=6e-2)
        assert m.pop("train/grad_norm") == pytest.approx(want_m["train/grad_norm"], rel=8e-3)
        for k, v in want_m.items():
            if k != "train/grad_norm":
                assert m[k] == pytest.approx(v, rel=2e-5, abs=1e-7), (k, mbs)


def test_bf16_behaviour_logprobs_are_the_trainers_bitwise(bf16_models):
    m16, ref16, _, _ = bf16_models
    cfg = load_config(None, BASE)
    groups = [
        [
            replace(
                r,
                behav_logprobs=exactrl.sequence_logprobs(m16, [r.prompt_ids + r.completion_ids])[0][
                    len(r.prompt_ids) - 1 :
                ].tolist(),
            )
            for r in g
        ]
        for g in make_groups(m16, 1.0)
    ]
    m = train_on(components(m16, ref16, cfg, 5), 1, groups)
    assert m["train/train_rollout_logprob_abs_diff"] == 0.0 and m["train/train_rollout_logprob_abs_diff_max"] == 0.0
