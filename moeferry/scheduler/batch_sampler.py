"""Turn a list of requests into one SamplingBatch and sample their next tokens."""
from __future__ import annotations

import torch

from moeferry.ops.sampler import SamplingBatch, draws_on_host, logprobs_of, sample
from moeferry.scheduler.grammar import advance_grammars, grammar_banned
from moeferry.scheduler.request import Request, TokenLogprob


def build_sampling_batch(reqs: list[Request], vocab: int, eos_ids: set[int], device) -> SamplingBatch:
    def vec(values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype, device=device)

    ps = [r.params for r in reqs]
    grammar = grammar_banned(reqs, vocab, eos_ids)
    adjusts = (grammar is not None or any(len(r.output_ids) < r.params.min_tokens for r in reqs)
               or any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 or p.logit_bias
                      for p in ps))
    width = vocab if adjusts else 0  # no row adjusts its logits: the [B, V] tensors stay empty
    counts = torch.zeros(len(reqs), width, device=device)
    bias = torch.zeros(len(reqs), width, device=device)
    seen = torch.zeros(len(reqs), width, dtype=torch.bool, device=device)
    banned = torch.zeros(len(reqs), width, dtype=torch.bool, device=device)
    for i, r in enumerate(reqs if adjusts else ()):
        p = r.params
        if p.logit_bias:
            tokens, values = zip(*p.logit_bias)
            bias[i, vec(tokens, torch.long)] = vec(values)
        if r.output_ids:
            counts[i].index_add_(0, vec(r.output_ids, torch.long), torch.ones(len(r.output_ids), device=device))
        if p.repetition_penalty != 1.0:
            seen[i, vec(r.all_ids, torch.long)] = True
        if len(r.output_ids) < p.min_tokens:
            stop_ids = [t for t in (eos_ids | set(p.stop_token_ids)) if 0 <= t < vocab]
            banned[i, vec(stop_ids, torch.long)] = True
    if grammar is not None:
        banned |= grammar.to(device)
    sampling = [p for p in ps if p.temperature > 0]
    top_k_max = max(p.top_k for p in sampling) if sampling and all(p.top_k > 0 for p in sampling) else 0
    on_host = draws_on_host(top_k_max, vocab)
    rows = torch.tensor([[p.temperature, max(p.top_k, 0), p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty,
                          p.repetition_penalty] for p in ps], dtype=torch.float32).T
    if not on_host or adjusts:  # penalties (and the general path's filter) read them on the device
        rows = rows.to(device)  # one host->device copy for every row's parameters
    draws = "cpu" if on_host else device
    return SamplingBatch(
        temperature=rows[0], top_k=rows[1].long(), top_p=rows[2], min_p=rows[3], presence=rows[4],
        frequency=rows[5], repetition=rows[6], output_counts=counts, seen=seen, banned=banned, bias=bias,
        generators=[r.generator(draws) if r.params.temperature > 0 else None for r in reqs],
        adjusts=adjusts, top_k_max=top_k_max)


def sample_requests(reqs: list[Request], logits: torch.Tensor, eos_ids: set[int]
                    ) -> tuple[list[int], list[TokenLogprob | None]]:
    batch = build_sampling_batch(reqs, logits.shape[-1], eos_ids, logits.device)
    tokens = sample(logits, batch)
    advance_grammars(reqs, tokens.tolist())
    want = [r.params.logprobs for r in reqs]
    out_lp: list[TokenLogprob | None] = [None] * len(reqs)
    if any(w is not None for w in want):
        top_n = max(w or 0 for w in want)
        chosen, top_ids, top_lp = logprobs_of(logits, tokens, top_n)
        for i, w in enumerate(want):
            if w is not None:
                top = list(zip(top_ids[i, :w].tolist(), top_lp[i, :w].tolist()))
                out_lp[i] = TokenLogprob(int(tokens[i]), float(chosen[i]), top)
    return tokens.tolist(), out_lp
