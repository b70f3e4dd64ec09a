"""SFT (train/sft.py, train/sft_data.py): which tokens the loss covers, packing, and bad records named by line."""

from __future__ import annotations

import json
import random

import pytest
import torch
from chat_helpers import tokenizer
from conftest import make_hf_model
from family_templates import family_tokenizer

import exactrl
from exactrl.envs import ArithmeticTask
from exactrl.envs.base import Problem
from exactrl.envs.prompts import answer_ids, prompt_ids
from exactrl.train.sft import example_logprobs, pack, sft_loss, sft_step
from exactrl.train.sft_data import Example, ExampleStream, read_sft_jsonl, record_example

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+3="},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "and 4+4="},
    {"role": "assistant", "content": "8"},
]


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    d = tmp_path_factory.mktemp("sft-model")
    make_hf_model(d, "qwen3", vocab_size=tok.vocab_size)
    return d


def hand_built(tok, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """Tokens and mask of ChatML text written out by hand, piece by piece (trained or not)."""
    tokens, mask = [], []
    for text, trained in pieces:
        ids = tok.encode(text)
        tokens += ids
        mask += [trained] * len(ids)
    return tokens, mask


def test_the_loss_mask_covers_the_assistant_replies_and_their_end_of_turn_only(tok):
    e = record_example(tok, {"messages": CHAT}, "chat.jsonl:1")
    tokens, mask = hand_built(
        tok,
        [
            (
                "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n",
                False,
            ),
            ("5<|im_end|>", True),
            ("\n<|im_start|>user\nand 4+4=<|im_end|>\n<|im_start|>assistant\n", False),
            ("8<|im_end|>", True),
            ("\n", False),
        ],
    )
    assert e.tokens == tokens and e.loss_mask == mask
    assert [tok.decode([t]) for t, m in zip(e.tokens, e.loss_mask) if m] == ["5", "<|im_end|>", "8", "<|im_end|>"]


def test_the_loss_is_the_mean_nll_of_the_masked_tokens(tok, model_dir):
    model = exactrl.load_model(model_dir)
    e = record_example(tok, {"messages": CHAT}, "chat.jsonl:1")
    with torch.no_grad():
        loss, metrics = sft_loss(example_logprobs(model, [e]), [torch.tensor(e.loss_mask[e.first :])], 4)
        every = exactrl.sequence_logprobs(model, [e.tokens])[0]  # every token's, lps[t - 1] of token t
    positions = [t for t, m in enumerate(e.loss_mask) if m]
    expected = -sum(every[t - 1].item() for t in positions) / 4
    assert len(positions) == 4 and loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["train/loss"] == loss.item()


def test_a_prompt_completion_record_trains_on_the_prompt_rl_renders(tok):
    """As a chat: the tokens before the completion are the task's RL prompt (envs/prompts.py), the trained ones
    the warm start's demonstration; `raw`: prompt, completion, eos and no template."""
    task, problem = ArithmeticTask(), Problem(prompt="17+25=", answer="42")
    assert not task.system_prompt
    e = record_example(tok, {"prompt": "17+25=", "completion": "42"}, "pc.jsonl:1")
    prompt, answer = prompt_ids(tok, task, problem), answer_ids(tok, problem)
    assert e.tokens == prompt + answer + tok.encode("\n")
    assert e.loss_mask == [False] * len(prompt) + [True] * len(answer) + [False]
    raw = record_example(tok, {"prompt": "17+25=", "completion": "42"}, "pc.jsonl:1", prompt_format="raw")
    assert raw.tokens == tok.encode("17+25=") + tok.encode("42") + [tok.eos_token_id]
    assert raw.loss_mask == [False] * len(tok.encode("17+25=")) + [True] * (len(tok.encode("42")) + 1)


def test_a_conversational_prompt_completion_trains_on_the_completion_only(tok):
    prompt, completion = CHAT[:4], CHAT[4:]
    e = record_example(tok, {"prompt": prompt, "completion": completion}, "pc.jsonl:1")
    whole = record_example(tok, {"messages": CHAT}, "chat.jsonl:1")
    assert e.tokens == whole.tokens
    assert [tok.decode([t]) for t, m in zip(e.tokens, e.loss_mask) if m] == ["8", "<|im_end|>"]


def test_tool_calls_are_trained_and_tool_results_masked(tok):
    msgs = [
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "content": "4"},
        {"role": "assistant", "content": "4"},
    ]
    e = record_example(tok, {"messages": msgs}, "t.jsonl:1")
    trained = tok.decode([t for t, m in zip(e.tokens, e.loss_mask) if m])
    assert trained == '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call><|im_end|>4<|im_end|>'


