"""verifiers environments (the `verifiers.v1` API) trained through the server's sessions, token-exact.

Two environments are written here with verifiers' own API and installed the way verifiers finds an
environment (a package on sys.path exporting its Taskset, Harness and Env via `__all__`): a single-turn
one and a multi-turn guessing game whose Env answers each wrong guess. Their harness is an in-process
chat loop through verifiers' interception server (verifiers' built-in harnesses install their program
with uv, which needs the network). Checked: every trajectory the server recorded is the turns' exact
tokens with the trainer's logprobs bitwise, each reward is the weighted sum of the task's rewards, and
a few GRPO steps train with train/train_rollout_logprob_abs_diff == 0.0 (and > 0 with `fast` kernels
in the trainer: the check can fail).
"""

from __future__ import annotations

import asyncio
import copy
import sys
import textwrap
import types

import pytest
import torch
from serving import check_trajectory, model_dir

pytest.importorskip("verifiers.v1")

import exactrl  # noqa: E402
from exactrl.algo.losses import build_loss  # noqa: E402
from exactrl.engine import Engine  # noqa: E402
from exactrl.envs.verifiers_env import VerifiersEnv  # noqa: E402
from exactrl.rollout.agents import agent_train_step, collect_agent_groups, complete_groups  # noqa: E402
from exactrl.server.app import ServerConfig, ServerState, ServerThread, create_app  # noqa: E402
from exactrl.train.trainer import StepSettings  # noqa: E402

CHAT = '''
import verifiers.v1 as vf
from openai import AsyncOpenAI


class ChatHarness(vf.Harness[vf.HarnessConfig]):
    """One model call per segment through verifiers' interception; the history kept as the server sent it."""

    NEEDS_CONTAINER = False
    EXECUTES_CODE = False
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    histories = {}  # trace id -> the messages sent and received

    async def _reply(self, ctx, trace, endpoint, secret, messages):
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            r = await client.chat.completions.create(model=ctx.model, messages=messages)
        messages.append(r.choices[0].message.model_dump(exclude_none=True))  # token fields kept
        self.histories[trace.id] = messages
        return vf.ProgramResult(0, "", "")

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kw):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        return await self._reply(ctx, trace, endpoint, secret, messages + [{"role": "user", "content": prompt}])

    async def resume(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, messages, tool_interception_url=None):
        new = [m.model_dump(exclude_none=True) for m in messages]
        return await self._reply(ctx, trace, endpoint, secret, self.histories[trace.id] + new)
'''

TASKS = """
import verifiers.v1 as vf
from vfx_chat import ChatHarness


class SumData(vf.TaskData):
    answer: str = ""


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=0.5)
    async def correct(self, task, trace) -> float:
        return float(task.answer in (trace.last_reply or ""))

    @vf.reward
    async def brevity(self, trace) -> float:
        return 1.0 / (1.0 + len(trace.last_reply or ""))


class SumConfig(vf.TasksetConfig):
    count: int = 3


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        for i in range(self.config.count):
            yield SumTask(SumData(prompt=f"What is {i}+1?", answer=str(i + 1)), self.config.task)
"""

SINGLE = (
    TASKS
    + """
__all__ = ["SumTaskset", "ChatHarness"]
"""
)

GUESS = (
    TASKS
    + """

class GuessEnv(vf.Env[vf.SingleAgentEnvConfig]):
    \"\"\"Up to three guesses: a wrong one is answered with a hint.\"\"\"

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            for _ in range(2):
                if task.data.answer in segment.last_reply:
                    break
                segment = await chat.turn("No. Think again: what is the sum?")


__all__ = ["SumTaskset", "ChatHarness", "GuessEnv"]
"""
)

BAD = (
    TASKS.replace("return float(task.answer in", "return ('yes', task.answer in")
    + """
__all__ = ["SumTaskset", "ChatHarness"]
"""
)

