"""End to end: the real server (subprocess, loopback, tiny checkpoint, CPU) through the openai client.

The module's server is started with our users' seed command line (offload backend, expert cache
sized by the memory plan, a 131072-token KV floor), on a free port instead of 1919.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from moeferry.text.tokenizer import Tokenizer

BOOT_TIMEOUT_S = 180.0
NAME = "tiny-seed"
SEED_LINE_BUILT = [  # the users' command line (tests/test_cli.py: SEED_LINE)
    "--served-model-name", NAME, "--host", "127.0.0.1", "--moe-backend", "offload", "--moe-cache-auto",
    "--kv-reserve-tokens", "131072", "--max-seq-len-override", "131072",
    "--max-running-requests", "1", "--max-output-tokens", "4096", "--sampling-defaults", "model",
    "--enable-cache-report",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`moeferry serve` in a subprocess; its output goes to a log file shown on failure."""

    def __init__(self, model_dir: Path, args: list[str], log_path: Path, env: dict | None = None):
        self.port = free_port()
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "moeferry.cli", "serve", "--model", str(model_dir), "--port", str(self.port),
               "--device", "cpu", *args]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=None if env is None else {**os.environ, **env})
        self.http = httpx.Client(base_url=self.url, timeout=30.0)

    def log(self, tail: int | None = 6000) -> str:
        text = self.log_path.read_text(errors="replace")
        return text[-tail:] if tail else text

    def health(self) -> dict:
        return self.http.get("/health").json()

    def wait_ok(self, timeout: float = BOOT_TIMEOUT_S, not_pid: int | None = None) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited with {self.proc.returncode}:\n{self.log()}"
            try:
                h = self.health()
                if h["status"] == "ok" and h["worker_pid"] != not_pid:
                    return h
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"server not ok within {timeout} s:\n{self.log()}")

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120.0, **kw)

    def stats(self) -> dict:
        return self.http.get("/v1/stats").json()

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


def model_copy(checkpoint, dest: Path, **generation) -> Path:
    """The tiny qwen3_5_moe checkpoint with generation_config.json fields replaced."""
    src = Path(checkpoint("qwen3_5_moe"))
    shutil.copytree(src, dest)
    path = dest / "generation_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(generation)
    path.write_text(json.dumps(cfg))
    return dest


def start_server(model_dir: Path, args: list[str], log_path: Path, env: dict | None = None) -> ServerProcess:
    server = ServerProcess(model_dir, args, log_path, env)
    try:
        server.wait_ok()
    except BaseException:
        server.stop()
        raise
    return server


# The checkpoint's generation_config.json makes sampling greedy by default (top_k 1), so a
# request that sets no sampling field must give the greedy text whatever its seed.
@pytest.fixture(scope="module")
def model_dir(checkpoint, tmp_path_factory):
    return model_copy(checkpoint, tmp_path_factory.mktemp("served") / "tiny", top_k=1, temperature=1.0)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = start_server(model_dir, SEED_LINE_BUILT, tmp_path_factory.mktemp("logs") / "server.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_dir(model_dir)


GREEDY = dict(temperature=0.0)
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three rivers."}]


def test_models_lists_the_served_name(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [NAME]
    assert models[0].model_extra["max_model_len"] == 131072
    log = server.log(tail=None)
    assert "served as          tiny-seed" in log and "at least 131072 tokens" in log  # the boot table
    assert "memory plan:" in log and "transient" in log and "measured" in log  # the plan table, once ready


def test_chat_stream_equals_non_stream_and_usage(client, tokenizer):
    full = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12, **GREEDY)
    text = full.choices[0].message.content
    expected_prompt = len(tokenizer.encode(tokenizer.apply_chat_template(MESSAGES)))
    assert full.usage.prompt_tokens == expected_prompt
    assert full.usage.completion_tokens == 12 or full.choices[0].finish_reason == "stop"
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert full.choices[0].finish_reason in ("length", "stop")
    assert text

    stream = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(deltas) == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == expected_prompt


def test_completions_string_and_token_ids(client, tokenizer):
    prompt = "def fibonacci(n):"
    by_text = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, **GREEDY)
    ids = tokenizer.encode(prompt)
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=8, **GREEDY)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == by_ids.usage.prompt_tokens == len(ids)
    stream = client.completions.create(model=NAME, prompt=ids, max_tokens=8, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in stream) == by_ids.choices[0].text


