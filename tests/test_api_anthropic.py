"""The Anthropic Messages API through the real `anthropic` SDK: text, thinking and tool_use blocks,
the streaming event sequence, tool results going back in, count_tokens, and Anthropic-shaped errors.
The worker runs tests/scripted_model.py (the model writes what the test asks for)."""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from moeferry.server.app import build_server
from scripted_model import NAME, scripted_config, serve_in_thread

TOOLS = [{"name": "get_weather", "description": "Weather of a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def scripted(checkpoint):
    server = build_server(scripted_config(str(checkpoint("qwen3_5_moe")), "--enable-cache-report"),
                          factory="scripted_model:factory")
    url, stop = serve_in_thread(server)
    yield server, url
    stop()


@pytest.fixture(scope="module")
def client(scripted):
    return anthropic.Anthropic(base_url=scripted[1], api_key="x", max_retries=0, timeout=60)


def say(reply: str, **kw) -> dict:
    return dict(model=NAME, max_tokens=200, messages=[{"role": "user", "content": f"REPLY[[{reply}]]END"}], **kw)


def test_text_message_and_usage(client, scripted):
    tok = scripted[0].frontend.tokenizer
    msg = client.messages.create(system="Be terse.", **say("Hello there."))
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [(b.type, b.text) for b in msg.content] == [("text", "Hello there.")]
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    prompt = tok.apply_chat_template([{"role": "system", "content": "Be terse."},
                                      {"role": "user", "content": "REPLY[[Hello there.]]END"}])
    assert msg.usage.input_tokens == len(tok.encode(prompt))
    assert msg.usage.output_tokens == len(tok.encode("Hello there.")) + 1
    assert msg.usage.cache_read_input_tokens is not None
    count = client.messages.count_tokens(model=NAME, system="Be terse.",
                                         messages=[{"role": "user", "content": "REPLY[[Hello there.]]END"}])
    assert count.input_tokens == msg.usage.input_tokens


def test_stop_sequences_and_max_tokens(client):
    msg = client.messages.create(stop_sequences=["STOP"], **say("one two STOP three"))
    assert msg.content[0].text == "one two " and msg.stop_reason == "stop_sequence" and msg.stop_sequence == "STOP"
    msg = client.messages.create(**{**say("a long answer that goes on and on"), "max_tokens": 3})
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3


def test_thinking_and_tool_use_blocks(client):
    reply = "<think>\nNeed the weather.\n</think>\n\nLet me check.\n" + CALL
    msg = client.messages.create(tools=TOOLS, **say(reply))
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[0].thinking == "Need the weather." and msg.content[1].text == "Let me check."
    use = msg.content[2]
    assert use.name == "get_weather" and use.input == {"city": "Oslo", "days": 3} and use.id.startswith("toolu_")
    assert msg.stop_reason == "tool_use"

    # the SDK's stream helper rebuilds the same message from the events
    with client.messages.stream(tools=TOOLS, **say(reply)) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == use.input and final.stop_reason == "tool_use"
    assert final.content[0].thinking == "Need the weather." and final.content[1].text == "Let me check."
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert final.usage.output_tokens == msg.usage.output_tokens


def test_raw_event_sequence(scripted):
    body = say("<think>\nhm\n</think>\n\nok " + CALL, tools=TOOLS, stream=True)
    with httpx.stream("POST", scripted[1] + "/v1/messages", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("event: ")]
    names = [line.removeprefix("event: ") for line in lines]
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    blocks = names[2:-2]
    # three blocks: each start, deltas, stop
    assert blocks.count("content_block_start") == blocks.count("content_block_stop") == 3
    assert blocks[0] == "content_block_start" and blocks[-1] == "content_block_stop"


def test_tool_result_round_trip_and_tool_choice(client):
    first = client.messages.create(tools=TOOLS, **say(CALL))
    use = first.content[0]
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "rainy"},
                                            {"type": "text", "text": "REPLY[[Take an umbrella.]]END"}]}]
    out = client.messages.create(model=NAME, max_tokens=50, tools=TOOLS, messages=history)
    assert out.content[0].text == "Take an umbrella." and out.stop_reason == "end_turn"
    forced = client.messages.create(tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"},
                                    **say('{"city": "Rome"}}\n</tool_call>'))
    assert forced.content[0].type == "tool_use" and forced.content[0].input == {"city": "Rome"}


def test_thinking_switch(client, scripted):
    tok = scripted[0].frontend.tokenizer
    off = client.messages.create(thinking={"type": "disabled"}, **say("x"))
    expected = tok.encode(tok.apply_chat_template([{"role": "user", "content": "REPLY[[x]]END"}],
                                                  enable_thinking=False))
    assert off.usage.input_tokens == len(expected)
    on = client.messages.create(thinking={"type": "enabled", "budget_tokens": 1024}, **{**say("x"), "max_tokens": 2000})
    assert on.usage.input_tokens < off.usage.input_tokens