EMPTY = (
    TASKS.replace("range(self.config.count)", "range(0)")
    + """
__all__ = ["SumTaskset", "ChatHarness"]
"""
)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The environments as installed packages: importable by name from sys.path."""
    root = tmp_path_factory.mktemp("vf_envs")
    (root / "vfx_chat.py").write_text(textwrap.dedent(CHAT))
    for name, source in (("vfx_single", SINGLE), ("vfx_guess", GUESS), ("vfx_bad", BAD), ("vfx_empty", EMPTY)):
        (root / name).mkdir()
        (root / name / "__init__.py").write_text(source)
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    for name in ("vfx_chat", "vfx_single", "vfx_guess", "vfx_bad", "vfx_empty"):
        sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def server(installed):
    torch.manual_seed(0)
    tok = exactrl.load_tokenizer(model_dir())
    model = exactrl.load_model(model_dir())
    engine = Engine(
        copy.deepcopy(model).requires_grad_(False), stop_token_ids=sorted(tok.stop_token_ids), kv_budget_tokens=8192
    )
    state = ServerState(engine, tok, ServerConfig("vf-policy"))
    with ServerThread(create_app(state)) as srv:
        yield types.SimpleNamespace(tok=tok, model=model, engine=engine, state=state, url=srv.url)


ENV_KW = dict(model="vf-policy", max_tokens=8, temperature=1.0)
SETTINGS = dict(top_k=-1, top_p=1.0, micro_batch_size=8, agg_mode="token-mean", agg_constant=None, grad_clip=1.0)


def play(server, env: VerifiersEnv, group_size: int = 2):
    groups = asyncio.run(
        collect_agent_groups(server.url, env, env.problems()[:2], group_size, seed=0, step=1, env_kwargs=ENV_KW)
    )
    return complete_groups(groups)


def check_episodes(server, env, groups, turns_max: int) -> list[int]:
    """Each episode's trajectory against the turns its harness saw; its reward against the task's."""
    histories = sys.modules["vfx_chat"].ChatHarness.histories
    turns_seen = []
    for g in groups:
        for r in g:
            ep = r.episode
            sent = [types.SimpleNamespace(**m) for m in histories[ep.trace.id] if "generation_token_ids" in m]
            assert 1 <= len(sent) == ep.turns <= turns_max
            (traj,) = r.trajectories
            check_trajectory(traj.to_json(), sent, temperature=1.0, model=server.model)
            reply = sent[-1].content or ""
            answer = r.problem.answer
            assert ep.rewards == {"correct": (float(answer in reply), 0.5), "brevity": (1 / (1 + len(reply)), 1.0)}
            assert r.reward == ep.reward == 0.5 * float(answer in reply) + 1 / (1 + len(reply))
            turns_seen.append(len(sent))
    return turns_seen


def test_single_turn_episodes_are_token_exact_and_scored_by_the_task(server):
    env = VerifiersEnv.load("vfx_single", {"taskset": {"count": 2}})
    assert [p.prompt for p in env.problems()] == ["What is 0+1?", "What is 1+1?"]
    assert [p.answer for p in env.problems()] == ["1", "2"]
    groups, failed = play(server, env)
    assert failed == 0
    assert check_episodes(server, env, groups, turns_max=1) == [1, 1, 1, 1]


def test_multi_turn_episodes_splice_every_turn_by_token_id(server):
    env = VerifiersEnv.load("vfx_guess")
    assert type(env.env).__name__ == "GuessEnv"
    groups, failed = play(server, env)
    assert failed == 0
    assert max(check_episodes(server, env, groups, turns_max=3)) == 3  # the random policy misses: three turns


@pytest.mark.parametrize("kernels", ["exact", "fast"])
def test_grpo_steps_on_a_multi_turn_environment(server, kernels):
    """A few steps: zero train/rollout mismatch with exact kernels in the trainer, a mismatch with fast ones."""
    env = VerifiersEnv.load("vfx_guess")
    model = server.model if kernels == "exact" else exactrl.load_model(model_dir(), kernels="fast")
    model.load_state_dict(server.engine.model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    settings = StepSettings(temperature=1.0, **SETTINGS)
    steps = (1, 2) if kernels == "exact" else (1,)
    for step in steps:
        m = agent_train_step(
            model, opt, build_loss("ppo"), settings, server.state, server.url, env, env.problems()[:2],
            group_size=2, seed=0, step=step, env_kwargs=ENV_KW,
        )  # fmt: skip
        assert m["rollout/failed_episodes"] == 0 and m["rollout/turns_mean"] > 1.0
        if kernels == "exact":
            assert m["train/train_rollout_logprob_abs_diff"] == 0.0
            assert m["train/train_rollout_logprob_abs_diff_max"] == 0.0
        else:
            assert m["train/train_rollout_logprob_abs_diff"] > 0.0
    for k, v in model.state_dict().items():  # the server's engine holds exactly the trained weights
        assert torch.equal(v, server.engine.model.state_dict()[k])


def test_errors_name_the_problem(server, tmp_path, capsys):
    from exactrl.cli import main as cli_main

    sets = ["task.kind=verifiers", "task.env_id=vfx_missing", f"model.path={model_dir()}", f"run_dir={tmp_path / 'r'}"]
    assert cli_main(["train", *[x for s in sets for x in ("--set", s)]]) == 2
    assert "task.env_id 'vfx_missing': no such verifiers environment is installed" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    with pytest.raises(ValueError, match="task.env_id 'vfx_missing': no such verifiers environment"):
        VerifiersEnv.load("vfx_missing")
    with pytest.raises(ValueError, match="'vfx_empty' has no tasks"):
        VerifiersEnv.load("vfx_empty")
    bad = VerifiersEnv.load("vfx_bad")
    groups = asyncio.run(
        collect_agent_groups(server.url, bad, bad.problems()[:1], 1, seed=0, step=1, env_kwargs=ENV_KW)
    )
    with pytest.raises(
        RuntimeError,
        match=r"'vfx_bad': the episode failed: TaskError: .* rewards brevity, correct must return a number",
    ):
        complete_groups(groups)


def test_exactrl_train_on_a_verifiers_environment(installed, tmp_path):
    """`exactrl train --set task.kind=verifiers --set task.env_id=...`: the multi-turn environment's episodes,
    through a server over the run's engine, train with zero mismatch at every step."""
    from conftest import train_rows

    settings = [
        "progress=false",
        "tensorboard=false",
        "task.kind=verifiers",
        "task.env_id=vfx_guess",
        "task.env_args={taskset: {count: 8}}",
        "task.eval_size=0",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2",
        "rollout.max_tokens=8",
        "engine.kv_budget_tokens=4096",
    ]
    rows = train_rows(settings, model_dir(), tmp_path / "run", "max_steps=1")
    rows = train_rows(settings, model_dir(), tmp_path / "run", "max_steps=2", "resume=true")  # task unchanged
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["train/train_rollout_logprob_abs_diff"] == 0.0
        assert r["train/train_rollout_logprob_abs_diff_max"] == 0.0
        assert 0.0 < r["rollout/reward_mean"] <= 1.5
        assert r["rollout/response_len_mean"] > 8  # several turns: more than one turn's max_tokens
