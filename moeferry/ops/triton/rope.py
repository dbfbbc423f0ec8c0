"""Partial neox-style rotary embedding: rotate the first R dims (rotate-half), copy the rest;
and attention's q/k RMSNorm + rotary in one launch (`qk_norm_rope`).

One program per (token, block of heads). The products are rounded to the activation dtype
before the sum, as the reference (which computes in that dtype) does. No workspace.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeferry.ops.triton import next_pow2
from moeferry.ops.triton.norm import weighted


@triton.jit
def _rotated(x1, x2, cos_row, sin_row, i, imask, half, dt):
    """The rotate-half rotary of the halves x1, x2 ([heads, half], fp32 values of dtype `dt`)
    by one token's cos/sin rows: each product rounded to `dt` before the sum, as the reference
    (which computes in that dtype) does. Returns (o1, o2) in fp32."""
    c1 = tl.load(cos_row + i, mask=imask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_row + half + i, mask=imask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_row + i, mask=imask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_row + half + i, mask=imask, other=0.0).to(tl.float32)[None, :]
    o1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
    o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    return o1, o2


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
    dt = out_ptr.dtype.element_ty
    o1, o2 = _rotated(x1.to(tl.float32), x2.to(tl.float32), cos_ptr + t * stride_ct, sin_ptr + t * stride_ct,
                      i, imask, HALF, dt)
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


@triton.jit
def _normed(base, w_ptr, cols, cmask, hmask, inv, dt, ZERO_CENTERED: tl.constexpr):
    """Columns `cols` of a block of heads after RMSNorm (1/rms per head in `inv`), rounded to the
    activation dtype `dt` where `norm._rms_norm_kernel` rounds; as fp32."""
    x = tl.load(base + cols[None, :], mask=hmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    return weighted(x * inv[:, None], w, dt, ZERO_CENTERED).to(dt).to(tl.float32)


@triton.jit(do_not_specialize=["stride_qt", "stride_qh", "stride_kt", "stride_kh", "HQ", "HK", "q_blocks"])
def _qk_norm_rope_kernel(q_ptr, stride_qt, stride_qh, k_ptr, stride_kt, stride_kh, qw_ptr, kw_ptr,
                         cos_ptr, sin_ptr, stride_ct, qo_ptr, ko_ptr, HQ, HK, q_blocks, eps,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                         PASS: tl.constexpr, BLOCK_PASS: tl.constexpr, BLOCK_H: tl.constexpr,
                         ZERO_CENTERED: tl.constexpr):
    """One program: a block of q heads or of k heads of one token; per head RMSNorm over D,
    then rotary on the first 2 * HALF dims (`_rope_kernel`'s rounding), the rest copied."""
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    if hb < q_blocks:
        x_ptr, w_ptr, o_ptr, stride_t, stride_h, H = q_ptr, qw_ptr, qo_ptr, stride_qt, stride_qh, HQ
    else:
        hb -= q_blocks
        x_ptr, w_ptr, o_ptr, stride_t, stride_h, H = k_ptr, kw_ptr, ko_ptr, stride_kt, stride_kh, HK
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    base = x_ptr + t * stride_t + heads[:, None] * stride_h
    d = tl.arange(0, BLOCK_D)
    xf = tl.load(base + d[None, :], mask=hmask[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / D + eps)
    dt = o_ptr.dtype.element_ty
    i = tl.arange(0, BLOCK_HALF)
    imask = i < HALF
    y1 = _normed(base, w_ptr, i, imask, hmask, inv, dt, ZERO_CENTERED)
    y2 = _normed(base, w_ptr, HALF + i, imask, hmask, inv, dt, ZERO_CENTERED)
    o1, o2 = _rotated(y1, y2, cos_ptr + t * stride_ct, sin_ptr + t * stride_ct, i, imask, HALF, dt)
    obase = o_ptr + t * H * D + heads[:, None] * D
    m = hmask[:, None] & imask[None, :]
    tl.store(obase + i[None, :], o1.to(dt), mask=m)
    tl.store(obase + HALF + i[None, :], o2.to(dt), mask=m)
    if PASS > 0:
        j = 2 * HALF + tl.arange(0, BLOCK_PASS)
        jmask = j < D
        yp = _normed(base, w_ptr, j, jmask, hmask, inv, dt, ZERO_CENTERED)
        tl.store(obase + j[None, :], yp.to(dt), mask=hmask[:, None] & jmask[None, :])


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 zero_centered: bool, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D] (unit last-dim stride, any other strides); per-head RMSNorm
    weights [D] in q's dtype; cos/sin [T, R], R <= D even. One launch for both; new contiguous
    outputs."""
    t, hq, d = q.shape
    hk = k.shape[1]
    rot = cos.shape[-1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    qo = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((t, hk, d), dtype=k.dtype, device=k.device)
    if t == 0:
        return qo, ko
    half, pas = rot // 2, d - rot
    block_h = min(next_pow2(max(hq, hk)), 16)
    q_blocks = triton.cdiv(hq, block_h)
    _qk_norm_rope_kernel[(t, q_blocks + triton.cdiv(hk, block_h))](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), q_weight, k_weight, cos, sin, cos.stride(0),
        qo, ko, hq, hk, q_blocks, eps, D=d, BLOCK_D=next_pow2(d), HALF=half, BLOCK_HALF=next_pow2(half),
        PASS=pas, BLOCK_PASS=next_pow2(max(pas, 1)), BLOCK_H=block_h, ZERO_CENTERED=zero_centered, num_warps=4)
    return qo, ko
