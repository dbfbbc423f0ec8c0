"""Expert executor over the fused Triton MoE kernels (CUDA, or the Triton interpreter)."""
from __future__ import annotations

import torch

from moeferry.moe.slots import SlotBuffer


class TritonExperts:
    """Same call as the other expert executors: (x [T, H], ids [T, k], weights [T, k]) -> [T, H].

    Reads experts from `buffer` through `table_row` (expert -> slot, -1 = skip). An optional
    shared expert lives in slot `shared_slot` of the same buffer (one extra pair per token,
    weighted by sigmoid(`shared_gate`), the shared_expert_gate's logit), or in a buffer of its
    own when its intermediate size differs; both run through the same kernels."""

    def __init__(self, buffer: SlotBuffer, table_row: torch.Tensor, shared_slot: int = -1,
                 shared_buffer: SlotBuffer | None = None):
        self.buffer, self.table_row, self.shared_slot = buffer, table_row, shared_slot
        self.shared_buffer = shared_buffer
        if shared_buffer is not None:
            self._shared_row = torch.zeros(1, dtype=torch.int32, device=table_row.device)

    @classmethod
    def resident(cls, gate_up: torch.Tensor, down: torch.Tensor, shared: tuple | None = None) -> "TritonExperts":
        """Unquantized stacked experts (gate_up [E, 2I, H], down [E, H, I]); `shared` =
        (gate_up [2Is, H], down [H, Is]) of the shared expert, if any."""
        e = gate_up.shape[0]
        dev = gate_up.device
        table = torch.arange(e, dtype=torch.int32, device=dev)
        if shared is None:
            return cls(SlotBuffer.from_dense(gate_up, down), table)
        sgu, sd = shared
        if sgu.shape == gate_up.shape[1:]:
            buf = SlotBuffer.from_dense(torch.cat([gate_up, sgu[None].to(gate_up)]), torch.cat([down, sd[None].to(down)]))
            return cls(buf, table, shared_slot=e)
        return cls(SlotBuffer.from_dense(gate_up, down), table,
                   shared_buffer=SlotBuffer.from_dense(sgu[None].to(gate_up), sd[None].to(down)))

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 shared_gate: torch.Tensor | None = None) -> torch.Tensor:
        if shared_gate is not None and self.shared_slot >= 0:
            return self.buffer.run(x, ids, weights, self.table_row, self.shared_slot, shared_gate.reshape(-1))
        out = self.buffer.run(x, ids, weights, self.table_row)
        if shared_gate is not None:
            if self.shared_buffer is None:
                raise ValueError("this executor holds no shared expert")
            t = x.shape[0]
            zeros = torch.zeros(t, 1, dtype=torch.int64, device=x.device)
            out = out + self.shared_buffer.run(x, zeros, torch.sigmoid(shared_gate.float()).reshape(t, 1), self._shared_row)
        return out

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes + (self.shared_buffer.nbytes if self.shared_buffer is not None else 0)