@pytest.mark.parametrize("kw, status, kind", [
    (dict(model="claude-opus-4"), 404, "not_found_error"),
    (dict(temperature=1.5), 400, "invalid_request_error"),
    (dict(tool_choice={"type": "tool", "name": "nope"}, tools=TOOLS), 400, "invalid_request_error"),
    (dict(tools=[{"type": "web_search_20250305", "name": "web_search"}]), 400, "invalid_request_error"),
    (dict(thinking={"type": "enabled", "budget_tokens": 10}), 400, "invalid_request_error"),
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), 400,
     "invalid_request_error"),
    (dict(frobnicate=1), 400, "invalid_request_error"),
])
def test_errors_have_anthropics_shape(scripted, client, kw, status, kind):
    r = httpx.post(scripted[1] + "/v1/messages", json={**say("x"), **kw}, timeout=30)
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"]
    with pytest.raises(anthropic.APIStatusError) as e:  # the SDK raises it as the status's error class
        client.messages.create(**say("x"), extra_body=kw)
    assert e.value.status_code == status and e.value.body["error"]["type"] == kind


def test_missing_max_tokens_is_a_400(scripted):
    body = say("x")
    del body["max_tokens"]
    r = httpx.post(scripted[1] + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


ODD_BODIES = [
    {"messages": [{"role": "user", "content": [5]}]},
    {"messages": [{"role": "user", "content": [{"no": "type"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x",
                                                "content": [{"type": "image"}]}]}]},
    {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": [1]}]}]},
    {"messages": [{"role": "assistant", "content": [{"type": "frob"}]}]},
    {"messages": [{"role": "system", "content": "x"}]},
    {"messages": []},
    {"system": [{"type": "image"}]},
    {"thinking": {"type": "enabled", "budget_tokens": "lots"}},
    {"thinking": {"type": "sideways"}},
    {"tool_choice": "any"},
    {"tool_choice": {"type": "sometimes"}},
    {"tool_choice": {"type": {"type": "any"}}},
    {"tool_choice": {"type": ["auto"]}, "tools": [{"name": "f", "input_schema": {"type": "object"}}]},
    {"tools": [{"name": "f"}]},
    {"tools": [{"name": "f", "input_schema": {"type": "object", "properties": 5, "required": 3}}],
     "tool_choice": {"type": "tool", "name": "f"}, "max_tokens": 2},
    {"tools": [{"name": "f", "input_schema": {"type": "frobnicate"}}], "tool_choice": {"type": "any"}},
    {"max_tokens": 0},
    {"stop_sequences": "STOP"},
    {"top_k": -1},
]


# each a 4xx, never a 500 nor a 200: text with a lone surrogate quoted in the error message (the error
# body is ASCII-escaped), content that is neither text nor a list, loose booleans
REFUSED = [
    ({"model": "\ud800"}, 404),
    ({"messages": [{"role": "user", "content": [{"type": "\ud800"}]}]}, 400),
    ({"tools": [{"name": "a", "input_schema": {}}], "tool_choice": {"type": "tool", "name": "\ud800"}}, 400),
    *(({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": c}]}]}, 400)
      for c in (5, 5.5, True)),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "ok",
                                                 "is_error": "yes"}]}]}, 400),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "text", "text": {"a": 1}}]}, {"role": "user", "content": "go"}]}, 400),
    ({"stream": "yes"}, 400),
    ({"stream": 1}, 400),
    ({"max_tokens": "5"}, 400),
    ({"max_tokens": True}, 400),
    ({"temperature": True}, 400),
    ({"top_k": "3"}, 400),
]
_MESSAGES_ONLY = {"model", "stream", "max_tokens", "temperature", "top_k"}  # count_tokens: no such fields checked


@pytest.mark.parametrize("odd, status", REFUSED)
def test_refused_bodies(scripted, odd, status):
    for route in ("/v1/messages", "/v1/messages/count_tokens"):
        if route.endswith("count_tokens") and _MESSAGES_ONLY & odd.keys():
            continue
        body = {**say("x"), **odd}
        if route.endswith("count_tokens"):
            body.pop("max_tokens")
        r = httpx.post(scripted[1] + route, content=json.dumps(body), timeout=30,  # \ud800 escaped
                       headers={"content-type": "application/json"})
        assert r.status_code == status, (route, odd, r.text)
        assert r.json()["type"] == "error" and r.json()["error"]["message"], r.text


def test_odd_bodies_are_4xx_never_500(scripted):
    for odd in ODD_BODIES:
        r = httpx.post(scripted[1] + "/v1/messages", json={**say("x"), **odd}, timeout=30)
        assert 400 <= r.status_code < 500 or r.status_code == 200, (odd, r.text)
        if r.status_code != 200:
            assert r.json()["type"] == "error", r.text
    assert httpx.get(scripted[1] + "/health").json()["status"] == "ok"
