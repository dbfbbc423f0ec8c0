"""LayerExperts: one MoE layer's routed experts as read from the checkpoint, on the host.

This is what the loader hands an expert backend, once per layer: every expert's (gate, up,
down) `PackedWeight`s in the layer's registry format (unquantized checkpoints use the `bf16`
entry's `DenseWeight`, in the model dtype). Backends turn it into device slots, pinned host
banks (`SlotBuffer.from_experts` / `write`: the format's slot form), or CPU references.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moeferry.checkpoint.formats import DenseWeight, PackedWeight

ExpertWeights = tuple[PackedWeight, PackedWeight, PackedWeight]  # gate, up, down


@dataclass
class LayerExperts:
    format: str                       # registry format name
    experts: list[ExpertWeights]
    stacked: tuple[torch.Tensor, torch.Tensor] | None = None  # unquantized: (gate_up [E, 2I, H], down [E, H, I])

    @classmethod
    def from_stacked(cls, gate_up: torch.Tensor, down: torch.Tensor) -> "LayerExperts":
        inter = down.shape[2]
        experts = [(DenseWeight(inter, gate_up.shape[2], gate_up[e, :inter]),
                    DenseWeight(inter, gate_up.shape[2], gate_up[e, inter:]),
                    DenseWeight(down.shape[1], inter, down[e])) for e in range(gate_up.shape[0])]
        return cls("bf16", experts, (gate_up, down))

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for triple in self.experts for w in triple)
