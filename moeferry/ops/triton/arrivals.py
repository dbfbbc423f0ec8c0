"""The last of a group of programs to arrive: how a kernel sums its own partial results
without another launch (split-K GEMMs, the MoE decode's split gate_up and down chunks).

Each program stores its partial result, then counts its arrival on a word of zeroed device
memory; the program that finds the count one short of the group is the last, sets the word
back to 0 (so the next call, or graph replay, finds it zeroed) and reads every partial result,
in a fixed order: the sums are deterministic.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def last_arrival(count_ptr, arrivals):
    """Whether this program is the last of `arrivals` to arrive at the word `count_ptr`. Every
    thread's stores before the call are visible to the last program's loads after it (load
    them with `cache_modifier=".cg"`: from L2, not from a stale L1 line)."""
    tl.debug_barrier()  # every thread's stores before the program's arrival
    last = tl.atomic_add(count_ptr, 1, sem="acq_rel") == arrivals - 1
    if last:
        tl.atomic_xchg(count_ptr, 0, sem="relaxed")
    return last
