"""An expert cache's LRU state kept on the device, so that a decode step with a partial cache
needs no host work: each MoE layer looks up its experts, evicts and updates the slot table in
one kernel (`moeferry.ops.triton.cache_resolve`), the gather kernel copies the misses from the
pinned host bank, and the whole step is one CUDA graph.

The host `ExpertCache` stays the owner for every other step (prefill chunks stream through
staging, eager steps, shrinking): the state moves between the two when the owner changes
(`push` before graph replays, `pull` before host work), a few milliseconds each.

State per slot: `owner` (key row * num_experts + expert, -1 free), `stamps` (the clock at its
last use; -1 free: taken first), `flags` (filled by a prefetch and not used since). The clock
ticks once per call, so the LRU order is kept at the granularity of a layer's step (experts
stamped in the same call tie; the lowest slot is evicted first, as `pull` orders them).
"""
from __future__ import annotations

import torch

from moeferry.ops.triton.cache_resolve import BIG


class DeviceLRU:
    def __init__(self, num_slots: int, counts: torch.Tensor):
        """`counts` [rows, 4] int64 on the device (hits, misses, prefetch hits, prefetched): the
        cache's device-side counters, which `resolve` adds to."""
        device = counts.device
        self.counts = counts
        # plain tensors even when made inside inference mode (a decode step's first capture): the
        # hand-over writes them in place outside it too (e.g. the warm-up's captures)
        with torch.inference_mode(False):
            self.owner = torch.full((num_slots,), -1, dtype=torch.int32, device=device)
            self.stamps = torch.full((num_slots,), -1, dtype=torch.int64, device=device)
            self.flags = torch.zeros(num_slots, dtype=torch.int8, device=device)
            self.clock = torch.zeros(1, dtype=torch.int64, device=device)

    def resolve(self, table: torch.Tensor, row: int, ids: torch.Tensor, prefetch: bool) -> torch.Tensor:
        """Look up `ids` of table row `row`, place the misses (table updated); returns the slot
        each id must be copied into ([n] int32, -1: nothing to copy). No host sync on CUDA."""
        if ids.is_cuda:
            from moeferry.ops.triton.cache_resolve import resolve
            return resolve(ids, table, self.owner, self.stamps, self.flags, self.clock, self.counts, row, prefetch)
        return resolve_reference(self, table, row, ids, prefetch)

    # -- moving the state between the host cache and the device ------------------------------
    def push(self, keys_lru_first: list[tuple[int, int]], prefetched: list[int]) -> None:
        """Load the host's state: (slot, key) pairs in LRU order (least recent first) and the
        slots filled by a prefetch not yet used."""
        n = self.owner.numel()
        owner = torch.full((n,), -1, dtype=torch.int32)
        stamps = torch.full((n,), -1, dtype=torch.int64)
        flags = torch.zeros(n, dtype=torch.int8)
        if keys_lru_first:
            slots = torch.tensor([s for s, _ in keys_lru_first])
            owner[slots] = torch.tensor([k for _, k in keys_lru_first], dtype=torch.int32)
            stamps[slots] = torch.arange(len(keys_lru_first), dtype=torch.int64)
        flags[prefetched] = 1
        for dev, host in ((self.owner, owner), (self.stamps, stamps), (self.flags, flags)):
            dev.copy_(host)
        self.clock.fill_(len(keys_lru_first))

    def pull(self) -> tuple[list[tuple[int, int]], list[int]]:
        """The device's state for the host: (slot, key) pairs in LRU order (least recent first,
        ties by slot) and the prefetched slots not used since (one sync)."""
        owner, stamps, flags = (t.cpu() for t in (self.owner, self.stamps, self.flags))
        used = (owner >= 0).nonzero().flatten().tolist()
        st, ow = stamps.tolist(), owner.tolist()
        used.sort(key=lambda s: (st[s], s))
        return [(s, ow[s]) for s in used], [s for s in used if flags[s]]


def resolve_reference(lru: DeviceLRU, table: torch.Tensor, row: int, ids: torch.Tensor, prefetch: bool) -> torch.Tensor:
    """The kernel's contract on the CPU, step by step (see `cache_resolve`)."""
    flat, experts = table.view(-1), table.shape[1]
    ids = ids.reshape(-1).tolist()
    clock = int(lru.clock) + 1
    lru.clock.fill_(clock)
    seen, hits, misses = set(), [], []
    for i, e in enumerate(ids):
        if e not in seen:
            seen.add(e)
            s = int(flat[row * experts + e])
            (hits if s >= 0 else misses).append((i, s))
    was = sum(int(lru.flags[s]) for _, s in hits)
    for _, s in hits:
        lru.stamps[s] = clock
        if not prefetch:
            lru.flags[s] = 0
    stamps, dst = lru.stamps.clone(), [-1] * len(ids)
    for i, _ in misses:
        dst[i] = int(torch.argmin(stamps))  # the first slot holding the smallest stamp
        stamps[dst[i]] = BIG
    for i, _ in misses:
        old = int(lru.owner[dst[i]])
        if old >= 0:
            flat[old] = -1
    for i, _ in misses:
        key, s = row * experts + ids[i], dst[i]
        flat[key], lru.owner[s], lru.stamps[s], lru.flags[s] = s, key, clock, int(prefetch)
    c = lru.counts[row]
    if prefetch:
        c[3] += len(misses)
    else:
        c[0] += len(hits)
        c[1] += len(misses)
        c[2] += was
    return torch.tensor(dst, dtype=torch.int32)
