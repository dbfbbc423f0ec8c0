"""Turn a list of requests into one SamplingBatch and sample their next tokens.

Sampling is launched (`launch_sampling`: the tokens are drawn where the logits are, and start
their copy to the host) apart from being read (`SampledStep.read`: wait for the copy, feed the
grammars), so that an overlapped scheduler can start the next step's forward, fed from the
tokens on the device, before the host has them (it reads them before that step's sampling).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moeferry.ops.sampler import SamplingBatch, draws_on_host, logprobs_of, sample
from moeferry.scheduler.grammar import advance_grammars, grammar_banned
from moeferry.scheduler.request import Request, TokenLogprob
from moeferry.transfer import to_device


def adjusts_logits(reqs: list[Request]) -> bool:
    """Whether some row's logits change before the draw (a grammar, min_tokens not reached yet,
    a penalty or a logit bias)."""
    return any(r.params.structured is not None or len(r.output_ids) < r.params.min_tokens
               or r.params.presence_penalty or r.params.frequency_penalty or r.params.repetition_penalty != 1.0
               or r.params.logit_bias for r in reqs)


def build_sampling_batch(reqs: list[Request], vocab: int, eos_ids: set[int], device,
                         host_draws: bool = True) -> SamplingBatch:
    """`host_draws`: a top-k draw may run on the host (not where the tokens must stay on the device)."""

    def vec(values, dtype=torch.float32):
        return to_device(torch.tensor(values, dtype=dtype), device)

    ps = [r.params for r in reqs]
    grammar = grammar_banned(reqs, vocab, eos_ids)
    adjusts = adjusts_logits(reqs)
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
            seen[i] = r.seen_mask(vocab, device)
        if len(r.output_ids) < p.min_tokens:
            stop_ids = [t for t in (eos_ids | set(p.stop_token_ids)) if 0 <= t < vocab]
            banned[i].index_fill_(0, vec(stop_ids, torch.long), True)  # not `[ids] = True` (Request.seen_mask)
    if grammar is not None:
        banned |= to_device(grammar, device)
    sampling = [p for p in ps if p.temperature > 0]
    top_k_max = max(p.top_k for p in sampling) if sampling and all(p.top_k > 0 for p in sampling) else 0
    on_host = host_draws and draws_on_host(top_k_max, vocab)
    rows = torch.tensor([[p.temperature, max(p.top_k, 0), p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty,
                          p.repetition_penalty] for p in ps], dtype=torch.float32).T.contiguous()
    if not on_host or adjusts:  # penalties (and the general path's filter) read them on the device
        rows = to_device(rows, device)  # one copy for every row's parameters, queued behind the step in flight
    draws = "cpu" if on_host else device
    return SamplingBatch(
        temperature=rows[0], top_k=rows[1].long(), top_p=rows[2], min_p=rows[3], presence=rows[4],
        frequency=rows[5], repetition=rows[6], output_counts=counts, seen=seen, banned=banned, bias=bias,
        generators=[r.generator(draws) if r.params.temperature > 0 else None for r in reqs],
        adjusts=adjusts, top_k_max=top_k_max, draw_on_host=on_host)


@dataclass
class SampledStep:
    """A step's sampled tokens (and logprobs), on their way to the host."""
    reqs: list[Request]
    tokens: torch.Tensor  # [B], where they were drawn (the next step's `feed`)
    host: list[torch.Tensor]  # tokens, then (chosen, top ids, top logprobs) where asked: host copies
    ready: torch.cuda.Event | None  # recorded after the copies (None: drawn on the host)

    @classmethod
    def start(cls, reqs: list[Request], tokens: torch.Tensor, logprobs: tuple = ()) -> "SampledStep":
        moved = [t.to("cpu", non_blocking=True) for t in (tokens, *logprobs)]
        ready = None
        if any(t.is_cuda for t in (tokens, *logprobs)):
            ready = torch.cuda.Event()
            ready.record()
        return cls(reqs, tokens, moved, ready)

    def read(self) -> tuple[list[int], list[TokenLogprob | None]]:
        """The tokens and logprobs on the host (waits for the copies); feeds the grammars."""
        if self.ready is not None:
            self.ready.synchronize()
        tokens = self.host[0].tolist()
        advance_grammars(self.reqs, tokens)
        out: list[TokenLogprob | None] = [None] * len(self.reqs)
        if len(self.host) > 1:
            chosen, top_ids, top_lp = (t.tolist() for t in self.host[1:])
            for i, r in enumerate(self.reqs):
                w = r.params.logprobs
                if w is not None:
                    out[i] = TokenLogprob(tokens[i], chosen[i], list(zip(top_ids[i][:w], top_lp[i][:w])))
        return tokens, out


def launch_sampling(reqs: list[Request], logits: torch.Tensor, eos_ids: set[int], on_device: bool = False
                    ) -> SampledStep:
    """Sample each request's next token from its row of `logits`, without waiting for them
    (`on_device`: every draw stays on the logits' device, the next step is fed from there)."""
    if all(r.params.greedy for r in reqs) and not adjusts_logits(reqs):
        tokens = logits.argmax(-1)  # what `sample` does for such a batch, without building one
    else:
        tokens = sample(logits, build_sampling_batch(reqs, logits.shape[-1], eos_ids, logits.device,
                                                     host_draws=not on_device))
    want = [r.params.logprobs for r in reqs if r.params.logprobs is not None]
    logprobs = logprobs_of(logits, tokens, max(want)) if want else ()
    return SampledStep.start(reqs, tokens, logprobs)


def sample_requests(reqs: list[Request], logits: torch.Tensor, eos_ids: set[int]
                    ) -> tuple[list[int], list[TokenLogprob | None]]:
    return launch_sampling(reqs, logits, eos_ids).read()
