"""Operations: API key and CORS both ways, /metrics parsed by prometheus_client, /v1/stats rates,
/tokenize and /detokenize, MOEFERRY_* environment defaults, --version."""
from __future__ import annotations

import argparse
import json
import time

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from moeferry.cli import build_parser
from moeferry.config import add_serve_arguments
from moeferry.server.app import build_server
from scripted_model import NAME, scripted_config, serve_in_thread

KEY = "s3cret-key"
ORIGIN = "http://localhost:3000"


@pytest.fixture(scope="module")
def locked(checkpoint):
    cfg = scripted_config(str(checkpoint("qwen3_5_moe")), "--api-key", KEY, "--cors-origins", ORIGIN)
    server = build_server(cfg, factory="scripted_model:factory")
    url, stop = serve_in_thread(server)
    yield server, url
    stop()


def chat(reply: str = "ok") -> dict:
    return {"model": NAME, "messages": [{"role": "user", "content": f"REPLY[[{reply}]]END"}]}


def test_api_key_both_ways(locked):
    _, url = locked
    assert httpx.get(url + "/health").status_code == 200  # open
    head = httpx.head(url + "/health")  # a load balancer's probe
    assert head.status_code == 200 and not head.content
    r = httpx.post(url + "/v1/chat/completions", json=chat())
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.post(url + "/v1/chat/completions", json=chat(), headers={"Authorization": "Bearer nope"}
                      ).status_code == 401
    assert httpx.get(url + "/metrics").status_code == 401 and httpx.get(url + "/v1/models").status_code == 401
    r = httpx.post(url + "/v1/messages", json={**chat(), "max_tokens": 5})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        assert httpx.post(url + "/v1/chat/completions", json=chat(), headers=headers).status_code == 200
    good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert good.chat.completions.create(**chat("fine")).choices[0].message.content == "fine"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    msg = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0).messages.create(max_tokens=20, **chat("hi"))
    assert msg.content[0].text == "hi"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(max_tokens=5, **chat())


def test_cors_both_ways(locked):
    _, url = locked
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(url + "/v1/chat/completions", headers={"Origin": ORIGIN, **pre})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    bad = httpx.options(url + "/v1/chat/completions", headers={"Origin": "http://evil.example", **pre})
    assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
    r = httpx.get(url + "/v1/models", headers={"Origin": ORIGIN, "x-api-key": KEY})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(url + "/v1/models", headers={"Origin": "http://evil.example", "x-api-key": KEY})
    assert "access-control-allow-origin" not in r.headers


def test_metrics_parse_and_count(locked):
    _, url = locked
    h = {"x-api-key": KEY}
    httpx.post(url + "/v1/chat/completions", json=chat("a b c d e f"), headers=h).raise_for_status()
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics", headers=h).text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("moeferry_requests_total", (("outcome", "finished"),))] >= 1
    assert samples[("moeferry_tokens_total", (("kind", "completion"),))] >= 7
    assert samples[("moeferry_time_to_first_token_seconds_count", ())] >= 1
    assert samples[("moeferry_inter_token_latency_seconds_count", ())] >= 6
    assert samples[("moeferry_worker_up", ())] == 1 and samples[("moeferry_worker_restarts_total", ())] == 0
    for name in ("moeferry_requests_running", "moeferry_requests_waiting", "moeferry_requests_in_flight"):
        assert (name, ()) in samples
    assert families["moeferry_time_to_first_token_seconds"].type == "histogram"


def test_stats_rate_is_over_the_time_observed(locked):
    server, url = locked
    h = {"x-api-key": KEY}
    reply = " ".join(["word"] * 40)
    t0 = time.monotonic()
    out = httpx.post(url + "/v1/chat/completions", json=chat(reply), headers=h).json()
    elapsed = time.monotonic() - t0
    stats = httpx.get(url + "/v1/stats", headers=h).json()["throughput"]
    n = out["usage"]["completion_tokens"]
    # the old fixed-window figure was n / 10 s; the rate now covers only the time spent decoding
    assert 0 < stats["decode_observed_s"] < 10
    assert stats["decode_tokens_per_s"] >= n / (elapsed + 0.5) / 2 > n / 10
    assert stats["prefill_tokens_per_s"] > out["usage"]["prompt_tokens"] / 10


def test_tokenize_and_detokenize(locked):
    server, url = locked
    tok = server.frontend.tokenizer
    h = {"x-api-key": KEY}
    r = httpx.post(url + "/tokenize", json={"prompt": "Hello world"}, headers=h).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 4096
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(url + "/tokenize", json={"model": NAME, "messages": msgs, "return_token_strs": True},
                   headers=h).json()
    assert r["tokens"] == tok.encode(tok.apply_chat_template(msgs))
    assert "".join(r["token_strs"]) == tok.apply_chat_template(msgs)
    back = httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}, headers=h).json()
    assert back["prompt"] == tok.apply_chat_template(msgs)
    bad = httpx.post(url + "/detokenize", json={"tokens": [10**9]}, headers=h)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(url + "/tokenize", json={"prompt": "x", "messages": msgs}, headers=h)
    assert both.status_code == 400
    for body in ({"prompt": "\ud800"}, {"messages": [{"role": "user", "content": "\ud800"}]},
                 {"messages": [{"role": "user", "content": "\ud800"}], "add_generation_prompt": False}):
        r = httpx.post(url + "/tokenize", content=json.dumps(body), headers={**h, "content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_text", r.text


def _parse(argv):
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(argv)


def test_environment_defaults(monkeypatch, capsys):
    monkeypatch.setenv("MOEFERRY_PORT", "8123")
    monkeypatch.setenv("MOEFERRY_API_KEY", "from-env")
    monkeypatch.setenv("MOEFERRY_NO_PREFIX_CACHE", "true")
    monkeypatch.setenv("MOEFERRY_TOOL_CALL_PARSER", "hermes")
    args = _parse([])
    assert (args.port, args.api_key, args.prefix_cache, args.tool_call_parser) == (8123, "from-env", False, "hermes")
    assert _parse(["--port", "9000"]).port == 9000  # the command line wins
    monkeypatch.setenv("MOEFERRY_MAX_PREFILL_LENGTH", "64")  # an alias's name (of --max-extend-tokens)
    assert _parse([]).max_extend_tokens == 64
    monkeypatch.setenv("MOEFERRY_PORT", "70000")
    with pytest.raises(SystemExit):
        _parse([])
    assert "MOEFERRY_PORT" in capsys.readouterr().err
    monkeypatch.setenv("MOEFERRY_PORT", "8000")
    monkeypatch.setenv("MOEFERRY_REASONING_PARSER", "deepseek")
    with pytest.raises(SystemExit):
        _parse([])


def test_version(capsys):
    from moeferry import __version__

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"moeferry {__version__}"


def test_worker_expert_counters_reach_the_metrics():
    from moeferry.server.metrics import WORKER_COUNTERS, flat_worker_stats
    flat = flat_worker_stats({"steps": 3, "experts": {"hits": 7, "misses": 2, "bytes_fetched": 64, "cpu_experts": 5}})
    assert (flat["expert_cache_hits"], flat["expert_cache_misses"], flat["expert_bytes_fetched"]) == (7, 2, 64)
    assert flat["experts_on_cpu"] == 5 and WORKER_COUNTERS["experts_on_cpu"][0] == "moeferry_experts_on_cpu"
