"""The CPU lane of hybrid decode steps that run whole in a CUDA graph.

hybrid splits a decode step's misses between the link (fetched into cache slots) and the CPU
(computed from the host bank). Where the host manages the cache, that costs each MoE layer two
cuts of the step's graph and a round trip of the host's Python (~370-450 us a layer measured on
H100 hosts, `bandwidth.CUT_S`), which ate most of what the CPU lane saved at batch 1. Here the
split is made on the device and the host's part is a thread in C (`cpu_lane.c`) that makes no
CUDA call:

    the step's split kernel (`ops.triton.lane_signal.split`) picks the layer's misses for the
    lane (a table of fetches per miss count, from the split measured at boot: `MissSplit`),
    writes the layer's rows into the layer's box in pinned host memory and posts it; the cache
    resolves and gathers the other misses as offload's device-managed steps do; the thread sees
    the box, computes its experts (`ops.cpu.experts`, its own OpenMP team) into the box's output
    and marks it served; the collect kernel, queued after the layer's cached experts, waits for
    that mark and adds the output.

So the whole step stays one graph that the host only replays, and the CPU computes while the
device gathers and runs the cached experts. A box holds `rows` rows: decode graphs of more
sequences use the piecewise path. On the CPU (tests) the device's two ends are done by the host
(`split_reference`, a wait on the served word) around the same thread.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import time
import weakref
from pathlib import Path
from typing import NamedTuple

import torch

from moeferry.native import library
from moeferry.ops.cpu.experts import kernel as cpu_kernel

log = logging.getLogger("moeferry.moe")

SOURCE = Path(__file__).with_name("cpu_lane.c")
FLAG_SETS = (["-O2", "-pthread"], ["-O2"])
IDLE_S = 0.002   # the thread spins this long after its last box, then naps 50 us between scans
WAIT_S = 10.0    # the host's wait (the CPU's stand-in for the collect kernel) gives up after this
WORDS = 4        # words of a box's posted and served rows (cpu_lane.c)


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = library(SOURCE, FLAG_SETS, ["-pthread"], lambda path, flags: ctypes.CDLL(str(path)))
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.lane_new.restype = p
    lib.lane_new.argtypes = [p] * 8 + [i] * 5 + [p, i, i64]
    for name in ("lane_start", "lane_stop", "lane_free"):
        getattr(lib, name).argtypes = [p]
    lib.lane_start.restype = i
    lib.lane_counts.argtypes = [p, p]  # (int64 x 5: LaneCounts)
    return lib


class Box(NamedTuple):
    """One layer's box: views of the lane's tensors (host: pinned; device: the step's own words)."""
    ids: torch.Tensor      # [pairs] int64, host: the pairs' experts, -1 where not on the lane
    weights: torch.Tensor  # [pairs] fp32, host
    x: torch.Tensor        # [rows * hidden] fp32, host
    out: torch.Tensor      # [rows * hidden] fp32, host: the lane's output
    posted: torch.Tensor   # [WORDS] int32, host: sequence, rows (written by the step)
    served: torch.Tensor   # [WORDS] int32, host: sequence, failed (written by the thread)
    seq: torch.Tensor      # [1] int32, device: the sequence posted last
    lane: torch.Tensor     # [1] int32, device: experts on the lane this step (0: nothing posted)
    fault: torch.Tensor    # [1] int32, host: a wait gave up or the lane failed


class LaneCounts(NamedTuple):
    """The thread's counters since it started."""
    failed: int     # boxes whose computation failed
    served: int     # boxes served
    busy_s: float   # time spent serving boxes (the OpenMP team's start and join included)
    experts: int    # experts computed
    pairs: int      # (token, expert) pairs computed


def split_reference(ids: torch.Tensor, table_row: torch.Tensor, fetch_of: list[int]) -> tuple[torch.Tensor, int]:
    """The split kernel's choice on the host: (the ids to resolve, -1 for pairs on the lane; the
    lane's expert count). Of the m distinct ids absent from `table_row`, the first `fetch_of[m]`
    by (most pairs, first position) stay; the rest go to the lane."""
    flat = ids.reshape(-1).tolist()
    count = {e: flat.count(e) for e in flat}
    misses = [e for i, e in enumerate(flat) if flat.index(e) == i and int(table_row[e]) < 0]
    ranked = sorted(misses, key=lambda e: (-count[e], flat.index(e)))
    lane = set(ranked[fetch_of[len(misses)]:])
    return torch.tensor([-1 if e in lane else e for e in flat], dtype=torch.int32), len(lane)


class CpuLane:
    """A box per layer of `banks` (layer -> host bank, in box order) of `rows` rows of `top_k`
    choices; the thread runs from construction to `close` with `threads` OpenMP threads."""

    def __init__(self, banks: dict, rows: int, top_k: int, device: torch.device, threads: int):
        kernel = cpu_kernel()
        if kernel is None:
            raise OSError("the CPU lane needs the C expert kernel (ops.cpu.experts)")
        self.device, self.rows, self.top_k, self.threads = device, rows, top_k, threads
        self.box_of = {layer: b for b, layer in enumerate(banks)}
        first = next(iter(banks.values()))
        boxes, pairs, hidden = len(banks), rows * top_k, first.hidden
        pin = device.type == "cuda"
        self.posted = torch.zeros(boxes, WORDS, dtype=torch.int32, pin_memory=pin)
        self.served = torch.zeros(boxes, WORDS, dtype=torch.int32, pin_memory=pin)
        self.ids = torch.full((boxes, pairs), -1, dtype=torch.int64, pin_memory=pin)
        self.weights = torch.zeros(boxes, pairs, dtype=torch.float32, pin_memory=pin)
        self.x = torch.zeros(boxes, rows * hidden, dtype=torch.float32, pin_memory=pin)
        self.out = torch.zeros(boxes, rows * hidden, dtype=torch.float32, pin_memory=pin)
        self.fault = torch.zeros(1, dtype=torch.int32, pin_memory=pin)
        self.seq = torch.zeros(boxes, dtype=torch.int32, device=device)
        self.lane = torch.zeros(boxes, dtype=torch.int32, device=device)
        self.table = torch.arange(first.num_slots, dtype=torch.int32)  # a host bank's slot e holds expert e
        self._views = [kernel.views(bank) for bank in banks.values()]  # kept alive: the thread reads them
        pointers = [ctypes.addressof(m) for pair in self._views for m in pair]
        self._banks = (ctypes.c_void_p * len(pointers))(*pointers)
        run = ctypes.cast(kernel.lib.moe_cpu_experts, ctypes.c_void_p).value
        lib = _lib()
        self.handle = lib.lane_new(*(t.data_ptr() for t in (self.posted, self.served, self.ids, self.weights, self.x,
                                                             self.out)),
                                   ctypes.addressof(self._banks), self.table.data_ptr(), boxes, rows, hidden, top_k,
                                   first.num_slots, run, threads, int(IDLE_S * 1e9))
        if not self.handle:
            raise MemoryError("the CPU lane's thread state could not be allocated")
        self.close = weakref.finalize(self, lib.lane_free, self.handle)  # stops the thread, once
        if lib.lane_start(self.handle) != 0:
            raise OSError("the CPU lane's thread could not be started")

    def box(self, layer: int) -> Box:
        b = self.box_of[layer]
        return Box(self.ids[b], self.weights[b], self.x[b], self.out[b], self.posted[b], self.served[b],
                   self.seq[b:b + 1], self.lane[b:b + 1], self.fault)

    def post(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, table_row: torch.Tensor,
             fetch_of: torch.Tensor, tally: torch.Tensor) -> torch.Tensor:
        """Split layer `layer`'s step and post its lane's share (on the current stream; on the
        CPU at once); returns the ids the cache resolves ([n] int32, -1: on the lane). `fetch_of`:
        fetches per miss count for this batch; `tally`: the cache counter the lane's experts add to."""
        if x.shape[0] > self.rows:
            raise ValueError(f"the CPU lane's boxes take {self.rows} rows, a step posted {x.shape[0]}")
        box = self.box(layer)
        if self.device.type == "cuda":
            from moeferry.ops.triton.lane_signal import split
            return split(ids, weights, x, table_row, fetch_of, box, tally)
        fetch, lane = split_reference(ids, table_row, fetch_of.tolist())
        box.lane.fill_(lane)
        if lane:
            n, on_lane = ids.numel(), fetch < 0
            box.ids[:n] = torch.where(on_lane, ids.reshape(-1).long(), -1)
            box.weights[:n] = weights.reshape(-1).float()
            box.x[:x.numel()] = x.reshape(-1).float()
            tally += lane
            box.seq.add_(1)
            box.posted[1] = x.shape[0]
            box.posted[0] = box.seq[0]  # (the thread reads the words after this one: x86's stores are ordered)
        return fetch

    def collect(self, layer: int, out: torch.Tensor) -> None:
        """`out` += the lane's output for layer `layer`'s step, once the thread has served it (the
        current stream waits on the device; on the CPU the host waits)."""
        box = self.box(layer)
        if self.device.type == "cuda":
            from moeferry.ops.triton.lane_signal import collect
            collect(out, box)
            return
        if int(box.lane[0]) == 0:
            return
        deadline = time.monotonic() + WAIT_S
        while int(box.served[0]) != int(box.seq[0]):
            if time.monotonic() > deadline:
                box.fault[0] = 1
                return
            time.sleep(0)
        if int(box.served[1]) != 0:
            box.fault[0] = 1
            return
        out += box.out[:out.numel()].view(out.shape).to(out.dtype)

    def counts(self) -> LaneCounts:
        out = (ctypes.c_int64 * 5)()
        _lib().lane_counts(self.handle, out)
        return LaneCounts(out[0], out[1], out[2] * 1e-9, out[3], out[4])

    def check(self) -> None:
        """Raise if a wait gave up or the lane failed to compute a box (a step went on without it)."""
        if int(self.fault[0]):
            c = self.counts()
            self.fault.zero_()
            raise RuntimeError(f"the CPU lane missed a step's experts ({c.failed} boxes failed of {c.served} "
                               "served; a wait that gave up means the lane's thread stalled)")
