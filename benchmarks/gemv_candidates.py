"""Candidate GEMV steps for the MoE decode path, timed against the engine's by
`moe_decode_sweep.py --forms fp4:scaled_3d` (a form, a colon, a candidate's name).

A candidate has the signature of the steps in `moeferry/ops/triton/moe_formats.py` ("decode GEMV
steps") and replaces its form's step in one slot buffer of the sweep, so it runs in the engine's
own kernels; the sweep checks its output against the fp32 reference like any config. A candidate
that wins moves into moe_formats.py; until then the engine does not run it.

scaled_3d (fp4): the weight tile is loaded 3-D [rows, groups of 16 values, 8 bytes], each group's
e4m3 scale multiplies its products and one row sum over groups x bytes follows. The engine's step
sums each group first and then reduces the [rows, groups] partial sums, a sliced layout that
Triton reduces across lanes with 468 shuffles a thread at the decode config; this one compiles to
3148 instructions a thread against 3615 (sm_90 SASS, counted offline; benchmarks/README.md).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fp4_scaled_3d(acc, x_ptr, w_ptr, s_ptr, z_ptr, slot, n0, k0, N, K, PART,
                  BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, GN: tl.constexpr, GB: tl.constexpr,
                  HAS_Z: tl.constexpr):
    offs_n = n0 + tl.arange(0, BN)
    mn = offs_n < N
    kp = K // 2
    groups: tl.constexpr = BK // 16
    offs_g = k0 // 16 + tl.arange(0, groups)
    byte = offs_g[:, None] * 8 + tl.arange(0, 8)[None, :]  # [groups, 8]: byte j holds k 2j, 2j + 1
    mb = byte < kp
    p = tl.load(w_ptr + slot * N * kp + offs_n[:, None, None] * kp + byte[None, :, :],
                mask=mn[:, None, None] & mb[None, :, :], other=0)
    xe = tl.load(x_ptr + 2 * byte, mask=mb, other=0.0).to(tl.float32)
    xo = tl.load(x_ptr + 2 * byte + 1, mask=mb, other=0.0).to(tl.float32)
    ks = K // 16
    sc = tl.load(s_ptr + slot * N * ks + offs_n[:, None, None] * ks + offs_g[None, :, None] + byte[None, :, :] * 0,
                 mask=mn[:, None, None] & (offs_g < ks)[None, :, None], other=0)
    sc = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    # E2M1 -> fp16 bits (value / 2**14, exact), as the engine's fp4 steps
    v = p.to(tl.uint16)
    lo = (((v & 8) << 12) | ((v & 7) << 9)).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (((v & 128) << 8) | ((v & 112) << 5)).to(tl.float16, bitcast=True).to(tl.float32)
    prod = (lo * xe[None, :, :] + hi * xo[None, :, :]) * sc
    return acc + tl.sum(tl.reshape(prod, (BN, BK // 2)), axis=1) * 16384.0


# name -> (the slot form it replaces the step of, the step)
CANDIDATES = {"scaled_3d": ("fp4", fp4_scaled_3d)}
