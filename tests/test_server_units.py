"""Pieces of the API process that need no server: sampling defaults, parameter resolution, messages."""
from __future__ import annotations

import json

import pytest

from moeferry.server.generation import Frontend, model_sampling_defaults
from moeferry.server.openai_api import chat_messages, completion_prompts
from moeferry.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from moeferry.server.stats import ServerStats
from moeferry.server.supervisor import describe_exit


def frontend(defaults: dict, max_output_tokens: int | None = None) -> Frontend:
    return Frontend(None, None, max_seq_len=100, vocab_size=50, default_max_tokens=max_output_tokens,
                    sampling_defaults=defaults, stats=ServerStats())


def test_model_sampling_defaults_read_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05,
         "max_new_tokens": 300, "do_sample": True, "eos_token_id": [1, 2], "presence_penalty": None}))
    assert model_sampling_defaults(str(tmp_path)) == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05,
        "max_tokens": 300}
    assert model_sampling_defaults(str(tmp_path / "nowhere")) == {}


def test_request_beats_model_default_beats_openai_default():
    f = frontend({"temperature": 0.6, "top_k": 20, "max_tokens": 300})
    req = CompletionRequest(model="m", prompt="x", top_k=5, seed=3, stop="END")
    p = f.sampling_params(req, None, None)
    assert (p.temperature, p.top_k, p.top_p, p.seed, p.stop) == (0.6, 5, 1.0, 3, ("END",))
    assert p.max_tokens == 300  # generation_config's max_new_tokens
    assert frontend({"max_tokens": 300}, max_output_tokens=40).sampling_params(req, None, None).max_tokens == 40
    assert frontend({}, max_output_tokens=40).sampling_params(req, 7, None).max_tokens == 7
    assert frontend({}).sampling_params(req, None, None).max_tokens is None  # the rest of the context
    assert frontend({}).sampling_params(req, None, 2).logprobs == 2


def test_invalid_sampling_values_name_their_param():
    f = frontend({})
    for fields, param in [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                          ({"min_tokens": 5}, "min_tokens"), ({"repetition_penalty": 0.0}, "repetition_penalty")]:
        with pytest.raises(ApiError) as e:
            f.sampling_params(CompletionRequest(model="m", prompt="x", **fields), 2, None)
        assert (e.value.status, e.value.param) == (400, param)


def test_prompt_checks():
    f = frontend({})
    f.check_prompt([1, 2, 3], "prompt")
    for ids, code in [([], None), ([1, 50], None), (list(range(1, 41)) * 3, "context_length_exceeded")]:
        with pytest.raises(ApiError) as e:
            f.check_prompt(ids, "prompt")
        assert (e.value.status, e.value.param, e.value.code) == (400, "prompt", code)


def test_chat_messages_for_the_template():
    req = ChatCompletionRequest(model="m", messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "content": "42", "tool_call_id": "1"},
    ])
    m = chat_messages(req)
    assert [x["role"] for x in m] == ["system", "user", "assistant", "tool"]
    assert m[1]["content"] == "ab" and m[2]["content"] == ""
    assert m[2]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert m[3]["tool_call_id"] == "1"
    image = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(ApiError) as e:
        chat_messages(image)
    assert e.value.param == "messages[0].content"


def test_completion_prompt_forms():
    class Tok:
        def encode(self, text, max_tokens=None):
            assert max_tokens in (None, 64)  # the context bound is passed on to the tokenizer
            return [ord(c) for c in text]

    assert completion_prompts(Tok(), "ab") == [[97, 98]]
    assert completion_prompts(Tok(), ["ab"], max_tokens=64) == [[97, 98]]
    assert completion_prompts(Tok(), [5, 6]) == [[5, 6]]
    assert completion_prompts(Tok(), [[5, 6]]) == [[5, 6]]
    assert completion_prompts(Tok(), ["ab", "c"]) == [[97, 98], [99]]
    assert completion_prompts(Tok(), [[1], [2, 3]]) == [[1], [2, 3]]
    assert completion_prompts(Tok(), []) == [[]]  # an empty prompt: check_prompt refuses it


def test_describe_exit():
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(3) == "exit code 3"


def test_restart_after_cache_shrinks_keeps_the_smaller_cache(tmp_path):
    from moeferry.engine.config import EngineConfig
    from moeferry.server.messages import WorkerSpec
    from moeferry.server.supervisor import smaller_plan

    spec = WorkerSpec(EngineConfig(str(tmp_path), moe_backend="offload", moe_cache_auto=True))
    assert smaller_plan(spec, {}) is spec  # no stats: nothing learned
    assert smaller_plan(spec, {"memory": {"cache_shrinks": 0}, "experts": {"slots": 90}}) is spec
    shrunk = smaller_plan(spec, {"memory": {"cache_shrinks": 2}, "experts": {"slots": 90}})
    e = shrunk.engine
    assert (e.moe_cache_size, e.moe_cache_auto, e.moe_cache_rate) == (90, False, None)
    resident = WorkerSpec(EngineConfig(str(tmp_path)))
    assert smaller_plan(resident, {"memory": {"cache_shrinks": 1}, "experts": {"slots": 8}}) is resident


def test_bench_summary_counts_textless_requests_without_timing_them():
    """A request whose tokens decoded to no text (usage says 128) completed: it counts in the
    throughput but not in TTFT/TPOT; a request with no tokens at all failed."""
    from moeferry.bench.serve import Result, summarize, table
    timed = Result(ok=True, prompt_tokens=8, output_tokens=5, ttft=0.5, e2e=0.9, itl=[0.1] * 4)
    textless = Result(ok=True, prompt_tokens=8, output_tokens=128, ttft=None, e2e=3.0)
    failed = Result(error="no tokens streamed")
    report = summarize([timed, textless, failed], 2.0, [50])
    assert (report["completed"], report["failed"], report["textless"]) == (2, 1, 1)
    assert report["output_tokens"] == 133 and report["output_throughput"] == 66.5
    assert report["ttft_ms"]["p50"] == 500.0 and abs(report["tpot_ms"]["mean"] - 100.0) < 1e-9
    assert "Requests streaming no text" in table(report, "t")
