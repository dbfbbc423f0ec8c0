"""Offline API: `LLM(model_dir).logits(token_ids)`."""
from __future__ import annotations

import torch

from moeferry.engine.batch import SeqChunk
from moeferry.engine.engine import Engine, PoolSizes, resolve_dtype


class LLM:
    def __init__(self, model_dir: str, device: str = "cpu", dtype: str = "auto", num_tokens: int = 4096,
                 page_size: int = 1, max_running_requests: int = 8, progress: bool = False):
        self.engine = Engine(model_dir, device, resolve_dtype(dtype, device),
                             PoolSizes(-(-num_tokens // page_size), page_size, max_running_requests), progress)
        self.spec = self.engine.spec

    def logits(self, token_ids: list[int], chunk_size: int | None = None) -> torch.Tensor:
        """[len, vocab] fp32 logits of every position, prefilled through the pools in chunks."""
        return self.logits_batch([token_ids], chunk_size)[0]

    def logits_batch(self, prompts: list[list[int]], chunk_size: int | list[int] | None = None) -> list[torch.Tensor]:
        """Score several sequences in shared steps. chunk_size: tokens per step per sequence (int),
        or an explicit list of chunk lengths applied to every sequence (the last one repeats)."""
        eng = self.engine
        kv, states = eng.kv_pool, eng.state_pool
        pages = [kv.pages.alloc(kv.pages_for(len(p))) for p in prompts]
        slots = [states.alloc() for _ in prompts]
        outs: list[list[torch.Tensor]] = [[] for _ in prompts]
        try:
            done = [0] * len(prompts)
            step = 0
            while any(d < len(p) for d, p in zip(done, prompts)):
                size = _chunk_len(chunk_size, step)
                chunks, owners = [], []
                for i, p in enumerate(prompts):
                    if done[i] < len(p):
                        n = min(size or len(p), len(p) - done[i])
                        chunks.append(SeqChunk(p[done[i]:done[i] + n], done[i], pages[i], slots[i], all_logits=True))
                        owners.append((i, n))
                        done[i] += n
                logits = eng.forward(chunks)
                row = 0
                for i, n in owners:
                    outs[i].append(logits[row:row + n])
                    row += n
                step += 1
        finally:
            for pg, sl in zip(pages, slots):
                kv.pages.free(pg)
                states.free(sl)
        return [torch.cat(o) for o in outs]


def _chunk_len(chunk_size, step: int) -> int | None:
    if isinstance(chunk_size, (list, tuple)):
        return chunk_size[min(step, len(chunk_size) - 1)]
    return chunk_size
