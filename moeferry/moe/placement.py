"""Copying a layer's experts into slot buffers (host banks, the resident backend's staging).

A layer's experts reach their slots as a list of copies, one per part (for NVFP4 about 2300 a
layer: each expert's packed weights, block scales and row scales; `MoEKernel.pack` decides
them). The first layer of a slot layout is placed the plain way: its experts are read as views
of the memory-mapped checkpoint, each part recorded by `SlotBuffer.write`'s copy hook, and the
copies run in one `torch._foreach_copy_`. When every recorded source is a byte range of one
checkpoint tensor (or one element of it, broadcast) in the same dtype as its destination, the
copies are kept as a template in layer-relative tensor names. The next layers of that layout
then skip the per-expert views and packing: the template is instantiated from the checkpoint's
index (each tensor checked for the template layer's shape and dtype and to lie inside its file;
any difference, and the layer is placed the plain way): dictionary lookups and address
arithmetic, and the byte copies run in one call of a small C helper over a few threads
(`memory.spans`; one torch copy per part instead forks torch's thread pool ~2300 times a
layer). Byte-identical to the plain path (tests); formats whose parts are computed (int4 AWQ's
repacking) always take it.
"""
from __future__ import annotations

import bisect
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from moeferry.memory.spans import Fill, Move, copy_spans, fill_spans
from moeferry.moe.layer_experts import ExpertWeights, LayerExperts

if TYPE_CHECKING:
    from moeferry.checkpoint.reader import CheckpointReader
    from moeferry.moe.slots import SlotBuffer

Pairs = tuple[list[torch.Tensor], list[torch.Tensor]]  # (destinations, sources) of copy_


def copy_pairs(pairs: Pairs) -> None:
    """Every dst.copy_(src) of `pairs` in one call (no Python between the copies)."""
    if pairs[0]:
        torch._foreach_copy_(*pairs)


def record(buf: "SlotBuffer", slots: Sequence[ExpertWeights]) -> Pairs:
    """The copies that put slots[s] into slot s of `buf`, not yet run."""
    dsts, srcs = [], []

    def hook(dst: torch.Tensor, src: torch.Tensor) -> None:
        dsts.append(dst)
        srcs.append(src)
    for slot, expert in enumerate(slots):
        buf.write(slot, expert, hook)
    return dsts, srcs


def _slot_tensors(buf: "SlotBuffer") -> list[torch.Tensor]:
    return [t for _, t in buf.named_tensors()]


@dataclass(frozen=True)
class _Part:
    dst: int          # index into the buffer's slot tensors
    dst_off: int      # byte offset in that tensor
    src: str          # tensor name after the layer prefix
    src_off: int      # byte offset in that tensor
    nbytes: int       # bytes copied (broadcast: the one element's size)
    count: int        # 0: a plain byte copy; else the element repeated `count` times


class _SourceIndex:
    """Which checkpoint tensor a host pointer lies in: the reader's mapped files by address."""

    def __init__(self, reader: "CheckpointReader"):
        self.reader = reader
        by_file: dict[object, list[tuple[int, str, int]]] = {}
        for name, info in reader.tensors.items():
            by_file.setdefault(info.file, []).append((info.start, name, info.end))
        self._files = {path: sorted(rows) for path, rows in by_file.items()}
        self._starts = {path: [r[0] for r in rows] for path, rows in self._files.items()}

    def locate(self, ptr: int, nbytes: int) -> tuple[str, int] | None:
        """(tensor name, byte offset in it) of [ptr, ptr + nbytes), None unless inside one tensor
        of a mapped file."""
        for path, rows in self._files.items():
            data = self.reader.mapped_file(path, create=False)
            if data is None or not 0 <= ptr - data.data_ptr() < data.numel():
                continue
            off = ptr - data.data_ptr()
            i = bisect.bisect_right(self._starts[path], off) - 1
            return (rows[i][1], off - rows[i][0]) if i >= 0 and off + nbytes <= rows[i][2] else None
        return None


