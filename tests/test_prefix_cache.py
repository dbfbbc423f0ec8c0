"""Radix tree bookkeeping: page ownership, splits, snapshots, LRU eviction."""
from __future__ import annotations

from moeferry.cache.kv_pool import IdAllocator
from moeferry.cache.prefix_cache import PrefixCache


def make(needs_state=False, page_size=1):
    pages = IdAllocator(100)
    freed_state = []
    return PrefixCache(page_size, needs_state, pages.free, freed_state.append), pages, freed_state


def test_match_insert_split_and_dedup():
    cache, pages, _ = make()
    a = pages.alloc(6)
    cache.insert([1, 2, 3, 4, 5, 6], a, [])
    m = cache.match([1, 2, 3, 9, 9])
    assert m.length == 3 and m.pages == a[:3]
    b = pages.alloc(5)  # a request that computed 1,2,3 itself before the cache had them
    cache.insert([1, 2, 3, 7, 8], b, [])
    assert pages.num_free == 100 - 6 - 2  # its duplicates of 1,2,3 were freed
    assert cache.match([1, 2, 3, 7, 8, 0]).pages == a[:3] + b[3:5]
    assert cache.num_pages == 8


def test_last_token_is_never_cached():
    cache, pages, _ = make()
    cache.insert([1, 2, 3], pages.alloc(3), [])
    assert cache.match([1, 2, 3]).length == 2


def test_state_models_resume_only_at_snapshots():
    cache, pages, freed = make(needs_state=True)
    cache.insert([1, 2, 3, 4, 5, 6], pages.alloc(6), [(2, 50), (5, 51)])
    m = cache.match([1, 2, 3, 4, 9, 9])
    assert m.length == 2 and m.snapshot == 50
    assert cache.match([1, 2, 3, 4, 5, 6, 7]).snapshot == 51
    cache.insert([1, 2, 3, 4, 5, 6], pages.alloc(6), [(2, 60)])  # duplicate snapshot is freed
    assert freed == [60]


def test_lru_eviction_skips_locked():
    cache, pages, _ = make()
    cache.insert([1, 2, 3], pages.alloc(3), [])
    cache.insert([4, 5, 6], pages.alloc(3), [])
    m = cache.match([1, 2, 3, 0])
    cache.lock(m.node, +1)
    assert cache.evict_pages(10) == 3
    assert cache.match([1, 2, 3, 0]).length == 3 and cache.match([4, 5, 6, 0]).length == 0
    cache.lock(m.node, -1)
    assert cache.evict_pages(10) == 3 and pages.num_free == 100


def test_page_size_alignment():
    cache, pages, _ = make(page_size=4)
    cache.insert(list(range(10)), pages.alloc(3), [])  # 8 tokens aligned, last partial page freed
    assert cache.num_pages == 2 and pages.num_free == 98
    assert cache.match(list(range(7)) + [99, 99]).length == 4


def test_common_prefix_equals_the_token_by_token_scan():
    """The halving search (slices compared whole) finds the first difference the scan finds, on
    tuples and on strings, and the cache's page-rounded length is the page-wise scan's, for
    several page sizes."""
    import random

    from moeferry.common_prefix import common_prefix_length

    rng = random.Random(1)
    for _ in range(2000):
        key = tuple(rng.randrange(3) for _ in range(rng.randrange(0, 200)))
        lead = [rng.randrange(3) for _ in range(rng.randrange(0, 5))]
        tokens = lead + list(key[:rng.randrange(len(key) + 1)]) + [rng.randrange(3) for _ in range(rng.randrange(50))]
        start = len(lead)
        length = min(len(key), len(tokens) - start)
        scan = 0
        while scan < length and key[scan] == tokens[start + scan]:
            scan += 1
        assert common_prefix_length(key, tuple(tokens[start:start + length])) == scan
        assert common_prefix_length("".join(map(str, key)), "".join(map(str, tokens[start:]))) == scan
        for ps in (1, 2, 4):
            cache = PrefixCache(ps, False, lambda pages: None, lambda slot: None)
            limit = rng.randrange(start, len(tokens) + 1)
            n = 0  # the page-wise scan the cache did before
            while (n + ps <= len(key) and start + n + ps <= limit
                   and key[n:n + ps] == tuple(tokens[start + n:start + n + ps])):
                n += ps
            assert cache._common(key, tokens, start, limit) == n


