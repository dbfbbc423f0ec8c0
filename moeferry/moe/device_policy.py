"""An expert cache's eviction state kept on the device, so that a decode step with a partial
cache needs no host work: each MoE layer looks up its experts, evicts and updates the slot table
in one kernel (`moeferry.ops.triton.cache_resolve`), the gather kernel copies the misses from
the pinned host bank, and the whole step is one CUDA graph.

The host `ExpertCache` stays the owner for every other step (prefill chunks stream through
staging, eager steps, shrinking): the state moves between the two when the owner changes
(`push` before graph replays, `pull` before host work), a few milliseconds each.

State per slot: `owner` (key row * num_experts + expert, -1 free), `stamps` (the clock at its
last use; -1 free), `flags` (filled by a prefetch and not used since), and for LFU `prio` and
`uses` (-1 and 0 free); `state` holds the clock and LFU's age. The clock ticks once per call, so
recency is kept at the granularity of a layer's step (experts stamped in the same call tie; the
lowest slot goes first, as `pull` orders them). The policies are the host's (`expert_cache`),
the kernel's contract says how each picks victims.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Entry(NamedTuple):
    """One cached expert as the policies hand it over (least recently used first)."""
    slot: int
    key: int     # table row * num_experts + expert
    prio: int    # LFU's priority (LRU: 0)
    uses: int    # LFU's uses (LRU: 0)


class DevicePolicy:
    def __init__(self, num_slots: int, counts: torch.Tensor, lfu: bool):
        """`counts` [rows, 5] int64 on the device (`expert_cache.DEVICE_COUNTS`): the cache's
        device-side counters, which `resolve` adds to; `lfu`: LFU with dynamic aging,
        else LRU."""
        device = counts.device
        self.counts, self.lfu = counts, lfu
        # plain tensors even when made inside inference mode (a decode step's first capture): the
        # hand-over writes them in place outside it too (e.g. the warm-up's captures)
        with torch.inference_mode(False):
            self.owner = torch.full((num_slots,), -1, dtype=torch.int32, device=device)
            self.stamps = torch.full((num_slots,), -1, dtype=torch.int64, device=device)
            self.flags = torch.zeros(num_slots, dtype=torch.int8, device=device)
            self.prio = torch.full((num_slots,), -1, dtype=torch.int64, device=device)
            self.uses = torch.zeros(num_slots, dtype=torch.int32, device=device)
            self.state = torch.zeros(2, dtype=torch.int64, device=device)  # clock, age

    def resolve(self, table: torch.Tensor, row: int, ids: torch.Tensor, prefetch: bool,
                budget: int | None = None) -> torch.Tensor:
        """Look up `ids` of table row `row`, place the misses (table updated; a prefetch at most
        `budget` of them, the first in `ids`' order); returns the slot each id must be copied into
        ([n] int32, -1: nothing to copy). No host sync on CUDA."""
        if ids.is_cuda:
            from moeferry.ops.triton.cache_resolve import resolve
            return resolve(ids, table, self, row, prefetch, budget)
        return resolve_reference(self, table, row, ids, prefetch, budget)

    # -- moving the state between the host cache and the device ------------------------------
    def push(self, entries: list[Entry], prefetched: list[int], age: int) -> None:
        """Load the host's state: its entries least recently used first, the slots filled by a
        prefetch not yet used, and LFU's age."""
        n = self.owner.numel()
        host = {"owner": torch.full((n,), -1, dtype=torch.int32), "stamps": torch.full((n,), -1, dtype=torch.int64),
                "flags": torch.zeros(n, dtype=torch.int8), "prio": torch.full((n,), -1, dtype=torch.int64),
                "uses": torch.zeros(n, dtype=torch.int32)}
        if entries:
            slots = torch.tensor([e.slot for e in entries])
            host["owner"][slots] = torch.tensor([e.key for e in entries], dtype=torch.int32)
            host["stamps"][slots] = torch.arange(len(entries), dtype=torch.int64)
            host["prio"][slots] = torch.tensor([e.prio for e in entries], dtype=torch.int64)
            host["uses"][slots] = torch.tensor([e.uses for e in entries], dtype=torch.int32)
        host["flags"][prefetched] = 1
        for name, t in host.items():
            getattr(self, name).copy_(t)
        self.state.copy_(torch.tensor([len(entries), age]))

    def pull(self) -> tuple[list[Entry], list[int], int]:
        """The device's state for the host: its entries least recently used first (ties by
        slot), the prefetched slots not used since, and the age (one sync)."""
        owner, stamps, flags, prio, uses, state = (t.cpu() for t in (self.owner, self.stamps, self.flags, self.prio,
                                                                      self.uses, self.state))
        used = (owner >= 0).nonzero().flatten().tolist()
        st, ow, pr, us = stamps.tolist(), owner.tolist(), prio.tolist(), uses.tolist()
        used.sort(key=lambda s: (st[s], s))
        lfu = self.lfu
        entries = [Entry(s, ow[s], pr[s] if lfu else 0, us[s] if lfu else 0) for s in used]
        return entries, [s for s in used if flags[s]], int(state[1])


def resolve_reference(dev: DevicePolicy, table: torch.Tensor, row: int, ids: torch.Tensor,
                      prefetch: bool, budget: int | None = None) -> torch.Tensor:
    """The kernel's contract on the CPU, step by step (see `cache_resolve`)."""
    flat, experts = table.view(-1), table.shape[1]
    ids = ids.reshape(-1).tolist()
    clock, age = int(dev.state[0]) + 1, int(dev.state[1])
    dev.state[0] = clock
    seen, hits, misses = set(), [], []
    for i, e in enumerate(ids):
        if e >= 0 and e not in seen:
            seen.add(e)
            s = int(flat[row * experts + e])
            (hits if s >= 0 else misses).append((i, s))
    if prefetch and budget is not None:
        misses = misses[:budget]
    was = sum(int(dev.flags[s]) for _, s in hits)
    for _, s in hits:
        dev.stamps[s] = clock
        if not prefetch:
            dev.flags[s] = 0
            if dev.lfu:
                dev.uses[s] += 1
                dev.prio[s] = age + int(dev.uses[s])
    dst = [-1] * len(ids)
    victims = _victims(dev, len(misses), clock)
    for (i, _), s in zip(misses, victims):
        dst[i] = s
        old = int(dev.owner[s])
        if old >= 0:
            flat[old] = -1
        if dev.lfu and int(dev.prio[s]) >= 0:
            age = max(age, int(dev.prio[s]))
    for i, _ in misses:
        key, s = row * experts + ids[i], dst[i]
        flat[key], dev.owner[s], dev.stamps[s], dev.flags[s] = s, key, clock, int(prefetch)
        if dev.lfu:
            dev.uses[s] = 0 if prefetch else 1
            dev.prio[s] = age + int(dev.uses[s])
    if dev.lfu:
        dev.state[1] = age
    c = dev.counts[row]
    if prefetch:
        c[3] += len(misses)
    else:
        c[0] += len(hits)
        c[1] += len(misses)
        c[2] += was
    return torch.tensor(dst, dtype=torch.int32)


def _victims(dev: DevicePolicy, n: int, clock: int) -> list[int]:
    """The slots `n` misses take, in order: LRU the smallest (stamp, slot); LFU the smallest
    (priority, stamp, slot) among slots stamped before the previous call."""
    slots = range(dev.owner.numel())
    st = dev.stamps.tolist()
    if dev.lfu:
        pr = dev.prio.tolist()
        ranked = sorted((s for s in slots if st[s] < clock - 1), key=lambda s: (pr[s], st[s], s))
    else:
        ranked = sorted(slots, key=lambda s: (st[s], s))
    return ranked[:n]
