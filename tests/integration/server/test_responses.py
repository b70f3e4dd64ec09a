"""POST /v1/responses through the official openai client (`client.responses.create`): the chat route's tokens in
the Responses spelling. A turn's output items carry the token fields on their last item (NeMo Gym's layout);
sent back unchanged, with a function_call_output after a function_call, they are spliced by token id, so the
session's trajectory is the exact concatenation of the prompt and generated tokens, and its logprobs are the
trainer's bitwise."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import openai
import pytest
from serving import calculator_served, check_trajectory, check_turns, served, trainer_logprobs

from exactrl.envs.tool_use import CALCULATOR_TOOL, SYSTEM_PROMPT, calculate

TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
TOOL = {"type": "function", **CALCULATOR_TOOL["function"]}  # the Responses API's flat function tool


def as_items(response) -> list[dict]:
    """The output items as a client sends them back (the SDK objects keep the extra token fields)."""
    return [o.model_dump(exclude_none=True) for o in response.output]


def turn_of(response) -> SimpleNamespace:
    """The generation's token fields, from the last output item (the only one that carries them)."""
    *rest, last = as_items(response)
    assert all(f not in item for item in rest for f in TOKEN_FIELDS)
    return SimpleNamespace(**{f: last[f] for f in TOKEN_FIELDS})


def test_single_turn_is_the_chat_routes_generation():
    s = served()
    client = s.client()
    r = client.responses.create(
        model=s.model,
        instructions="You are terse.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Compute 12*7"}]}],
        max_output_tokens=12,
        temperature=0.8,
        extra_body={"seed": 3},
    )
    chat = client.chat.completions.create(
        model=s.model,
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Compute 12*7"}],
        max_tokens=12,
        temperature=0.8,
        seed=3,
    ).choices[0]
    (item,) = r.output
    t = turn_of(r)
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert item.content[0].text == chat.message.content and r.output_text == chat.message.content
    assert (t.prompt_token_ids, t.generation_token_ids) == (
        chat.message.prompt_token_ids,
        chat.message.generation_token_ids,
    )
    full = t.prompt_token_ids + t.generation_token_ids
    start = len(t.prompt_token_ids)
    assert trainer_logprobs(full, 0.8)[start - 1 :] == t.generation_log_probs  # bitwise
    assert r.usage.input_tokens == start and r.usage.output_tokens == len(t.generation_token_ids)
    assert r.status == ("incomplete" if chat.finish_reason == "length" else "completed")
    # a string input is one user message; token fields can be turned off (NeMo Gym's flag)
    plain = client.responses.create(
        model=s.model,
        input="Compute 12*7",
        max_output_tokens=4,
        extra_body={"seed": 3, "return_token_id_information": False},
    )
    assert all(f not in plain.output[0].model_dump() for f in TOKEN_FIELDS)
    ids = client.responses.create(model=s.model, input="Compute 12*7", max_output_tokens=4, extra_body={"seed": 3})
    user = {"role": "user", "content": "Compute 12*7"}
    assert turn_of(ids).prompt_token_ids == s.tokenizer.apply_chat_template([user])
    # NeMo Gym's request schema: model optional (the served one), tool_choice "auto" by default, tools []
    nemo = httpx.post(
        f"{s.url}/v1/responses",
        timeout=60,
        json={"input": "Compute 12*7", "tools": [], "tool_choice": "auto", "max_output_tokens": 4, "seed": 3},
    )
    assert nemo.status_code == 200, nemo.text
    assert nemo.json()["model"] == s.model and nemo.json()["output"][-1]["generation_token_ids"] == (
        turn_of(ids).generation_token_ids
    )


