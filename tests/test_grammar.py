"""The grammar mask in the batched sampler: constrained rows follow their grammar, others are untouched."""
from __future__ import annotations

import json

import pytest
import torch

from moeferry.scheduler.batch_sampler import sample_requests
from moeferry.scheduler.grammar import StructuredOutput
from moeferry.scheduler.request import Request
from moeferry.scheduler.sampling import SamplingParams
from moeferry.server.structured import compile_schema
from moeferry.text.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 22, 333]}},
          "required": ["ok", "n"], "additionalProperties": False}


def test_constrained_rows_write_valid_json_in_a_mixed_batch(checkpoint):
    model_dir = checkpoint("qwen3_5_moe")
    tok = Tokenizer.from_dir(model_dir)
    eos = {tok.token_to_id("<|im_end|>")}
    structured = StructuredOutput(compile_schema(SCHEMA), str(model_dir))
    reqs = [Request("a", [1, 2], SamplingParams(temperature=1.0, seed=s, max_tokens=64, structured=structured))
            for s in range(3)]
    free = Request("free", [1, 2], SamplingParams(temperature=0.0, max_tokens=64))
    reqs.append(free)
    gen = torch.Generator().manual_seed(0)
    live = list(reqs)
    for _ in range(40):
        logits = torch.randn(len(live), tok.vocab_size, generator=gen)
        logits[:, 7] += 50.0  # a token no JSON starts with: the unconstrained greedy row takes it
        tokens, _ = sample_requests(live, logits, eos)
        for r, t in zip(live, tokens):
            r.output_ids.append(t)
        live = [r for r in live if not (r.output_ids[-1] in eos or r is free)]
        if not live:
            break
    assert free.output_ids == [7]
    for r in reqs[:3]:
        assert r.output_ids[-1] in eos, tok.decode(r.output_ids)
        value = json.loads(tok.decode(r.output_ids[:-1]))
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 22, 333)


TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                          "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                                          "metric": {"type": "boolean"}},
                         "required": ["city", "days"]},
         "noop": {}}


def _forced_run(model_dir, parser, forced, seed):
    """Random logits under the forced-call grammar; the parser must read one valid call."""
    from moeferry.server.chat_plan import ChatPlan
    from moeferry.server.structured import tool_call_grammar
    from moeferry.text.tool_parsers import ToolCallStream

    tok = Tokenizer.from_dir(model_dir)
    eos = {tok.token_to_id("<|im_end|>")}
    plan = ChatPlan(parser, None, tools=[], schemas=TOOLS, forced_tool=forced)
    structured = StructuredOutput(tool_call_grammar(plan, tok), str(model_dir))
    req = Request("t", [1, 2], SamplingParams(temperature=1.0, seed=seed, max_tokens=400, structured=structured))
    gen = torch.Generator().manual_seed(seed)
    while not req.output_ids or req.output_ids[-1] not in eos:
        assert len(req.output_ids) < 400
        logits = torch.randn(1, tok.vocab_size, generator=gen) * 3
        logits[0, list(eos)] -= 5.0  # let values grow a little before the grammar allows the end
        tokens, _ = sample_requests([req], logits, eos)
        req.output_ids.append(tokens[0])
    stream = ToolCallStream(parser, TOOLS, prefix=plan.prefix)
    items = stream.feed(tok.decode(req.output_ids[:-1])) + stream.finish()
    return items


@pytest.mark.parametrize("parser", ["hermes", "qwen3_coder"])
@pytest.mark.parametrize("forced", ["get_weather", ""])
def test_forced_tool_call_grammar_gives_a_parsable_call(checkpoint, parser, forced):
    from moeferry.text.tool_parsers import ParsedToolCall

    for seed in (0, 1):
        items = _forced_run(checkpoint("qwen3_5_moe"), parser, forced, seed)
        assert len(items) == 1 and isinstance(items[0], ParsedToolCall), items
        call = items[0]
        assert call.name in ((forced,) if forced else tuple(TOOLS))
        args = json.loads(call.arguments)
        if call.name == "get_weather":
            assert isinstance(args["city"], str) and 1 <= args["days"] <= 9
            assert set(args) <= {"city", "days", "metric"} and isinstance(args.get("metric", True), bool)
