"""A project tokenizer built once per test process (tests/chat)."""

from __future__ import annotations

import functools
import random
import tempfile

from exactrl.envs import ArithmeticTask
from exactrl.envs.tool_use import CALCULATOR_TOOL, CalculatorTask, ideal_transcript
from exactrl.model.tokenizer import build_tokenizer, default_tokenizer_corpus, load_tokenizer, render_chat_template


def corpus() -> list[str]:
    rng = random.Random(0)
    task = CalculatorTask()
    texts = default_tokenizer_corpus([ArithmeticTask(), task], 200, 0)
    texts += [render_chat_template(ideal_transcript(task.generate(rng)), [CALCULATOR_TOOL], False) for _ in range(200)]
    texts += ["hello world, the quick brown fox jumps over the lazy dog. " * 3] * 20
    return texts


@functools.cache
def tokenizer_dir() -> str:
    d = tempfile.mkdtemp(prefix="exactrl-chat-tok-")
    build_tokenizer(d, corpus(), vocab_size=512)
    return d


@functools.cache
def tokenizer():
    return load_tokenizer(tokenizer_dir())