def test_completions_echo_prepends_each_prompt(client, tokenizer):
    """echo: a choice's text is its prompt (as sent, or token ids decoded) then the completion,
    streamed as a first chunk of its own; lists of prompts echo each their own."""
    prompt = "def fibonacci(n):"
    plain = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, **GREEDY).choices[0].text
    by_text = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, echo=True, **GREEDY)
    assert by_text.choices[0].text == prompt + plain
    ids = tokenizer.encode(prompt)
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=6, echo=True, **GREEDY)
    assert by_ids.choices[0].text == tokenizer.decode(ids, skip_special_tokens=False) + plain
    stream = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=6, echo=True, stream=True,
                                            **GREEDY))
    assert stream[0].choices[0].text == prompt and stream[0].choices[0].finish_reason is None
    assert "".join(c.choices[0].text for c in stream if c.choices) == prompt + plain
    two = client.completions.create(model=NAME, prompt=["Once upon", prompt], max_tokens=3, n=2, echo=True, **GREEDY)
    assert [c.text.startswith(p) for c, p in zip(two.choices, ["Once upon"] * 2 + [prompt] * 2)] == [True] * 4
    assert two.usage.prompt_tokens == len(tokenizer.encode("Once upon")) + len(ids)


def test_logit_bias_forces_and_bans_tokens(client, tokenizer):
    """logit_bias through the API: +100 on a token makes greedy decoding emit only it; -100 on
    what greedy chose bans it (the model's own logits lose)."""
    word = tokenizer.encode(" river")[0]
    forced = client.completions.create(model=NAME, prompt="Name a", max_tokens=4, logit_bias={str(word): 100},
                                       **GREEDY)
    assert forced.choices[0].text == tokenizer.decode([word] * 4)
    plain = client.completions.create(model=NAME, prompt="Name a", max_tokens=1, logprobs=1, **GREEDY)
    first = tokenizer.encode(plain.choices[0].text)[0]
    banned = client.completions.create(model=NAME, prompt="Name a", max_tokens=1, logit_bias={str(first): -100},
                                       logprobs=1, **GREEDY)
    assert banned.choices[0].text != plain.choices[0].text


def test_best_of_returns_the_most_likely_per_token(client):
    """best_of: best_of generations (seeds seed + j, as n choices get), the n with the highest log
    probability per token returned; usage counts every generated token."""
    kw = dict(model=NAME, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=11, logprobs=1,
              extra_body={"top_k": 0})  # the served model's default top_k is 1
    every = client.completions.create(n=3, **kw)

    def per_token(choice):
        return sum(choice.logprobs.token_logprobs) / len(choice.logprobs.token_logprobs)
    best = max(every.choices, key=per_token)
    assert best.index != 0  # (this seed's first choice is not the best: the ranking is tested)
    one = client.completions.create(n=1, best_of=3, **kw)
    assert [(c.index, c.text) for c in one.choices] == [(0, best.text)]
    assert one.usage.completion_tokens == every.usage.completion_tokens
    plain = client.completions.create(n=1, best_of=3, **{**kw, "logprobs": None})
    assert plain.choices[0].text == best.text and plain.choices[0].logprobs is None


def test_completion_text_is_the_decoded_tokens(client, tokenizer):
    """logprobs: the chosen tokens decode to the text; the chosen token is the top-1 under greedy."""
    out = client.completions.create(model=NAME, prompt="The quick brown fox", max_tokens=6, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and max(top.values()) == pytest.approx(chosen)
    assert "".join(lp.tokens) == out.choices[0].text


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=5, logprobs=True,
                                         top_logprobs=2, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2 and item.logprob <= 0.0
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert sum(2.718281828 ** t.logprob for t in item.top_logprobs) <= 1.0 + 1e-5


def test_cached_tokens_on_a_repeated_prefix(client, tokenizer):
    first = tokenizer.encode("A long shared system preamble about rivers, mountains and the sea. " * 3)
    out1 = client.completions.create(model=NAME, prompt=first, max_tokens=2, **GREEDY)
    assert out1.usage.prompt_tokens_details.cached_tokens == 0
    second = first + tokenizer.encode(" And now a different question entirely?")
    out2 = client.completions.create(model=NAME, prompt=second, max_tokens=2, **GREEDY)
    cached = out2.usage.prompt_tokens_details.cached_tokens
    assert len(first) <= cached < len(second)


def test_tools_and_template_kwargs_reach_the_template(client, tokenizer):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=tools, max_tokens=1,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    text = tokenizer.apply_chat_template(MESSAGES, tools=tools, enable_thinking=False)
    assert "get_weather" in text and "</think>" in text
    assert out.usage.prompt_tokens == len(tokenizer.encode(text))


def test_sampling_defaults_come_from_generation_config(client):
    """generation_config.json sets top_k=1: unseeded/seeded requests with no sampling fields are greedy."""
    greedy = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=8, **GREEDY)
    for seed in (1, 2):
        out = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=8, seed=seed)
        assert out.choices[0].text == greedy.choices[0].text


