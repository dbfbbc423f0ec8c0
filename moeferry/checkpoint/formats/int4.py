"""int4 weights with a scale (and zero point) per group of inputs, two producers.

int4_awq (AutoAWQ GEMM, `version: gemm`), stored transposed, input dim first:
    qweight  int32 [in, out/8]
    qzeros   int32 [ceil(in/g), out/8]
    scales   fp16  [ceil(in/g), out]
    W[o, i] = (q[i, o] - z[i // g, o]) * s[i // g, o]        q, z unsigned in 0..15
  AWQ nibble order: the 8 nibbles of one int32 word hold 8 consecutive output columns
  c0..c7 of its pack, but not in order. AutoAWQ packs with ORDER = [0, 2, 4, 6, 1, 3, 5, 7]:
      word = sum_i col[ORDER[i]] << (4 * i)
  so nibble i (bits 4i..4i+3) holds column ORDER[i]; column c lives in nibble
  REVERSE[c] with REVERSE = [0, 4, 1, 5, 2, 6, 3, 7]. qzeros uses the same packing.

int4_ct (compressed-tensors `pack-quantized`, num_bits 4), row-major like the weight:
    weight_packed      int32 [out, ceil(in/8)]: element 8w+j of a row in bits 4j..4j+3 of
                       word w, stored offset-binary (q + 8, q in -8..7)
    weight_scale       float [out, ceil(in/g)]   ([out, 1] for the channel strategy)
    weight_shape       int   [2] = (out, in)
    weight_zero_point  asymmetric only: int32 [ceil(out/8), ceil(in/g)], packed along the
                       OUTPUT dim: zp of row 8w+j, group k in bits 4j of word [w, k], offset +8
    W[o, i] = (q - zp) * s

Device form (both): `Int4Weight` -- uint8 [out, in/2] of unsigned nibbles (element 2j low,
2j+1 high, the same byte layout as NVFP4), scales [out, ngroups], unsigned zeros uint8
[out, ngroups] (None: symmetric, the zero is 8). W = (u - z) * s.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from moeferry.native import library_or_none

from .base import PackedWeight, QuantFormat, QuantParams, cdiv
from .fp4 import unpack_nibbles

log = logging.getLogger("moeferry.checkpoint")

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
_SHIFTS = torch.arange(0, 32, 4)


# -- int32 nibble packing ------------------------------------------------------------------
def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the same bits as int32."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_int32(vals: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[R, 8C] nibbles -> int32 [R, C]; nibble i of word c holds column 8c + order[i]."""
    v = vals.long().view(vals.shape[0], -1, 8)[..., list(order)]
    return _to_int32((v << _SHIFTS).sum(-1))


