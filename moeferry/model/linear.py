"""Linear layers over checkpoint weights, plain or quantized (one format per module)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moeferry.checkpoint.formats import PackedWeight


class Linear:
    """y = x W^T for a dense W [out, in]."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.to(dtype)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class QuantLinear:
    """A weight kept in its packed checkpoint format; the reference path dequantizes it on
    the fly for each call (never the whole model at load)."""

    def __init__(self, packed: PackedWeight, fmt: str):
        self.packed, self.format = packed, fmt
        self.out_features, self.in_features = packed.out_features, packed.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense(x.dtype))

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        return self.packed.dequantize(dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes
