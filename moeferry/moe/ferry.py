"""Misses of device-managed decode steps moved by the copy engine instead of the gather kernel.

A decode step in a CUDA graph knows its misses only on the device, so the gather kernel moves
them: its SMs read the pinned bank across PCIe. On some hosts that reaches about half the link's
DMA rate (an H100 VM: 29 GB/s against 47-52 by the copy engine, huge pages or not,
`benchmarks/host_pages.py`). The ferry keeps the step on the device and the copies on the
copy engine: the step posts its (expert, slot) pairs into a mailbox in pinned host memory
(`ferry_signal.post`), a host thread in C (`ferry.c`) sees them, queues one copy per slot tensor
per miss on the box's stream and then sets the box's done word on the device, which the step's
MoE waits for (`ferry_signal.wait`). Nothing in the step waits for the host's Python.

Boxes: each layer with a cache has two, its own misses and the prefetch of its experts by the
layer before. A box's experts are dealt over `LANES` streams (a copy engine runs a stream's
copies one after another, each paying the link's read latency; lanes overlap it), own misses
and prefetches on separate ones (a prefetch never queues ahead of a layer's own misses). On the CPU (tests) the device is the CPU: copies are memcpy, the post and
the wait are done by the host, and the thread runs the same protocol.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import time
import weakref
from pathlib import Path

import torch

from moeferry.moe.slots import SlotBuffer
from moeferry.native import library
from moeferry.ops.triton.ferry_signal import HEADER

log = logging.getLogger("moeferry.moe")

SOURCE = Path(__file__).with_name("ferry.c")
FLAG_SETS = (["-O2", "-pthread"], ["-O2"])
IDLE_S = 0.002    # the thread spins this long after its last box, then naps 50 us between scans
LANES = 3         # streams a box's experts are dealt over (the copy engines overlap their link latency)
WAIT_S = 10.0     # the CPU's wait gives up after this (the device's: `ferry_signal.LIMIT` polls)


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = library(SOURCE, FLAG_SETS, ["-pthread"], lambda path, flags: ctypes.CDLL(str(path)))
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.ferry_new.restype = p
    lib.ferry_new.argtypes = [p, i, i, p, p, p, i64]
    lib.ferry_plan.argtypes = [p, i, i, p, i, i, i, p, ctypes.c_uint64]
    lib.ferry_start.argtypes = [p]
    lib.ferry_stop.argtypes = [p]
    lib.ferry_free.argtypes = [p]
    lib.ferry_counts.argtypes = [p, p]
    return lib


DRIVER = ("cuMemcpyHtoDAsync_v2", "cuCtxSetCurrent", "cuEventCreate", "cuEventRecord", "cuStreamWaitEvent",
          "cuEventDestroy_v2")  # the thread's calls, in ferry.c's Driver order
HOST = ("ferry_host_copy", "ferry_no_ctx", "ferry_no_event_create", "ferry_no_event_record", "ferry_no_stream_wait",
        "ferry_no_event_destroy")  # the same on the CPU: memcpy and no-ops


def _driver(device: torch.device) -> tuple[list[int], int]:
    """The CUDA driver's calls for the thread and the device's current (primary) context."""
    cuda = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    with torch.cuda.device(device):
        torch.cuda.synchronize()  # the context is current on this thread
        if cuda.cuCtxGetCurrent(ctypes.byref(ctx)) != 0 or not ctx.value:
            raise OSError("no current CUDA context for the ferry's thread")
    return [_address(getattr(cuda, name)) for name in DRIVER], ctx.value


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


class Ferry:
    """`boxes` mailbox boxes of `max_pairs` pairs, their copies on `lanes` streams for own
    misses and as many for prefetches; the thread runs from construction to `close`."""

    def __init__(self, device: torch.device, boxes: int, max_pairs: int, lanes: int = LANES):
        self.device, self.max_pairs = device, max_pairs
        cuda = device.type == "cuda"
        lib = _lib()
        self.mailbox = torch.zeros(boxes, HEADER + 2 * max_pairs, dtype=torch.int32, pin_memory=cuda)
        self.one = torch.ones(1, dtype=torch.int32, pin_memory=cuda)
        self.done = torch.zeros(boxes, dtype=torch.int32, device=device)
        self.lanes = [[torch.cuda.Stream(device) if cuda else None for _ in range(lanes)] for _ in range(2)]
        calls, ctx = _driver(device) if cuda else ([_address(getattr(lib, name)) for name in HOST], None)
        self.handle = lib.ferry_new(self.mailbox.data_ptr(), boxes, max_pairs, self.one.data_ptr(),
                                    (ctypes.c_void_p * len(calls))(*calls), ctx, int(IDLE_S * 1e9))
        if not self.handle:
            raise MemoryError("the ferry's thread state could not be allocated")
        self.close = weakref.finalize(self, lib.ferry_free, self.handle)  # stops the thread, once
        self._start()

    def _start(self) -> None:
        if _lib().ferry_start(self.handle) != 0:
            raise OSError("the ferry's thread could not be started")

    def plan(self, box: int, bank: SlotBuffer, cache: SlotBuffer, ahead: bool = False) -> bool:
        """Box `box` moves `bank`'s slots into `cache`'s on the own misses' lanes (`ahead`: the
        prefetch's); False (no plan) when a slot tensor's slots are not contiguous in both."""
        parts = []
        for (name, src), (_, dst) in zip(bank.named_tensors(), cache.named_tensors()):
            if not (src[0].is_contiguous() and dst[0].is_contiguous() and src[0].nbytes == dst[0].nbytes):
                return False
            size = src.element_size()
            parts += [src.data_ptr(), src.stride(0) * size, dst.data_ptr(), dst.stride(0) * size, src[0].nbytes]
        words = (ctypes.c_uint64 * len(parts))(*parts)
        lanes = [s.cuda_stream if s is not None else None for s in self.lanes[int(ahead)]]
        rc = _lib().ferry_plan(self.handle, box, len(parts) // 5, words, bank.num_slots, cache.num_slots, len(lanes),
                               (ctypes.c_void_p * len(lanes))(*lanes), self.done[box:].data_ptr())
        if rc != 0:
            raise MemoryError(f"the ferry could not take box {box}'s plan")
        return True

    def post(self, box: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Post pairs (`src` slots of the bank [n], `dst` slots of the cache [n], -1: nothing
        to move) into `box`, on the current stream (on the CPU at once)."""
        n = src.numel()
        if n > self.max_pairs:
            raise ValueError(f"the ferry's boxes take {self.max_pairs} pairs, a step posted {n}")
        row = self.mailbox[box]
        if self.device.type == "cuda":
            from moeferry.ops.triton.ferry_signal import post
            post(row, src, dst)
            return
        pairs = torch.stack([src.reshape(-1), dst.reshape(-1)], dim=1).to(torch.int32).reshape(-1)
        row[HEADER:HEADER + 2 * n] = pairs
        row[1] = n
        row[0] = 1

    def wait(self, box: int) -> None:
        """The current stream waits for `box`'s copies (on the CPU, the host does)."""
        if self.device.type == "cuda":
            from moeferry.ops.triton.ferry_signal import wait
            wait(self.done[box:box + 1], self.mailbox[box, 2:3])
            return
        deadline = time.monotonic() + WAIT_S
        while int(self.done[box]) == 0:
            if time.monotonic() > deadline:
                self.mailbox[box, 2] = 1
                break
            time.sleep(0)
        self.done[box] = 0

    def counts(self) -> dict:
        out = (ctypes.c_int64 * 4)()
        _lib().ferry_counts(self.handle, out)
        return {"error": out[0], "experts": out[1], "bytes": out[2], "boxes": out[3]}

    def check(self) -> None:
        """Raise if a copy failed or a wait gave up (the device went on without its experts)."""
        c = self.counts()
        if c["error"]:
            raise RuntimeError(f"the ferry's copies failed (code {c['error']})")
        gave_up = torch.nonzero(self.mailbox[:, 2]).flatten().tolist()
        if gave_up:
            raise RuntimeError(f"the ferry's boxes {gave_up} were never served (its thread stalled)")

    def reset(self) -> None:
        """After a step failed part-way: nothing posted, nothing marked done. The thread is
        stopped (it ends the box in hand) while the device's copies drain."""
        _lib().ferry_stop(self.handle)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.mailbox[:, :3] = 0
        self.done.zero_()
        self._start()
