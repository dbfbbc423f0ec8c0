"""The decode graphs' page table moves only what changed (`cuda_graph.PageRows`), which relies on
the cache manager growing a sequence's page list in place."""
from __future__ import annotations

import random

import torch

from moeferry.cache.kv_pool import KVPool
from moeferry.cache.manager import CacheManager
from moeferry.cache.state_pool import StatePool
from moeferry.engine.cuda_graph import SCATTER_PAGES, PageRows


def _check(table: torch.Tensor, batch: list[list[int]]) -> None:
    for b, pages in enumerate(batch):
        assert table[b, :len(pages)].tolist() == pages, f"row {b}"


def test_page_rows_match_a_full_rebuild_over_random_steps():
    """Decode steps (a page appended in place), finished sequences (the rows after shift up),
    new sequences (short and longer than SCATTER_PAGES), a list replaced by an equal copy, and a
    last page changed under a row: after every load each row holds its sequence's pages."""
    rng = random.Random(0)
    width = 4 * SCATTER_PAGES
    table = torch.full((6, width), -7, dtype=torch.int32)
    rows = PageRows(table)
    fresh = iter(range(10**6))

    def new_seq() -> list[int]:
        return [next(fresh) for _ in range(rng.choice([1, 3, SCATTER_PAGES + 5]))]

    batch = [new_seq() for _ in range(3)]
    for _ in range(400):
        op = rng.random()
        if op < 0.6:
            for pages in batch:
                if len(pages) < width:
                    pages.append(next(fresh))  # in place, as CacheManager.grow does
        elif op < 0.7 and len(batch) > 1:
            batch.pop(rng.randrange(len(batch)))
        elif op < 0.8 and len(batch) < 6:
            batch.insert(rng.randrange(len(batch) + 1), new_seq())
        elif op < 0.9:
            b = rng.randrange(len(batch))
            batch[b] = list(batch[b])  # another list object with the same pages
        else:
            batch[rng.randrange(len(batch))][-1] = next(fresh)  # the last page changed under the row
        rows.load(batch)
        _check(table, batch)


def test_page_rows_move_only_new_pages():
    table = torch.zeros(2, 256, dtype=torch.int32)
    rows = PageRows(table)
    a, b = list(range(100, 200)), [5]
    rows.load([a, b])
    table[0, :100] = -1  # anything still to be written would overwrite these
    a.append(7)
    b.append(8)
    rows.load([a, b])
    assert table[0, :100].eq(-1).all() and table[0, 100] == 7 and table[1, :2].tolist() == [5, 8]


def test_grow_extends_the_sequence_page_list_in_place():
    kv = KVPool(1, 64, 1, 1, 4, torch.float32, "cpu")
    states = StatePool(1, 2, 4, 2, 1, 4, 4, torch.float32, "cpu")
    cache = CacheManager(kv, states, needs_state=True, prefix_cache=True)
    blocks = cache.admit([1, 2, 3])
    pages = blocks.pages
    assert cache.grow(blocks, 3) and cache.grow(blocks, 4)
    assert blocks.pages is pages and len(pages) == 4


def test_fed_tokens_land_in_their_rows():
    """An overlapped step's decode tokens come from the previous step's sampled tokens on the
    device (`SeqChunk.fed`): in the graphs' static ids and in an eager batch, in any order,
    beside tokens the host knows and a prefill chunk."""
    from moeferry.engine.cuda_graph import DecodeGraphs
    from moeferry.model.batch import ForwardBatch, SeqChunk

    feed = torch.randint(10, 1000, (5,))
    chunks = [SeqChunk([0], 3, [0, 1, 2, 3], 0, fed=4), SeqChunk([77], 2, [4, 5, 6], 1),
              SeqChunk([0], 1, [7, 8], 2, fed=0)]
    graphs = DecodeGraphs(None, None, None, max_batch=4, max_pages=8, page_size=1, device=torch.device("cpu"))
    graphs._load(chunks, 4, feed)
    assert graphs.tokens[0].tolist() == [int(feed[4]), 77, int(feed[0]), 0]
    in_order = [SeqChunk([0], 3, [0, 1, 2, 3], b, fed=b) for b in range(3)]
    graphs._load(in_order, 4, feed)
    assert graphs.tokens[0, :3].tolist() == feed[:3].tolist()
    prefill = SeqChunk([5, 6, 7], 0, [9, 10, 11], 3)
    batch = ForwardBatch.build([prefill] + chunks, 1, "cpu", feed)
    assert batch.input_ids.tolist() == [5, 6, 7, int(feed[4]), 77, int(feed[0])]
    assert ForwardBatch.build(chunks[1:2], 1, "cpu").input_ids.tolist() == [77]
