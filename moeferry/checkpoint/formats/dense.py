"""bf16: a plain unquantized weight (any float dtype on disk, bf16 on the device)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from .base import PackedWeight, QuantFormat, QuantParams


@dataclass(frozen=True, eq=False)
class DenseWeight(PackedWeight):
    weight: torch.Tensor  # [out, in] bf16
    row_fields = ("weight",)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return self.weight.to(dtype)


class Bf16Format(QuantFormat):
    name = "bf16"
    device_form = "dense"
    tensor_suffixes = ("weight",)

    def shape_options(self, out_features, in_features, params=None):
        return {"weight": [(out_features, in_features)]}

    def dtype_ok(self, suffix, dtype):
        return dtype.is_floating_point and dtype.itemsize >= 2

    def expected_dtype(self, suffix):
        return "a 16/32-bit float"

    def bytes_for(self, out_features, in_features, params=None):
        return out_features * in_features * 2

    def dequantize(self, tensors: Mapping[str, torch.Tensor], out_features, in_features,
                   dtype=torch.bfloat16, params=None):
        return tensors["weight"].to(dtype)

    def quantize(self, weight, params: QuantParams | None = None):
        return {"weight": weight}

    def packed(self, tensors, params=None):
        w = tensors["weight"]
        return DenseWeight(w.shape[0], w.shape[1], w.to(torch.bfloat16).contiguous())
