"""Partial neox-style rotary embedding: rotate the first R dims (rotate-half), copy the rest.

One program per (token, block of heads). The products are rounded to the activation dtype
before the sum, as the reference (which computes in that dtype) does. No workspace.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeferry.ops.triton import next_pow2


@triton.jit
def _rope_kernel(x_ptr, stride_xt, stride_xh, cos_ptr, sin_ptr, stride_ct, out_ptr, H, D,
                 HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr,
                 BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    i = tl.arange(0, BLOCK_HALF)
    imask = i < HALF
    m = hmask[:, None] & imask[None, :]
    base = x_ptr + t * stride_xt + heads[:, None] * stride_xh
    x1 = tl.load(base + i[None, :], mask=m, other=0.0)
    x2 = tl.load(base + HALF + i[None, :], mask=m, other=0.0)
    c1 = tl.load(cos_ptr + t * stride_ct + i, mask=imask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + i, mask=imask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * stride_ct + i, mask=imask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * stride_ct + HALF + i, mask=imask, other=0.0).to(tl.float32)[None, :]
    dt = out_ptr.dtype.element_ty
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    o1 = (x1f * c1).to(dt).to(tl.float32) + (-x2f * s1).to(dt).to(tl.float32)
    o2 = (x2f * c2).to(dt).to(tl.float32) + (x1f * s2).to(dt).to(tl.float32)
    obase = out_ptr + t * H * D + heads[:, None] * D
    tl.store(obase + i[None, :], o1.to(dt), mask=m)
    tl.store(obase + HALF + i[None, :], o2.to(dt), mask=m)
    if PASS > 0:
        j = tl.arange(0, BLOCK_PASS)
        pm = hmask[:, None] & (j < PASS)[None, :]
        xp = tl.load(base + 2 * HALF + j[None, :], mask=pm, other=0.0)
        tl.store(obase + 2 * HALF + j[None, :], xp.to(dt), mask=pm)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (any strides with unit last-dim stride); cos/sin [T, R], R <= D even."""
    t, h, d = x.shape
    rot = cos.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    half, pas = rot // 2, d - rot
    block_h = min(next_pow2(h), 16)
    _rope_kernel[(t, triton.cdiv(h, block_h))](
        x, x.stride(0), x.stride(1), cos, sin, cos.stride(0), out, h, d,
        HALF=half, BLOCK_HALF=next_pow2(half), PASS=pas, BLOCK_PASS=next_pow2(max(pas, 1)), BLOCK_H=block_h,
        num_warps=4)
    return out
