"""Linear layers over checkpoint weights, plain or quantized (one format per module)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

from moeferry.checkpoint.formats import FORMATS, PackedWeight
from moeferry.ops.triton import use_triton


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


class Linears:
    """Several projections of the same input as one GEMM where their weights can be stacked
    (plain `Linear`s of one dtype, or `QuantLinear`s of one format whose packed weights stack:
    `PackedWeight.stack_rows`), one launch instead of several; a tuple of outputs either way."""

    def __init__(self, *parts):
        self.sizes = [m.out_features for m in parts]
        self.fused = _stacked(parts)
        self.parts = None if self.fused is not None else parts

    def __call__(self, x: torch.Tensor) -> tuple:
        if self.fused is not None:
            return self.fused(x).split(self.sizes, dim=-1)
        return tuple(m(x) for m in self.parts)

    def first(self, x: torch.Tensor) -> torch.Tensor:
        """Only the first projection's output (the rest computed too when fused: one GEMM)."""
        return self(x)[0] if self.fused is not None else self.parts[0](x)


def _stacked(parts) -> "Linear | QuantLinear | None":
    if all(type(m) is Linear for m in parts) and len({m.weight.dtype for m in parts}) == 1:
        return Linear(torch.cat([m.weight for m in parts]))
    if all(type(m) is QuantLinear for m in parts) and len({m.format for m in parts}) == 1:
        packed = type(parts[0].packed).stack_rows([m.packed for m in parts])
        return None if packed is None else QuantLinear(packed, parts[0].format)
    return None


class QuantLinear:
    """A weight kept in its packed checkpoint format. On CUDA (or under
    MOEFERRY_TRITON_INTERPRET=1) a Triton GEMM of the format's device form reads the packed
    weight and dequantizes tiles in registers (`moeferry.ops.triton.quant_linear`); elsewhere
    the reference path dequantizes the weight for each call (never the whole model at load)."""

    def __init__(self, packed: PackedWeight, fmt: str):
        self.packed, self.format = packed, fmt
        self.device_form = FORMATS[fmt].device_form
        self.out_features, self.in_features = packed.out_features, packed.in_features
        self._operands = None  # kernel operands (views of `packed`), built on the first kernel call

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            op = self._kernel_operands()
            if op is not None:
                from moeferry.ops.triton.quant_linear import quant_linear
                return quant_linear(x, op)
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense(x.dtype))

    def _kernel_operands(self):
        """Built for real even when first asked inside a dispatch mode (the boot's compile-ahead
        walk computes nothing: a scale converted there could be kept as zeros)."""
        if self._operands is None:
            from moeferry.ops.triton.quant_linear import dense_operands, supported
            with _disable_current_modes():
                op = dense_operands(self.packed, self.device_form)
            self._operands = op if supported(op) else False
        return self._operands or None

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        return self.packed.dequantize(dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes
