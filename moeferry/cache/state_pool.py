"""Gated DeltaNet state pool: conv state + fp32 recurrent state per sequence slot and layer."""
from __future__ import annotations

import torch

from moeferry.cache.kv_pool import IdAllocator


class StatePool:
    """conv[layer]: [S, conv_dim, K-1] (activation dtype); recurrent[layer]: [S, Hv, Dk, Dv] fp32."""

    def __init__(self, num_layers: int, num_slots: int, conv_dim: int, conv_kernel: int, num_v_heads: int,
                 k_dim: int, v_dim: int, dtype: torch.dtype, device: torch.device | str):
        self.slots = IdAllocator(num_slots, what="GDN state slots")
        self.conv = [torch.zeros(num_slots, conv_dim, conv_kernel - 1, dtype=dtype, device=device)
                     for _ in range(num_layers)]
        self.recurrent = [torch.zeros(num_slots, num_v_heads, k_dim, v_dim, dtype=torch.float32, device=device)
                          for _ in range(num_layers)]

    @property
    def num_slots(self) -> int:
        return self.slots.num_pages

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.conv + self.recurrent)

    def alloc(self) -> int:
        """A zeroed slot (a fresh sequence starts from the zero state)."""
        slot = self.slots.alloc(1)[0]
        for conv, rec in zip(self.conv, self.recurrent):
            conv[slot].zero_()
            rec[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        self.slots.free([slot])

    def copy(self, src: int, dst: int) -> None:
        """Copy every layer's state of slot src into slot dst (prefix-cache checkpoints)."""
        for conv, rec in zip(self.conv, self.recurrent):
            conv[dst].copy_(conv[src])
            rec[dst].copy_(rec[src])


def state_bytes_per_slot(spec, dtype: torch.dtype) -> int:
    """GDN conv + recurrent state of one sequence slot over every linear-attention layer."""
    if not spec.linear_layers:
        return 0
    conv = spec.conv_dim * (spec.conv_kernel - 1) * torch.empty((), dtype=dtype).element_size()
    recurrent = spec.linear_num_v_heads * spec.linear_k_head_dim * spec.linear_v_head_dim * 4
    return len(spec.linear_layers) * (conv + recurrent)
