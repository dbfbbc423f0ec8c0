"""LayerExperts: one MoE layer's routed experts as read from the checkpoint, on the host.

This is what the loader hands an expert backend, once per layer: every expert's (gate, up,
down) `PackedWeight`s in the layer's registry format (unquantized checkpoints use the `bf16`
entry's `DenseWeight`, in the model dtype). Backends turn it into device slots, pinned host
banks (`SlotBuffer.from_experts` / `write`: the format's slot form), or CPU references.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from moeferry.checkpoint.formats import DenseWeight, PackedWeight

if TYPE_CHECKING:
    from moeferry.checkpoint.reader import CheckpointReader

ExpertWeights = tuple[PackedWeight, PackedWeight, PackedWeight]  # gate, up, down


class LazyExperts(Sequence):
    """A layer's experts, each read (`read(e)`: views of the mapped checkpoint) when first
    asked for: a placement that copies from the files directly (`moe.placement`) reads none."""

    def __init__(self, count: int, read: Callable[[int], ExpertWeights]):
        self._count, self._read = count, read
        self._done: dict[int, ExpertWeights] = {}

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, e):
        if isinstance(e, slice):
            return [self[i] for i in range(*e.indices(self._count))]
        if not -self._count <= e < self._count:
            raise IndexError(f"expert {e} of {self._count}")
        e %= self._count
        if e not in self._done:
            self._done[e] = self._read(e)
        return self._done[e]


@dataclass(frozen=True)
class ExpertSource:
    """Where a layer's expert tensors lie: `prefix` + a layer-relative name in `reader`."""
    reader: "CheckpointReader"
    prefix: str                       # e.g. "model.layers.3.mlp."


@dataclass
class LayerExperts:
    format: str                       # registry format name
    experts: Sequence[ExpertWeights]
    stacked: tuple[torch.Tensor, torch.Tensor] | None = None  # unquantized: (gate_up [E, 2I, H], down [E, H, I])
    source: ExpertSource | None = None  # the experts are views of these mapped files

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