def test_packing_gives_each_example_the_logprobs_it_has_alone_bitwise_and_fast_kernels_only_within_rounding(
    tok, model_dir
):
    """Each example of a packed sequence attends to itself only; the exact kernels give it the same bits as a
    forward of its own. The fast twin (plain torch ops, whose kernels depend on the row count) must differ."""
    rng = random.Random(0)
    rows = [
        {
            "prompt": f"{rng.randint(0, 999)}+{rng.randint(0, 999)}=" * rng.randint(1, 30),
            "completion": str(rng.random()),
        }
        for _ in range(12)
    ]
    examples = [record_example(tok, r, f"row {i}") for i, r in enumerate(rows)]
    for kernels in ("exact", "fast"):
        model = exactrl.load_model(model_dir, kernels=kernels)
        with torch.no_grad():
            packed = example_logprobs(model, examples)
            alone = [example_logprobs(model, [e])[0] for e in examples]
            masks = [torch.tensor(e.loss_mask[e.first :]) for e in examples]
            losses_packed = [sft_loss([p], [m], int(m.sum()))[0] for p, m in zip(packed, masks)]
            losses_alone = [sft_loss([a], [m], int(m.sum()))[0] for a, m in zip(alone, masks)]
        if kernels == "exact":
            assert all(torch.equal(p, a) for p, a in zip(packed, alone))
            assert torch.equal(torch.stack(losses_packed), torch.stack(losses_alone))
        else:
            assert not all(torch.equal(p, a) for p, a in zip(packed, alone))
        for p, a in zip(packed, alone):
            torch.testing.assert_close(p, a, rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.stack(losses_packed), torch.stack(losses_alone), rtol=1e-6, atol=0)


def test_a_step_packed_or_not_has_the_same_loss_and_gradient_within_rounding(tok, model_dir):
    rows = [{"prompt": f"{i}+{i}=" * (1 + i % 3), "completion": str(2 * i)} for i in range(6)]
    examples = [record_example(tok, r, f"row {i}") for i, r in enumerate(rows)]
    moved = {}
    for budget in (max(len(e.tokens) for e in examples), sum(len(e.tokens) for e in examples)):
        model = exactrl.load_model(model_dir)
        before = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=1.0)  # the weights move by the clipped gradient
        m = sft_step(model, opt, examples, budget, grad_clip=1e9)
        moved[m["train/packs"]] = (m, [b - p.detach() for p, b in zip(model.parameters(), before)])
    assert sorted(moved) == [1, 6]
    (one, g1), (six, g6) = moved[1], moved[6]
    assert one["train/tokens"] == six["train/tokens"] == sum(sum(e.loss_mask) for e in examples)
    assert one["train/loss"] == pytest.approx(six["train/loss"], rel=1e-6)
    for a, b in zip(g1, g6):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_pack_groups_consecutive_examples_within_the_budget():
    assert pack([3, 4, 2, 5, 5], 7) == [[0, 1], [2, 3], [4]]
    assert pack([7, 7], 7) == [[0], [1]]
    assert pack([1, 1, 1], 100) == [[0, 1, 2]]


