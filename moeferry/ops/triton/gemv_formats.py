"""GEMV steps: a few rows of x times one weight tile on the CUDA cores, no tl.dot.

For decode (a handful of rows) the MMA path pays for layout shuffles of every dequantized
tile; a GEMV step keeps the tile in the layout it was loaded in, dequantizes it in registers
and reduces along K with `tl.sum`. A step has one signature,

    acc = step(acc, x_ptr, stride_x, M, w_ptr, s_ptr, z_ptr, slot, n0, k0, N, K, PART,
               BM, BN, BK, G, GN, HAS_Z)

and adds `x[0:M, k0:k0+BK] @ W[slot, n0:n0+BN, k0:k0+BK]^T` to the fp32 accumulator `acc`
[BN, BM] (rows of W first, so a row's partial sum joins the accumulator in the tile's own
layout). Weight layouts are the slot layouts of moe_formats.py (one slot: slot = 0); any K.
Only forms where the GEMV measured faster than the tl.dot kernel have one (`GEMV_STEPS`).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rows_times(acc, w, x_ptr, stride_x, M, offs_k, mask_k, BM: tl.constexpr):
    """acc[:, m] += sum_k w[:, k] * x[m, k] for m < M (w fp32 [BN, BK'], offs_k its columns)."""
    offs_m = tl.arange(0, BM)
    for m in tl.static_range(BM):
        xm = tl.load(x_ptr + m * stride_x + offs_k, mask=mask_k & (m < M), other=0.0).to(tl.float32)
        part = tl.sum(w * xm[None, :], axis=1)
        acc = tl.where(offs_m[None, :] == m, acc + part[:, None], acc)
    return acc


@triton.jit
def fp8_row_gemv(acc, x_ptr, stride_x, M, w_ptr, s_ptr, z_ptr, slot, n0, k0, N, K, PART,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, GN: tl.constexpr,
                 HAS_Z: tl.constexpr):
    offs_n = n0 + tl.arange(0, BN)
    offs_k = k0 + tl.arange(0, BK)
    mk = offs_k < K
    q = tl.load(w_ptr + slot * N * K + offs_n[:, None] * K + offs_k[None, :],
                mask=(offs_n < N)[:, None] & mk[None, :], other=0)
    w = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return _rows_times(acc, w, x_ptr, stride_x, M, offs_k, mk, BM)


# Device forms whose GEMV beats their tl.dot decode kernel on the H200 (benchmarks/README.md):
# fp8_row. For fp4 the register dequantization made it 2-3x slower than the tl.dot kernel.
GEMV_STEPS = {"fp8_row": fp8_row_gemv}