def test_stop_string_ends_the_text(client):
    base = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=10, **GREEDY)
    text = base.choices[0].text
    stop = text[3:6]
    assert stop
    out = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=10, stop=[stop], **GREEDY)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[:text.index(stop)]


def test_stats_count_requests_and_pools(server, client):
    first = "Once upon a time, by the river."  # its own requests: the second's prompt extends the first's,
    for prompt in (first, first + " The end."):  # whose state the prefix cache holds
        client.completions.create(model=NAME, prompt=prompt, max_tokens=4, **GREEDY)
    stats = server.stats()
    assert stats["status"] == "ok" and stats["restarts"] == 0
    assert stats["requests"]["finished"] >= 2 and stats["requests"]["failed"] == 0
    assert stats["tokens"]["completion"] > 0 and stats["tokens"]["cached"] > 0
    assert stats["kv"]["tokens_total"] == 131072
    assert stats["state_slots"]["total"] == 2 * 1 + 8
    assert set(stats["throughput"]) == {"window_s", "prefill_tokens_per_s", "decode_tokens_per_s",
                                        "prefill_observed_s", "decode_observed_s"}


def test_cache_status_serves_the_plan(server):
    """/v1/cache/status: the memory plan the seed line resolved (offload, auto cache, KV floor), and
    /health and /v1/stats carry its headline and the expert-cache counters."""
    status = server.http.get("/v1/cache/status").json()
    plan = status["plan"]
    assert plan["kv_tokens"] >= 131072 and plan["expert_slots"] >= 1
    terms = plan["terms"]
    assert set(terms) >= {"weights", "experts", "staging", "kv", "states", "transient", "graphs", "margin"}
    assert terms["transient"]["source"].startswith("measured") and terms["weights"]["source"].startswith("measured")
    assert plan["total_bytes"] <= plan["usable"]["bytes"]
    assert "transient" in status["plan_table"]
    health = server.health()
    assert health["engine"]["expert_slots"] == plan["expert_slots"] and health["engine"]["moe_backend"] == "offload"
    deadline = time.monotonic() + 10
    while (stats := server.http.get("/v1/stats").json())["experts"] is None and time.monotonic() < deadline:
        time.sleep(0.2)  # the worker reports its counters a few times a second
    assert stats["experts"]["backend"] == "offload" and stats["experts"]["slots"] == plan["expert_slots"]
    assert stats["memory"]["oom_caught"] == 0


WEATHER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "alerts": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["city", "days", "unit", "alerts"], "additionalProperties": False}


def test_json_schema_output_parses_and_validates(client):
    """The random-weight model, constrained by the grammar mask, writes JSON that fits the schema."""
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER_SCHEMA}}
    for seed in (1, 2):
        out = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=120, temperature=1.0,
                                             seed=seed, response_format=fmt, extra_body={"top_k": 0})
        assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
        jsonschema.validate(json.loads(out.choices[0].message.content), WEATHER_SCHEMA)
    stream = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=120, stream=True,
                                            response_format=fmt, **GREEDY)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), WEATHER_SCHEMA)
    # json_object: any object; the random model may not close its strings within max_tokens
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=40,
                                         response_format={"type": "json_object"}, **GREEDY)
    text = out.choices[0].message.content
    assert text.startswith("{")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_schema_the_parser_gives_up_on_is_a_400_not_free_text(client):
    """A recursive schema passes the up-front check, then llguidance stops on it mid-request (too
    many items): the request ends as a 400, never as unconstrained text with a 200."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=30, response_format=fmt, **GREEDY)
    assert "cannot follow" in e.value.body["message"], e.value.body
    assert client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2).choices  # still serving


def test_stop_token_ids_are_checked(client):
    for ids, why in (([-1], "outside the vocabulary"), ([10**12], "outside the vocabulary"),
                     (list(range(1025)), "at most 1024")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2,
                                           extra_body={"stop_token_ids": ids})
        assert why in e.value.body["message"] and e.value.body["param"] == "stop_token_ids", e.value.body


@pytest.mark.parametrize("field, value", [("max_tokens", "5"), ("max_tokens", True), ("max_tokens", 5.5),
                                          ("temperature", True), ("temperature", "0.5"), ("n", "1"), ("seed", "7"),
                                          ("top_k", True), ("stop_token_ids", [True]), ("logit_bias", {" 5 ": 1}),
                                          ("logit_bias", {"1_0": 1}), ("logit_bias", {"\u0661\u0662": 1})])
def test_loose_numbers_are_a_400(client, field, value):
    """Numbers as OpenAI's API has them: a string, a boolean or a fraction for an integer is the
    client's error, not quietly read as a number."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=MESSAGES, extra_body={field: value})
    assert field in json.dumps(e.value.body), e.value.body