class _Template:
    """A layer's copies in layer-relative names; `instantiate` gives another layer's."""

    def __init__(self, parts: list[_Part], shapes: dict[str, tuple]):
        self.parts, self.shapes = parts, shapes
        self.extents = [0] * (1 + max((p.dst for p in parts), default=0))  # bytes each slot tensor must hold
        for p in parts:
            self.extents[p.dst] = max(self.extents[p.dst], p.dst_off + p.nbytes * max(1, p.count))

    @classmethod
    def build(cls, pairs: Pairs, buf: "SlotBuffer", index: _SourceIndex, prefix: str) -> "_Template | None":
        bases = [(t.data_ptr(), t.numel() * t.element_size()) for t in _slot_tensors(buf)]
        parts = []
        for dst, src in zip(*pairs):
            part = _part(dst, src, bases, index, prefix)
            if part is None:
                return None
            parts.append(part)
        infos = index.reader.tensors
        return cls(parts, {p.src: (infos[prefix + p.src].shape, infos[prefix + p.src].dtype) for p in parts})

    def _sources(self, reader: "CheckpointReader", prefix: str) -> dict[str, tuple[int, int]] | None:
        """Each template tensor of the layer at `prefix`: (its mapped file's address, its start in it);
        None when one is missing, differs in shape or dtype from the template layer's, or runs
        past the end of its file (a truncated checkpoint: the plain path names it)."""
        found = {}
        for name, shape_dtype in self.shapes.items():
            info = reader.tensors.get(prefix + name)
            if info is None or (info.shape, info.dtype) != shape_dtype:
                return None
            data = reader.mapped_file(info.file)
            if info.end > data.numel():
                return None
            found[name] = (data.data_ptr(), info.start)
        return found

    def instantiate(self, reader: "CheckpointReader", prefix: str, buf: "SlotBuffer") -> "LayerCopies | None":
        """The copies of the layer at `prefix` into `buf` (None: see `_sources`)."""
        found = self._sources(reader, prefix)
        tensors = _slot_tensors(buf)
        if found is None or any(not t.is_contiguous() or t.numel() * t.element_size() < end
                                for t, end in zip(tensors, self.extents)):
            return None
        bases = [t.data_ptr() for t in tensors]
        moves, fills = [], []
        for p in self.parts:
            address, start = found[p.src]
            dst, src = bases[p.dst] + p.dst_off, address + start + p.src_off
            if p.count:
                fills.append((dst, src, p.nbytes, p.count))
            else:
                moves.append((dst, src, p.nbytes))
        return LayerCopies(moves, fills)


@dataclass
class LayerCopies:
    """A templated layer's copies: byte moves (destination, source, bytes) and element fills
    (destination, source, element bytes, count), addresses inside the buffer's tensors and the
    mapped files, checked by `instantiate`."""
    moves: list[Move]
    fills: list[Fill]

    def run(self, threads: int) -> None:
        """The moves, then the fills, each on `threads` threads in one call (`memory.spans`: no
        Python between them, no torch thread pool per part)."""
        copy_spans(self.moves, threads)
        fill_spans(self.fills, threads)


def _part(dst: torch.Tensor, src: torch.Tensor, bases, index: _SourceIndex, prefix: str) -> _Part | None:
    """One recorded copy as a template part; None when it cannot be one (a computed source, a
    dtype conversion, a strided destination)."""
    if src.dtype != dst.dtype or not dst.is_contiguous() or src.device.type != "cpu":
        return None
    ptr = dst.data_ptr()
    where = next(((i, ptr - base) for i, (base, size) in enumerate(bases)
                  if base <= ptr and ptr + dst.numel() * dst.element_size() <= base + size), None)
    if where is None:
        return None
    if src.is_contiguous():
        nbytes, count = src.nbytes, 0
    elif all(st == 0 or n == 1 for st, n in zip(src.stride(), src.shape)):  # one element, broadcast
        nbytes, count = src.element_size(), dst.numel()
    else:
        return None
    found = index.locate(src.data_ptr(), nbytes)
    if found is None or not found[0].startswith(prefix):
        return None
    return _Part(where[0], where[1], found[0][len(prefix):], found[1], nbytes, count)


class Placement:
    """Places layers one after another, keeping a template per slot layout (see module doc); a
    templated layer's byte copies run on `threads` threads. `templated` / `plain`: layers placed
    each way (the log and tests read them)."""

    def __init__(self, threads: int | None = None):
        self._templates: dict[tuple, _Template | None] = {}
        self._index: _SourceIndex | None = None
        self.threads = threads or min(8, os.cpu_count() or 1)
        self.templated = self.plain = 0

    @staticmethod
    def _key(buf: "SlotBuffer", experts: LayerExperts, extra: Sequence[ExpertWeights]) -> tuple:
        return (experts.format, experts.num_experts, len(extra),
                tuple((t.shape[1:], t.dtype) for t in _slot_tensors(buf)))

    def fill(self, buf: "SlotBuffer", experts: LayerExperts, extra: Sequence[ExpertWeights] = ()) -> None:
        """Slot s of `buf` <- experts.experts[s], then `extra` (e.g. the shared expert) after them."""
        source = experts.source
        key = self._key(buf, experts, extra)
        template = self._templates.get(key) if source is not None else None
        copies = template.instantiate(source.reader, source.prefix, buf) if template is not None else None
        if copies is not None:
            copies.run(self.threads)
            self.templated += 1
            return
        pairs = record(buf, list(experts.experts) + list(extra))
        self.plain += 1
        if source is not None and key not in self._templates:
            if self._index is None or self._index.reader is not source.reader:
                self._index = _SourceIndex(source.reader)
            self._templates[key] = _Template.build(pairs, buf, self._index, source.prefix)
        copy_pairs(pairs)
