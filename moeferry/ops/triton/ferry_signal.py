"""The device's two ends of the ferry (`moeferry.moe.ferry`), each a one-program kernel a CUDA
graph can hold.

    post  writes a step's (source slot, destination slot) pairs and their count into a box of
          the mailbox (pinned host memory, addressed from the device), then, after a system-wide
          fence, the box's ready word: the host thread sees the pairs before the word.
    wait  spins on the box's done word (device memory, written by the copy engine after the
          box's copies) and clears it; after `LIMIT` polls without it (the host thread gone:
          seconds) it gives up and raises the box's error word in the mailbox for the host to
          report, so that the device never hangs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeferry.ops.triton import interpreting

HEADER = 4      # a box's words before its pairs: ready, n, error, unused
LIMIT = 1 << 24  # polls of the done word before a wait gives up (~5-10 s on an H100)
_HEADER = tl.constexpr(HEADER)


@triton.jit
def _fence(x):
    return tl.inline_asm_elementwise("fence.sc.sys; mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False,
                                     pack=1)


@triton.jit(do_not_specialize=["n"])
def _post_kernel(box_ptr, src_ptr, dst_ptr, n, N: tl.constexpr, FENCE: tl.constexpr):
    offs = tl.arange(0, N)
    valid = offs < n
    src = tl.load(src_ptr + offs, mask=valid, other=0).to(tl.int32)
    dst = tl.load(dst_ptr + offs, mask=valid, other=-1).to(tl.int32)
    tl.store(box_ptr + _HEADER + 2 * offs, src, mask=valid)
    tl.store(box_ptr + _HEADER + 2 * offs + 1, dst, mask=valid)
    count = tl.full([N], 0, tl.int32) + n
    tl.store(box_ptr + 1 + offs * 0, count, mask=offs == 0)
    if FENCE:
        count = _fence(count)
    tl.debug_barrier()
    tl.store(box_ptr + offs * 0, count * 0 + 1, mask=offs == 0)


@triton.jit
def _wait_kernel(done_ptr, error_ptr, LIMIT: tl.constexpr):
    seen = tl.load(done_ptr, volatile=True)
    polls = 0
    while (seen == 0) & (polls < LIMIT):
        seen = tl.load(done_ptr, volatile=True)
        polls += 1
    tl.store(done_ptr, 0)
    if seen == 0:
        tl.store(error_ptr, 1)


def post(box: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Post `src` / `dst` ([n] each, n at most the box's pairs) into `box` (a mailbox row: a
    pinned host tensor of int32 words) on the current stream."""
    n = src.numel()
    _post_kernel[(1,)](box, src.reshape(-1), dst.reshape(-1), n, N=triton.next_power_of_2(max(n, 16)),
                       FENCE=not interpreting())


def wait(done: torch.Tensor, error: torch.Tensor, limit: int = LIMIT) -> None:
    """The current stream waits until `done` (a one-word device tensor) is set, and clears it;
    `error` (a one-word pinned host tensor) is set if the wait gave up."""
    _wait_kernel[(1,)](done, error, LIMIT=limit)
