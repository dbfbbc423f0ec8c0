"""Faults and bad input against the real server: every bad request gets its documented 4xx and the
server keeps serving; a client that leaves aborts its request; `kill -9` of the worker fails the
in-flight stream within a second, /health goes restarting -> ok, and the next request succeeds."""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.test_server import model_copy, start_server

NAME = "tiny-faults"
CONTEXT = 64
ARGS = ["--served-model-name", NAME, "--max-seq-len-override", str(CONTEXT), "--max-running-requests", "4",
        "--max-output-tokens", "5", "--sampling-defaults", "openai", "--max-extend-tokens", "16"]
GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    # Same generation_config.json as test_server.py (top_k=1), but --sampling-defaults openai ignores it.
    model_dir = model_copy(checkpoint, tmp_path_factory.mktemp("served") / "tiny", top_k=1, temperature=1.0)
    s = start_server(model_dir, ARGS, tmp_path_factory.mktemp("logs") / "server.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat(**overrides) -> dict:
    return {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **overrides}


BAD_REQUESTS = [
    # (path, body or raw bytes, status, code, param)
    ("/v1/chat/completions", b'{"model": "tiny-faults", "messages": [', 400, "invalid_json", None),
    ("/v1/chat/completions", b"not json at all", 400, "invalid_json", None),
    ("/v1/chat/completions", b"[1, 2, 3]", 400, "invalid_json", None),
    ("/v1/chat/completions", chat(messages="hello"), 400, "invalid_type", "messages"),
    ("/v1/chat/completions", chat(messages=[]), 400, "invalid_value", "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "wizard", "content": "x"}]), 400, "invalid_value",
     "messages[0].role"),
    ("/v1/chat/completions", chat(temperature="hot"), 400, "invalid_type", "temperature"),
    ("/v1/chat/completions", chat(max_tokens="many"), 400, "invalid_type", "max_tokens"),
    ("/v1/chat/completions", chat(max_tokens=-5), 400, "invalid_value", "max_tokens"),
    ("/v1/chat/completions", chat(max_completion_tokens=0), 400, "invalid_value", "max_tokens"),
    ("/v1/chat/completions", chat(top_p=1.5), 400, "invalid_value", "top_p"),
    ("/v1/chat/completions", chat(top_logprobs=3), 400, None, "top_logprobs"),
    ("/v1/chat/completions", chat(n=17), 400, "invalid_value", "n"),
    ("/v1/chat/completions", chat(seed=2**70), 400, "invalid_value", "seed"),
    ("/v1/chat/completions", b'{"model": "tiny-faults", "messages": [{"role": "user", "content": "hi"}], '
     b'"temperature": NaN}', 400, "invalid_value", "temperature"),
    ("/v1/chat/completions", chat(frobnicate=True), 400, "unknown_parameter", "frobnicate"),
    ("/v1/chat/completions", chat(model="gpt-4o"), 404, "model_not_found", "model"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "word " * 200}]), 400,
     "context_length_exceeded", "messages"),
    ("/v1/completions", {"model": NAME, "prompt": list(range(1, CONTEXT + 1))}, 400, "context_length_exceeded",
     "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": [5, 10**9]}, 400, None, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": []}, 400, None, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": ["a"] * 33, "n": 2}, 400, "invalid_value", "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": ["a", ""]}, 400, None, "prompt"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "echo": True, "logprobs": 1}, 400, None, "echo"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "n": 3, "best_of": 2}, 400, "invalid_value", "best_of"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "best_of": 17}, 400, "invalid_value", "best_of"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "best_of": 2, "stream": True}, 400, "invalid_value",
     "best_of"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "logit_bias": {"abc": 1}}, 400, "invalid_value", "logit_bias"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "logit_bias": {"5": 500}}, 400, "invalid_value", "logit_bias"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "logit_bias": {str(i): 1 for i in range(2000)}}, 400,
     "invalid_value", "logit_bias"),
    ("/v1/chat/completions", chat(logit_bias={str(10**9): 1}), 400, "invalid_value", "logit_bias"),
    ("/v1/completions", {"model": NAME, "prompt": {"nested": [1]}}, 400, "invalid_type", "prompt"),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, None, None),  # nesting deeper than json allows
    ("/v1/nowhere", {}, 404, None, None),
]


