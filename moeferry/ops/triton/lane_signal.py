"""The device's two ends of the CPU lane of hybrid decode graphs (`moeferry.moe.cpu_lane`), each
a kernel a CUDA graph can hold.

    split    (one program) looks the step's experts up in the layer's table row and splits the
             misses: the first `fetch_of[m]` of a layer's m misses (most tokens first, then the
             earliest) stay for the fetch, the others go to the CPU lane. It writes the ids the
             cache must resolve (-1 for a pair on the lane) and, when the lane has experts, the
             box (x in fp32, the lane's pairs' ids, -1 elsewhere, the routing weights) and, after
             a system-wide fence, the box's posted words [sequence, rows]: the host thread sees
             the box before the word. The sequence (one more per post) and the lane's expert
             count stay on the device for `collect`; the count is also added to the cache's
             counters.
    collect  spins on the box's served word until it holds the sequence posted, then adds the
             lane's output (fp32 in the box, rounded to the output's dtype as the eager path
             does) into the layer's output. Nothing posted this step: it does nothing. After
             `LIMIT` polls without the word (the host thread gone: seconds) it gives up and sets
             the fault word for the host to report, so that the device never hangs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeferry.ops.triton import interpreting, next_pow2

LIMIT = 1 << 22  # polls of the served word (host memory, a PCIe round trip each: seconds) before a wait gives up
BLOCK = 1024


@triton.jit
def _fence(x):
    return tl.inline_asm_elementwise("fence.sc.sys; mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False,
                                     pack=1)


@triton.jit(do_not_specialize=["n", "rows"])
def _split_kernel(ids_ptr, w_ptr, x_ptr, x_stride, table_ptr, fetch_of_ptr, fetch_ptr, box_ids_ptr, box_w_ptr,
                  box_x_ptr, posted_ptr, seq_ptr, lane_ptr, tally_ptr, n, rows, hidden, N: tl.constexpr,
                  BLOCK: tl.constexpr, FENCE: tl.constexpr):
    offs = tl.arange(0, N)
    valid = offs < n
    ids = tl.load(ids_ptr + offs, mask=valid, other=-1).to(tl.int32)
    same = (ids[:, None] == ids[None, :]) & valid[:, None] & valid[None, :]
    earlier = offs[None, :] < offs[:, None]
    first = valid & (tl.max((same & earlier).to(tl.int32), axis=1) == 0)
    tokens = tl.sum(same.to(tl.int32), axis=1)
    slot = tl.load(table_ptr + ids, mask=first, other=0)
    miss = first & (slot < 0)
    fetched = tl.load(fetch_of_ptr + tl.sum(miss.to(tl.int32), axis=0))
    # a miss's rank among the misses: those with more tokens first, then the earlier
    ahead = miss[None, :] & ((tokens[None, :] > tokens[:, None]) | ((tokens[None, :] == tokens[:, None]) & earlier))
    on_lane_first = miss & (tl.sum(ahead.to(tl.int32), axis=1) >= fetched)
    on_lane = tl.max((same & on_lane_first[None, :]).to(tl.int32), axis=1) > 0
    tl.store(fetch_ptr + offs, tl.where(on_lane, -1, ids), mask=valid)
    lane = tl.sum(on_lane_first.to(tl.int32), axis=0)
    tl.store(lane_ptr, lane)
    if lane > 0:
        seq = tl.load(seq_ptr) + 1
        tl.store(seq_ptr, seq)
        tl.store(tally_ptr, tl.load(tally_ptr) + lane.to(tl.int64))
        tl.store(box_ids_ptr + offs, tl.where(on_lane, ids, -1).to(tl.int64), mask=valid)
        tl.store(box_w_ptr + offs, tl.load(w_ptr + offs, mask=valid, other=0).to(tl.float32), mask=valid)
        total = rows * hidden
        for start in range(0, total, BLOCK):
            i = start + tl.arange(0, BLOCK)
            inside = i < total
            v = tl.load(x_ptr + (i // hidden) * x_stride + i % hidden, mask=inside, other=0).to(tl.float32)
            tl.store(box_x_ptr + i, v, mask=inside)
        word = tl.zeros([N], tl.int32) + rows
        tl.store(posted_ptr + 1 + offs * 0, word, mask=offs == 0)
        word = word * 0 + seq
        if FENCE:
            word = _fence(word)
        tl.debug_barrier()
        tl.store(posted_ptr + offs * 0, word, mask=offs == 0)


@triton.jit(do_not_specialize=["rows"])
def _collect_kernel(out_ptr, out_stride, box_out_ptr, served_ptr, seq_ptr, lane_ptr, fault_ptr, rows, hidden,
                    LIMIT: tl.constexpr, BLOCK: tl.constexpr, FENCE: tl.constexpr):
    if tl.load(lane_ptr) > 0:
        seq = tl.load(seq_ptr)
        seen = tl.load(served_ptr, volatile=True)
        polls = 0
        while (seen != seq) & (polls < LIMIT):
            seen = tl.load(served_ptr, volatile=True)
            polls += 1
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        if FENCE:
            i = _fence(i)  # the loads below (the failed word, the output) come after the served word's
        failed = tl.max(tl.load(served_ptr + 1 + i * 0, volatile=True), axis=0)
        if (seen != seq) | (failed != 0):
            tl.store(fault_ptr, 1)
        else:
            inside = i < rows * hidden
            lane = tl.load(box_out_ptr + i, mask=inside, other=0, volatile=True)
            at = out_ptr + (i // hidden) * out_stride + i % hidden
            out = tl.load(at, mask=inside, other=0)
            dtype = out_ptr.dtype.element_ty
            tl.store(at, (out.to(tl.float32) + lane.to(dtype).to(tl.float32)).to(dtype), mask=inside)


def split(ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor, table_row: torch.Tensor, fetch_of: torch.Tensor,
          box, tally: torch.Tensor) -> torch.Tensor:
    """The split kernel for one layer's step (`box`: the lane's `Box` of that layer; `tally`: the
    cache's counter the lane's experts are added to); returns the ids to resolve ([n] int32,
    -1: on the lane)."""
    n = ids.numel()
    fetch = torch.empty(n, dtype=torch.int32, device=ids.device)
    _split_kernel[(1,)](ids.reshape(-1), weights.reshape(-1), x, x.stride(0), table_row, fetch_of, fetch, box.ids,
                        box.weights, box.x, box.posted, box.seq, box.lane, tally, n, x.shape[0], x.shape[1],
                        N=next_pow2(max(n, 16)), BLOCK=BLOCK, FENCE=not interpreting())
    return fetch


def collect(out: torch.Tensor, box, limit: int = LIMIT) -> None:
    """The collect kernel: `out` [rows, hidden] += the lane's output of `box`, once served."""
    rows, hidden = out.shape
    grid = (triton.cdiv(rows * hidden, BLOCK),)
    _collect_kernel[grid](out, out.stride(0), box.out, box.served, box.seq, box.lane, box.fault, rows, hidden,
                          LIMIT=limit, BLOCK=BLOCK, FENCE=not interpreting())
