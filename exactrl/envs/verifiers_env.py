"""verifiers environments as tasks: the model is only ever called through the session URL an episode is handed.

An installed `verifiers` environment (PyPI `verifiers` 0.4, the `verifiers.v1` API; `pip install
'exactrl[verifiers]'`) is named by its taskset id, `task.env_id`: the package verifiers itself imports
for `--env.taskset.id` (a `Taskset` subclass in its `__all__`, with optionally its own `Harness` and
`Env`). An episode is verifiers' own:

    task k of the taskset  ->  Env.run_episode(task, ModelContext(model, client -> <server>/sessions/<id>/v1))
        the env's `run()` (one segment, or turn after turn through `agent.interaction(task)`),
        its harness's program, every model call relayed by verifiers' interception server
        -> the task's @vf.reward functions score the trace: reward = Σ score · weight (verifiers' Trace.reward)

and exactrl reads the episode's tokens back from the session (exactrl/rollout/agents.py): the generated
tokens with the engine's logprobs, every other token masked. verifiers' `eval` client relays the
server's answer unchanged, so a harness that sends the assistant message back as it came (verifiers'
chat programs do within a segment) sends the token fields with it, and the next turn is spliced by
token id (exactrl/chat/splice.py). verifiers' default `Harness.resume()` replays its own transcript,
without them: that turn is a fresh render, which extends the last only if its text re-tokenizes to the
sampled tokens (else the session splits the episode, and `VerifiersTask.play` refuses it).

Sampling: exactrl's temperature, top_p, top_k, max_tokens and each episode's seed go in the episode's
`ModelContext.sampling`, which verifiers applies to every model call of the episode (one seed for all
of its turns: the engine's draw is keyed by the seed and the token position, so turns draw apart).

Where exactrl departs from verifiers' own runs: every agent seat runs in the `subprocess` runtime
unless `task.env_args` names another (verifiers' default is a remote sandbox); and an episode must
be one agent run (one trace): the session records every model call of the episode, so a second
agent's (a simulated user's) tokens would be trained on as the policy's.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import random
from dataclasses import dataclass, field
from typing import Any

from exactrl.envs.base import Problem, Task
from exactrl.envs.rewards import as_reward

EXTRA = "verifiers"  # pip install 'exactrl[verifiers]'


def import_verifiers():
    """`verifiers.v1`, or a ValueError naming the extra that installs it."""
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ValueError(
            f"task.kind=verifiers needs the `verifiers` package ({e}): pip install 'exactrl[{EXTRA}]'"
        ) from None
    return vf


@dataclass
class VerifiersEpisode:
    """What one episode returned: its reward and the environment's own account of it."""

    reward: float  # Σ score · weight over the task's rewards (verifiers' Trace.reward)
    rewards: dict[str, tuple[float, float]]  # reward name -> (score, weight)
    turns: int  # the model calls verifiers recorded
    reply: str  # the agent's last reply, as verifiers read it
    trace: Any = field(repr=False, default=None)  # the verifiers Trace


