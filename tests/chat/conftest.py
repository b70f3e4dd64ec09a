"""Fixtures of the splicing tests: the chat tokenizer and its Splicer, built once per module."""
from __future__ import annotations

import pytest

from chat_helpers import tokenizer
from exactrl.chat.splice import Splicer


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


@pytest.fixture(scope="module")
def sp(tok):
    return Splicer(tok)
