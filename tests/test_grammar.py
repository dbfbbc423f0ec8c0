"""The grammar mask in the batched sampler: constrained rows follow their grammar, others are untouched."""
from __future__ import annotations

import json

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
