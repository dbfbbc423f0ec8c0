"""RMSNorm kernels: plain / zero-centred, fused residual add, gated (Gated DeltaNet output).

Each program normalises ROWS rows of length N (BLOCK = next power of two >= N). Rounding
follows the references in `moeferry.ops.norm` step by step (fp32 math, casts where the
reference casts), so bf16 results agree to the last bit in most elements.
No workspace.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeferry.ops.triton import next_pow2


@triton.jit
def weighted(normed, w, dt, ZERO_CENTERED: tl.constexpr):
    """RMSNorm's weight on fp32 normalised rows (w fp32, broadcastable): times (1 + w) when
    zero-centered, else the rows rounded to the activation dtype `dt` first, as the reference
    rounds; fp32."""
    if ZERO_CENTERED:
        return normed * (1.0 + w)
    return normed.to(dt).to(tl.float32) * w


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(x_ptr, stride_x, res_ptr, stride_r, sum_ptr, w_ptr, out_ptr, n_rows, N, eps,
                     HAS_RES: tl.constexpr, ZERO_CENTERED: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < N)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + rows64[:, None] * N + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / N
    normed = xf * (1.0 / tl.sqrt(var + eps))[:, None]
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = weighted(normed, w[None, :], x.dtype, ZERO_CENTERED)
    tl.store(out_ptr + rows64[:, None] * N + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])
def _gated_rms_norm_kernel(x_ptr, stride_x, g_ptr, stride_g, w_ptr, out_ptr, n_rows, N, eps,
                           ROUND_MID: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < N)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    g = tl.load(g_ptr + rows64[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / N
    normed = (xf * (1.0 / tl.sqrt(var + eps))[:, None]).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = normed * w[None, :]
    if ROUND_MID:  # the reference's `weight * normed` is in the activation dtype
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    y = y * (g / (1.0 + tl.exp(-g)))
    tl.store(out_ptr + rows64[:, None] * N + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D [rows, N] view with unit column stride (copy only if it cannot be viewed)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch_shape(n_rows: int, n: int) -> tuple[int, int, int, int]:
    block = next_pow2(n)
    rows = max(1, min(16, 4096 // block))
    warps = 4 if block * rows <= 4096 else 8
    return block, rows, triton.cdiv(n_rows, rows), warps


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    x2 = _rows(x)
    n_rows, n = x2.shape
    out_dtype = x.dtype if zero_centered else torch.result_type(weight, x)
    out = torch.empty((n_rows, n), dtype=out_dtype, device=x.device)
    block, rows, grid, warps = _launch_shape(n_rows, n)
    if n_rows:
        _rms_norm_kernel[(grid,)](x2, x2.stride(0), x2, 0, x2, weight, out, n_rows, n, eps,
                                  HAS_RES=False, ZERO_CENTERED=zero_centered, ROWS=rows, BLOCK=block, num_warps=warps)
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    x2, r2 = _rows(x), _rows(residual)
    n_rows, n = x2.shape
    sum_dtype = torch.result_type(residual, x)
    summed = torch.empty((n_rows, n), dtype=sum_dtype, device=x.device)
    out_dtype = sum_dtype if zero_centered else torch.result_type(weight, summed)
    out = torch.empty((n_rows, n), dtype=out_dtype, device=x.device)
    block, rows, grid, warps = _launch_shape(n_rows, n)
    if n_rows:
        _rms_norm_kernel[(grid,)](x2, x2.stride(0), r2, r2.stride(0), summed, weight, out, n_rows, n, eps,
                                  HAS_RES=True, ZERO_CENTERED=zero_centered, ROWS=rows, BLOCK=block, num_warps=warps)
    return out.view(x.shape), summed.view(x.shape)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2, g2 = _rows(x), _rows(gate)
    n_rows, n = x2.shape
    out = torch.empty((n_rows, n), dtype=x.dtype, device=x.device)
    block, rows, grid, warps = _launch_shape(n_rows, n)
    if n_rows:
        _gated_rms_norm_kernel[(grid,)](x2, x2.stride(0), g2, g2.stride(0), weight, out, n_rows, n, eps,
                                        ROUND_MID=torch.result_type(weight, x) == x.dtype, ROWS=rows, BLOCK=block,
                                        num_warps=warps)
    return out.view(x.shape)