class VerifiersEnv:
    """A loaded verifiers environment: its tasks as exactrl `Problem`s, and an agent-path episode function
    (`exactrl.rollout.agents.EnvFn`): `await env(base_url, problem, seed=..., model=..., ...)`."""

    def __init__(self, env_id: str, env: Any, tasks: list):
        self.env_id = env_id
        self.env = env  # a verifiers.v1.Env
        self.tasks = tasks  # its taskset's tasks, in load() order; Problem.meta["vf_task"] indexes them
        self._open = None  # (event loop, lock, serving context, episodes inside it) while any episode runs

    @classmethod
    def load(cls, env_id: str, env_args: dict | None = None) -> VerifiersEnv:
        """The environment whose taskset id is `env_id`, its config's other fields from `env_args` (verifiers'
        `EnvConfig`: `taskset` knobs, each seat's `harness`, `runtime`, `max_turns`, ...)."""
        vf = import_verifiers()
        if not isinstance(env_id, str) or not env_id.strip():
            raise ValueError(f"task.env_id must name an installed verifiers environment, got {env_id!r}")
        args = copy.deepcopy(dict(env_args or {}))
        taskset = args.pop("taskset", {})
        if not isinstance(taskset, dict):
            raise ValueError(f"task.env_args.taskset must be a mapping of the taskset's settings, got {taskset!r}")
        data = {**args, "taskset": {**taskset, "id": env_id}}
        try:
            config = vf.resolve_env_config(data)
            for role in _roles(config):
                seat = data.setdefault(role, {})
                if isinstance(seat, dict) and "runtime" not in seat:
                    seat["runtime"] = {"type": "subprocess"}
            config = vf.resolve_env_config(data)
            env = vf.load_environment(config)
        except ModuleNotFoundError as e:
            raise ValueError(f"task.env_id {env_id!r}: no such verifiers environment is installed ({e})") from None
        except (ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"task.env_id {env_id!r} / task.env_args: {type(e).__name__}: {e}") from None
        if not env.taskset.bounded:
            raise ValueError(f"verifiers environment {env_id!r} has an infinite taskset: exactrl reads its tasks once")
        tasks = list(env.taskset)
        if not tasks:
            raise ValueError(f"verifiers environment {env_id!r} has no tasks: its taskset's load() yielded none")
        return cls(env_id, env, tasks)

    def problems(self) -> list[Problem]:
        """One `Problem` per task: its prompt text, its `answer` field (if it has one) and its index."""
        out = []
        for k, t in enumerate(self.tasks):
            answer = getattr(t.data, "answer", "")
            out.append(Problem(t.data.prompt_text, "" if answer is None else str(answer), {"vf_task": k}))
        return out

    def task_of(self, problem: Problem):
        k = problem.meta.get("vf_task")
        if not isinstance(k, int) or not 0 <= k < len(self.tasks):
            raise ValueError(
                f"problem {problem.prompt!r:.60} is not a task of verifiers environment {self.env_id!r} "
                f"(meta.vf_task={k!r})"
            )
        return self.tasks[k]

    async def __call__(
        self,
        base_url: str,
        problem: Problem,
        *,
        seed: int,
        model: str,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        max_tokens: int | None = None,
    ) -> VerifiersEpisode:
        """One episode of `problem`'s task, every model call made to `base_url` (a session's /v1)."""
        vf = import_verifiers()
        sampling = {"temperature": temperature, "top_p": top_p, "seed": seed, "max_tokens": max_tokens}
        if top_k != -1:
            sampling["top_k"] = top_k
        ctx = vf.ModelContext(
            model=model,
            # not PRIME_API_KEY: verifiers reads Prime's login for that one. The key is sent if the variable is set
            client=vf.EvalClientConfig(base_url=base_url, api_key_var="EXACTRL_API_KEY"),
            sampling=vf.SamplingConfig(**{k: v for k, v in sampling.items() if v is not None}),
        )
        async with self._serving():
            episode = await self.env.run_episode(self.task_of(problem), ctx)
        return self.scored(episode)

    @contextlib.asynccontextmanager
    async def _serving(self):
        """verifiers' serving resources (its interception server, shared tool servers), opened by the first
        episode that runs and closed by the last: `Env.serving()` keeps them on the Env itself, so two open
        at once would take each other's."""
        loop = asyncio.get_running_loop()
        if self._open is None or self._open[0] is not loop:
            self._open = [loop, asyncio.Lock(), None, 0]
        state = self._open
        async with state[1]:
            if state[3] == 0:
                state[2] = self.env.serving()
                await state[2].__aenter__()
            state[3] += 1
        try:
            yield
        finally:
            async with state[1]:
                state[3] -= 1
                if state[3] == 0:
                    await state[2].__aexit__(None, None, None)

    def scored(self, episode) -> VerifiersEpisode:
        """The episode's reward, or a ValueError naming what went wrong (an error verifiers recorded, a reward
        that was not computed or is not a finite number, more than one agent run)."""
        where = f"verifiers environment {self.env_id!r}"
        errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
        if errors:
            e = errors[0]
            hint = ""
            if e.type == "TaskError" and "scoring" in e.message:  # verifiers does not say which reward failed
                names = ", ".join(fn.__name__ for fn in self.tasks[0].hooks("reward"))
                hint = f" (each of the task's rewards {names} must return a number, or a mapping of names to numbers)"
            raise ValueError(f"{where}: the episode failed: {e.type}: {e.message}{hint}")
        if len(episode.traces) != 1:
            raise ValueError(
                f"{where}: an episode of {len(episode.traces)} agent runs; exactrl trains environments "
                f"with one agent run per episode (every model call of the episode is trained as the policy's)"
            )
        (trace,) = episode.traces
        rewards = {}
        for name, r in trace.rewards.items():
            if r is None:
                raise ValueError(f"{where}: reward {name!r} was not computed for the episode")
            rewards[name] = (as_reward(r.score, f"{where}: reward {name!r}"), float(r.weight))
        reward = as_reward(trace.reward, f"{where}: the weighted sum of its rewards")
        return VerifiersEpisode(reward, rewards, trace.num_turns, trace.last_reply or "", trace)


