"""FP8 e4m3 weights: one scale per tensor (or per row), or one per 128x128 block.

fp8_tensor (ModelOpt FP8, compressed-tensors float-quantized, HF fp8 without blocks):
    weight        float8_e4m3fn [out, in]
    weight_scale  fp32 [] / [1] (per tensor) or [out] / [out, 1] (per row)
    input_scale   optional fp32 scalar: static activation scale, read and kept, unused
                  by weight-only math
    W = weight.float() * weight_scale
  HF's fp8 config without `weight_block_size` names the scalar `weight_scale_inv`; it is
  accepted as an alias (it multiplies too, despite the name).

fp8_block (DeepSeek/Qwen fine-grained FP8, `weight_block_size` [128, 128]):
    weight            float8_e4m3fn [out, in]
    weight_scale_inv  fp32 [ceil(out/128), ceil(in/128)]
    W[i, j] = weight[i, j].float() * weight_scale_inv[i // 128, j // 128]
  (`_inv` is historical: the stored value is the dequantization multiplier amax/448.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import FP8_MAX, PackedWeight, QuantFormat, QuantParams, as_scalar, cdiv

E4M3 = torch.float8_e4m3fn
_TINY = 1e-12


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even into e4m3, saturating at +-448 (a bare cast would give NaN)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(E4M3)


@dataclass(frozen=True, eq=False)
class Fp8Weight(PackedWeight):
    weight: torch.Tensor  # e4m3 [out, in]
    scale: torch.Tensor   # fp32 [out]: per-tensor scales are broadcast to every row
    row_fields = ("weight", "scale")

    def dequantize(self, dtype=torch.bfloat16):
        return (self.weight.float() * self.scale[:, None]).to(dtype)


@dataclass(frozen=True, eq=False)
class Fp8BlockWeight(PackedWeight):
    weight: torch.Tensor     # e4m3 [out, in]
    scale_inv: torch.Tensor  # fp32 [ceil(out/b0), ceil(in/b1)]
    block_size: tuple[int, int] = (128, 128)
    row_fields = ("weight", "scale_inv")  # scale_inv by blocks of rows

    @classmethod
    def can_stack(cls, parts) -> bool:
        """Scale rows cover whole blocks: every part but the last fills its blocks."""
        return all(p.out_features % p.block_size[0] == 0 for p in parts[:-1])

    def dequantize(self, dtype=torch.bfloat16):
        return dequant_blocks(self.weight, self.scale_inv, self.block_size).to(dtype)


def dequant_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    out, inp = weight.shape
    s = scale.float().repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :inp]
    return weight.float() * s


class Fp8TensorFormat(QuantFormat):
    name = "fp8_tensor"
    device_form = "fp8_row"
    tensor_suffixes = ("weight", "weight_scale", "input_scale")
    optional_suffixes = ("input_scale",)
    suffix_aliases = {"weight_scale_inv": "weight_scale"}

    def shape_options(self, out_features, in_features, params=None):
        return {"weight": [(out_features, in_features)],
                "weight_scale": [(), (out_features,), (out_features, 1)],
                "input_scale": [()]}

    def dtype_ok(self, suffix, dtype):
        return dtype == E4M3 if suffix == "weight" else dtype.is_floating_point

    def expected_dtype(self, suffix):
        return "float8_e4m3fn" if suffix == "weight" else "a float"

    def bytes_for(self, out_features, in_features, params=None):
        return out_features * in_features + 4 * out_features

    def _row_scale(self, scale: torch.Tensor, out_features: int) -> torch.Tensor:
        if scale.numel() == 1:
            return as_scalar(scale).expand(out_features).contiguous()
        return scale.reshape(out_features).float()

    def dequantize(self, tensors, out_features, in_features, dtype=torch.bfloat16, params=None):
        t = self.canonical(tensors)
        scale = self._row_scale(t["weight_scale"], out_features)
        return (t["weight"].float() * scale[:, None]).to(dtype)

    def quantize(self, weight, params: QuantParams | None = None):
        """ModelOpt FP8: scale = amax / 448 per tensor (per row with per_channel)."""
        p = self.params(params)
        w = weight.float()
        if p.per_channel:
            scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=_TINY)
        else:
            scale = (w.abs().amax() / FP8_MAX).clamp(min=_TINY)
        return {"weight": to_e4m3(w / scale), "weight_scale": scale.float()}

    def packed(self, tensors, params=None):
        t = self.canonical(tensors)
        w = t["weight"]
        return Fp8Weight(w.shape[0], w.shape[1], w.contiguous(),
                         self._row_scale(t["weight_scale"], w.shape[0]).contiguous())


class Fp8BlockFormat(QuantFormat):
    name = "fp8_block"
    device_form = "fp8_block"
    tensor_suffixes = ("weight", "weight_scale_inv")
    default_params = QuantParams(block_size=(128, 128))

    def _block(self, params):
        return tuple(self.params(params).block_size or (128, 128))

    def shape_options(self, out_features, in_features, params=None):
        b0, b1 = self._block(params)
        return {"weight": [(out_features, in_features)],
                "weight_scale_inv": [(cdiv(out_features, b0), cdiv(in_features, b1))]}

    def dtype_ok(self, suffix, dtype):  # Qwen's FP8 releases store weight_scale_inv in bf16
        return dtype == E4M3 if suffix == "weight" else dtype.is_floating_point

    def expected_dtype(self, suffix):
        return "float8_e4m3fn" if suffix == "weight" else "a float"

    def bytes_for(self, out_features, in_features, params=None):
        b0, b1 = self._block(params)
        return out_features * in_features + 4 * cdiv(out_features, b0) * cdiv(in_features, b1)

    def dequantize(self, tensors, out_features, in_features, dtype=torch.bfloat16, params=None):
        return dequant_blocks(tensors["weight"], tensors["weight_scale_inv"], self._block(params)).to(dtype)

    def quantize(self, weight, params: QuantParams | None = None):
        """DeepSeek-V3 block quantization: per block scale = amax / 448 (edge blocks partial)."""
        b0, b1 = self._block(params)
        out, inp = weight.shape
        rb, cb = cdiv(out, b0), cdiv(inp, b1)
        w = torch.zeros(rb * b0, cb * b1, dtype=torch.float32)
        w[:out, :inp] = weight.float()
        blocks = w.view(rb, b0, cb, b1)
        scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=_TINY)
        q = to_e4m3(blocks / scale[:, None, :, None]).view(rb * b0, cb * b1)[:out, :inp]
        return {"weight": q.contiguous(), "weight_scale_inv": scale.float()}

    def packed(self, tensors, params=None):
        w = tensors["weight"]
        return Fp8BlockWeight(w.shape[0], w.shape[1], w.contiguous(),
                              tensors["weight_scale_inv"].float().contiguous(), self._block(params))
