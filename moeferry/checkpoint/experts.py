"""Read one MoE layer's experts from either checkpoint layout into stacked tensors."""
from __future__ import annotations

import torch

from moeferry.checkpoint.reader import CheckpointReader


def read_experts(reader: CheckpointReader, prefix: str, num_experts: int, hidden: int, inter: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H], down [E, H, I]) from `{prefix}experts.gate_up_proj` (fused) or
    `{prefix}experts.{e}.{gate,up,down}_proj.weight` (per expert)."""
    fused = f"{prefix}experts.gate_up_proj"
    if reader.has(fused):
        gate_up = reader.get(fused, (num_experts, 2 * inter, hidden))
        down = reader.get(f"{prefix}experts.down_proj", (num_experts, hidden, inter))
        return gate_up, down
    first = reader.get(f"{prefix}experts.0.gate_proj.weight", (inter, hidden))
    gate_up = torch.empty(num_experts, 2 * inter, hidden, dtype=first.dtype)
    down = torch.empty(num_experts, hidden, inter, dtype=first.dtype)
    for e in range(num_experts):
        p = f"{prefix}experts.{e}."
        gate_up[e, :inter] = first if e == 0 else reader.get(p + "gate_proj.weight", (inter, hidden))
        gate_up[e, inter:] = reader.get(p + "up_proj.weight", (inter, hidden))
        down[e] = reader.get(p + "down_proj.weight", (hidden, inter))
    return gate_up, down
