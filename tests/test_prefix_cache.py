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
