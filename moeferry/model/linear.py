"""Linear layer over a checkpoint weight."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear:
    """y = x W^T for W [out, in]."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()
