"""Request fields are validated strictly, as OpenAI does: a number sent as text, a bool as a number, a
string as a number is a 400 naming the field (pydantic's lax mode read `max_tokens: "5"` as 5); an int
where a float is expected (temperature: 1) is still a number."""

from __future__ import annotations

import httpx
import pytest
from serving import served

MSGS = [{"role": "user", "content": "hello"}]


def post(path: str, body: dict) -> httpx.Response:
    return httpx.post(served().url + path, json=body, timeout=60)


@pytest.mark.parametrize(
    "path, field, value",
    [
        ("/v1/chat/completions", "max_tokens", "5"),
        ("/v1/chat/completions", "max_tokens", 5.0),
        ("/v1/chat/completions", "n", "1"),
        ("/v1/chat/completions", "temperature", "1"),
        ("/v1/chat/completions", "top_p", "0.5"),
        ("/v1/chat/completions", "seed", "3"),
        ("/v1/chat/completions", "stream", "false"),
        ("/v1/chat/completions", "stream", 0),
        ("/v1/chat/completions", "logprobs", 1),
        ("/v1/chat/completions", "ignore_eos", "true"),
        ("/v1/chat/completions", "model", 5),
        ("/v1/chat/completions", "stop", 5),
        ("/v1/completions", "max_tokens", "5"),
        ("/v1/completions", "echo", "true"),
        ("/v1/completions", "logprobs", "1"),
        ("/v1/completions", "prompt", 5),
        ("/v1/responses", "max_output_tokens", "5"),
        ("/v1/responses", "temperature", "1"),
        ("/v1/responses", "stream", "false"),
        ("/v1/responses", "input", 5),
        ("/v1/responses", "top_k", True),
        ("/v1/responses", "stop", 5),  # passed on to the chat route, checked there
        ("/v1/responses", "stop_token_ids", ["1"]),
    ],
)
def test_a_field_of_the_wrong_type_is_400_naming_it(path, field, value):
    s = served()
    if path == "/v1/responses":
        body = {"model": s.model, "input": "hi", "max_output_tokens": 2}
    else:
        body = {"model": s.model, "max_tokens": 2} | ({"messages": MSGS} if "chat" in path else {"prompt": "hi"})
    r = post(path, body | {field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err


def test_ints_are_numbers_where_floats_are_expected():
    s = served()
    r = post(
        "/v1/chat/completions",
        {"model": s.model, "messages": MSGS, "max_tokens": 2, "temperature": 1, "top_p": 1, "seed": 0},
    )
    assert r.status_code == 200, r.text


def test_update_weights_model_path_must_be_text():
    r = post("/update_weights_from_disk", {"model_path": 5})
    assert r.status_code in (400, 403), r.text
