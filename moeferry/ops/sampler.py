"""Batched sampling: every row uses its own parameters in one vectorised pass.

Order: penalties (repetition on prompt+output, presence/frequency on output), logit_bias, min_tokens
(EOS/stop ids masked), temperature, top-k, top-p, min-p, then a draw with each row's own
generator (exponential race, reproducible per seed). Greedy rows take argmax of the penalised
logits. Logprobs are of the raw model distribution. Where every sampling row has a top-k (a
model's usual defaults), the draw is among each row's top-k_max tokens (`filter_candidates` after one
`topk`, no sort of the vocabulary; the same distribution). That draw runs on the host where the
step reads its tokens at once anyway (`draw_on_host`): the [B, k] candidates come over in one
copy, where filtering and the race are a few microseconds instead of ~15 tiny device launches;
an overlapped step, whose tokens must stay on the device to feed the next one, draws them there.
A batch of greedy rows only takes the argmax; penalties run only where some row has one.

Numerically safe over the whole accepted range: temperatures below GREEDY_BELOW are greedy (dividing
by 1e-40 overflows fp32 to inf, and a softmax of infs is NaN), and penalised logits are clamped to
+-LOGIT_LIMIT (a repetition penalty of 1e-40 would otherwise make them inf), so every row keeps a
finite, well-defined distribution.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

GREEDY_BELOW = 1e-5
LOGIT_LIMIT = 1e30  # / GREEDY_BELOW stays far below fp32's max (3.4e38)


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [B]
    top_k: torch.Tensor  # [B] int, 0 = off
    top_p: torch.Tensor  # [B]
    min_p: torch.Tensor  # [B]
    presence: torch.Tensor  # [B]
    frequency: torch.Tensor  # [B]
    repetition: torch.Tensor  # [B]
    output_counts: torch.Tensor  # [B, V] counts of generated tokens ([B, 0] where no row `adjusts`)
    seen: torch.Tensor  # [B, V] bool: token in prompt or output (the same)
    banned: torch.Tensor  # [B, V] bool: masked this step (min_tokens, grammar; the same)
    bias: torch.Tensor  # [B, V] added to the logits (logit_bias; the same)
    generators: list[torch.Generator | None]  # on the device that draws (draw_on_host); None for greedy rows
    # known on the host when the batch is built (the defaults take the general path):
    adjusts: bool = True  # some row has a penalty, a logit bias or banned tokens (else `apply_penalties` changes nothing)
    top_k_max: int = 0  # every sampling row has a top-k, the largest (0: some row has none)
    draw_on_host: bool = False  # the top-k draw runs on the host (its generators are the host's)

    def row_params_on_host(self) -> "SamplingBatch":
        """The per-row parameters the draw reads, on the host (no copy where they are already)."""
        if self.temperature.device.type == "cpu":
            return self
        return replace(self, temperature=self.temperature.cpu(), top_k=self.top_k.cpu(), top_p=self.top_p.cpu(),
                       min_p=self.min_p.cpu())


def draws_on_host(top_k_max: int, vocab: int) -> bool:
    """The short path (every sampling row has a top-k below the vocabulary) draws on the host
    (its ids travel as fp32, exact below 2^24: every real vocabulary)."""
    return 0 < top_k_max < vocab < 2**24


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    rep = b.repetition[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(b.seen, penalised, logits)
    logits = logits - b.frequency[:, None] * b.output_counts - b.presence[:, None] * (b.output_counts > 0) + b.bias
    return logits.clamp(-LOGIT_LIMIT, LOGIT_LIMIT).masked_fill(b.banned, float("-inf"))


def is_greedy(temperature: torch.Tensor) -> torch.Tensor:
    return temperature < GREEDY_BELOW


def _scaled(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Logits over each row's temperature (greedy rows: 1)."""
    temp = torch.where(is_greedy(b.temperature), torch.ones_like(b.temperature), b.temperature)
    return logits / temp[:, None]


def _drop_sorted(sorted_logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """[B, n] bool: which of each row's best-first candidates top-k / top-p / min-p exclude."""
    n = sorted_logits.shape[-1]
    rank = torch.arange(n, device=sorted_logits.device)[None, :]
    k = torch.where(b.top_k > 0, b.top_k, torch.full_like(b.top_k, n))
    drop = rank >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(-1) - probs  # mass strictly before each token
    drop |= before >= b.top_p[:, None]
    drop |= probs < b.min_p[:, None] * probs[:, :1]
    drop[:, 0] = False  # always keep the best token
    return drop


def filter_logits(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p masking (excluded tokens get -inf)."""
    logits = _scaled(logits, b)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    mask = torch.zeros_like(sorted_logits, dtype=torch.bool).scatter_(1, order, _drop_sorted(sorted_logits, b))
    return logits.masked_fill(mask, float("-inf"))


def filter_candidates(best: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Every row has a top-k of at most k: its k best logits [B, k] (best first, from `topk`)
    filtered, excluded ones -inf. The same distribution as `filter_logits` without sorting the
    vocabulary (a temperature keeps the order)."""
    best = _scaled(best, b)
    return best.masked_fill(_drop_sorted(best, b), float("-inf"))


def sample(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Token ids [B] for fp32 logits [B, V] (on the host where the short path drew them)."""
    logits = logits.float()
    if b.adjusts:
        logits = apply_penalties(logits, b)
    if all(g is None for g in b.generators):  # every row greedy
        return logits.argmax(-1)
    if b.top_k_max and b.draw_on_host:  # draw among each row's best few, not the vocabulary
        return _draw_on_host(logits, b)
    if 0 < b.top_k_max < logits.shape[-1]:  # the same on the logits' device
        best, ids = logits.topk(b.top_k_max, dim=-1)
        drawn = _pick(best, ids, b)
    else:
        drawn = _race(filter_logits(logits, b), b)
    return torch.where(is_greedy(b.temperature), logits.argmax(-1), drawn)


def _draw_on_host(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """The short path: each row's top_k_max candidates (and, if a row is greedy, the argmax)
    come to the host in one copy (ids are exact in fp32: vocabularies are far below 2^24),
    where the filter and the race run on [B, k] with the rows' host generators."""
    best, ids = logits.topk(b.top_k_max, dim=-1)
    k, any_greedy = b.top_k_max, any(g is None for g in b.generators)
    parts = (best, ids.float()) + ((logits.argmax(-1, keepdim=True).float(),) if any_greedy else ())
    both = torch.cat(parts, dim=1).cpu()
    host = b.row_params_on_host()
    drawn = _pick(both[:, :k], both[:, k:2 * k].long(), host)
    return torch.where(is_greedy(host.temperature), both[:, 2 * k].long(), drawn) if any_greedy else drawn


def _pick(best: torch.Tensor, ids: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """One draw per row among its candidates (logits `best` [B, k], best first, of tokens `ids`)."""
    return ids.gather(1, _race(filter_candidates(best, b), b)[:, None])[:, 0]


def _race(filtered: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """One draw per row from softmax(filtered) (exponential race, each row's own generator)."""
    noise = torch.ones_like(filtered)
    for i, g in enumerate(b.generators):  # drawn on `filtered`'s device; greedy rows need none
        if g is not None:
            noise[i].exponential_(generator=g)
    return (filtered.softmax(-1) / noise).argmax(-1)


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, top_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen logprob [B], top ids [B, n], top logprobs [B, n]) of the raw distribution."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens.to(lp.device)[:, None])[:, 0]
    top_lp, top_ids = lp.topk(max(top_n, 1), dim=-1)
    return chosen, top_ids[:, :top_n], top_lp[:, :top_n]