def test_an_agents_next_turn_resumes_where_the_last_one_ended():
    """One running place (the users' line: 10 state slots) and a conversation long enough for
    twice as many prefill chunk checkpoints: the next turn resumes at the last computed token
    (the request's own state slot became its end's checkpoint), not at the last chunk whose
    checkpoint still found a slot; the kept checkpoints keep the first chunk's and spread out;
    every page and slot is owned once."""
    import random

    from benchmarks.scheduler_load import VOCAB, FakeEngine
    from moeferry.engine.config import EngineConfig
    from moeferry.scheduler.request import Request
    from moeferry.scheduler.sampling import SamplingParams
    from moeferry.scheduler.scheduler import Scheduler

    engine = FakeEngine(EngineConfig("(fake)", num_tokens=3000, max_running_requests=1, max_extend_tokens=64,
                                     max_seq_len=3000))
    sched = Scheduler(engine)
    rng = random.Random(0)
    conversation = [rng.randrange(VOCAB - 1) for _ in range(1400)]  # 22 chunks against 10 slots
    params = SamplingParams(temperature=0.0, max_tokens=20)
    first = Request("turn-1", conversation, params)
    sched.add(first)
    while sched.has_work:
        sched.step()
    saved = sorted(n.depth_end for n in engine.cache.prefix.nodes() if n.snapshot is not None)
    assert saved[0] == 64 and saved[-1] == 1400 + 19 and len(saved) <= engine.sizes.num_state_slots
    assert max(b - a for a, b in zip(saved, saved[1:])) <= 4 * 64  # spread, not the first 10 chunks
    turn = Request("turn-2", conversation + first.output_ids + [7, 8, 9], params)
    sched.add(turn)
    while sched.has_work:
        sched.step()
    assert turn.cached_tokens == 1400 + 19  # every computed token (the last output is never fed)
    engine.cache.check()


def test_own_checkpoints_give_way_one_for_one_only():
    """Short of slots with nothing cached to evict: a new checkpoint replaces one of the
    sequence's own (never its first) when one slot is all that is missing; when other running
    places need slots too, it is skipped and the sequence keeps the ones it has."""
    import torch

    from moeferry.cache.kv_pool import KVPool
    from moeferry.cache.manager import CacheManager
    from moeferry.cache.state_pool import StatePool

    cache = CacheManager(KVPool(1, 64, 1, 1, 1, torch.float32, "cpu"),
                         StatePool(1, 6, 1, 2, 1, 1, 1, torch.float32, "cpu"), needs_state=True, prefix_cache=True)
    blocks = cache.admit()
    for pos in (8, 16, 24, 32):  # 1 + 4 slots of 6 held: one free
        cache.checkpoint(blocks, pos, keep_free=0)
    assert [p for p, _ in blocks.snapshots] == [8, 16, 24, 32] and cache.states.slots.num_free == 1
    cache.checkpoint(blocks, 40, keep_free=1)  # one slot missing: 16 goes (the smallest gap, 8..24; not 8)
    assert [p for p, _ in blocks.snapshots] == [8, 24, 32, 40] and cache.states.slots.num_free == 1
    cache.checkpoint(blocks, 48, keep_free=2)  # two missing: skipped, nothing given up
    assert [p for p, _ in blocks.snapshots] == [8, 24, 32, 40] and cache.states.slots.num_free == 1
    cache.release(blocks, list(range(50)))  # its own slot becomes the checkpoint at 50
    cache.check()
    assert sorted(n.depth_end for n in cache.prefix.nodes() if n.snapshot is not None) == [8, 24, 32, 40, 50]
