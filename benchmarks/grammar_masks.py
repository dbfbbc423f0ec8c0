"""Structured output: per-step token-mask cost of llguidance (used) and xgrammar (if installed).

    python benchmarks/grammar_masks.py [--tokenizer MODEL_DIR] [--steps 2000]

Both libraries walk the same JSON schema with random allowed tokens on the same tokenizer
(default: the demo tokenizer, 4096 tokens; pass a real model directory for a 150k vocabulary).
Reported: tokenizer/grammar preparation, and mask time per step. A decode step of the engine
is milliseconds, so either is small; the numbers say by how much.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from moeferry.text.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                           "unit": {"enum": ["celsius", "fahrenheit"]},
                                           "alerts": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
          "required": ["city", "days", "unit", "alerts"], "additionalProperties": False}
BITS = torch.arange(32, dtype=torch.int32)


def pick(bitmask: torch.Tensor, vocab: int, gen: torch.Generator) -> int:
    allowed = ((bitmask.unsqueeze(-1) >> BITS) & 1).reshape(-1)[:vocab].nonzero().flatten()
    return int(allowed[torch.randint(len(allowed), (1,), generator=gen)])


def bench_llguidance(model_dir: Path, vocab: int, eos: int, steps: int) -> str:
    from llguidance import LLMatcher, LLTokenizer

    t0 = time.perf_counter()
    tok = LLTokenizer((model_dir / "tokenizer.json").read_text(), n_vocab=vocab, eos_token=[eos])
    grammar = LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    prep = time.perf_counter() - t0
    buf = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    gen, done, spent = torch.Generator().manual_seed(0), 0, 0.0
    while done < steps:
        m = LLMatcher(tok, grammar)
        while not m.is_stopped() and done < steps:
            t = time.perf_counter()
            m.unsafe_compute_mask_ptr(buf.data_ptr(), buf.numel() * 4)
            spent += time.perf_counter() - t
            m.consume_token(pick(buf, vocab, gen))
            done += 1
    return f"llguidance: prepare {1e3 * prep:.0f} ms, mask {1e6 * spent / done:.0f} us/step"


def bench_xgrammar(tok: Tokenizer, vocab: int, eos: int, steps: int) -> str:
    try:
        import xgrammar as xgr
    except ImportError:
        return "xgrammar: not installed"
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo([tok._tok.id_to_token(i) or "" for i in range(vocab)],
                             vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=[eos])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    prep = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    gen, done, spent = torch.Generator().manual_seed(0), 0, 0.0
    while done < steps:
        m = xgr.GrammarMatcher(compiled)
        while not m.is_terminated() and done < steps:
            t = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            spent += time.perf_counter() - t
            m.accept_token(pick(bitmask[0], vocab, gen))
            done += 1
    return f"xgrammar:   prepare {1e3 * prep:.0f} ms, mask {1e6 * spent / done:.0f} us/step"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", type=Path, help="model directory with tokenizer.json (default: demo tokenizer)")
    p.add_argument("--steps", type=int, default=2000)
    args = p.parse_args()
    model_dir = args.tokenizer
    if model_dir is None:
        from moeferry.text.demo_tokenizer import train_demo_tokenizer

        model_dir = Path(tempfile.mkdtemp())
        train_demo_tokenizer(model_dir)
    tok = Tokenizer.from_dir(model_dir)
    vocab, eos = tok.vocab_size, tok.token_to_id("<|im_end|>")
    print(f"vocabulary {vocab}, {args.steps} steps")
    print(bench_llguidance(model_dir, vocab, eos, args.steps))
    print(bench_xgrammar(tok, vocab, eos, args.steps))


if __name__ == "__main__":
    main()
