"""One tiny model + project tokenizer and one live server per test process (tests/server).

The server is real: uvicorn on 127.0.0.1 in a background thread, spoken to by
the official `openai` client over HTTP. Built lazily and shared by the test
modules (a session fixture per module would rebuild it).
"""

from __future__ import annotations

import atexit
import functools
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import openai
from conftest import make_hf_model

import exactrl
from exactrl.envs import ArithmeticTask
from exactrl.envs.tool_use import CALCULATOR_TOOL, CalculatorTask, ideal_transcript
from exactrl.model.tokenizer import build_tokenizer, default_tokenizer_corpus, load_tokenizer, render_chat_template
from exactrl.server.app import ServerThread, build_state, create_app
from exactrl.server.guard import Access


def tokenizer_corpus() -> list[str]:
    rng = random.Random(0)
    task = CalculatorTask()
    texts = default_tokenizer_corpus([ArithmeticTask(), task], 200, 0)
    texts += [render_chat_template(ideal_transcript(task.generate(rng)), [CALCULATOR_TOOL], False) for _ in range(200)]
    return texts + ["hello world, the quick brown fox jumps over the lazy dog. " * 3] * 20


@functools.cache
def model_dir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="exactrl-server-model-"))
    atexit.register(shutil.rmtree, d, True)
    build_tokenizer(d, tokenizer_corpus(), vocab_size=512)
    tok = load_tokenizer(d)
    make_hf_model(
        d, "qwen3", seed=0, vocab_size=tok.vocab_size, eos_token_id=tok.end_of_turn_id, pad_token_id=tok.pad_token_id
    )
    return d


@dataclass
class Served:
    url: str
    state: object  # exactrl.server.app.ServerState
    thread: ServerThread

    @property
    def model(self) -> str:
        return self.state.config.model_name

    @property
    def tokenizer(self):
        return self.state.tokenizer

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="test", max_retries=0, **kw)

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="test", max_retries=0, **kw)


@functools.cache
def served() -> Served:
    state = build_state(str(model_dir()), kv_budget_tokens=8192, access=Access(weight_updates=True))
    thread = ServerThread(create_app(state)).start()
    atexit.register(thread.stop)
    return Served(thread.url, state, thread)


@functools.cache
def trainer_model():
    """A separate copy of the served weights: the trainer path the server's logprobs must match."""
    return exactrl.load_model(model_dir())


def trainer_logprobs(
    tokens: list[int], temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0, model=None
) -> list[float]:
    return exactrl.sequence_logprobs(model or trainer_model(), [tokens], temperature, top_k, top_p)[0].tolist()


def check_turns(tok, turns, temperature=1.0, top_k=-1, top_p=1.0, model=None) -> None:
    """Each turn's prompt extends the previous turn's exact tokens; logprobs equal the trainer's bitwise."""
    for prev, cur in zip(turns, turns[1:]):
        hist = prev.prompt_token_ids + prev.generation_token_ids
        assert cur.prompt_token_ids[: len(hist)] == hist
        if hist[-1] != tok.end_of_turn_id:
            assert cur.prompt_token_ids[len(hist)] == tok.end_of_turn_id
    last = turns[-1]
    full = last.prompt_token_ids + last.generation_token_ids
    lps = trainer_logprobs(full, temperature, top_k, top_p, model)
    for m in turns:
        start = len(m.prompt_token_ids)
        assert full[start : start + len(m.generation_token_ids)] == m.generation_token_ids
        assert lps[start - 1 : start - 1 + len(m.generation_token_ids)] == m.generation_log_probs  # bitwise


def warm_start(model, tokenizer, problems, steps: int, lr: float = 1e-2) -> float:
    """Supervised fine-tuning on the calculator tasks' ideal transcripts (teaches the tool-call format)."""
    import torch

    from exactrl.envs.tool_use import ideal_transcript, sft_example
    from exactrl.model.logprobs import token_logprobs

    examples = [sft_example(tokenizer, ideal_transcript(p)) for p in problems]
    masks = [torch.tensor(m[1:], dtype=torch.float32) for _, m in examples]
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        lps, _ = token_logprobs(model, [ids for ids, _ in examples])
        loss = -sum((lp * m).sum() for lp, m in zip(lps, masks)) / sum(m.sum() for m in masks)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return loss.item()


def check_trajectory(t: dict, turns, temperature=1.0, model=None) -> None:
    """A recorded session trajectory: its tokens are the turns' exact tokens, mask 1 exactly on the generated
    ones, behaviour logprobs equal to the trainer's bitwise there and 0.0 elsewhere."""
    full = t["prompt_ids"] + t["completion_ids"]
    assert t["prompt_ids"] == turns[0].prompt_token_ids
    assert full == turns[-1].prompt_token_ids + turns[-1].generation_token_ids
    want = [0] * len(full)
    for m in turns:
        a = len(m.prompt_token_ids)
        want[a : a + len(m.generation_token_ids)] = [1] * len(m.generation_token_ids)
    p = len(t["prompt_ids"])
    assert t["loss_mask"] == want[p:] and t["num_turns"] == len(turns)
    lps = trainer_logprobs(full, temperature, model=model)[p - 1 :]
    assert t["behav_logprobs"] == [lp if m else 0.0 for lp, m in zip(lps, t["loss_mask"])]  # bitwise


@functools.cache
def calculator_served() -> tuple[Served, list, object]:
    """(a live server, its problems, the trainer's copy of its weights): the tiny model warm-started on two
    calculator problems' ideal transcripts, so that greedy sampling calls the `calculator` tool on them (the
    tool-call format is learnt, not injected), served as "calc-agent"; `trainer_model` stays the untrained one."""
    import copy

    import torch

    from exactrl.engine import Engine
    from exactrl.server.app import ServerConfig, ServerState

    torch.manual_seed(0)
    tok = load_tokenizer(model_dir())
    model = exactrl.load_model(model_dir())
    rng = random.Random(0)
    problems = [CalculatorTask().generate(rng) for _ in range(2)]
    warm_start(model, tok, problems, steps=50)
    engine = Engine(
        copy.deepcopy(model).requires_grad_(False), stop_token_ids=sorted(tok.stop_token_ids), kv_budget_tokens=8192
    )
    state = ServerState(engine, tok, ServerConfig("calc-agent"))
    thread = ServerThread(create_app(state)).start()
    atexit.register(thread.stop)
    return Served(thread.url, state, thread), problems, model
