"""The project's tokenizer: builds offline and fast, loads with AutoTokenizer, round-trips any
text, splits digits, and renders ChatML (tools, tool calls, tool results, reasoning) with exactly
one end-of-turn token per message."""

from __future__ import annotations

import json

import pytest
from fuzzing import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from exactrl.envs import ArithmeticTask, CountdownTask
from exactrl.model.tokenizer import (
    ADDED_TOKENS,
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    build_tokenizer,
    default_tokenizer_corpus,
    load_tokenizer,
    render_chat_template,
)

TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Adds two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
CHAT = [
    {"role": "system", "content": "You add."},
    {"role": "user", "content": "12+7="},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Use the tool.",
        "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 7}}},
            {"type": "function", "function": {"name": "add", "arguments": '{"a": 0, "b": 1}'}},
        ],
    },
    {"role": "tool", "content": "19"},
    {"role": "tool", "content": "1"},
    {"role": "assistant", "content": "19"},
    {"role": "user", "content": "Thanks"},
]
EXPECTED_TOOLS_CHAT = (
    "<|im_start|>system\nYou add.\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
    "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(TOOL)
    + "\n</tools>\n\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "<|im_start|>user\n12+7=<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n"
    '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 7}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 0, "b": 1}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n19\n</tool_response><|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n1\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n19<|im_end|>\n"
    "<|im_start|>user\nThanks<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out, default_tokenizer_corpus([ArithmeticTask(), CountdownTask()], 500, seed=0), vocab_size=384)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def test_autotokenizer_loads_it_offline(tok_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    assert hf.is_fast and hf.eos_token == "<|im_end|>" and hf.pad_token == "<|endoftext|>"
    assert json.loads((tok_dir / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    assert (
        hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        == "<|im_start|>user\nhi<|im_end|>\n"
    )


def test_special_ids(tok):
    ids = {t: tok.hf.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS + ADDED_TOKENS}
    assert len(set(ids.values())) == len(ids)
    assert tok.eos_token_id == tok.end_of_turn_id == ids["<|im_end|>"]
    assert tok.pad_token_id == ids["<|endoftext|>"]
    assert tok.stop_token_ids == {ids["<|im_end|>"]}
    assert tok.vocab_size == len(tok.hf) <= 384 and max(ids.values()) < tok.vocab_size
    for t in SPECIAL_TOKENS + ADDED_TOKENS:  # each marker is one token, in any context
        assert tok.encode(f"x{t}y") == tok.encode("x") + [ids[t]] + tok.encode("y")
    assert tok.decode(tok.encode("a<think>b<|im_end|>"), skip_special_tokens=True) == "a<think>b"


def test_digits_are_single_tokens(tok):
    for text in ("12345", " 2024 and 99", "x=1000000;", "3.14159e10"):
        pieces = [tok.decode([i]) for i in tok.encode(text)]
        assert "".join(pieces) == text
        assert all(not (p.isdigit() and len(p) > 1) for p in pieces), pieces
    assert len(tok.encode("12+7=")) == 5


@settings(max_examples=examples(200), deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=60))
def test_round_trip_any_text(tok, text):
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("extra", ["<|im_end|>", "<think>", " \n\t ", "漢字 🙂 é"])
def test_round_trip_with_markers(tok, extra):
    text = f"a{extra}b{extra}"
    assert tok.decode(tok.encode(text)) == text


def test_tools_chat_renders_as_expected(tok):
    assert tok.render_chat(CHAT, tools=[TOOL]) == EXPECTED_TOOLS_CHAT
    assert render_chat_template(CHAT, tools=[TOOL]) == EXPECTED_TOOLS_CHAT  # our renderer == transformers'
    assert tok.apply_chat_template(CHAT, tools=[TOOL]) == tok.encode(EXPECTED_TOOLS_CHAT)


def test_tools_without_system_and_tool_call_without_wrapper(tok):
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Calling.", "tool_calls": [{"name": "add", "arguments": {"a": 1}}]},
    ]
    text = tok.render_chat(msgs, tools=[TOOL], add_generation_prompt=False)
    assert text.startswith("<|im_start|>system\n# Tools\n\n")
    assert text.endswith(
        '<|im_start|>assistant\nCalling.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><|im_end|>\n'
    )


def test_plain_chat_and_generation_prompt(tok):
    msgs = [{"role": "user", "content": "3+5="}]
    assert tok.render_chat(msgs) == "<|im_start|>user\n3+5=<|im_end|>\n<|im_start|>assistant\n"
    assert tok.render_chat(msgs, add_generation_prompt=False) == "<|im_start|>user\n3+5=<|im_end|>\n"
    sys = [{"role": "system", "content": "S"}, *msgs, {"role": "assistant", "content": "8"}]
    assert tok.render_chat(sys, add_generation_prompt=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n3+5=<|im_end|>\n<|im_start|>assistant\n8<|im_end|>\n"
    )


@pytest.mark.parametrize("tools", [None, [TOOL]])
def test_every_message_ends_with_exactly_one_end_of_turn(tok, tools):
    prev_ids: list[int] = []
    for k in range(1, len(CHAT) + 1):
        ids = tok.apply_chat_template(CHAT[:k], tools=tools, add_generation_prompt=False)
        assert ids[: len(prev_ids)] == prev_ids  # appending a message only appends tokens
        new = ids[len(prev_ids) :]
        assert new.count(tok.end_of_turn_id) == 1 and tok.decode(new).endswith("<|im_end|>\n")
        prev_ids = ids
    with_prompt = tok.apply_chat_template(CHAT, tools=tools)
    assert with_prompt[: len(prev_ids)] == prev_ids and tok.end_of_turn_id not in with_prompt[len(prev_ids) :]


def test_template_errors_are_value_errors(tok):
    with pytest.raises(ValueError, match="only be the first"):
        tok.render_chat([{"role": "user", "content": "a"}, {"role": "system", "content": "s"}])
    with pytest.raises(ValueError, match="unknown message role"):
        tok.render_chat([{"role": "bot", "content": "a"}])


def test_saved_by_transformers_loads_the_same(tok, tmp_path):
    tok.hf.save_pretrained(tmp_path)  # a "normal" HF directory (transformers' own layout)
    again = load_tokenizer(tmp_path)
    assert (again.vocab_size, again.stop_token_ids, again.pad_token_id) == (
        tok.vocab_size,
        tok.stop_token_ids,
        tok.pad_token_id,
    )
    assert again.apply_chat_template(CHAT, tools=[TOOL]) == tok.apply_chat_template(CHAT, tools=[TOOL])


def test_foreign_tokenizer_without_chatml(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    t = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "hi": 2}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "unk_token": "<unk>"})
    )
    foreign = load_tokenizer(tmp_path)
    assert foreign.eos_token_id == foreign.end_of_turn_id == foreign.pad_token_id == 1
    assert foreign.encode("hi hi") == [2, 2] and foreign.stop_token_ids == {1}
    with pytest.raises(ValueError, match="no chat template"):
        foreign.render_chat([{"role": "user", "content": "hi"}])


