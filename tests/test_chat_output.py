"""Tool-call and reasoning parsers on recorded-style Qwen3 / Qwen3.5 outputs, whole and streamed."""
from __future__ import annotations

import json

import pytest

from moeferry.text.chat_output import ChatOutput
from moeferry.text.reasoning import ReasoningStream, detect_reasoning_parser, opens_reasoning
from moeferry.text.tool_parsers import (Content, ToolCallStream, detect_tool_parser, forced_prefix,
                                        parse_tool_calls)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "metric": {"type": "boolean"}, "ratio": {"type": "number"},
                                            "tags": {"type": "array"}, "opts": {"type": "object"},
                                            "zip": {"type": "string"}}}
TOOLS = {"get_weather": WEATHER, "search": {"type": "object", "properties": {"q": {"type": "string"}}}}

# Qwen3 (hermes JSON) output, as Qwen3-30B-A3B writes it after thinking.
QWEN3_OUT = ('<think>\nThe user wants the weather in Paris and Tokyo.\n</think>\n\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo", "days": 1}}\n</tool_call>')
# Qwen3.5/3.6 output (the prompt opened <think>), XML parameters with multi-line and typed values.
QWEN35_OUT = ('Let me check.\n</think>\n\nI will look that up.\n\n<tool_call>\n<function=get_weather>\n'
              '<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n5\n</parameter>\n'
              '<parameter=metric>\ntrue\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n'
              '<parameter=tags>\n["a", "b"]\n</parameter>\n<parameter=opts>\n{"x": 1}\n</parameter>\n'
              '<parameter=zip>\n01234\n</parameter>\n</function>\n</tool_call>')


def run(parser: ChatOutput, text: str, step: int) -> list:
    items = []
    for i in range(0, len(text), step):
        items += parser.feed(text[i:i + step])
    return items + parser.finish()


def chat(tool_parser="hermes", in_reasoning=False, tools=TOOLS, parallel=True, prefix=""):
    return ChatOutput(ReasoningStream(in_reasoning), ToolCallStream(tool_parser, tools, parallel, prefix))


@pytest.mark.parametrize("step", [1, 3, 7, 10_000])
def test_qwen3_reasoning_then_parallel_hermes_calls(step):
    reasoning, content, calls = ChatOutput.collect(run(chat(), QWEN3_OUT, step))
    assert reasoning == "The user wants the weather in Paris and Tokyo."
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Tokyo", "days": 1})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("step", [1, 4, 10_000])
def test_qwen35_xml_call_values_typed_from_schema(step):
    reasoning, content, calls = ChatOutput.collect(run(chat("qwen3_coder", in_reasoning=True), QWEN35_OUT, step))
    assert reasoning == "Let me check."
    assert content == "I will look that up."
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "New York", "days": 5, "metric": True, "ratio": 0.5,
                                              "tags": ["a", "b"], "opts": {"x": 1}, "zip": "01234"}


def test_values_that_do_not_fit_the_schema_stay_text():
    text = ('<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n'
            '<parameter=unknown>\n42\n</parameter>\n<parameter=city>\n  two spaces \n</parameter>\n'
            '</function>\n</tool_call>')
    _, calls = parse_tool_calls("qwen3_coder", text, TOOLS)
    assert json.loads(calls[0].arguments) == {"days": "three", "unknown": "42", "city": "  two spaces "}


@pytest.mark.parametrize("parser, text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>'),  # bad JSON
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),  # no name
    ("hermes", '<tool_call>\n["get_weather"]\n</tool_call>'),  # not an object
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'),  # cut off by max_tokens
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\nstray text\n</function>\n</tool_call>"),
    ("qwen3_coder", "<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>"),  # wrong format for the parser
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"),  # cut off
])
@pytest.mark.parametrize("step", [1, 10_000])
def test_malformed_calls_come_back_as_the_model_wrote_them(parser, text, step):
    _, content, calls = ChatOutput.collect(run(chat(parser), "Sure. " + text, step))
    assert calls == [] and content == "Sure. " + text


def test_good_call_kept_next_to_a_malformed_one():
    text = ('<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>\n'
            '<tool_call>\n{"name": oops}\n</tool_call>')
    content, calls = parse_tool_calls("hermes", text, TOOLS)
    assert [c.name for c in calls] == ["search"]
    assert content == '\n<tool_call>\n{"name": oops}\n</tool_call>'


def test_unterminated_but_complete_call_at_the_end_is_a_call():
    content, calls = parse_tool_calls("hermes", '<tool_call>\n{"name": "search", "arguments": {"q": "y"}}\n', TOOLS)
    assert content == "" and [c.name for c in calls] == ["search"]


def test_arguments_as_a_json_string_and_parameters_key():
    _, calls = parse_tool_calls("hermes", '<tool_call>{"name": "search", "arguments": "{\\"q\\": 1}"}</tool_call>'
                                '<tool_call>{"name": "search", "parameters": {"q": 2}}</tool_call>', TOOLS)
    assert [json.loads(c.arguments) for c in calls] == [{"q": 1}, {"q": 2}]


def test_parallel_false_keeps_the_first_call():
    _, _, calls = ChatOutput.collect(run(chat(parallel=False), QWEN3_OUT, 5))
    assert len(calls) == 1 and json.loads(calls[0].arguments)["city"] == "Paris"


def test_text_streams_without_waiting_for_the_end():
    s = ToolCallStream("hermes", TOOLS)
    assert s.feed("Hello wor") == [Content("Hello wor")]
    assert s.feed("ld <tool") == [Content("ld")]  # ' <tool' may open a call: held
    assert s.feed("box> done") == [Content(" <toolbox> done")]


@pytest.mark.parametrize("parser", ["hermes", "qwen3_coder"])
def test_forced_prefix_is_parsed_as_the_models_text(parser):
    prefix = forced_prefix(parser, "search")
    rest = ('{"q": "z"}}\n</tool_call>' if parser == "hermes"
            else "<parameter=q>\nz\n</parameter>\n</function>\n</tool_call>")
    _, _, calls = ChatOutput.collect(run(chat(parser, prefix=prefix), rest, 2))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("search", {"q": "z"})]


@pytest.mark.parametrize("step", [1, 2, 10_000])
def test_reasoning_only_stream(step):
    out = run(ChatOutput(ReasoningStream(False), None), "<think>\nhmm </thi\n</think>\n\nThe answer is 4.\n", step)
    assert ChatOutput.collect(out)[:2] == ("hmm </thi", "The answer is 4.\n")
    out = run(ChatOutput(ReasoningStream(False), None), "No thinking <think> here", step)
    assert ChatOutput.collect(out)[:2] == (None, "No thinking <think> here")
    out = run(ChatOutput(ReasoningStream(True), None), "cut off by max_tok", step)  # never closed
    assert ChatOutput.collect(out)[:2] == ("cut off by max_tok", None)


def test_prompt_state_and_detection(checkpoint):
    from moeferry.text.tokenizer import Tokenizer

    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_reasoning("<|im_start|>assistant\n")
    demo = Tokenizer.from_dir(checkpoint("qwen3_5_moe")).chat_template
    assert detect_tool_parser(demo) == "hermes" and detect_reasoning_parser(demo) == "qwen3"
    assert detect_tool_parser("{{ '<tool_call>\\n<function=' }}") == "qwen3_coder"
    assert detect_tool_parser("{{ messages }}") is None and detect_reasoning_parser(None) is None