def test_streaming_events_add_up_to_the_json_answer():
    s = served()
    client = s.client()
    kw = dict(model=s.model, input="hello world", max_output_tokens=16, extra_body={"seed": 7})
    ref = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-5:-1] == [
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == ref.output_text == next(e.text for e in events if e.type == "response.output_text.done")
    done = events[-2].item.model_dump()
    final = events[-1].response
    assert final.status == ref.status and final.output_text == ref.output_text
    for f in TOKEN_FIELDS:
        assert done[f] == final.output[0].model_dump()[f] == ref.output[0].model_dump()[f]
    assert final.usage.output_tokens == ref.usage.output_tokens


def test_tool_episode_is_token_exact_in_its_session():
    """A function_call parsed from the model's text, its result sent back as function_call_output, the answer,
    a user turn: every prompt extends the previous turn's exact tokens; the session's one trajectory is the last
    prompt + generation, mask 1 exactly on the generated tokens, logprobs the trainer's bitwise."""
    s, problems, model = calculator_served()
    sid = "responses-tools"
    client = openai.OpenAI(base_url=f"{s.url}/sessions/{sid}/v1", api_key="t", max_retries=0)
    kw = dict(model=s.model, instructions=SYSTEM_PROMPT, tools=[TOOL], temperature=0.0, max_output_tokens=40)
    conversation: list = [{"role": "user", "content": problems[0].prompt}]
    r1 = client.responses.create(input=conversation, **kw)
    (call,) = r1.output
    assert call.type == "function_call" and call.name == "calculator" and call.status == "completed"
    expression = json.loads(call.arguments)["expression"]
    assert expression == problems[0].meta["expression"]
    # streamed, outside the session: the same call, whole, after the text events
    events = list(s.client().responses.create(input=conversation, stream=True, **kw))
    assert "response.output_text.delta" not in [e.type for e in events]
    (args,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args.arguments == call.arguments
    assert events[-1].response.output[0].model_dump()["generation_token_ids"] == turn_of(r1).generation_token_ids

    conversation += as_items(r1) + [
        {"type": "function_call_output", "call_id": call.call_id, "output": calculate(expression)}
    ]
    r2 = client.responses.create(input=conversation, **kw)
    assert [o.type for o in r2.output] == ["message"]
    conversation += as_items(r2) + [{"role": "user", "content": "Compute 1+1"}]
    r3 = client.responses.create(input=conversation, **kw)
    turns = [turn_of(r) for r in (r1, r2, r3)]
    check_turns(s.tokenizer, turns, temperature=0.0, model=model)
    tool_turn = turns[1].prompt_token_ids[len(turns[0].prompt_token_ids) + len(turns[0].generation_token_ids) :]
    assert s.tokenizer.decode(tool_turn) == (
        f"\n<|im_start|>user\n<tool_response>\n{calculate(expression)}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    (t,) = httpx.get(f"{s.url}/sessions/{sid}/trajectories").json()["trajectories"]
    # the trajectory is a concatenation of token ids, never a re-tokenization of text
    assert t["prompt_ids"] + t["completion_ids"] == turns[-1].prompt_token_ids + turns[-1].generation_token_ids
    check_trajectory(t, turns, temperature=0.0, model=model)


def test_edited_history_is_refused_or_split_by_the_policy():
    """A function_call sent back with other arguments than its tokens say is a non-monotonic history: a 400
    naming the input item (policy raise), or a fresh prompt under monotonicity=split."""
    s, problems, _ = calculator_served()
    client = s.client()
    kw = dict(model=s.model, instructions=SYSTEM_PROMPT, tools=[TOOL], temperature=0.0, max_output_tokens=40)
    first = [{"role": "user", "content": problems[1].prompt}]
    r1 = client.responses.create(input=first, **kw)
    (call,) = as_items(r1)
    edited = first + [call | {"arguments": json.dumps({"expression": "1+1"})}]
    edited.append({"type": "function_call_output", "call_id": call["call_id"], "output": "2"})
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(input=edited, **kw)
    assert e.value.body["code"] == "non_monotonic_history" and e.value.body["param"] == "input"
    assert "input[1]" in e.value.message and "messages[" not in e.value.message
    split = client.responses.create(input=edited, extra_body={"monotonicity": "split"}, **kw)
    assert turn_of(split).prompt_token_ids[: len(turn_of(r1).prompt_token_ids)] == turn_of(r1).prompt_token_ids


@pytest.mark.parametrize(
    "fields, param, needle",
    [
        (dict(input=[{"type": "web_search_call", "id": "x"}]), "input", "input[0].type 'web_search_call'"),
        (dict(input=[{"role": "wizard", "content": "hi"}]), "input", "input[0].role must be one of"),
        (
            dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
            "input",
            "input[0].content[0]",
        ),
        (dict(input=[]), "input", "non-empty list"),
        (dict(input="hi", tools=[TOOL], tool_choice={"type": "function", "name": "nope"}), "tool_choice", "'nope'"),
        (dict(input="hi", tools=[{"type": "web_search"}]), "tools", "tools[0].type"),
        (dict(input="hi", tools=[CALCULATOR_TOOL]), "tools", "flat"),
        (dict(input="hi", tools=[{"type": "function", "name": "bad name"}]), "tools", "tools[0].name must match"),
        (dict(input="hi", max_output_tokens=0), "max_output_tokens", "max_output_tokens must be >= 1"),
        (dict(input="hi", max_output_tokens=-3), "max_output_tokens", "max_output_tokens must be >= 1"),
        (dict(input="hi", max_output_tokens=10**7), "max_output_tokens", "lower max_output_tokens"),
        (dict(input="hi", previous_response_id="resp_1"), "previous_response_id", "whole conversation"),
        (dict(input="hi", temperature=5), "temperature", "temperature must be in [0, 2]"),
        (dict(input="hi", max_output_tokens="5"), "max_output_tokens", "max_output_tokens"),
        (
            dict(input=[{"role": "user", "content": "hi", "generation_token_ids": [1]}]),
            "input",
            "token fields belong on the model's output items",
        ),
        (
            dict(input=[{"type": "function_call_output", "call_id": "call_x", "output": "4"}]),
            "input",
            "input[0] (role 'tool') answers no tool call",
        ),
    ],
)
def test_bad_input_is_a_400_naming_the_field(fields, param, needle):
    s = served()
    r = httpx.post(f"{s.url}/v1/responses", timeout=60, json={"model": s.model} | fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err
    # the server keeps serving
    ok = s.client().responses.create(model=s.model, input="hi", max_output_tokens=2)
    # the random model may sample its <think> token first, which the server returns as a reasoning item
    assert ok.output and ok.output[0].type in ("message", "reasoning")


def test_session_route_and_unknown_session_items():
    s = served()
    sid = "responses-plain"
    client = openai.OpenAI(base_url=f"{s.url}/sessions/{sid}/v1", api_key="t", max_retries=0)
    r1 = client.responses.create(model=s.model, input="hello", max_output_tokens=6, extra_body={"seed": 1})
    items = [{"role": "user", "content": "hello"}, *as_items(r1), {"role": "user", "content": "again"}]
    r2 = client.responses.create(model=s.model, input=items, max_output_tokens=6, extra_body={"seed": 2})
    check_turns(s.tokenizer, [turn_of(r1), turn_of(r2)])
    (t,) = httpx.get(f"{s.url}/sessions/{sid}/trajectories").json()["trajectories"]
    check_trajectory(t, [turn_of(r1), turn_of(r2)])


def test_fast_kernels_server_is_not_bitwise_the_trainer():
    """The inverse twin of the bitwise checks above: the same model served with plain torch (`fast`) kernels
    returns generation_log_probs that differ from the exact trainer's somewhere in a multi-turn conversation."""
    from serving import model_dir

    from exactrl.server.app import ServerThread, build_state, create_app

    state = build_state(str(model_dir()), kernels="fast", kv_budget_tokens=4096)
    with ServerThread(create_app(state)) as thread:
        client = openai.OpenAI(base_url=f"{thread.url}/v1", api_key="t", max_retries=0)
        items: list = [{"role": "user", "content": "the quick brown fox"}]
        turns = []
        for k in range(3):
            r = client.responses.create(
                model=state.config.model_name, input=items, max_output_tokens=24, extra_body={"seed": k}
            )
            turns.append(turn_of(r))
            items += as_items(r) + [{"role": "user", "content": f"and {k}?"}]
    last = turns[-1]
    full = last.prompt_token_ids + last.generation_token_ids
    exact = trainer_logprobs(full)
    diffs = [abs(a - b) for t in turns for a, b in zip(exact[len(t.prompt_token_ids) - 1 :], t.generation_log_probs)]
    assert max(diffs) > 0