def test_unenforceable_schema_is_a_400(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=5, response_format=fmt)
    assert e.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=5,
                                       response_format={"type": "json_object"}, extra_body={"ignore_eos": True})
    assert e.value.body["param"] == "ignore_eos"


def test_bench_serve_against_the_server(server, model_dir, tmp_path, capsys):
    """`moeferry bench serve`: exact prompt/output token counts, every request measured, JSON report."""
    from moeferry.cli import main

    out = tmp_path / "bench.json"
    rc = main(["bench", "serve", "--base-url", server.url, "--tokenizer", str(model_dir), "--num-prompts", "3",
               "--input-len", "24", "--output-len", "5", "--ignore-eos", "--max-concurrency", "2",
               "--result-json", str(out), "--no-progress", "--label", "moeferry"])
    assert rc == 0
    table = capsys.readouterr().out
    assert "Serving Benchmark Result - moeferry" in table and "P99 TTFT (ms)" in table
    report = json.loads(out.read_text())
    assert (report["completed"], report["failed"]) == (3, 0)
    assert report["input_tokens"] == 3 * 24 and report["output_tokens"] == 3 * 5
    for r in report["requests"]:
        # one gap per streamed chunk with text after the first: at most 4 for 5 tokens (a token that
        # ends inside a UTF-8 character streams with the next)
        assert 0 < r["ttft"] <= r["e2e"] and 1 <= len(r["itl"]) <= 4
    assert report["ttft_ms"]["p50"] > 0 and report["tpot_ms"]["mean"] > 0
    assert report["output_throughput"] == pytest.approx(15 / report["duration_s"])
    rc = main(["bench", "serve", "--base-url", server.url, "--tokenizer", str(model_dir), "--num-prompts", "2",
               "--input-len", "24", "--output-len", "3", "--ignore-eos", "--prompt-format", "ids",
               "--result-json", str(out), "--no-progress"])
    report = json.loads(out.read_text())
    assert rc == 0 and report["input_tokens"] == 2 * 24 and report["output_tokens"] == 2 * 3


AGENT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]


def test_forced_tool_calls_on_the_demo_model_whole_and_streamed(client):
    """tool_choice required / named: the grammar holds the random-weight model to a valid call."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=AGENT_TOOLS, tool_choice=named,
                                         max_tokens=80)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and isinstance(args["city"], str) and 1 <= args["days"] <= 7
    stream = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=AGENT_TOOLS, tool_choice=named,
                                            max_tokens=80, stream=True)
    name, arguments, finish = "", "", None
    for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            assert tc.index == 0
            name += tc.function.name or ""
            arguments += tc.function.arguments or ""
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    assert (name, json.loads(arguments), finish) == ("get_weather", args, "tool_calls")  # greedy: the same call
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=AGENT_TOOLS, tool_choice="required",
                                         max_tokens=80)
    assert [c.function.name in ("get_weather", "ping") for c in out.choices[0].message.tool_calls] == [True]


def test_anthropic_sdk_on_the_demo_model(server):
    import anthropic

    ac = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in AGENT_TOOLS]
    msg = ac.messages.create(model=NAME, max_tokens=80, tools=tools, tool_choice={"type": "any"},
                             messages=[{"role": "user", "content": "Weather in Oslo?"}])
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use"]
    assert msg.content[0].name in ("get_weather", "ping")
    with ac.messages.stream(model=NAME, max_tokens=8, messages=[{"role": "user", "content": "Hi"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.usage.output_tokens >= 1 and final.stop_reason in ("end_turn", "max_tokens")
    assert text == "".join(b.text for b in final.content if b.type == "text")