def _roles(config) -> list[str]:
    from verifiers.v1.configs.agent import agent_config_fields

    return list(agent_config_fields(config))


SERVED_MODEL = "exactrl-policy"  # the model name of the server `VerifiersTask.play` opens for a batch


class VerifiersTask(Task):
    """A verifiers environment as the task of `exactrl train` (`task.kind: verifiers`): its tasks are the
    problems, and `play` replaces the engine's one-shot sampling with the environment's episodes."""

    def __init__(self, env: VerifiersEnv):
        self.env = env
        self.name = f"verifiers:{env.env_id}"
        self.problems = env.problems()  # every task once, in taskset order

    def generate(self, rng: random.Random) -> Problem:
        return rng.choice(self.problems)

    def reward(self, problem: Problem, completion: str) -> float:
        raise ValueError(
            f"{self.name}: a verifiers environment scores whole episodes (its task's rewards), not one completion"
        )

    def split_key(self, problem: Problem) -> str:
        """The task's own key (verifiers' content hash of its data): tasks may share a prompt."""
        return self.env.task_of(problem).key

    def play(self, engine, tokenizer, problems: list[Problem], rs, seed: int, step: int, greedy: bool, indices):
        """The groups of `problems` (`exactrl.rollout.groups.generate_groups`' contract), each episode played
        by the environment against a session of a server over `engine`, open for this batch only.

        An episode that failed takes its group out (`rollout.agents.complete_groups`; every group failing is
        an error). Each episode must leave one trajectory in its session: one conversation, spliced turn by
        turn (a harness that rebuilt its history so that it no longer extends the last turn splits it)."""
        from exactrl.rollout.agents import collect_agent_groups, complete_groups
        from exactrl.rollout.groups import Rollout
        from exactrl.server.app import ServerConfig, ServerState, ServerThread, create_app

        state = ServerState(engine, tokenizer, ServerConfig(SERVED_MODEL))
        kw = dict(
            model=SERVED_MODEL,
            temperature=0.0 if greedy else rs.temperature,
            top_p=rs.top_p,
            top_k=rs.top_k,
            max_tokens=rs.max_tokens,
        )
        n = 1 if greedy else rs.samples_per_prompt
        with ServerThread(create_app(state)) as srv:
            groups, _ = complete_groups(
                asyncio.run(collect_agent_groups(srv.url, self.env, problems, n, seed, step, kw, indices=indices))
            )
        out = []
        for g in groups:
            out.append([])
            for r in g:
                if len(r.trajectories) != 1:
                    raise ValueError(
                        f"{self.name}: an episode of the task {r.problem.prompt!r:.60} left "
                        f"{len(r.trajectories)} trajectories in its session, not one conversation: its "
                        f"harness sent a history that does not extend its last turn"
                    )
                (t,) = r.trajectories
                out[-1].append(
                    Rollout(
                        r.problem,
                        t.prompt_ids,
                        t.completion_ids,
                        t.behav_logprobs,
                        t.versions,
                        "stop",
                        r.episode.reply,
                        r.reward,
                        loss_mask=t.loss_mask,
                    )
                )
        return out
