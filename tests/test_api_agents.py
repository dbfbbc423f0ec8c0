"""What agents need from the OpenAI API, through the real app, worker process and openai client:
tool calls (whole and streamed), reasoning_content, tool_choice, parallel_tool_calls, n > 1.
The worker runs tests/scripted_model.py, whose model writes exactly the text a test asks for."""
from __future__ import annotations

import json

import openai
import pytest

from moeferry.server.app import build_server
from scripted_model import NAME, scripted_config, serve_in_thread

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}},
         {"type": "function", "function": {"name": "search", "parameters": {
             "type": "object", "properties": {"q": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "search", "arguments": {"q": "rivers"}}\n</tool_call>'


@pytest.fixture(scope="module")
def scripted(checkpoint):
    server = build_server(scripted_config(str(checkpoint("qwen3_5_moe"))), factory="scripted_model:factory")
    url, stop = serve_in_thread(server)
    yield server, url
    stop()


@pytest.fixture(scope="module")
def client(scripted):
    return openai.OpenAI(base_url=scripted[1] + "/v1", api_key="x", max_retries=0, timeout=60)


def ask(reply: str, **kw) -> dict:
    return dict(model=NAME, messages=[{"role": "user", "content": f"REPLY[[{reply}]]END"}], **kw)


def streamed(client, **kw):
    """Accumulate a stream the way agent frameworks do: content, reasoning, tool calls by index."""
    content, reasoning, calls, finish = "", "", {}, []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            d = choice.delta
            content += d.content or ""
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = tc.id or entry["id"]
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            if choice.finish_reason:
                finish.append(choice.finish_reason)
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


def test_tool_calls_whole_and_streamed(client):
    reply = "<think>\nTwo lookups.\n</think>\n\n" + CALL + "\n" + CALL2
    out = client.chat.completions.create(**ask(reply, tools=TOOLS))
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "Two lookups."
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris", "days": 2}), ("search", {"q": "rivers"})]
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)

    content, reasoning, scalls, finish = streamed(client, **ask(reply, tools=TOOLS))
    assert (content, reasoning, finish) == ("", "Two lookups.", ["tool_calls"])
    assert [(c["name"], json.loads(c["arguments"])) for c in scalls] == calls
    assert all(c["id"].startswith("call_") for c in scalls)


def test_the_answer_goes_back_in_as_history(client):
    """An agent's second turn: the assistant's tool call and the tool result render and run."""
    first = client.chat.completions.create(**ask(CALL, tools=TOOLS)).choices[0].message
    history = [{"role": "user", "content": "weather?"}, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny"},
               {"role": "user", "content": "REPLY[[It is sunny.]]END"}]
    out = client.chat.completions.create(model=NAME, messages=history, tools=TOOLS)
    assert out.choices[0].message.content == "It is sunny." and out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("bad", ['<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
                                 '<tool_call>\n{"name": "get_weather", "argu'])
def test_malformed_call_is_content_not_an_error(client, bad):
    out = client.chat.completions.create(**ask("Calling. " + bad, tools=TOOLS))
    assert out.choices[0].message.content == "Calling. " + bad and out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "stop"
    content, _, calls, finish = streamed(client, **ask("Calling. " + bad, tools=TOOLS))
    assert (content, calls, finish) == ("Calling. " + bad, [], ["stop"])


def test_tool_choice_none_and_no_tools_leave_text_alone(client):
    for kw in (dict(tools=TOOLS, tool_choice="none"), {}):
        out = client.chat.completions.create(**ask(CALL, **kw))
        assert out.choices[0].message.content == CALL and out.choices[0].finish_reason == "stop"


def test_named_and_required_tool_choice_open_the_call_in_the_prompt(client):
    named = {"type": "function", "function": {"name": "search"}}
    out = client.chat.completions.create(**ask('{"q": "forced"}}\n</tool_call>', tools=TOOLS, tool_choice=named))
    calls = out.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("search", {"q": "forced"})]
    out = client.chat.completions.create(**ask(CALL2[len("<tool_call>\n"):], tools=TOOLS, tool_choice="required"))
    assert [c.function.name for c in out.choices[0].message.tool_calls] == ["search"]


@pytest.mark.parametrize("kw, param", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function"}), "tool_choice"),
    (dict(reasoning_effort="extreme"), "reasoning_effort"),
    (dict(reasoning_effort="none", extra_body={"chat_template_kwargs": {"enable_thinking": True}}),
     "reasoning_effort"),
])
def test_bad_tool_and_reasoning_fields_are_400(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**ask("x", **kw))
    assert e.value.body["param"] == param


def test_parallel_tool_calls_false_keeps_one(client):
    out = client.chat.completions.create(**ask(CALL + "\n" + CALL2, tools=TOOLS, parallel_tool_calls=False))
    assert [c.function.name for c in out.choices[0].message.tool_calls] == ["get_weather"]


