"""NVFP4: E2M1 values in groups of 16 with an e4m3 scale per group and one fp32 global.

Packing (both producers): uint8 [out, in/2]; element 2j of a row is the LOW nibble of
byte j, element 2j+1 the HIGH nibble. A nibble is sign (bit 3) + magnitude code (bits
0-2) indexing E2M1 {0, 0.5, 1, 1.5, 2, 3, 4, 6}.

nvfp4 (ModelOpt):
    weight          uint8 [out, in/2]
    weight_scale    float8_e4m3fn [out, in/16]
    weight_scale_2  fp32 []               W = e2m1 * weight_scale.float() * weight_scale_2
    input_scale     optional fp32 [] (W4A4 activation scale; unused weight-only)
nvfp4_ct (compressed-tensors nvfp4-pack-quantized):
    weight_packed        uint8 [out, in/2]
    weight_scale         float8_e4m3fn [out, in/16]
    weight_global_scale  fp32 [1]          W = e2m1 * weight_scale.float() / weight_global_scale
    input_global_scale   optional fp32 [1]
i.e. weight_global_scale = 1 / weight_scale_2; the device form stores the multiplier.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import FP8_MAX, PackedWeight, QuantFormat, QuantParams, as_scalar
from .fp8 import E4M3

FP4_MAX = 6.0
GROUP = 16
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
# 2 * magnitude -> magnitude code (only 0, 1, 2, 3, 4, 6, 8, 12 occur)
_CODE_OF_TWICE = torch.tensor([0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7], dtype=torch.uint8)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (uint8 nibble) of already-scaled values; |x| > 6 saturates.

    The E2M1 grid has step 0.5 on [0, 2], 1 on [2, 4] and 2 on [4, 6], so rounding to the
    nearest grid value is a round-half-even at that step; on this grid a tie between two
    values always goes to the one with the even code (the ties of the RTN quantizers).
    Device-agnostic (works on CUDA tensors)."""
    mag = x.abs().float().clamp(max=FP4_MAX)
    twice = torch.where(mag < 2, torch.round(mag * 2),
                        torch.where(mag < 4, torch.round(mag) * 2, torch.round(mag * 0.5) * 4))
    code = _CODE_OF_TWICE.to(x.device)[twice.long()]
    return code | ((x < 0).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 nibbles -> float32 values. On the CPU a table lookup; on a device computed there (a
    host table would need a host-to-device copy, which syncs): magnitude code m in 0..7 is
    m/2 below 4, m-2 at 4..5, 2(m-4) at 6..7."""
    if codes.device.type == "cpu":
        return E2M1_VALUES[codes.long()]
    c = codes.to(torch.int32)
    m = (c & 7).float()
    mag = torch.where(m < 4, m * 0.5, torch.where(m < 6, m - 2.0, (m - 4.0) * 2.0))
    return torch.where((c & 8) != 0, -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., n] nibbles -> [..., n/2] bytes, element 2j low, 2j+1 high."""
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n/2] bytes -> [..., n] nibbles (inverse of pack_nibbles)."""
    p = packed.to(torch.uint8)
    return torch.stack((p & 0x0F, p >> 4), dim=-1).flatten(-2)


def dequant_nvfp4(packed: torch.Tensor, scale: torch.Tensor, global_mult: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    out = packed.shape[0]
    vals = e2m1_decode(unpack_nibbles(packed)).view(out, -1, GROUP)
    w = vals * (scale.float() * global_mult.float().reshape(-1, 1))[..., None]  # a scalar or one per row
    return w.view(out, -1).to(dtype)


@dataclass(frozen=True, eq=False)
class Fp4Weight(PackedWeight):
    packed: torch.Tensor       # uint8 [out, in/2], low nibble first
    scale: torch.Tensor        # float8_e4m3fn [out, in/16]
    global_scale: torch.Tensor  # fp32 [1], a multiplier (ModelOpt weight_scale_2); [out] once rows are stacked
    row_fields = ("packed", "scale", "global_scale")

    def rows_of(self, name: str) -> torch.Tensor:
        if name == "global_scale":
            return self.global_scale.float().reshape(-1).expand(self.out_features) \
                if self.global_scale.numel() == 1 else self.global_scale
        return getattr(self, name)

    def dequantize(self, dtype=torch.bfloat16):
        return dequant_nvfp4(self.packed, self.scale, self.global_scale, dtype)


class _Nvfp4Base(QuantFormat):
    device_form = "fp4"
    packed_name: str
    global_name: str
    input_name: str
    default_params = QuantParams(group_size=GROUP)

    def _check_dims(self, in_features):
        if in_features % GROUP:
            raise ValueError(f"{self.name}: in_features {in_features} is not a multiple of {GROUP}")

    def shape_options(self, out_features, in_features, params=None):
        return {self.packed_name: [(out_features, in_features // 2)],
                "weight_scale": [(out_features, in_features // GROUP)],
                self.global_name: [()], self.input_name: [()]}

    def dtype_ok(self, suffix, dtype):
        if suffix == self.packed_name:
            return dtype == torch.uint8
        if suffix == "weight_scale":
            return dtype == E4M3
        return dtype == torch.float32

    def expected_dtype(self, suffix):
        return {self.packed_name: "uint8", "weight_scale": "float8_e4m3fn"}.get(suffix, "float32")

    def bytes_for(self, out_features, in_features, params=None):
        return out_features * in_features // 2 + out_features * in_features // GROUP + 4

    def _global_mult(self, g: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self, tensors, out_features, in_features, dtype=torch.bfloat16, params=None):
        return dequant_nvfp4(tensors[self.packed_name], tensors["weight_scale"],
                             self._global_mult(tensors[self.global_name]), dtype)

    def packed(self, tensors, params=None):
        p = tensors[self.packed_name]
        return Fp4Weight(p.shape[0], p.shape[1] * 2, p.contiguous(), tensors["weight_scale"].contiguous(),
                         self._global_mult(tensors[self.global_name]).reshape(1).contiguous())

    @staticmethod
    def _encode(w: torch.Tensor, eff_scale: torch.Tensor) -> torch.Tensor:
        """Pack w [out, in] given the effective per-group scale [out, in/16]."""
        out = w.shape[0]
        scaled = w.view(out, -1, GROUP) / eff_scale[..., None]
        return pack_nibbles(e2m1_encode(scaled.clamp(-FP4_MAX, FP4_MAX)).view(out, -1))


class Nvfp4Format(_Nvfp4Base):
    """ModelOpt NVFP4QTensor math."""

    name = "nvfp4"
    tensor_suffixes = ("weight", "weight_scale", "weight_scale_2", "input_scale")
    optional_suffixes = ("input_scale",)
    packed_name, global_name, input_name = "weight", "weight_scale_2", "input_scale"

    def _global_mult(self, g):
        return as_scalar(g)

    def quantize(self, weight, params: QuantParams | None = None):
        """weight_scale_2 = amax / (6 * 448); weight_scale = e4m3(group_amax / 6 / weight_scale_2)
        (1.0 for an all-zero group); values = nearest E2M1 of w / (weight_scale * weight_scale_2)."""
        self._check_dims(weight.shape[1])
        w = weight.float()
        amax = w.abs().amax()
        scale_2 = (torch.where(amax > 0, amax, torch.ones_like(amax)) / (FP4_MAX * FP8_MAX)).float()
        group_amax = w.view(w.shape[0], -1, GROUP).abs().amax(-1)
        per_group = group_amax / FP4_MAX / scale_2
        per_group = torch.where(group_amax == 0, torch.ones_like(per_group), per_group)
        scale = per_group.clamp(max=FP8_MAX).to(E4M3)
        eff = scale.float() * scale_2
        eff = torch.where(eff == 0, torch.ones_like(eff), eff)  # scale underflowed e4m3: w ~ 0
        return {"weight": self._encode(w, eff), "weight_scale": scale, "weight_scale_2": scale_2}


class Nvfp4CtFormat(_Nvfp4Base):
    """compressed-tensors NVFP4 (llm-compressor tensor_group strategy) math."""

    name = "nvfp4_ct"
    tensor_suffixes = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")
    optional_suffixes = ("input_global_scale",)
    packed_name, global_name, input_name = "weight_packed", "weight_global_scale", "input_global_scale"

    def _global_mult(self, g):
        return 1.0 / as_scalar(g)

    def quantize(self, weight, params: QuantParams | None = None):
        """global = 448 * 6 / amax; weight_scale = e4m3(global * group_amax / 6) (0 -> 0.125,
        the e4m3 eps CT substitutes); values = nearest E2M1 of w / (weight_scale / global)."""
        self._check_dims(weight.shape[1])
        w = weight.float()
        amax = w.abs().amax().clamp(min=torch.finfo(torch.float32).tiny)
        gscale = torch.nan_to_num(FP8_MAX * FP4_MAX / amax, nan=1.0, posinf=1.0, neginf=1.0).float()
        group_amax = w.view(w.shape[0], -1, GROUP).abs().amax(-1)
        scale = (gscale * (group_amax / FP4_MAX)).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
        scale = torch.where(scale.float() == 0, torch.full_like(scale.float(), 0.125), scale.float()).to(E4M3)
        eff = scale.float() / gscale
        return {"weight_packed": self._encode(w, eff), "weight_scale": scale,
                "weight_global_scale": gscale.reshape(1)}
