"""Copy expert slots from pinned host memory into device slots with one kernel launch.

A decode-time cache miss moves a few experts, each a few tensors (weights, block scales, row
scales). One DMA copy per tensor per expert costs ~10 us of host time (40 layers x ~30 copies
per token: milliseconds), and each small copy pays the copy engine's fixed cost. Pinned host
memory is addressable from the device (unified addressing), so this kernel reads every tensor
of every missed expert straight from the host bank and writes its slot: one launch per layer.
`moeferry.moe.offload` times it against the copies at boot and keeps the faster. Its host cost is
what a decode step pays per fetch (measured on the H200: ~176 us a call when the launch took
every tensor as five arguments), so the tensors' addresses and strides sit in a device
descriptor built once per (bank, cache) pair, and a launch takes three arguments.

The tensors are moved as 32-bit words: every slot tensor of the registry's formats holds a
multiple of 4 bytes per slot (`word_view` refuses otherwise, and the copies are used). Where
every tensor's address, slot stride and slot size are whole 16-byte units, a `vec` config
addresses them from two base pointers in those units, so that the compiler knows the
alignment and each thread moves 16 bytes per load and store instead of 4 (an address read
from the descriptor carries no alignment the compiler could use).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# (words per program, warps, vec): a pinned host read's latency is hidden by the reads in flight,
# which these trade against the programs' count; vec: 16-byte accesses where the tensors allow
# (else the same config in words, so no config asks for words only); the offload backend times
# each at boot (on a full grid and on the prefetch's quarter of the SMs, where more warps per
# program keep more reads in flight per SM), keeps the fastest
CONFIGS = ((2048, 4, True), (4096, 8, True), (8192, 8, True), (8192, 16, True), (16384, 16, True))
FIELDS = tl.constexpr(5)  # per tensor in the descriptor: source and destination address, their slot strides, words
UNIT = 4  # words in a 16-byte unit (vec descriptors count in units)
_UNIT = tl.constexpr(UNIT)


@triton.jit(do_not_specialize=["items"])
def _gather_kernel(desc_ptr, pieces_ptr, src_ptr, dst_ptr, src_base, dst_base, items, pieces,
                   BLOCK: tl.constexpr, VEC: tl.constexpr):
    """Work item w = (i, piece): piece (part, blk) = words blk*BLOCK.. of tensor `part` of the
    i-th expert moved (nothing where its destination slot is negative: a hit). `pieces_ptr`
    lists only the blocks that hold words (a scale tensor is a few blocks where a weight is
    dozens), so no item is empty but a hit's. Program p does items p, p + programs, ... (one
    item each on a full grid; a capped grid leaves the other SMs to the compute that overlaps a
    prefetch, and its programs pass over a hit's items after one load). The descriptor holds
    each tensor's addresses as integers (a pinned host tensor's address is valid on the
    device), so a launch takes a few arguments besides the slot lists, whatever the tensors.
    VEC: the descriptor holds offsets from `src_base` / `dst_base`, strides and sizes in 16-byte
    units (multiplied back here, the compiler sees whole units: vector accesses)."""
    for w in range(tl.program_id(0), items, tl.num_programs(0)):
        i, j = w // pieces, w % pieces
        d = tl.load(dst_ptr + i).to(tl.int64)  # destination slot (device), -1: skip
        if d >= 0:
            s = tl.load(src_ptr + i).to(tl.int64)  # source slot (bank)
            part, blk = tl.load(pieces_ptr + 2 * j), tl.load(pieces_ptr + 2 * j + 1)
            field = desc_ptr + part * FIELDS
            if VEC:
                src = src_base + (tl.load(field) + s * tl.load(field + 2)) * _UNIT
                dst = dst_base + (tl.load(field + 1) + d * tl.load(field + 3)) * _UNIT
                n = tl.load(field + 4) * _UNIT
            else:
                src = tl.load(field).to(tl.pointer_type(tl.int32)) + s * tl.load(field + 2)
                dst = tl.load(field + 1).to(tl.pointer_type(tl.int32)) + d * tl.load(field + 3)
                n = tl.load(field + 4)
            offs = blk * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


def _pieces(words: list[int], block: int, device) -> torch.Tensor:
    """(part, block) of every block that holds words, for parts of these many words: the
    kernel's work items for one expert (int32 [pieces, 2] on `device`)."""
    rows = [(part, blk) for part, n in enumerate(words) for blk in range(triton.cdiv(n, block))]
    return torch.tensor(rows, dtype=torch.int32).to(device)