def test_reasoning_effort_switches_thinking(client, scripted):
    tok = scripted[0].frontend.tokenizer
    msgs = [{"role": "user", "content": "REPLY[[hi]]END"}]
    for effort, thinking in (("none", False), ("high", True)):
        out = client.chat.completions.create(model=NAME, messages=msgs, reasoning_effort=effort)
        expected = tok.encode(tok.apply_chat_template(msgs, enable_thinking=thinking))
        assert out.usage.prompt_tokens == len(expected)


def test_n_choices(client, scripted):
    tok = scripted[0].frontend.tokenizer
    out = client.chat.completions.create(**ask("same answer", n=3))
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert {c.message.content for c in out.choices} == {"same answer"}
    assert out.usage.completion_tokens == 3 * (len(tok.encode("same answer")) + 1)  # + <|im_end|>
    assert out.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(ask("same answer")["messages"])))
    chunks = list(client.completions.create(model=NAME, prompt="REPLY[[abc]]END", n=2, stream=True,
                                            stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts == {0: "abc", 1: "abc"}
    assert chunks[-1].usage.completion_tokens == 2 * (len(tok.encode("abc")) + 1)


def test_a_list_of_prompts(client, scripted):
    """A completions request may list prompts: choice i * n + j is prompt i's j-th, streamed or
    not; usage counts each prompt once."""
    tok = scripted[0].frontend.tokenizer
    prompts = ["REPLY[[one]]END", "REPLY[[two]]END", tok.encode("REPLY[[three]]END")]
    replies = ["one", "two", "three"]
    out = client.completions.create(model=NAME, prompt=prompts[:2], n=2)
    assert [(c.index, c.text) for c in out.choices] == [(0, "one"), (1, "one"), (2, "two"), (3, "two")]
    assert out.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts[:2])
    assert out.usage.completion_tokens == 2 * sum(len(tok.encode(r)) + 1 for r in replies[:2])
    ids = [tok.encode(p) for p in prompts[:2]] + [prompts[2]]
    chunks = list(client.completions.create(model=NAME, prompt=ids, stream=True,
                                            stream_options={"include_usage": True}))
    texts = {i: "" for i in range(3)}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts == dict(enumerate(replies))
    assert chunks[-1].usage.prompt_tokens == sum(len(p) for p in ids)


def test_odd_tool_requests_are_4xx_never_500(scripted):
    import httpx

    odd_tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": 5, "required": 3}}}]
    bodies = [
        ask("x", tools=odd_tools, tool_choice="required"),
        ask("x", tools=odd_tools, tool_choice={"type": "function", "function": {"name": "f"}}),
        ask("x", tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
            tool_choice="required"),
        ask("x", tools=TOOLS, tool_choice={"type": "function", "function": "get_weather"}),
        ask("x", tools=TOOLS, tool_choice=7),
        ask("x", tools=[{"type": "function"}]),
        ask("x", response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": 5}}),
        ask("x", response_format={"type": "yaml"}),
        ask("x", tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
        ask("x", n=0),
        ask("x", reasoning_effort=5),
    ]
    for body in bodies:
        r = httpx.post(scripted[1] + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code in (200, 400), (body, r.text)
        if r.status_code == 400:
            assert r.json()["error"]["message"], r.text
    assert httpx.get(scripted[1] + "/health").json()["status"] == "ok"


# A Qwen3.5/3.6-style template: XML tool calls, the generation prompt opens <think>.
QWEN35_TEMPLATE = r"""{%- if tools -%}
<|im_start|>system
# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}Call a function as <tool_call>
<function=NAME>
<parameter=KEY>
VALUE
</parameter>
</function>
</tool_call><|im_end|>
{% endif -%}
{%- for m in messages -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif -%}
{%- endif -%}"""


@pytest.fixture(scope="module")
def qwen35(checkpoint, tmp_path_factory):
    import shutil

    model = tmp_path_factory.mktemp("q35") / "model"
    shutil.copytree(checkpoint("qwen3_5_moe"), model)
    (model / "chat_template.jinja").write_text(QWEN35_TEMPLATE)
    server = build_server(scripted_config(str(model)), factory="scripted_model:factory")
    assert (server.cfg.tool_call_parser, server.cfg.reasoning_parser) == ("qwen3_coder", "qwen3")  # auto
    url, stop = serve_in_thread(server)
    yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    stop()


def test_qwen35_template_open_thinking_and_xml_calls(qwen35):
    reply = ("The user wants Rome.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n"
             "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    out = qwen35.chat.completions.create(**ask(reply, tools=TOOLS))
    msg = out.choices[0].message
    assert msg.model_extra["reasoning_content"] == "The user wants Rome." and msg.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Rome", "days": 3})]
    content, reasoning, calls, finish = streamed(qwen35, **ask(reply, tools=TOOLS))
    assert (content, reasoning, finish) == ("", "The user wants Rome.", ["tool_calls"])
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Rome", "days": 3})]
    # thinking switched off: the template closes the block, everything is content
    out = qwen35.chat.completions.create(**ask("Plain answer.", reasoning_effort="none"))
    assert out.choices[0].message.content == "Plain answer."
    assert out.choices[0].message.model_extra.get("reasoning_content") is None