def test_load_errors_name_the_path(tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path / "missing")):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(ValueError, match=f"{tmp_path}.*no tokenizer files"):
        load_tokenizer(tmp_path)


def test_build_errors(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(tmp_path, ["abc"], vocab_size=100)
    with pytest.raises(ValueError, match="no training text"):
        build_tokenizer(tmp_path, [], vocab_size=384)


def test_corpus_is_deterministic_and_covers_the_chat_format():
    tasks = [ArithmeticTask()]
    corpus = default_tokenizer_corpus(tasks, 40, seed=1)
    assert corpus == default_tokenizer_corpus(tasks, 40, seed=1) != default_tokenizer_corpus(tasks, 40, seed=2)
    joined = "".join(corpus)
    for marker in ("<|im_start|>assistant\n", "<think>", "<tool_call>", "<tool_response>", "<tools>"):
        assert marker in joined
    with pytest.raises(ValueError):
        default_tokenizer_corpus([], 10, seed=0)


@pytest.mark.parametrize("task", [ArithmeticTask(max_value=99), CountdownTask()])
def test_prompt_then_answer_tokens_equal_the_rendered_conversation(tok, task):
    """A warm start encodes prompt and answer separately; the boundary must not change the tokens."""
    import random

    rng = random.Random(0)
    for _ in range(50):
        p = task.generate(rng)
        msgs = [{"role": "system", "content": task.system_prompt}] if task.system_prompt else []
        msgs.append({"role": "user", "content": p.prompt})
        split = tok.apply_chat_template(msgs) + tok.encode(p.answer) + [tok.end_of_turn_id]
        whole = tok.apply_chat_template(
            [*msgs, {"role": "assistant", "content": p.answer}], add_generation_prompt=False
        )
        assert split == whole[:-1] and tok.decode(whole[-1:]) == "\n"


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_naming_the_flag(tok, tmp_path):
    """A model's own tokenizer fits (its vocabulary may be padded larger); another one with more tokens is
    refused when it is loaded, not at the first request that holds an id past the embedding."""
    tok.check_fits(tok.vocab_size, "--tokenizer")
    tok.check_fits(tok.vocab_size + 64, "--tokenizer")
    with pytest.raises(
        ValueError,
        match=rf"\(model.tokenizer\) has {tok.vocab_size} tokens but the model's "
        rf"vocabulary has {tok.vocab_size - 1}",
    ):
        tok.check_fits(tok.vocab_size - 1, "model.tokenizer")
    with pytest.raises(ValueError, match="lone surrogate"):
        tok.encode("a \ud800 b")
