"""Copy expert slots from pinned host memory into device slots with one kernel launch.

A decode-time cache miss moves a few experts, each a few tensors (weights, block scales, row
scales). One DMA copy per tensor per expert costs ~10 us of host time (40 layers x ~30 copies
per token: milliseconds), and each small copy pays the copy engine's fixed cost. Pinned host
memory is addressable from the device (unified addressing), so this kernel reads every tensor
of every missed expert straight from the host bank and writes its slot: one launch per layer.
`moeferry.moe.offload` times it against the copies at boot and keeps the faster.

The tensors are moved as 32-bit words: every slot tensor of the registry's formats holds a
multiple of 4 bytes per slot (`word_view` refuses otherwise, and the copies are used).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_PARTS = 8  # tensors per slot that one launch moves (gate_up and down: at most 4 each)
BLOCK = 2048   # words per program


@triton.jit
def _gather_kernel(slots_ptr, n_slots,
                   a0, b0, sa0, sb0, n0, a1, b1, sa1, sb1, n1, a2, b2, sa2, sb2, n2, a3, b3, sa3, sb3, n3,
                   a4, b4, sa4, sb4, n4, a5, b5, sa5, sb5, n5, a6, b6, sa6, sb6, n6, a7, b7, sa7, sb7, n7,
                   BLOCK: tl.constexpr):
    i, part, blk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s = tl.load(slots_ptr + i).to(tl.int64)            # source slot (bank)
    d = tl.load(slots_ptr + n_slots + i).to(tl.int64)  # destination slot (device)
    src, dst, n = a0 + s * sa0, b0 + d * sb0, n0
    if part == 1:
        src, dst, n = a1 + s * sa1, b1 + d * sb1, n1
    elif part == 2:
        src, dst, n = a2 + s * sa2, b2 + d * sb2, n2
    elif part == 3:
        src, dst, n = a3 + s * sa3, b3 + d * sb3, n3
    elif part == 4:
        src, dst, n = a4 + s * sa4, b4 + d * sb4, n4
    elif part == 5:
        src, dst, n = a5 + s * sa5, b5 + d * sb5, n5
    elif part == 6:
        src, dst, n = a6 + s * sa6, b6 + d * sb6, n6
    elif part == 7:
        src, dst, n = a7 + s * sa7, b7 + d * sb7, n7
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


def word_view(t: torch.Tensor) -> torch.Tensor | None:
    """[slots, words] int32 view of a contiguous slot tensor; None if a slot is not whole words."""
    if not t.is_contiguous() or (t[0].numel() * t.element_size()) % 4:
        return None
    return t.reshape(t.shape[0], -1).view(torch.uint8).view(torch.int32)


def gather_slots(pairs: list[tuple[torch.Tensor, torch.Tensor]], src_slots: list[int], dst_slots: list[int]) -> None:
    """For each (source [S, W], destination [S', W]) word view: destination[dst_slots[i]] =
    source[src_slots[i]], in one launch on the current stream. Sources may be pinned host
    tensors (read over PCIe by the kernel); destinations are device tensors."""
    if not src_slots:
        return
    if len(pairs) > MAX_PARTS:
        raise ValueError(f"at most {MAX_PARTS} tensors per slot, got {len(pairs)}")
    device = pairs[0][1].device
    slots = torch.tensor([src_slots, dst_slots], dtype=torch.int32, pin_memory=device.type == "cuda")
    slots = slots.to(device, non_blocking=True)
    args = []
    for a, b in pairs + [pairs[0]] * (MAX_PARTS - len(pairs)):
        args += [a, b, a.stride(0), b.stride(0), a.shape[1]]
    most = max(a.shape[1] for a, _ in pairs)
    _gather_kernel[(len(src_slots), len(pairs), triton.cdiv(most, BLOCK))](slots, len(src_slots), *args, BLOCK=BLOCK)
