"""Many host byte copies in one call (`spans.c`): a templated layer's expert placement
(`moe.placement.LayerCopies`), ~2300 copies a layer for NVFP4, and its element fills (a scale
broadcast over a slot's rows, 768 a NVFP4 layer; made as tensor views and `copy_`s, they took
~6 ms a layer of Python on the development machine).

The C source is built once per machine (`moeferry.native`, with OpenMP where the compiler has
it) and called through ctypes, which releases the GIL: the copies run on `threads` threads with
no Python between them. Without a compiler the copies are `ctypes.memmove`s split over Python
threads (each memmove runs without the GIL, but its call does not: 2 threads measured 40.5 ms
a 453 MB layer that way against 34.4 ms in one C call, which is also one 453 MB copy's time).
A copy larger than `PIECE` bytes is cut into pieces first, so that one big copy is shared too.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from moeferry.native import library_or_none

log = logging.getLogger("moeferry.memory")

SOURCE = Path(__file__).with_name("spans.c")
FLAG_SETS = (["-O3", "-fopenmp"], ["-O3"])
PIECE = 4 << 20  # bytes: copies above this are cut into pieces of it, shared among the threads

Move = tuple[int, int, int]  # (destination address, source address, bytes)
Fill = tuple[int, int, int, int]  # (destination address, source address, element bytes, count)


class SpanCopier:
    """The loaded C helper."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        for fn in (lib.copy_spans, lib.fill_spans):
            fn.restype = None
            fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]

    def copy(self, moves: list[Move], threads: int) -> None:
        rows = torch.tensor(moves, dtype=torch.int64)
        self.lib.copy_spans(len(moves), rows.data_ptr(), threads)

    def fill(self, fills: list[Fill], threads: int) -> None:
        rows = torch.tensor(fills, dtype=torch.int64)
        self.lib.fill_spans(len(fills), rows.data_ptr(), threads)


def pieces(moves: list[Move], piece: int = PIECE) -> list[Move]:
    """`moves` with every copy above `piece` bytes cut into copies of at most `piece` bytes."""
    out = []
    for dst, src, n in moves:
        if n <= piece:
            out.append((dst, src, n))
        else:
            out.extend((dst + a, src + a, min(piece, n - a)) for a in range(0, n, piece))
    return out


@functools.cache
def copier() -> SpanCopier | None:
    """The built helper, or None (no C compiler: the log says so once)."""
    return library_or_none(SOURCE, FLAG_SETS, lambda path, flags: SpanCopier(ctypes.CDLL(str(path))), log,
                           "host span copies: memmoves over Python threads")


def copy_spans(moves: list[Move], threads: int, use_c: bool = True) -> None:
    """Every (destination, source, bytes) copy of `moves` (non-overlapping host memory) on up to
    `threads` threads: one C call, or (`use_c` False, or no helper) memmoves over Python threads."""
    moves = pieces(moves)
    if not moves:
        return
    helper = copier() if use_c else None
    if helper is not None:
        helper.copy(moves, threads)
        return
    chunks = _split(moves, threads)
    if len(chunks) > 1:
        with ThreadPoolExecutor(len(chunks)) as pool:
            list(pool.map(_memmove_all, chunks))
    else:
        _memmove_all(chunks[0])


def fill_spans(fills: list[Fill], threads: int, use_c: bool = True) -> None:
    """Every (destination, source, element bytes, count) fill of `fills`: one C call, or (`use_c`
    False, or no helper) memmoves doubling what is written (log2(count) of them a fill)."""
    if not fills:
        return
    helper = copier() if use_c else None
    if helper is not None:
        helper.fill(fills, threads)
        return
    for dst, src, size, count in fills:
        done, total = min(size, size * count), size * count
        ctypes.memmove(dst, src, done)
        while done < total:
            n = min(done, total - done)
            ctypes.memmove(dst + done, dst, n)
            done += n


def _split(moves: list[Move], threads: int) -> list[list[Move]]:
    """`moves` in at most `threads` runs of about equal bytes, in order."""
    chunks, share, done = [[]], sum(m[2] for m in moves) / max(1, threads), 0
    for move in moves:
        if done >= share * len(chunks) and len(chunks) < threads:
            chunks.append([])
        chunks[-1].append(move)
        done += move[2]
    return chunks


def _memmove_all(moves: list[Move]) -> None:
    for dst, src, n in moves:
        ctypes.memmove(dst, src, n)
