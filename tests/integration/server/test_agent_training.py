"""Tool-using agents end to end, on a model warm-started on the calculator format.

1. Tool calls through the openai client (JSON and streamed): parsed into `tool_calls` for the client,
   while the next turn's prompt keeps the generated tokens exactly and the logprobs equal the trainer's.
2. Training: a calculator agent plays episodes on session URLs of a live server; the server's recorded
   trajectories (tool/template tokens masked) train the policy for a few steps with zero train/rollout
   logprob mismatch, and the new weights go back into the server's engine.
"""

from __future__ import annotations

import copy
import json
import random

import httpx
import pytest
import torch
from serving import check_trajectory, check_turns, model_dir, warm_start

import exactrl
from exactrl.algo.losses import build_loss
from exactrl.engine import Engine
from exactrl.envs.tool_use import CALCULATOR_TOOL, CalculatorTask, calculate, calculator_episode, first_messages
from exactrl.rollout.agents import agent_train_step
from exactrl.server.app import ServerConfig, ServerState, ServerThread, create_app
from exactrl.train.trainer import StepSettings


@pytest.fixture(scope="module")
def calc():
    torch.manual_seed(0)
    tok = exactrl.load_tokenizer(model_dir())
    model = exactrl.load_model(model_dir())
    rng = random.Random(0)
    problems = [CalculatorTask().generate(rng) for _ in range(2)]
    warm_start(model, tok, problems, steps=50)  # learns the tool-call format, not yet reliably
    engine = Engine(
        copy.deepcopy(model).requires_grad_(False), stop_token_ids=sorted(tok.stop_token_ids), kv_budget_tokens=8192
    )
    state = ServerState(engine, tok, ServerConfig("calc-agent"))
    with ServerThread(create_app(state)) as srv:
        yield dict(tok=tok, model=model, engine=engine, state=state, url=srv.url, problems=problems)


def test_tool_call_turns_are_token_exact(calc):
    import openai

    client = openai.OpenAI(base_url=calc["url"] + "/sessions/tools/v1", api_key="t", max_retries=0)
    messages = first_messages(calc["problems"][0])
    kw = dict(model="calc-agent", tools=[CALCULATOR_TOOL], temperature=0.0, max_tokens=40)
    r1 = client.chat.completions.create(messages=messages, **kw)
    m1 = r1.choices[0].message
    assert r1.choices[0].finish_reason == "tool_calls" and m1.content is None
    call = m1.tool_calls[0]
    assert call.function.name == "calculator"
    # the same request streamed: the tool call arrives as a delta, the token fields in the closing chunk
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **kw))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        (call.function.name, json.loads(call.function.arguments))
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].choices[0].delta.generation_token_ids == m1.generation_token_ids
    result = calculate(json.loads(call.function.arguments)["expression"])
    messages += [m1, {"role": "tool", "tool_call_id": call.id, "content": result}]
    r2 = client.chat.completions.create(messages=messages, **kw)
    m2 = r2.choices[0].message
    messages += [m2, {"role": "user", "content": "Compute 1+1"}]
    m3 = client.chat.completions.create(messages=messages, **kw).choices[0].message
    check_turns(calc["tok"], [m1, m2, m3], temperature=0.0, model=calc["model"])
    (traj,) = httpx.get(calc["url"] + "/sessions/tools/trajectories").json()["trajectories"][-1:]
    check_trajectory(traj, [m1, m2, m3], temperature=0.0, model=calc["model"])
    assert traj["completion_ids"][-len(m3.generation_token_ids) :] == m3.generation_token_ids
    tool_turn = m2.prompt_token_ids[len(m1.prompt_token_ids) + len(m1.generation_token_ids) :]
    assert calc["tok"].decode(tool_turn) == (
        f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_calculator_agent_trains_end_to_end(calc):
    model, engine, state = calc["model"], calc["engine"], calc["state"]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    settings = StepSettings(
        temperature=1.0,
        top_k=-1,
        top_p=1.0,
        micro_batch_size=8,
        agg_mode="token-mean",
        agg_constant=None,
        grad_clip=1.0,
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    history = []
    for step in (1, 2):
        m = agent_train_step(
            model,
            opt,
            build_loss("ppo"),
            settings,
            state,
            calc["url"],
            calculator_episode,
            calc["problems"],
            group_size=4,
            seed=0,
            step=step,
            env_kwargs=dict(model="calc-agent", max_tokens=40, temperature=1.0),
        )
        history.append(m)
        assert m["train/train_rollout_logprob_abs_diff"] == 0.0
        assert m["train/train_rollout_logprob_abs_diff_max"] == 0.0
        assert m["engine/version"] == step == engine.version
    # the agent used the tool: trajectories interleave generated turns with masked tool/template tokens
    assert max(m["rollout/turns_mean"] for m in history) > 1.0
    assert all(m["rollout/masked_tokens_mean"] > 0 for m in history)
    assert any(m["rollout/zero_std_group_frac"] < 1.0 for m in history)  # some group had a learning signal
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    for k, v in model.state_dict().items():  # the engine serves exactly the trained weights
        assert torch.equal(v, engine.model.state_dict()[k])


def test_a_failing_episode_takes_only_its_group_out_of_the_step(calc):
    """An environment that raises (here: for problem 1's second episode) costs its group, not the step; the
    session it opened is deleted. Every group failing is an error carrying the first failure."""
    import asyncio

    from exactrl.rollout.agents import TURN_SEEDS, collect_agent_groups, complete_groups
    from exactrl.seeds import derive_seed

    seeds = []
    failing = derive_seed(0, 1, 1, 1) * TURN_SEEDS  # run seed 0, step 1, problem 1, episode j = 1

    async def env(base_url, problem, *, seed, **kw):
        seeds.append(seed)
        reward = await calculator_episode(base_url, problem, seed=seed, **kw)  # the session now holds turns
        if problem is calc["problems"][1] and seed == failing:
            raise RuntimeError("the tool server is down")
        return reward

    sessions = len(calc["state"].sessions)
    groups = asyncio.run(
        collect_agent_groups(
            calc["url"], env, calc["problems"], 2, seed=0, step=1, env_kwargs=dict(model="calc-agent", max_tokens=8)
        )
    )
    kept, failed = complete_groups(groups)
    assert failed == 1 and len(kept) == 1 and kept[0] is groups[0]
    assert isinstance(groups[1][1], RuntimeError)
    assert len(set(seeds)) == 4 and all(s % TURN_SEEDS == 0 for s in seeds)  # turns (seed + t) never collide
    assert len(calc["state"].sessions) == sessions  # no session left behind
    with pytest.raises(RuntimeError, match="every group had an episode that failed .*the tool server is down"):
        complete_groups([[RuntimeError("the tool server is down"), groups[0][0]]])