def unpack_int32(words: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """int32 [R, C] -> nibbles int64 [R, 8C] (inverse of pack_int32 with the same order)."""
    nib = (words.long()[..., None] >> _SHIFTS) & 0xF  # [R, C, 8], nibble i
    inverse = [order.index(c) for c in range(8)]      # column c sits in nibble inverse[c]
    return nib[..., inverse].reshape(words.shape[0], -1)


_NIBBLES = 0x0F0F0F0F
_AWQ_BYTE_COLUMNS = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # column c of a word pair's 8 bytes sits in byte [c]


def awq_nibble_bytes(qweight: torch.Tensor) -> torch.Tensor:
    """AWQ qweight int32 [in, out/8] -> uint8 [out, in/2] (inputs 2j low, 2j+1 high; the same
    bytes as `pack_nibbles(unpack_int32(qweight, AWQ_ORDER).t())`) in int32 word operations:
    rows 2j and 2j+1 are merged nibble by nibble (even nibbles, then odd: columns 0,4,1,5 and
    2,6,3,7 of the pack, by AWQ's order) and the bytes put in column order while transposing.
    6-12x faster than going through int64 nibbles (int4_awq expert reads: 1.3 s a layer on the
    H200 host). Bytes of an int32 in little-endian order, as on every host torch runs on here."""
    a, b = qweight[0::2], qweight[1::2]
    even = (a & _NIBBLES) | ((b & _NIBBLES) << 4)
    odd = ((a >> 4) & _NIBBLES) | (((b >> 4) & _NIBBLES) << 4)
    pairs = torch.stack((even, odd), -1).view(torch.uint8).view(a.shape[0], -1, 8)  # [in/2, out/8, 8]
    return pairs.permute(1, 2, 0).index_select(1, _AWQ_BYTE_COLUMNS.to(qweight.device)).reshape(-1, a.shape[0])


_REPACK_SOURCE = Path(__file__).with_name("awq_repack.c")


@functools.cache
def _repacker() -> ctypes.CDLL | None:
    """`awq_repack.c` built (once per machine, on first use), or None without a C compiler."""
    def load(path: Path, flags: list[str]) -> ctypes.CDLL:
        lib = ctypes.CDLL(str(path))
        lib.awq_repack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        lib.awq_repack.restype = None
        return lib
    return library_or_none(_REPACK_SOURCE, (["-O3", "-march=native"], ["-O3"]), load, log, "int4_awq repacking: PyTorch")


def awq_device_bytes(qweight: torch.Tensor) -> torch.Tensor:
    """`awq_nibble_bytes(qweight)`, by its C form for a host tensor where that is built: one pass
    in cache tiles, without the GIL (the loader's reader threads repack several modules at once;
    2.4x the PyTorch form's single call on the development machine)."""
    lib = _repacker() if qweight.device.type == "cpu" and qweight.dtype == torch.int32 else None
    if lib is None or qweight.shape[0] % 2:
        return awq_nibble_bytes(qweight)
    q = qweight.contiguous()
    out = torch.empty(8 * q.shape[1], q.shape[0] // 2, dtype=torch.uint8)
    lib.awq_repack(q.data_ptr(), q.shape[0], q.shape[1], out.data_ptr())
    return out


def _grouped(w: torch.Tensor, g: int) -> torch.Tensor:
    """[out, in] -> [out, ceil(in/g), g]; a partial last group is padded with its own last value."""
    out, inp = w.shape
    pad = cdiv(inp, g) * g - inp
    if pad:
        w = torch.cat([w, w[:, -1:].expand(out, pad)], dim=1)
    return w.view(out, -1, g)


def _expand_groups(t: torch.Tensor, g: int, in_features: int) -> torch.Tensor:
    return t.repeat_interleave(g, dim=1)[:, :in_features]


def _group_size(in_features: int, ngroups: int, params: QuantParams) -> int:
    """The configured group size when the scales agree with it, else the one they imply."""
    g = params.group_size or in_features
    if cdiv(in_features, g) == ngroups:
        return g
    if in_features % ngroups == 0:
        return in_features // ngroups
    raise ValueError(f"{ngroups} scale groups do not fit {in_features} inputs with group size {g}")


@dataclass(frozen=True, eq=False)
class Int4Weight(PackedWeight):
    packed: torch.Tensor         # uint8 [out, in/2] unsigned nibbles, element 2j low
    scales: torch.Tensor         # fp16/bf16 [out, ngroups]
    zeros: torch.Tensor | None   # uint8 [out, ngroups] unsigned zero points; None means 8
    group_size: int = 128
    row_fields = ("packed", "scales", "zeros")

    def dequantize(self, dtype=torch.bfloat16):
        u = unpack_nibbles(self.packed).float()[:, :self.in_features]
        z = self.zeros.float() if self.zeros is not None else torch.full_like(self.scales, 8, dtype=torch.float32)
        zz = _expand_groups(z, self.group_size, self.in_features)
        ss = _expand_groups(self.scales.float(), self.group_size, self.in_features)
        return ((u - zz) * ss).to(dtype)


def _int4_bytes(out_features, in_features, g, zeros: bool) -> int:
    ng = cdiv(in_features, g)
    return out_features * in_features // 2 + out_features * ng * 2 + (out_features * ng if zeros else 0)


class Int4AwqFormat(QuantFormat):
    name = "int4_awq"
    device_form = "int4"
    repacks = True
    tensor_suffixes = ("qweight", "qzeros", "scales")
    default_params = QuantParams(group_size=128, symmetric=False)

    def _g(self, in_features, params):
        return self.params(params).group_size or in_features

    def shape_options(self, out_features, in_features, params=None):
        ng = cdiv(in_features, self._g(in_features, params))
        return {"qweight": [(in_features, out_features // 8)],
                "qzeros": [(ng, out_features // 8)],
                "scales": [(ng, out_features)]}

    def dtype_ok(self, suffix, dtype):
        return dtype == torch.int32 if suffix in ("qweight", "qzeros") else dtype.is_floating_point

    def expected_dtype(self, suffix):
        return "int32" if suffix in ("qweight", "qzeros") else "float16"

    def bytes_for(self, out_features, in_features, params=None):
        return _int4_bytes(out_features, in_features, self._g(in_features, params), zeros=True)

    def _zeros_scales_group(self, tensors, params):
        """(unsigned zeros [ngroups, out], scales [ngroups, out], group size)."""
        s = tensors["scales"]
        z = unpack_int32(tensors["qzeros"], AWQ_ORDER)
        return z, s, _group_size(tensors["qweight"].shape[0], s.shape[0], self.params(params))

    def _unpacked(self, tensors, params):
        q = unpack_int32(tensors["qweight"], AWQ_ORDER)  # [in, out]
        return (q, *self._zeros_scales_group(tensors, params))

    def dequantize(self, tensors, out_features, in_features, dtype=torch.bfloat16, params=None):
        q, z, s, g = self._unpacked(tensors, params)
        zz = z.float().repeat_interleave(g, 0)[:in_features]
        ss = s.float().repeat_interleave(g, 0)[:in_features]
        return ((q.float() - zz) * ss).t().contiguous().to(dtype)

    def quantize(self, weight, params: QuantParams | None = None):
        """AutoAWQ pseudo_quantize_tensor (zero_point=True, 4 bits) + WQLinear_GEMM packing:
        s = max(max - min, 1e-5) / 15 (fp16), z = clamp(-round(min / s), 0, 15),
        q = clamp(round(w / s) + z, 0, 15)."""
        out, inp = weight.shape
        if out % 8:
            raise ValueError(f"int4_awq: out_features {out} is not a multiple of 8")
        g = self._g(inp, params)
        wg = _grouped(weight.float(), g)
        mx, mn = wg.amax(-1), wg.amin(-1)
        scales = ((mx - mn).clamp(min=1e-5) / 15).to(torch.float16)
        s = scales.float()
        zeros = (-torch.round(mn / s)).clamp(0, 15)
        q = (torch.round(wg / s[..., None]) + zeros[..., None]).clamp(0, 15).view(out, -1)[:, :inp]
        return {"qweight": pack_int32(q.t().contiguous(), AWQ_ORDER),
                "qzeros": pack_int32(zeros.t().contiguous(), AWQ_ORDER),
                "scales": scales.t().contiguous()}

    def packed(self, tensors, params=None):
        qweight = tensors["qweight"]
        inp, out = qweight.shape[0], 8 * qweight.shape[1]
        if inp % 2:
            raise ValueError(f"int4_awq: in_features {inp} is odd (nibble pairs need an even count)")
        z, s, g = self._zeros_scales_group(tensors, params)
        return Int4Weight(out, inp, awq_device_bytes(qweight), s.t().contiguous(), z.t().to(torch.uint8).contiguous(), g)


class Int4CtFormat(QuantFormat):
    name = "int4_ct"
    device_form = "int4"
    tensor_suffixes = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
    optional_suffixes = ("weight_zero_point",)
    default_params = QuantParams(group_size=128, symmetric=True)

    def _g(self, in_features, params):
        return self.params(params).group_size or in_features

    def required_suffixes(self, params=None):
        req = ("weight_packed", "weight_scale", "weight_shape")
        return req if self.params(params).symmetric else req + ("weight_zero_point",)

    def shape_options(self, out_features, in_features, params=None):
        ng = cdiv(in_features, self._g(in_features, params))
        return {"weight_packed": [(out_features, cdiv(in_features, 8))],
                "weight_scale": [(out_features, ng)],
                "weight_shape": [(2,)],
                "weight_zero_point": [(cdiv(out_features, 8), ng)]}

    def dtype_ok(self, suffix, dtype):
        if suffix in ("weight_packed", "weight_zero_point"):
            return dtype == torch.int32
        if suffix == "weight_shape":
            return not dtype.is_floating_point
        return dtype.is_floating_point

    def expected_dtype(self, suffix):
        return {"weight_packed": "int32", "weight_zero_point": "int32",
                "weight_shape": "an integer"}.get(suffix, "a float")

    def bytes_for(self, out_features, in_features, params=None):
        p = self.params(params)
        return _int4_bytes(out_features, in_features, self._g(in_features, p), zeros=not p.symmetric)

    @staticmethod
    def _zeros(tensors, out_features):
        """Unsigned zeros [out, ngroups] (None: symmetric)."""
        zp = tensors.get("weight_zero_point")
        return unpack_int32(zp.t().contiguous()).t()[:out_features] if zp is not None else None

    def _unsigned(self, tensors, out_features, in_features):
        """Unsigned weight nibbles [out, in] and unsigned zeros [out, ngroups] (None: symmetric)."""
        return unpack_int32(tensors["weight_packed"])[:, :in_features], self._zeros(tensors, out_features)

    def dequantize(self, tensors, out_features, in_features, dtype=torch.bfloat16, params=None):
        u, uz = self._unsigned(tensors, out_features, in_features)
        s = tensors["weight_scale"].float()
        g = _group_size(in_features, s.shape[1], self.params(params))
        z = uz.float() if uz is not None else torch.full_like(s, 8.0)
        return ((u.float() - _expand_groups(z, g, in_features)) * _expand_groups(s, g, in_features)).to(dtype)

    def quantize(self, weight, params: QuantParams | None = None):
        """compressed-tensors calculate_qparams + quantize for int4 group quantization.
        symmetric: s = amax / 7.5, q = clamp(round(w / s), -8, 7);
        asymmetric: s = (max - min) / 15 with min <= 0 <= max, zp = round(clamp(-8 - min / s, -8, 7)),
        q = clamp(round(w / s + zp), -8, 7). Arithmetic in the weight's dtype, like CT."""
        p = self.params(params)
        out, inp = weight.shape
        g = self._g(inp, p)
        wg = _grouped(weight, g)
        mn = torch.minimum(wg.amin(-1), torch.zeros((), dtype=weight.dtype))
        mx = torch.maximum(wg.amax(-1), torch.zeros((), dtype=weight.dtype))
        eps = torch.finfo(weight.dtype).eps
        if p.symmetric:
            scale = torch.maximum(mn.abs(), mx) / 7.5
            scale = torch.where(scale == 0, torch.full_like(scale, eps), scale)
            zp = None
            scaled = wg / scale[..., None]
        else:
            scale = (mx - mn) / 15
            scale = torch.where(scale == 0, torch.full_like(scale, eps), scale)
            zp = torch.round((-8 - mn / scale).clamp(-8, 7)).to(torch.int8)
            scaled = wg / scale[..., None] + zp[..., None].to(weight.dtype)
        q = torch.round(scaled.clamp(-8, 7)).view(out, -1)[:, :inp].long()
        pad = cdiv(inp, 8) * 8 - inp
        u = torch.nn.functional.pad(q + 8, (0, pad))
        t = {"weight_packed": pack_int32(u), "weight_scale": scale.contiguous(),
             "weight_shape": torch.tensor([out, inp])}
        if zp is not None:
            uz = torch.nn.functional.pad(zp.long().t() + 8, (0, cdiv(out, 8) * 8 - out))
            t["weight_zero_point"] = pack_int32(uz).t().contiguous()
        return t

    def packed(self, tensors, params=None):
        out, inp = (int(x) for x in tensors["weight_shape"].tolist())
        if inp % 2:
            raise ValueError(f"int4_ct: in_features {inp} must be even for the device layout")
        uz = self._zeros(tensors, out)
        s = tensors["weight_scale"]
        g = _group_size(inp, s.shape[1], self.params(params))
        zeros = uz.to(torch.uint8).contiguous() if uz is not None else None
        # element 8w+j in bits 4j of word w: a little-endian word's bytes already hold elements
        # 2k (low) and 2k+1 (high), the device layout; the stored offset-binary nibble is unsigned
        nibble_bytes = tensors["weight_packed"].contiguous().view(torch.uint8)[:, :inp // 2].contiguous()
        return Int4Weight(out, inp, nibble_bytes, s.contiguous(), zeros, g)
