"""An expert cache's lookup, eviction and table update for one layer's step, on the device, in
one single-program kernel: a decode step's cache work without the host (so that the whole step
can live in one CUDA graph).

Contract (`moeferry.moe.device_policy.resolve_reference` is the CPU reference, tested equal):
the step's expert ids `ids` [n] of table row `row` (-1: a pair to leave alone, e.g. on hybrid's CPU
lane: never looked up, counted or copied); every distinct id is looked up in the flat
table (`row * num_experts + id` -> slot, -1 absent). The clock `state[0]` ticks once per call;
hits get it as their stamp. Misses (distinct ids without a slot) take victims one at a time; a
victim's old owner leaves the table, the miss enters it, the slot gets the clock and the miss's
key. `dst[i]` is the slot the i-th id must be copied into, -1 where nothing moves. Counters of
the row: hits, misses, prefetch hits (hits on slots a prefetch filled and no step had used
since), prefetched. A `prefetch` call (the next layer's predicted experts) counts only what it
placed and marks those slots as prefetched; it places at most `budget` misses, the first ones
in `ids`' order (the guess ranked best first), and leaves the others out of the table.

Victims by policy:
    LRU  the smallest stamp (free slots hold -1, so they go first; ties: the lowest slot). The
         caller guarantees that slots stamped this call or the one before never have to be
         victims (the cache holds two steps' experts): they carry the newest stamps.
    LFU  with dynamic aging: the smallest priority (ties: the smallest stamp, then the lowest
         slot) among slots stamped before the previous call (this call's and the previous
         one's slots may still be read or copied: never victims; the caller guarantees enough
         others). A step's hit adds a use and sets priority = age + uses; the age `state[1]`
         rises to the largest priority evicted (free slots hold priority -1 and leave it), and
         a miss enters with age + 1 (a prefetch's with 0 uses, at the age: a wrong guess is the
         next victim). A prefetch call's hits are only stamped (a guess is not a use).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BIG = 2**62  # above every stamp and priority: a slot already chosen this call, or not a candidate
SLOT_BITS = 20  # slots a cache may have: 2**20 (the victim search packs a stamp and a slot)
_BIG, _SLOT_BITS, _SLOTS = tl.constexpr(BIG), tl.constexpr(SLOT_BITS), tl.constexpr(1 << SLOT_BITS)


@triton.jit(do_not_specialize=["n"])
def _resolve_kernel(ids_ptr, n, table_ptr, owner_ptr, stamp_ptr, flag_ptr, prio_ptr, uses_ptr, state_ptr, dst_ptr,
                    count_ptr, key_base, num_slots, budget, PREFETCH: tl.constexpr, LFU: tl.constexpr, N: tl.constexpr,
                    S: tl.constexpr):
    offs = tl.arange(0, N)
    valid = offs < n
    ids = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int64)
    earlier = (ids[:, None] == ids[None, :]) & (offs[None, :] < offs[:, None]) & valid[None, :]
    first = valid & (ids >= 0) & (tl.max(earlier.to(tl.int32), axis=1) == 0)
    keys = key_base + ids
    slot = tl.load(table_ptr + keys, mask=first, other=-1).to(tl.int64)
    hit = first & (slot >= 0)
    miss = first & (slot < 0)
    if PREFETCH:  # the first `budget` misses in ids' order are placed, the others left out
        miss = miss & (tl.cumsum(miss.to(tl.int32), axis=0) <= budget)
    clock = tl.load(state_ptr) + 1
    tl.store(state_ptr, clock)
    age = tl.load(state_ptr + 1)
    hit_slot = tl.where(hit, slot, 0)
    was = tl.load(flag_ptr + hit_slot, mask=hit, other=0)  # prefetched, not used since
    if PREFETCH:
        mark = tl.full([N], 1, tl.int8)
    else:
        mark = tl.full([N], 0, tl.int8)
        tl.store(flag_ptr + hit_slot, mark, mask=hit)
        if LFU:
            uses = tl.load(uses_ptr + hit_slot, mask=hit, other=0) + 1
            tl.store(uses_ptr + hit_slot, uses, mask=hit)
            tl.store(prio_ptr + hit_slot, age + uses.to(tl.int64), mask=hit)
    tl.store(stamp_ptr + hit_slot, tl.zeros_like(hit_slot) + clock, mask=hit)
    misses = miss.to(tl.int32)
    num_misses = tl.sum(misses, axis=0)
    dst = tl.full([N], -1, tl.int64)
    if num_misses > 0:  # (a call that only hits reads no slot's stamp or priority)
        tl.debug_barrier()  # the stamps above, seen by every thread of the program below
        s_offs = tl.arange(0, S)
        in_cache = s_offs < num_slots
        stamps = tl.load(stamp_ptr + s_offs, mask=in_cache, other=_BIG >> _SLOT_BITS)
        # (stamp, slot) packed in one integer: one reduction finds the oldest stamp's lowest slot
        order = stamps * _SLOTS + s_offs
        if LFU:
            prio = tl.load(prio_ptr + s_offs, mask=in_cache, other=_BIG)
            prio = tl.where(stamps < clock - 1, prio, _BIG)  # this call's and the previous one's: kept
        rank = tl.cumsum(misses, axis=0) - 1
        for i in range(0, num_misses):  # the i-th miss takes the next victim
            if LFU:
                least = tl.min(prio, axis=0)
                victim = tl.min(tl.where(prio == least, order, _BIG), axis=0) & (_SLOTS - 1)
                age = tl.maximum(age, tl.where(least < _BIG, least, age))
                prio = tl.where(s_offs == victim, _BIG, prio)
            else:
                victim = tl.min(order, axis=0) & (_SLOTS - 1)
            dst = tl.where(miss & (rank == i), victim, dst)
            order = tl.where(s_offs == victim, _BIG, order)
    dst_slot = tl.where(miss, dst, 0)
    old = tl.load(owner_ptr + dst_slot, mask=miss, other=-1).to(tl.int64)
    tl.store(table_ptr + tl.where(old >= 0, old, 0), tl.full([N], -1, tl.int32), mask=miss & (old >= 0))
    tl.store(table_ptr + keys, dst.to(tl.int32), mask=miss)
    tl.store(owner_ptr + dst_slot, keys.to(tl.int32), mask=miss)
    tl.store(stamp_ptr + dst_slot, tl.zeros_like(dst_slot) + clock, mask=miss)
    tl.store(flag_ptr + dst_slot, mark, mask=miss)
    if LFU:
        first_uses = 1 - mark.to(tl.int32)  # a step's miss is a use, a prefetch's is not
        tl.store(uses_ptr + dst_slot, first_uses, mask=miss)
        tl.store(prio_ptr + dst_slot, age + first_uses.to(tl.int64), mask=miss)
        tl.store(state_ptr + 1, age)
    tl.store(dst_ptr + offs, dst.to(tl.int32), mask=valid)
    if PREFETCH:
        tl.store(count_ptr + 3, tl.load(count_ptr + 3) + tl.sum(misses, axis=0).to(tl.int64))
    else:
        tl.store(count_ptr, tl.load(count_ptr) + tl.sum(hit.to(tl.int64), axis=0))
        tl.store(count_ptr + 1, tl.load(count_ptr + 1) + tl.sum(misses, axis=0).to(tl.int64))
        tl.store(count_ptr + 2, tl.load(count_ptr + 2) + tl.sum(tl.where(hit, was, 0).to(tl.int64), axis=0))


def resolve(ids: torch.Tensor, table: torch.Tensor, s, row: int, prefetch: bool, budget: int | None = None) -> torch.Tensor:
    """Launch the kernel for `ids` (any integer dtype) of table row `row` over the device state
    `s` (`moeferry.moe.device_policy.DevicePolicy`: owner [slots] int32, key row*experts+id, -1
    free; stamps [slots] int64; flags [slots] int8; prio [slots] int64; uses [slots] int32;
    state [2] int64, clock and age; counts [rows, 5] int64); `table` [rows, experts] int32.
    `budget`: a prefetch's most misses placed (None: all). Returns dst [n] int32."""
    flat = ids.reshape(-1)
    n, slots = flat.numel(), s.owner.numel()
    if slots > 1 << SLOT_BITS:
        raise ValueError(f"a device-managed expert cache holds at most {1 << SLOT_BITS} slots, not {slots}")
    dst = torch.empty(n, dtype=torch.int32, device=ids.device)
    size = triton.next_power_of_2(slots)
    _resolve_kernel[(1,)](flat, n, table, s.owner, s.stamps, s.flags, s.prio, s.uses, s.state, dst, s.counts[row],
                          row * table.shape[1], slots, n if budget is None else budget, PREFETCH=prefetch, LFU=s.lfu,
                          N=max(16, triton.next_power_of_2(n)), S=size, num_warps=16 if size >= 8192 else 8)
    return dst
