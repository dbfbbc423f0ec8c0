"""Structured output in the worker: a request's grammar (llguidance) as a mask of allowed tokens.

The API process compiles `response_format` into an llguidance grammar and checks it; the
request carries it here as `SamplingParams.structured`. On the request's first sampling step a
matcher is made for it (over the checkpoint's tokenizer.json, built once per worker); every
step the matcher says which tokens may come next (EOS only once the value is complete), the
sampler bans the rest, and the sampled token is fed back. Masks are computed on the CPU.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("moeferry.grammar")
_BITS = torch.arange(32, dtype=torch.int32)


@dataclass(frozen=True)
class StructuredOutput:
    grammar: str  # an llguidance grammar (e.g. LLMatcher.grammar_from_json_schema)
    tokenizer_dir: str  # the checkpoint directory holding tokenizer.json


@functools.lru_cache(maxsize=2)
def _ll_tokenizer(tokenizer_dir: str, vocab: int, eos: tuple[int, ...]):
    from llguidance import LLTokenizer

    text = (Path(tokenizer_dir) / "tokenizer.json").read_text()
    return LLTokenizer(text, n_vocab=vocab, eos_token=list(eos))


def _matcher(req, vocab: int, eos_ids: set[int]):
    if req.matcher is None:
        from llguidance import LLMatcher

        s = req.params.structured
        req.matcher = LLMatcher(_ll_tokenizer(s.tokenizer_dir, vocab, tuple(sorted(eos_ids))), s.grammar)
    return req.matcher


def grammar_banned(reqs: list, vocab: int, eos_ids: set[int]) -> torch.Tensor | None:
    """[B, V] bool, True where a request's grammar forbids the token; None if no request has one."""
    if not any(r.params.structured is not None for r in reqs):
        return None
    words = (vocab + 31) // 32
    bitmask = torch.full((len(reqs), words), -1, dtype=torch.int32)  # all allowed
    for i, r in enumerate(reqs):
        if r.params.structured is None:
            continue
        m = _matcher(r, vocab, eos_ids)
        if m.is_error():  # the request ends this step (`grammar_failure`); its row stays unconstrained
            continue
        row = bitmask[i]
        m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
    allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).reshape(len(reqs), -1)[:, :vocab]
    return allowed == 0


def grammar_failure(req) -> str | None:
    """Why the request's grammar can no longer be followed (its matcher failed, e.g. a recursive
    schema past the parser's limits), as the client is told; None while it can. A failed grammar
    ends the request: its next tokens would not fit the schema it asked for."""
    m = req.matcher
    if m is None or not m.is_error():
        return None
    why = m.get_error().split("\n", 1)[0][:300]
    log.warning("request %s: the output grammar failed, request ended: %s", req.request_id, why)
    return f"the output parser cannot follow this response_format / tool schema: {why}"


def advance_grammars(reqs: list, tokens: list[int]) -> None:
    """Feed each constrained request its sampled token."""
    for r, t in zip(reqs, tokens):
        if r.matcher is not None and not r.matcher.is_error():
            r.matcher.consume_token(t)