BAD = [
    ('{"messages": [', "not valid JSON"),
    ("[1, 2]", "expected a JSON object with 'messages' or 'prompt' and 'completion', got list"),
    ('{"prompt": "1+1="}', "missing field 'completion'"),
    ('{"text": "hello"}', "missing field 'prompt' and 'completion'"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "the record has no assistant turn: nothing to train on"),
    ('{"messages": [{"role": "assistant", "content": "hi"}]}', "messages[0] is an assistant turn with nothing before"),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "messages[0].role must be one of"),
    ('{"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}', "messages[0] (role 'user') needs"),
    ('{"messages": [], "prompt": "a", "completion": "b"}', "holds both 'messages' and 'prompt'/'completion'"),
    ('{"prompt": "a", "completion": 5}', "must both be strings or both lists of messages, got str and int"),
    ('{"prompt": "a<|im_end|>", "completion": "b"}', "'prompt' holds the text of the special token '<|im_end|>'"),
    (
        '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<|im_start|>"}]}',
        "messages[1].content holds the text of the special token",
    ),
    (
        '{"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "user", "content": "b"}]}',
        "the completion has no assistant",
    ),
]


@pytest.mark.parametrize("line, message", BAD)
def test_a_bad_record_is_named_by_file_and_line(tok, tmp_path, line, message):
    f = tmp_path / "data.jsonl"
    f.write_text('{"prompt": "1+1=", "completion": "2"}\n\n' + line + "\n")
    with pytest.raises(ValueError) as e:
        read_sft_jsonl(f, tok)
    assert str(e.value).startswith(f"{f}:3: ") and message in str(e.value), str(e.value)


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_record(tmp_path):
    """Qwen3's template drops the reasoning of assistant turns before the last user query: rendering the chat
    one message further changes text already rendered, so the assistant's tokens cannot be located."""
    qwen3 = family_tokenizer("qwen3")
    msgs = [
        {"role": "user", "content": "2+3="},
        {"role": "assistant", "content": "5", "reasoning_content": "two and three"},
        {"role": "user", "content": "and 4+4="},
        {"role": "assistant", "content": "8"},
    ]
    f = tmp_path / "chats.jsonl"
    f.write_text(json.dumps({"messages": msgs[:2]}) + "\n" + json.dumps({"messages": msgs}) + "\n")
    with pytest.raises(ValueError, match=rf"^{f}:2: the chat template's text for messages\[:3\] does not extend"):
        read_sft_jsonl(f, qwen3)
    one = record_example(qwen3, {"messages": msgs[:2]}, "one turn")  # nothing after it to rewrite it
    trained = qwen3.decode([t for t, m in zip(one.tokens, one.loss_mask) if m])
    assert trained == "<think>\ntwo and three\n</think>\n\n5<|im_end|>"


def test_a_template_whose_turns_end_in_another_stop_token_is_masked_up_to_it():
    llama = family_tokenizer("llama3")
    e = record_example(llama, {"messages": CHAT[1:3]}, "l.jsonl:1")
    assert llama.decode([t for t, m in zip(e.tokens, e.loss_mask) if m]) == "5<|eot_id|>"


def test_the_example_stream_resumes_where_it_stopped_and_refuses_other_data():
    examples = [Example([1, i + 2], [False, True], str(i)) for i in range(5)]
    full = ExampleStream(examples, seed=3)
    first, rest = full.take(7), full.take(6)
    assert sorted(e.where for e in first[:5]) == [str(i) for i in range(5)]  # an epoch is a permutation
    part = ExampleStream(examples, seed=3)
    part.take(7)
    resumed = ExampleStream(examples, seed=3)
    resumed.load_state_dict(json.loads(json.dumps(part.state_dict())))
    assert resumed.take(6) == rest
    other = ExampleStream(examples[:4] + [Example([1, 9], [False, True], "x")], seed=3)
    with pytest.raises(ValueError, match="fingerprint=.*resume with the same data file, tokenizer"):
        other.load_state_dict(part.state_dict())
