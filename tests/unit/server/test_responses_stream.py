"""The Responses stream's events (exactrl/server/responses.py `_events`) for a generation with reasoning, text and
calls, fed the chat route's deltas: items open and close in the order the JSON answer lists them, the text
deltas add up to the message, and the last item's done event and response.completed carry the token fields.
(The tiny test models never write `<think>`: this covers the reasoning item the live tests cannot reach.)"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from exactrl.server import responses
from exactrl.server.responses_items import output_items

FIELDS = {"prompt_token_ids": [1, 2], "generation_token_ids": [3, 4, 5], "generation_log_probs": [-0.5, -0.25, -1.0]}
CALL = {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


class FakeJob:
    """What `_ResponsesJob` reads of the chat job: its prompt, its one choice and the parsed message."""

    def __init__(self, msg: dict):
        self.msg = msg | FIELDS
        self.plan = SimpleNamespace(prompt_ids=FIELDS["prompt_token_ids"])
        self.gen = SimpleNamespace(choices=[SimpleNamespace(finish_reason="stop", token_ids=[3, 4, 5])])
        self.st = SimpleNamespace(count_generation=lambda prompt, choices: None)
        self.recorded = 0

    def record(self) -> None:
        self.recorded += 1

    def message(self, c) -> dict:
        return self.msg


def events_of(monkeypatch, msg: dict, deltas: list[dict]) -> tuple[list[dict], responses._ResponsesJob]:
    async def chat_deltas(job):
        for d in deltas:
            yield {"choices": [{"index": 0, "delta": d}]}

    monkeypatch.setattr(responses, "_chat_deltas", chat_deltas)
    r = responses._ResponsesJob(FakeJob(msg), responses.ResponsesRequest(model="m", input="q"))

    async def collect():
        return [e async for e in responses._events(r, responses._Events())]

    return [json.loads(e.split("data: ", 1)[1]) for e in asyncio.run(collect())], r


def test_reasoning_text_and_calls(monkeypatch):
    msg = {"role": "assistant", "content": "four", "reasoning_content": "2+2", "tool_calls": [CALL]}
    events, r = events_of(
        monkeypatch,
        msg,
        [{"reasoning_content": "2+"}, {"reasoning_content": "2"}, {"content": "fo"}, {"content": "ur"}, {}],
    )
    assert [(e["type"], e.get("output_index")) for e in events] == [
        ("response.output_item.added", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.content_part.added", 1),
        ("response.output_text.delta", 1),
        ("response.output_text.delta", 1),
        ("response.output_text.done", 1),
        ("response.content_part.done", 1),
        ("response.output_item.done", 1),
        ("response.output_item.added", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.done", 2),
        ("response.output_item.done", 2),
        ("response.completed", None),
    ]
    want = output_items(msg | FIELDS, r.ids, True, False)
    assert events[1]["item"] == want[0] and events[8]["item"] == want[1] and events[12]["item"] == want[2]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "four"
    assert events[9]["item"]["arguments"] == "" and "generation_token_ids" not in events[9]["item"]
    assert events[-1]["response"]["output"] == want and events[-1]["response"]["usage"]["output_tokens"] == 3
    assert r.job.recorded == 1
    assert all(f not in item for item in want[:2] for f in FIELDS) and want[2]["generation_token_ids"] == [3, 4, 5]


@pytest.mark.parametrize(
    "msg, deltas, kinds",
    [
        ({"content": "", "reasoning_content": "hm"}, [{"reasoning_content": "hm"}], ["reasoning"]),
        ({"content": ""}, [{}], ["message"]),  # nothing generated: an empty message, as the JSON answer
        ({"content": None, "tool_calls": [CALL]}, [{}], ["function_call"]),
    ],
)
def test_the_last_item_carries_the_token_fields(monkeypatch, msg, deltas, kinds):
    events, r = events_of(monkeypatch, {"role": "assistant"} | msg, deltas)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in done] == kinds and done[-1]["generation_log_probs"] == FIELDS["generation_log_probs"]
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [i["type"] for i in added] == kinds and all("prompt_token_ids" not in i for i in added)
    assert events[-1]["response"]["output"] == done
