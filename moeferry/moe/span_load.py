"""Filling device slots from the mapped checkpoint in a few large copies.

The staging path (`SlotBuffer.from_experts`) copies each part of each expert (about 2300 parts
a layer for NVFP4) from the mapped file into a page-locked host buffer, then the buffer to the
device. Here the parts are only recorded (`SlotBuffer.write` with a recording `copy`); the
parts that are byte-for-byte views of a mapped file move as one host-to-device copy per span of
nearby parts (a checkpoint stores a layer's expert tensors of one dtype next to each other),
then one device copy each into its slot; the rest (row scales the format computes, dtype
conversions, unaligned copies) are copied directly. One span at a time is the device memory
this needs beyond the slots. Byte-identical to the staging path (tests); which is faster is
`benchmarks/load_speed.py`'s `resident span` row (not yet timed on a GPU).
"""
from __future__ import annotations

from typing import Sequence

import torch

from moeferry.moe.layer_experts import ExpertWeights
from moeferry.moe.slots import SlotBuffer

MAX_GAP = 1 << 20  # bytes of other data between two parts that still share a span


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def fill_from_spans(buf: SlotBuffer, experts: Sequence[ExpertWeights]) -> int:
    """Slot s <- experts[s] for every expert, on buf's device. Returns the bytes moved as spans."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for slot, expert in enumerate(experts):
        buf.write(slot, expert, lambda dst, src: pairs.append((dst, src)))
    by_storage: dict[int, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    direct = []
    for dst, src in pairs:
        if src.dtype == dst.dtype and src.is_contiguous() and dst.is_contiguous() and src.device.type == "cpu":
            off = src.storage_offset() * src.element_size()
            by_storage.setdefault(src.untyped_storage().data_ptr(), []).append((off, src.nbytes, dst, src))
        else:
            direct.append((dst, src))
    moved = 0
    for parts in by_storage.values():
        for run in _runs(sorted(parts, key=lambda p: p[0])):
            if len(run) == 1:
                direct.append(run[0][2:])
            else:
                moved += _copy_span(run)
    for dst, src in direct:
        dst.copy_(src)
    return moved


def _runs(parts: list) -> list[list]:
    """Parts sorted by offset, split where more than MAX_GAP bytes of other data lie between two."""
    runs, end = [], None
    for part in parts:
        if end is None or part[0] - end > MAX_GAP:
            runs.append([])
        runs[-1].append(part)
        end = part[0] + part[1] if end is None else max(end, part[0] + part[1])
    return runs


def _copy_span(run: list) -> int:
    """One run of a file's parts: its span to the device in one copy, then each part into place."""
    lo, hi = run[0][0], max(off + n for off, n, _, _ in run)
    span = torch.as_strided(_byte_view(run[0][3]), (hi - lo,), (1,), lo).to(run[0][2].device)
    for off, n, dst, _ in run:
        _byte_view(dst).copy_(span[off - lo:off - lo + n])
    return hi - lo
