"""Property-based fuzzing of the HTTP APIs from the server's own OpenAPI schema (schemathesis): every
route the schema lists, so an API added later (Anthropic's /v1/messages) is fuzzed as well.

Every operation gets schema-valid and schema-violating requests (hypothesis, derandomized, bounded
in count); each must get a non-5xx answer with an error body on 4xx, and the server must stay
healthy (the same worker, no restart) after each. --soak runs many more cases.
"""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.reliability.harness import FUZZ_NAME

CI_CASES, SOAK_CASES = 15, 300  # per operation and generation mode
# Generating is cheap, generating tokens is not: large max_tokens are lowered (the server clamps them
# to the context anyway); out-of-range values are kept so their validation is still fuzzed.
MAX_TOKENS_CAP = 4
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens")


def _shrink(body):
    if isinstance(body, dict):
        for name in TOKEN_FIELDS:
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and MAX_TOKENS_CAP < value < 2**31:
                body[name] = MAX_TOKENS_CAP
        if body.get("model") is not None and isinstance(body.get("model"), str) and len(body) % 2 == 0:
            body["model"] = FUZZ_NAME  # half the cases reach past the model check into generation
    return body


@pytest.fixture(scope="module")
def schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzzed_requests_never_get_a_5xx_and_the_server_stays_healthy(fuzz_server, schema, soak, mode):
    pid = fuzz_server.health()["worker_pid"]
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= paths
    seen: dict[str, int] = {}
    if mode == GenerationMode.NEGATIVE:  # only a body can be invalid (the GET routes take no input)
        operations = [op for op in operations if op.method.upper() == "POST"]
    for op in operations:
        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=SOAK_CASES if soak else CI_CASES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            case.body = _shrink(case.body) if hasattr(case, "body") else None
            response = case.call(base_url=fuzz_server.url, timeout=60)
            status = response.status_code
            seen[f"{op.method.upper()} {op.path} {status // 100}xx"] = seen.get(f"{op.method.upper()} {op.path} "
                                                                               f"{status // 100}xx", 0) + 1
            assert status < 500 or (op.path == "/health" and status == 503), (case.as_curl_command(), response.text)
            if 400 <= status < 500 and op.path.startswith("/v1/"):
                body = response.json()
                if op.path.startswith("/v1/messages"):  # Anthropic's error shape (count_tokens too)
                    assert body["type"] == "error" and body["error"]["message"], body
                else:
                    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
            health = fuzz_server.health()
            assert health["status"] == "ok" and health["worker_pid"] == pid, (case.as_curl_command(), health)

        check()
    if mode == GenerationMode.POSITIVE:  # it got through validation to generation, not only to 4xx
        assert any(k.endswith("2xx") and "completions" in k for k in seen), seen
    else:
        assert any(k.endswith("4xx") and "completions" in k for k in seen), seen