def test_bad_requests_get_documented_errors_and_the_server_keeps_serving(server, client):
    for path, body, status, code, param in BAD_REQUESTS:
        if isinstance(body, bytes):
            r = server.http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = server.http.post(path, json=body)
        assert r.status_code == status, (path, body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        assert err["type"] == "invalid_request_error"
        if code is not None:
            assert err["code"] == code, (body, err)
        assert err["param"] == param, (body, err)
    r = server.http.post("/v1/completions", content=b" " * (33 * 2**20), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert server.health()["status"] == "ok"
    out = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "still there?"}],
                                         max_tokens=2)
    assert out.usage.completion_tokens >= 1
    assert server.stats()["requests"]["failed"] == 0


def test_openai_sampling_defaults_and_max_output_tokens(client):
    """--sampling-defaults openai: generation_config.json's top_k=1 is not applied, so seeds matter;
    --max-output-tokens 5 is the default max_tokens."""
    def run(seed):
        return client.completions.create(model=NAME, prompt="Once upon a time", seed=seed,
                                         extra_body={"ignore_eos": True})
    a, a2, b = run(1), run(1), run(2)
    assert a.choices[0].text == a2.choices[0].text  # seeded runs reproduce
    assert a.choices[0].text != b.choices[0].text  # and sampling is random (temperature 1, no top_k)
    assert a.usage.completion_tokens == 5 and a.choices[0].finish_reason == "length"


def test_eight_concurrent_streams_complete(client):
    prompts = [f"Story number {i}: the" for i in range(8)]
    expected = [client.completions.create(model=NAME, prompt=p, max_tokens=6, **GREEDY).choices[0].text
                for p in prompts]
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def stream(i):
        try:
            chunks = client.completions.create(model=NAME, prompt=prompts[i], max_tokens=6, stream=True, **GREEDY)
            results[i] = "".join(c.choices[0].text for c in chunks)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert [results.get(i) for i in range(8)] == expected  # batched greedy == one at a time


def _wait(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not reached")


def test_client_disconnect_aborts_its_request(server):
    before = server.stats()["requests"]["aborted"]
    body = chat(max_tokens=50, stream=True, ignore_eos=True)
    with server.http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]  # role chunk, blank line, first content chunk
        assert got[0].startswith("data: ")
    # The worker stops generating for it: nothing running or waiting, the abort is counted.
    stats = _wait(lambda: (s := server.stats())["requests"]["aborted"] > before
                  and s["scheduler"].get("running") == 0 and s["scheduler"].get("waiting") == 0 and s)
    assert stats["in_flight"] == 0
    assert stats["tokens"]["completion"] < 1000


def test_kill_9_worker_mid_stream(server, client):
    pid = server.health()["worker_pid"]
    stream = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "count"}],
                                            max_tokens=50, stream=True, extra_body={"ignore_eos": True}, **GREEDY)
    it = iter(stream)
    next(it), next(it)  # role chunk, first token: the request is running in the worker
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(openai.APIError) as err:
        for _ in it:
            pass
    assert time.monotonic() - killed < 1.0
    assert "worker died" in str(err.value) and "restarting" in str(err.value)

    assert _wait(lambda: server.health()["status"] == "restarting", timeout=2.0)
    with pytest.raises(openai.InternalServerError) as unavailable:  # 503 while restarting
        client.completions.create(model=NAME, prompt="hi", max_tokens=1)
    assert unavailable.value.status_code == 503
    health = server.wait_ok(not_pid=pid)
    assert health["restarts"] == 1 and health["worker_pid"] != pid
    out = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "again"}], max_tokens=3)
    assert out.usage.completion_tokens >= 1
    stats = server.stats()
    assert stats["restarts"] == 1 and stats["requests"]["failed"] == 1


def test_health_reports_pid(server):
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and isinstance(h["worker_pid"], int)


def test_max_tokens_beyond_the_context_is_clamped(client):
    """As offline (tests/test_generate.py::test_context_limits): the output stops where the context ends."""
    out = client.completions.create(model=NAME, prompt=list(range(1, CONTEXT - 3)), max_tokens=1000,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length"
