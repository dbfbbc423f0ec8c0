"""Per-format GEMV steps: a few rows of x times one weight tile on the CUDA cores, no tl.dot.

For decode (a handful of rows) the MMA path pays for layout shuffles of every dequantized
tile; these steps keep the tile in the layout it was loaded in, dequantize it in registers
and reduce along K with `tl.sum`. Every form has one `@triton.jit` step with one signature,

    acc = step(acc, x_ptr, stride_x, M, w_ptr, s_ptr, z_ptr, slot, n0, k0, N, K, PART,
               BM, BN, BK, G, GN, HAS_Z)

that adds `x[0:M, k0:k0+BK] @ W[slot, n0:n0+BN, k0:k0+BK]^T` to the fp32 accumulator `acc`
[BN, BM] (rows of W first, so a row's partial sum joins the accumulator in the tile's own
layout). Weight layouts are the slot layouts of moe_formats.py (one slot: slot = 0). Scales
are gathered per element (a group's scale is read by its neighbours from L1), so BK need
not divide a scale group and K needs no padding: any K (even, for nibble-packed forms).
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
def _rows_times2(acc, lo, hi, x_ptr, stride_x, M, offs_b, mask_b, BM: tl.constexpr):
    """Nibble-packed tile: lo holds the even k (2b), hi the odd k (2b + 1) of byte column b."""
    offs_m = tl.arange(0, BM)
    for m in tl.static_range(BM):
        row = x_ptr + m * stride_x + 2 * offs_b
        xe = tl.load(row, mask=mask_b & (m < M), other=0.0).to(tl.float32)
        xo = tl.load(row + 1, mask=mask_b & (m < M), other=0.0).to(tl.float32)
        part = tl.sum(lo * xe[None, :] + hi * xo[None, :], axis=1)
        acc = tl.where(offs_m[None, :] == m, acc + part[:, None], acc)
    return acc


@triton.jit
def dense_gemv(acc, x_ptr, stride_x, M, w_ptr, s_ptr, z_ptr, slot, n0, k0, N, K, PART,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, GN: tl.constexpr,
               HAS_Z: tl.constexpr):
    offs_n = n0 + tl.arange(0, BN)
    offs_k = k0 + tl.arange(0, BK)
    mk = offs_k < K
    w = tl.load(w_ptr + slot * N * K + offs_n[:, None] * K + offs_k[None, :],
                mask=(offs_n < N)[:, None] & mk[None, :], other=0.0).to(tl.float32)
    return _rows_times(acc, w, x_ptr, stride_x, M, offs_k, mk, BM)


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


@triton.jit
def fp8_block_gemv(acc, x_ptr, stride_x, M, w_ptr, s_ptr, z_ptr, slot, n0, k0, N, K, PART,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, GN: tl.constexpr,
                   HAS_Z: tl.constexpr):
    offs_n = n0 + tl.arange(0, BN)
    offs_k = k0 + tl.arange(0, BK)
    mk = offs_k < K
    mask = (offs_n < N)[:, None] & mk[None, :]
    q = tl.load(w_ptr + slot * N * K + offs_n[:, None] * K + offs_k[None, :], mask=mask, other=0)
    nbk = tl.cdiv(K, G)
    nbr = tl.cdiv(PART, GN)
    brow = (offs_n // PART) * nbr + (offs_n % PART) // GN
    sc = tl.load(s_ptr + slot * (N // PART) * nbr * nbk + brow[:, None] * nbk + (offs_k // G)[None, :], mask=mask, other=0.0)
    w = q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc
    return _rows_times(acc, w, x_ptr, stride_x, M, offs_k, mk, BM)


@triton.jit
def fp4_gemv(acc, x_ptr, stride_x, M, w_ptr, s_ptr, z_ptr, slot, n0, k0, N, K, PART,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, GN: tl.constexpr,
             HAS_Z: tl.constexpr):
    kp = K // 2
    ks = K // 16
    offs_n = n0 + tl.arange(0, BN)
    offs_b = k0 // 2 + tl.arange(0, BK // 2)  # byte columns: k = 2b (low nibble), 2b + 1 (high)
    mb = offs_b < kp
    mask = (offs_n < N)[:, None] & mb[None, :]
    p = tl.load(w_ptr + slot * N * kp + offs_n[:, None] * kp + offs_b[None, :], mask=mask, other=0)
    sc = tl.load(s_ptr + slot * N * ks + offs_n[:, None] * ks + (offs_b // 8)[None, :], mask=mask, other=0)
    # e4m3 scale x 2**14 (the E2M1 decode below yields value / 2**14)
    sc = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0
    v = p.to(tl.uint16)
    lo = (((v & 8) << 12) | ((v & 7) << 9)).to(tl.float16, bitcast=True).to(tl.float32) * sc
    hi = (((v & 128) << 8) | ((v & 112) << 5)).to(tl.float16, bitcast=True).to(tl.float32) * sc
    return _rows_times2(acc, lo, hi, x_ptr, stride_x, M, offs_b, mb, BM)


@triton.jit
def int4_gemv(acc, x_ptr, stride_x, M, w_ptr, s_ptr, z_ptr, slot, n0, k0, N, K, PART,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, GN: tl.constexpr,
              HAS_Z: tl.constexpr):
    kp = K // 2
    ng = tl.cdiv(K, G)
    offs_n = n0 + tl.arange(0, BN)
    offs_b = k0 // 2 + tl.arange(0, BK // 2)
    mb = offs_b < kp
    mask = (offs_n < N)[:, None] & mb[None, :]
    p = tl.load(w_ptr + slot * N * kp + offs_n[:, None] * kp + offs_b[None, :], mask=mask, other=0)
    goff = slot * N * ng + offs_n[:, None] * ng + (2 * offs_b // G)[None, :]  # 2b and 2b+1 share a group (G even)
    sc = tl.load(s_ptr + goff, mask=mask, other=0.0).to(tl.float32)
    if HAS_Z:
        zp = tl.load(z_ptr + goff, mask=mask, other=8).to(tl.float32)
    else:
        zp = 8.0
    lo = ((p & 0xF).to(tl.float32) - zp) * sc
    hi = ((p >> 4).to(tl.float32) - zp) * sc
    return _rows_times2(acc, lo, hi, x_ptr, stride_x, M, offs_b, mb, BM)


GEMV_STEPS = {"dense": dense_gemv, "fp8_row": fp8_row_gemv, "fp8_block": fp8_block_gemv,
              "fp4": fp4_gemv, "int4": int4_gemv}
