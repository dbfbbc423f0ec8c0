"""An expert cache's lookup, LRU eviction and table update for one layer's step, on the device,
in one single-program kernel: a decode step's cache work without the host (so that the whole
step can live in one CUDA graph).

Contract (`moeferry.moe.device_lru.resolve_reference` is the CPU reference, tested equal):
the step's expert ids `ids` [n] of table row `row`; every distinct id is looked up in the flat
table (`row * num_experts + id` -> slot, -1 absent). Hits get the new clock as their stamp.
Misses (distinct ids without a slot) take the slots with the smallest stamps (free slots hold
-1, so they go first; ties: the lowest slot), one at a time; a victim's old owner leaves the
table, the miss enters it, the slot gets the clock and the miss's key. `dst[i]` is the slot
the i-th id must be copied into, -1 where nothing moves. Counters of the row: hits, misses,
prefetch hits (hits on slots a prefetch filled and no step had used since), prefetched.
A `prefetch` call (the next layer's predicted experts) counts only what it placed and marks
those slots as prefetched.

The caller guarantees that the slots stamped this step never have to be victims (the cache
holds at least two steps' worth of experts): they are stamped before the victims are chosen.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BIG = 2**62  # above every stamp: a slot already chosen this step
SLOT_BITS = 20  # slots a cache may have: 2**20 (the victim search packs a stamp and a slot)
_BIG, _SLOT_BITS, _SLOTS = tl.constexpr(BIG), tl.constexpr(SLOT_BITS), tl.constexpr(1 << SLOT_BITS)


@triton.jit(do_not_specialize=["n"])
def _resolve_kernel(ids_ptr, n, table_ptr, owner_ptr, stamp_ptr, flag_ptr, clock_ptr, dst_ptr, count_ptr,
                    key_base, num_slots, PREFETCH: tl.constexpr, N: tl.constexpr, S: tl.constexpr):
    offs = tl.arange(0, N)
    valid = offs < n
    ids = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int64)
    earlier = (ids[:, None] == ids[None, :]) & (offs[None, :] < offs[:, None]) & valid[None, :]
    first = valid & (tl.max(earlier.to(tl.int32), axis=1) == 0)
    keys = key_base + ids
    slot = tl.load(table_ptr + keys, mask=first, other=-1).to(tl.int64)
    hit = first & (slot >= 0)
    miss = first & (slot < 0)
    clock = tl.load(clock_ptr) + 1
    tl.store(clock_ptr, clock)
    hit_slot = tl.where(hit, slot, 0)
    was = tl.load(flag_ptr + hit_slot, mask=hit, other=0)  # prefetched, not used since
    if PREFETCH:
        mark = tl.full([N], 1, tl.int8)
    else:
        mark = tl.full([N], 0, tl.int8)
        tl.store(flag_ptr + hit_slot, mark, mask=hit)
    tl.store(stamp_ptr + hit_slot, tl.zeros_like(hit_slot) + clock, mask=hit)
    tl.debug_barrier()  # the stamps above, seen by every thread of the program below
    s_offs = tl.arange(0, S)
    # (stamp, slot) packed in one integer: one reduction finds the oldest stamp's lowest slot
    order = tl.load(stamp_ptr + s_offs, mask=s_offs < num_slots, other=_BIG >> _SLOT_BITS) * _SLOTS + s_offs
    misses = miss.to(tl.int32)
    rank = tl.cumsum(misses, axis=0) - 1
    dst = tl.full([N], -1, tl.int64)
    for i in range(0, tl.sum(misses, axis=0)):  # the i-th miss takes the oldest slot left
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
    tl.store(dst_ptr + offs, dst.to(tl.int32), mask=valid)
    if PREFETCH:
        tl.store(count_ptr + 3, tl.load(count_ptr + 3) + tl.sum(misses, axis=0).to(tl.int64))
    else:
        tl.store(count_ptr, tl.load(count_ptr) + tl.sum(hit.to(tl.int64), axis=0))
        tl.store(count_ptr + 1, tl.load(count_ptr + 1) + tl.sum(misses, axis=0).to(tl.int64))
        tl.store(count_ptr + 2, tl.load(count_ptr + 2) + tl.sum(tl.where(hit, was, 0).to(tl.int64), axis=0))


def resolve(ids: torch.Tensor, table: torch.Tensor, owner: torch.Tensor, stamps: torch.Tensor,
            flags: torch.Tensor, clock: torch.Tensor, counts: torch.Tensor, row: int, prefetch: bool) -> torch.Tensor:
    """Launch the kernel for `ids` (any integer dtype) of table row `row`; returns dst [n] int32.
    `table` [rows, experts] int32, `owner` [slots] int32 (key row*experts+id, -1 free), `stamps`
    [slots] int64, `flags` [slots] int8, `clock` [1] int64, `counts` [rows, 4] int64."""
    flat = ids.reshape(-1)
    n, slots = flat.numel(), owner.numel()
    if slots > 1 << SLOT_BITS:
        raise ValueError(f"a device-managed expert cache holds at most {1 << SLOT_BITS} slots, not {slots}")
    dst = torch.empty(n, dtype=torch.int32, device=ids.device)
    s = triton.next_power_of_2(slots)
    _resolve_kernel[(1,)](flat, n, table, owner, stamps, flags, clock, dst, counts[row], row * table.shape[1], slots,
                          PREFETCH=prefetch, N=max(16, triton.next_power_of_2(n)), S=s,
                          num_warps=16 if s >= 8192 else 8)
    return dst
