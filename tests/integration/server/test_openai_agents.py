"""The OpenAI Agents SDK (`openai-agents`) as a real client: a tool-using agent runs against a live server's
session URL through `OpenAIResponsesModel`, and its trajectory comes back from the session token-exact for
training. The SDK replays the output items it was given (token fields included) as the next request's input,
so every turn is spliced by token id; no network, tracing off."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest
from serving import calculator_served, check_trajectory, check_turns

from exactrl.envs.tool_use import CALCULATOR_TOOL, SYSTEM_PROMPT, calculate

agents = pytest.importorskip(
    "agents", reason="the OpenAI Agents SDK is not installed: pip install 'exactrl[agents]' (openai-agents)"
)

TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def calculator_tool(calls: list[str]):
    """The calculator as an Agents SDK function tool, with the schema the model was warm-started on."""

    async def invoke(ctx, arguments: str) -> str:
        try:  # the model's text: any JSON at all
            expression = json.loads(arguments).get("expression")
        except (ValueError, AttributeError):
            expression = None
        calls.append(expression)
        return calculate(expression)

    fn = CALCULATOR_TOOL["function"]
    return agents.FunctionTool(
        name=fn["name"],
        description=fn["description"],
        params_json_schema=fn["parameters"],
        on_invoke_tool=invoke,
        strict_json_schema=False,  # not enforced by the server (no constrained decoding): say so
    )


async def run_agent(url: str, model_name: str, prompt: str, streamed: bool = False, **settings):
    """(the SDK's run result, the tool's calls): one agent run against `url` (a session's /v1)."""
    import openai

    agents.set_tracing_disabled(True)
    calls: list[str] = []
    async with openai.AsyncOpenAI(base_url=url, api_key="t", max_retries=0) as client:
        agent = agents.Agent(
            name="calculator agent",
            instructions=SYSTEM_PROMPT,
            tools=[calculator_tool(calls)],
            model=agents.OpenAIResponsesModel(model_name, client),
            model_settings=agents.ModelSettings(max_tokens=40, **settings),
        )
        if not streamed:
            return await agents.Runner.run(agent, prompt, max_turns=4), calls
        run = agents.Runner.run_streamed(agent, prompt, max_turns=4)
        async for _ in run.stream_events():
            pass
        return run, calls


def turns_of(result) -> list[SimpleNamespace]:
    """Each model call's token fields: on the last output item of its response."""
    turns = []
    for response in result.raw_responses:
        last = response.output[-1].model_dump()
        turns.append(SimpleNamespace(**{f: last[f] for f in TOKEN_FIELDS}))
    return turns


@pytest.mark.parametrize("streamed", [False, True])
def test_agents_sdk_tool_agent_trajectory_is_token_exact(streamed):
    s, problems, model = calculator_served()
    problem = problems[0]
    sid = f"agents-sdk-{'stream' if streamed else 'json'}"
    before = httpx.get(f"{s.url}/metrics").json().get("chat/prompts_spliced", 0)
    result, calls = asyncio.run(
        run_agent(f"{s.url}/sessions/{sid}/v1", s.model, problem.prompt, streamed, temperature=0.0)
    )
    assert calls == [problem.meta["expression"]]  # the model called the tool, the SDK ran it
    assert len(result.raw_responses) >= 2 and result.raw_responses[0].output[0].type == "function_call"
    assert isinstance(result.final_output, str)
    turns = turns_of(result)
    # every turn after the first was spliced: the SDK sent the output items back with their token fields
    assert httpx.get(f"{s.url}/metrics").json().get("chat/prompts_spliced", 0) - before == len(turns) - 1
    check_turns(s.tokenizer, turns, temperature=0.0, model=model)
    # the tool result the SDK sent back is between the turns, as the chat template renders it
    between = turns[1].prompt_token_ids[len(turns[0].prompt_token_ids) + len(turns[0].generation_token_ids) :]
    assert s.tokenizer.decode(between) == (
        f"\n<|im_start|>user\n<tool_response>\n{calculate(calls[0])}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # the session's one trajectory: prompt + generated tokens concatenated, mask 1 on the generated ones
    (t,) = httpx.get(f"{s.url}/sessions/{sid}/trajectories", timeout=30).json()["trajectories"]
    assert t["prompt_ids"] + t["completion_ids"] == turns[-1].prompt_token_ids + turns[-1].generation_token_ids
    check_trajectory(t, turns, temperature=0.0, model=model)


def test_agents_sdk_agent_as_an_exactrl_environment():
    """The agent run as exactrl's agent environment (`rollout/agents.py`: one session per episode): its
    episodes become a TrainBatch whose tokens, loss masks and behaviour logprobs are the trainer's."""
    from serving import trainer_logprobs

    from exactrl.envs.tool_use import CalculatorTask
    from exactrl.rollout.agents import agent_train_batch, collect_agent_groups, complete_groups

    s, problems, model = calculator_served()

    async def env(base_url, problem, *, seed, model):
        try:
            result, _ = await run_agent(base_url, model, problem.prompt, temperature=1.0, extra_body={"seed": seed})
        except (agents.MaxTurnsExceeded, agents.ModelBehaviorError):  # no answer, or a call of no tool: it scores 0
            return 0.0
        return CalculatorTask().reward(problem, str(result.final_output))

    groups = asyncio.run(
        collect_agent_groups(s.url, env, problems, group_size=2, seed=0, step=1, env_kwargs=dict(model=s.model))
    )
    kept, failed = complete_groups(groups)
    assert failed == 0
    # each episode is one trajectory (its turns spliced into one branch) in which the agent used the tool
    assert all(len(r.trajectories) == 1 and r.trajectories[0].num_turns >= 2 for g in kept for r in g)
    batch = agent_train_batch(kept)
    assert len(batch.prompt_ids) >= 4
    for p, c, m, lp in zip(batch.prompt_ids, batch.completion_ids, batch.loss_mask, batch.behav_logprobs):
        want = trainer_logprobs(p + c, 1.0, model=model)[len(p) - 1 :]
        assert lp == [x if k else 0.0 for x, k in zip(want, m)]  # bitwise
