"""ForwardBatch: one engine step over a flat batch of sequence chunks."""
from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from moeferry.transfer import to_device


def int32_tensor(values: list[int]) -> torch.Tensor:
    """A CPU int32 tensor of a list, through an array: 3x faster than torch.tensor on long lists
    (a 128k-token context's page list: 3.7 ms against 11.8)."""
    return torch.frombuffer(array("i", values), dtype=torch.int32) if values else torch.empty(0, dtype=torch.int32)


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's contribution to a step: new tokens starting at position `start`.

    `pages` are the sequence's KV pages covering start + len(tokens) tokens; `state_slot` is
    its GDN state slot (ignored by models without linear attention).
    """
    tokens: list[int]
    start: int
    pages: list[int]
    state_slot: int
    all_logits: bool = False  # logits for every new token (scoring) or only the last (generation)
    fed: int = -1  # >= 0: the last token is row `fed` of the step's `feed` (sampled by the step before,
    #                still on the device; `tokens` holds a placeholder for it)


def feed_tokens(ids: torch.Tensor, chunks: list[SeqChunk], ends, feed: torch.Tensor | None) -> None:
    """Each fed chunk's last token (the flat batch's row `ends[b] - 1`: `ends` says where each
    chunk's rows end) taken from its row of `feed` on ids' device, without the host reading
    `feed` (the tokens the previous step sampled: an overlapped step starts before they reach
    the host)."""
    fed = [(end - 1, c.fed) for c, end in zip(chunks, ends) if c.fed >= 0]
    if not fed:
        return
    at, rows = [a for a, _ in fed], [r for _, r in fed]
    feed = feed.to(ids.device, non_blocking=True)
    if at == rows == list(range(len(at))):  # a decode batch in the previous step's order: one copy
        ids[: len(at)].copy_(feed[: len(at)])
        return
    where = to_device(torch.tensor([at, rows], dtype=torch.long), ids.device)
    ids.index_copy_(0, where[0], feed.index_select(0, where[1]))


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    q_lens: list[int]
    kv_lens: list[int]  # context length of each sequence after this step
    cu_seqlens: list[int]  # [B+1] offsets of each sequence's rows in the flat batch
    page_table: torch.Tensor  # [B, max_pages] int32
    out_slots: torch.Tensor  # [T] KV slot of each new token
    state_slots: list[int]
    logit_rows: torch.Tensor  # rows of the flat batch whose logits are returned
    page_size: int
    # The same metadata as int32 device tensors, for kernels (and CUDA graphs: no host lists).
    cu_seqlens_t: torch.Tensor | None = None  # [B+1]
    kv_lens_t: torch.Tensor | None = None  # [B]
    state_slots_t: torch.Tensor | None = None  # [B]
    max_q_len: int = 0

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.q_lens)

    @classmethod
    def build(cls, chunks: list[SeqChunk], page_size: int, device: torch.device | str,
              feed: torch.Tensor | None = None) -> "ForwardBatch":
        """`feed`: the previous step's sampled tokens, where a chunk's last token is `fed`."""
        ids, pos, slots, rows, q_lens, kv_lens, cu = [], [], [], [], [], [], [0]
        max_pages = max(len(c.pages) for c in chunks)
        table = torch.zeros(len(chunks), max(max_pages, 1), dtype=torch.int32)
        for b, c in enumerate(chunks):
            n = len(c.tokens)
            if n == 0:
                raise ValueError("a sequence chunk must contain at least one token")
            if len(c.pages) * page_size < c.start + n:
                raise ValueError(f"sequence {b}: {len(c.pages)} pages cannot hold {c.start + n} tokens")
            ids += c.tokens
            for p in range(c.start, c.start + n):
                pos.append(p)
                slots.append(c.pages[p // page_size] * page_size + p % page_size)
            rows += list(range(cu[-1], cu[-1] + n)) if c.all_logits else [cu[-1] + n - 1]
            table[b, : len(c.pages)] = int32_tensor(c.pages)
            q_lens.append(n)
            kv_lens.append(c.start + n)
            cu.append(cu[-1] + n)

        def t(x):  # (queued behind the step in flight, not waited for: `moeferry.transfer`)
            return to_device(torch.tensor(x, dtype=torch.long), device)

        state_slots = [c.state_slot for c in chunks]
        # one host->device copy; each list starts on a 16-byte boundary, so a kernel reading it
        # is compiled for an aligned pointer whatever the batch size (one variant, warmed at boot)
        b, w = len(chunks), -(-(len(chunks) + 1) // 4) * 4
        pad = [0] * (w - b)
        meta = to_device(torch.tensor(cu + pad[1:] + kv_lens + pad + state_slots, dtype=torch.int32), device)
        input_ids = t(ids)
        feed_tokens(input_ids, chunks, cu[1:], feed)
        return cls(input_ids, t(pos), q_lens, kv_lens, cu, to_device(table, device), t(slots), state_slots, t(rows),
                   page_size, meta[: b + 1], meta[w: w + b], meta[2 * w:], max(q_lens))
