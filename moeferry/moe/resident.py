"""Resident expert executor: every expert of a layer stacked in device memory."""
from __future__ import annotations

import torch

from moeferry.ops.moe import fused_experts


class ResidentExperts:
    """gate_up [E, 2I, H] (gate rows first), down [E, H, I]."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        self.gate_up, self.down = gate_up, down

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return fused_experts(x, ids, weights, lambda e: (self.gate_up[e], self.down[e]))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate_up, self.down))


class PackedExperts:
    """Experts kept in their quantized checkpoint format, one (gate, up, down) triple of
    QuantLinear per expert; the reference path dequantizes only the experts a step selects."""

    def __init__(self, experts: list[tuple], dtype: torch.dtype):
        self.experts, self.dtype = experts, dtype

    def _weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up, down = self.experts[e]
        return torch.cat([gate.dense(self.dtype), up.dense(self.dtype)]), down.dense(self.dtype)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return fused_experts(x, ids, weights, self._weights)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for triple in self.experts for m in triple)