def word_view(t: torch.Tensor) -> torch.Tensor | None:
    """[slots, words] int32 view of a contiguous slot tensor; None if a slot is not whole words."""
    if not t.is_contiguous() or (t[0].numel() * t.element_size()) % 4:
        return None
    return t.reshape(t.shape[0], -1).view(torch.uint8).view(torch.int32)


def whole_units(t: torch.Tensor) -> bool:
    """A [slots, words] view whose address, slot stride and slot size are whole 16-byte units."""
    return t.data_ptr() % 16 == 0 and t.stride(0) % UNIT == 0 and t.shape[1] % UNIT == 0


class SlotGather:
    """Gather launches from one source to one destination slot buffer (their word views as
    `pairs` of (source [S, W], destination [S', W])): the kernel's arguments are built once,
    and the slot indices go through a ring of pinned and device buffers, each reused only after
    the launch that read it has finished (a decode step launches one or two gathers a layer)."""

    RING, WIDTH = 4, 64

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], config: tuple = CONFIGS[0]):
        self.pairs, self.device = pairs, pairs[0][1].device  # the tensors kept alive: the descriptor has their addresses
        self.block, self.warps, vec = config
        self.vec = vec and all(whole_units(t) for pair in pairs for t in pair)
        self.base = pairs[0]  # the vec kernel addresses every tensor from these (the word kernel ignores them)
        rows = [[a.data_ptr(), b.data_ptr(), a.stride(0), b.stride(0), a.shape[1]] for a, b in pairs]
        if self.vec:  # offsets from the first pair's tensors, all in 16-byte units
            sb, db = self.base[0].data_ptr(), self.base[1].data_ptr()
            rows = [[(a - sb) // 16, (b - db) // 16, sa // UNIT, sd // UNIT, n // UNIT] for a, b, sa, sd, n in rows]
        self.desc = torch.tensor(rows, dtype=torch.int64).to(self.device)
        self.pieces = _pieces([a.shape[1] for a, _ in pairs], self.block, self.device)  # one expert's work items
        cuda = self.device.type == "cuda"
        self.host = [torch.zeros(2, self.WIDTH, dtype=torch.int32, pin_memory=cuda) for _ in range(self.RING)]
        self.slots = [torch.zeros(2, self.WIDTH, dtype=torch.int32, device=self.device) for _ in range(self.RING)]
        self.done = [torch.cuda.Event() if cuda else None for _ in range(self.RING)]
        self.used = [False] * self.RING
        self.turn = 0

    def __call__(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """destination[dst_slots[i]] = source[src_slots[i]] for every pair, in one launch on the
        current stream (more than WIDTH experts: one launch per WIDTH)."""
        for at in range(0, len(src_slots), self.WIDTH):
            self._launch(src_slots[at:at + self.WIDTH], dst_slots[at:at + self.WIDTH])

    def _launch(self, src_slots: list[int], dst_slots: list[int]) -> None:
        i, n = self.turn, len(src_slots)
        self.turn = (i + 1) % self.RING
        if self.used[i] and self.done[i] is not None:
            self.done[i].synchronize()  # the launch that last read this buffer has run
        host = self.host[i].numpy()
        host[0, :n], host[1, :n] = src_slots, dst_slots
        slots = self.slots[i]
        slots.copy_(self.host[i], non_blocking=True)
        self.indexed(slots[0, :n], slots[1, :n])
        if self.done[i] is not None:
            self.done[i].record()
        self.used[i] = True

    def indexed(self, src_slots: torch.Tensor, dst_slots: torch.Tensor, programs: int | None = None) -> None:
        """The same from slot lists on the device (any integer dtype; a negative destination
        moves nothing): no host work but the launch, so it can run inside a CUDA graph.
        `programs` caps the grid (None: a program per work item)."""
        items = src_slots.numel() * len(self.pieces)
        grid = min(items, programs or items)
        if grid:
            _gather_kernel[(grid,)](self.desc, self.pieces, src_slots, dst_slots, *self.base, items, len(self.pieces),
                                    BLOCK=self.block, VEC=self.vec, num_warps=self.warps)
