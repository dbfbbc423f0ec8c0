"""Dense linear layers over packed quantized weights (Triton): y = x @ W^T, W [N, K] read in
its device form and dequantized inside the kernel, never as a bf16 copy.

Up to GEMV_MAX_M rows, `_quant_gemv_kernel` runs the GEMV step of the form (gemv_formats.py;
fp8_row only, where it wins) on the CUDA cores (no tl.dot, no layout shuffles of the dequantized tile),
with the same split-K as below. Beyond that, one tl.dot kernel serves decode and prefill.
Programs tile (M rows of x) x (N rows of W) and, with
split-K, also K: program (n, m, s) reduces k in [s * K_SPLIT, (s + 1) * K_SPLIT). Decode
shapes (M <= 16) use the weight tile as the dot's first operand (SWAP, see moe_formats.py)
and split K until the grid covers the GPU several times over, so the packed weight streams
from HBM by many short programs (GEMV-like) instead of a few long k-loops. Split-K is serial
and needs no second launch: each program stores its fp32 partial sum to a workspace
[SPLIT, M, N] and bumps its tile's counter; the last one to arrive adds the partials, applies
the row scale, writes the output and re-arms the counter (the operands own the counters).
Prefill shapes use wide tiles and no split.

The per-format dequantization is the MoE kernels' step (`moe_formats.py`) with one slot and
one part (PART = N), so a format's weight is read by the same code in both. `DenseOperands`
turns a registry `PackedWeight` into the step's arguments as views (no copy of the weight):

    form        w                    s                       z            rs (epilogue)
    dense       bf16 [N, K]          -                       -            -
    fp8_row     e4m3 [N, K]          -                       -            fp32 [N]
    fp8_block   e4m3 [N, K]          fp32 [N/GN, K/G]        -            -
    fp4         uint8 [N, K/2]       e4m3 [N, K/16]          -            fp32 [N] (global)
    int4        uint8 [N, K/2]       fp16/bf16 [N, K/G]      uint8 | -     -

`DENSE_KERNELS` maps a registry entry's `device_form` to its step (`GEMV_STEPS` to its GEMV
step); `quant_linear` runs one.
Under TRITON_INTERPRET=1 the dots run in fp32 (the interpreter's bf16 dot is wrong).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from . import interpreting, num_sms
from .arrivals import last_arrival
from .gemv_formats import GEMV_STEPS
from .moe_decode import gemv_bk, gemv_handles
from .moe_formats import DENSE, FP4, FP8_BLOCK, FP8_ROW, INT4, TL_DTYPES, MoEKernel


# device form (QuantFormat.device_form) -> the kernel side of that form
DENSE_KERNELS: dict[str, MoEKernel] = {k.name: k for k in (DENSE, FP8_ROW, FP8_BLOCK, FP4, INT4)}


@triton.jit(do_not_specialize=["M"])
def _quant_gemm_kernel(x_ptr, stride_x, out_ptr, ws_ptr, cnt_ptr, w_ptr, s_ptr, z_ptr, rs_ptr, M, N, K, K_SPLIT, SPLIT,
                       STEP: tl.constexpr, ROW_SCALE: tl.constexpr, G: tl.constexpr, GN: tl.constexpr,
                       HAS_Z: tl.constexpr, DT: tl.constexpr, SWAP: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mask_m = offs_m < M
    offs_k = tl.arange(0, BK)
    a_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x + offs_k[None, :]
    n0 = pid_n * BN
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    acc = tl.zeros((BN, BM) if SWAP else (BM, BN), tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        a = tl.load(a_ptrs + k0, mask=mask_m[:, None] & (offs_k[None, :] + k0 < K), other=0.0).to(DT)
        acc = STEP(acc, a, w_ptr, s_ptr, z_ptr, 0, n0, k0, N, K, N, BN, BK, G, GN, HAS_Z, DT, SWAP)
    if SWAP:
        acc = tl.trans(acc)
    _finish(acc, out_ptr, ws_ptr, cnt_ptr, rs_ptr, offs_m, mask_m, n0, pid_k, pid_m * tl.num_programs(0) + pid_n,
            M, N, SPLIT, ROW_SCALE, BM, BN)


@triton.jit(do_not_specialize=["M"])
def _quant_gemv_kernel(x_ptr, stride_x, out_ptr, ws_ptr, cnt_ptr, w_ptr, s_ptr, z_ptr, rs_ptr, M, N, K, K_SPLIT, SPLIT,
                       STEP: tl.constexpr, ROW_SCALE: tl.constexpr, G: tl.constexpr, GN: tl.constexpr,
                       HAS_Z: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Few rows (M <= BM <= GEMV_MAX_M): CUDA-core dot products, one program per (BN rows, K slice)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    n0 = pid_n * BN
    acc = tl.zeros((BN, BM), tl.float32)
    k_lo = pid_k * K_SPLIT
    for k0 in range(k_lo, tl.minimum(K, k_lo + K_SPLIT), BK):
        acc = STEP(acc, x_ptr, stride_x, M, w_ptr, s_ptr, z_ptr, 0, n0, k0, N, K, N, BM, BN, BK, G, GN, HAS_Z)
    offs_m = tl.arange(0, BM)
    _finish(tl.trans(acc), out_ptr, ws_ptr, cnt_ptr, rs_ptr, offs_m, offs_m < M, n0, pid_k, pid_n,
            M, N, SPLIT, ROW_SCALE, BM, BN)


@triton.jit(do_not_specialize=["N"])
def _row_gemv_kernel(x_ptr, out_ptr, w_ptr, s_ptr, z_ptr, rs_ptr, N, K: tl.constexpr,
                     STEP: tl.constexpr, ROW_SCALE: tl.constexpr, G: tl.constexpr, GN: tl.constexpr,
                     GB: tl.constexpr, HAS_Z: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One row (M = 1): BN weight rows over all of K per program, by the form's MoE decode GEMV
    step (moe_formats.py, "decode GEMV steps"; one slot, one part), unrolled over K."""
    n0 = tl.program_id(0) * BN
    acc = tl.zeros((BN,), tl.float32)
    for k0 in tl.static_range(0, K, BK):
        acc = STEP(acc, x_ptr, w_ptr, s_ptr, z_ptr, 0, n0, k0, N, K, N, BN, BK, G, GN, GB, HAS_Z)
    offs_n = n0 + tl.arange(0, BN)
    mask_n = offs_n < N
    if ROW_SCALE:
        acc *= tl.load(rs_ptr + offs_n, mask=mask_n, other=0.0)
    tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _finish(acc, out_ptr, ws_ptr, cnt_ptr, rs_ptr, offs_m, mask_m, n0, pid_k, tile, M, N, SPLIT,
            ROW_SCALE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Store acc [BM, BN] (rows offs_m, columns n0..n0+BN): directly, or as split pid_k of
    SPLIT through the workspace and the tile's counter."""
    offs_n = n0 + tl.arange(0, BN)
    mask_n = offs_n < N
    rows = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT > 1:
        # serial split-K: store this slice's partial sum; the tile's last program to finish
        # (counted on cnt[tile], `arrivals.last_arrival`) adds all partials in split order
        tl.store(ws_ptr + pid_k.to(tl.int64) * M * N + rows, acc, mask=mask)
        if last_arrival(cnt_ptr + tile, SPLIT):
            total = tl.zeros((BM, BN), tl.float32)
            for sp in range(0, SPLIT):
                total += tl.load(ws_ptr + sp * M * N + rows, mask=mask, other=0.0, cache_modifier=".cg")
            _store_out(total, out_ptr, rs_ptr, rows, mask, offs_n, mask_n, ROW_SCALE)
    else:
        _store_out(acc, out_ptr, rs_ptr, rows, mask, offs_n, mask_n, ROW_SCALE)


@triton.jit
def _store_out(acc, out_ptr, rs_ptr, rows, mask, offs_n, mask_n, ROW_SCALE: tl.constexpr):
    if ROW_SCALE:
        acc *= tl.load(rs_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=mask)


# -- operands -------------------------------------------------------------------------------
@dataclass(frozen=True)
class DenseOperands:
    """One packed weight as the kernel reads it (views of the PackedWeight's tensors)."""

    kernel: MoEKernel
    n: int
    k: int
    w: torch.Tensor
    s: torch.Tensor | None = None
    z: torch.Tensor | None = None
    rs: torch.Tensor | None = None
    group: int = 1 << 30
    group_n: int = 1
    counters: torch.Tensor | None = None  # int32 [cdiv(N, 16)], zero between calls (split-K tiles)

    def args(self) -> tuple[torch.Tensor, ...]:
        def arg(t):
            if t is None:
                return self.w
            return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
        return arg(self.w), arg(self.s), arg(self.z), arg(self.rs)


def _row_vector(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.float().reshape(-1).expand(n).contiguous() if t.numel() == 1 else t.float().reshape(n).contiguous()


def dense_operands(packed: Any, form: str) -> DenseOperands:
    """The kernel operands of a registry `PackedWeight` whose format has device form `form`."""
    kern = DENSE_KERNELS[form]
    n, k = packed.out_features, packed.in_features
    if form == "dense":
        parts = dict(w=packed.weight)
    elif form == "fp8_row":
        parts = dict(w=packed.weight, rs=_row_vector(packed.scale, n))
    elif form == "fp8_block":
        b0, b1 = packed.block_size
        parts = dict(w=packed.weight, s=packed.scale_inv.float().contiguous(), group=b1, group_n=b0)
    elif form == "fp4":
        parts = dict(w=packed.packed, s=packed.scale, rs=_row_vector(packed.global_scale, n), group=16)
    elif form == "int4":
        parts = dict(w=packed.packed, s=packed.scales, z=packed.zeros, group=packed.group_size)
    else:
        raise KeyError(f"no dense kernel for device form {form!r}")
    counters = torch.zeros(triton.cdiv(n, MIN_BN), dtype=torch.int32, device=parts["w"].device)
    return DenseOperands(kern, n, k, counters=counters, **parts)


# -- configs --------------------------------------------------------------------------------
@dataclass(frozen=True)
class DenseConfig:
    bm: int
    bn: int
    bk: int
    split: int = 1
    swap: bool = True
    num_warps: int = 4
    num_stages: int = 4
    gemv: bool = False  # CUDA-core kernel (M <= bm), else the tl.dot kernel
    row: bool = False   # M = 1: the one-row GEMV kernel (the MoE decode GEMV step), no split


DECODE_MAX_M = 16  # split-K only here: one row of tiles, so the counters cover every tile
GEMV_MAX_M = 4     # up to this many rows: the CUDA-core GEMV kernel (forms in GEMV_STEPS)
MIN_BN = 16
# GEMV: (bn, bk) per form, split-K to DECODE_WAVES x SMs programs
GEMV_TILES = {"fp8_row": (16, 512)}
# M = 1: the one-row GEMV per form where it beat the kernels above, as (up to N rows, (bn, bk,
# warps)) in order. H200, `benchmarks/quant_decode.py dense --rows 1` (benchmarks/README.md):
# fp4 lm_head 248320x2048 170.5 us (was 240.6), fp8_row 8192x2048 6.5 us (8.6), 2048x4096 5.0 (6.9).
ROW_TILES: dict[str, list[tuple[int, tuple[int, int, int]]]] = {
    "fp4": [(65536, (8, 2048, 4)), (1 << 62, (16, 1024, 4))],
    "fp8_row": [(4096, (2, 2048, 4)), (1 << 62, (16, 512, 8))],
}
# decode: (bn, bk) per form; split-K fills DECODE_WAVES x SMs programs. Prefill: (bm, bn, bk, swap).
# Picked on an H200 by `benchmarks/quant_decode.py dense` (benchmarks/README.md).
DECODE_TILES = {"dense": (64, 128), "fp8_row": (64, 256), "fp8_block": (64, 128), "fp4": (64, 128), "int4": (64, 128)}
DECODE_WAVES = 4
PREFILL_TILES = {"dense": (128, 128, 64, False), "fp8_row": (128, 128, 64, False), "fp8_block": (128, 128, 64, True),
                 "fp4": (128, 128, 128, True), "int4": (128, 64, 128, True)}


def supported(op: DenseOperands) -> bool:
    """Shapes the kernel handles: nibble-packed K a multiple of 32, 32-bit offsets."""
    if op.kernel.packed_k and op.k % 32:
        return False
    return op.n * op.k < 2**31


def _fit_bk(bk: int, op: DenseOperands) -> int:
    return op.kernel.fit_bk(min(bk, max(32, triton.next_power_of_2(op.k))), op.group, op.k)


def row_supported(op: DenseOperands) -> bool:
    """Whether the one-row GEMV runs this weight (its form's GEMV step handles the layout)."""
    return gemv_handles(op.kernel, op.group)


def choose_config(m: int, op: DenseOperands, device: torch.device) -> DenseConfig:
    form = op.kernel.name
    if interpreting():  # small tiles; split-K, the GEMV and both orientations of the dot are exercised
        if m <= GEMV_MAX_M and form in GEMV_STEPS:
            return DenseConfig(triton.next_power_of_2(m), 32, 64, min(3, triton.cdiv(op.k, 64)), gemv=True)
        bk = _fit_bk(32, op)
        if m <= DECODE_MAX_M:
            return DenseConfig(16, 32, bk, min(3, triton.cdiv(op.k, bk)), True)
        return DenseConfig(32, 32, bk, 1, False)
    if m == 1 and form in ROW_TILES and row_supported(op):
        bn, bk, warps = next(tile for upto, tile in ROW_TILES[form] if op.n <= upto)
        return DenseConfig(1, bn, gemv_bk(bk, op.kernel, op.group, op.k)[0], 1, num_warps=warps, row=True)
    if m <= DECODE_MAX_M:
        gemv = m <= GEMV_MAX_M and form in GEMV_TILES
        bn, bk = (GEMV_TILES if gemv else DECODE_TILES)[form]
        bn = min(bn, max(MIN_BN, triton.next_power_of_2(op.n)))
        bk = min(bk, max(32, triton.next_power_of_2(op.k))) if gemv else _fit_bk(bk, op)
        tiles, steps = triton.cdiv(op.n, bn), triton.cdiv(op.k, bk)
        want = DECODE_WAVES * num_sms(device)
        split = max(1, min(steps, triton.cdiv(want, tiles)))
        return DenseConfig(triton.next_power_of_2(m) if gemv else 16, bn, bk, split, True, gemv=gemv)
    bm, bn, bk, swap = PREFILL_TILES[form]
    bm = min(bm, max(16, triton.next_power_of_2(m)))
    return DenseConfig(bm, bn, _fit_bk(bk, op), 1, swap, 8 if bm * bn >= 128 * 128 else 4, 3)


# -- launch ---------------------------------------------------------------------------------
def quant_linear(x: torch.Tensor, op: DenseOperands, config: DenseConfig | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W^T in x's dtype, fp32 accumulation."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, op.k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, op.n, dtype=x.dtype, device=x.device)
    if m:
        cfg = config or choose_config(m, op, x.device)
        (_run_row if cfg.row else _run_tiles)(x2, out, op, cfg)
    return out.reshape(*lead, op.n)


def _run_row(x2: torch.Tensor, out: torch.Tensor, op: DenseOperands, cfg: DenseConfig) -> None:
    """The one-row GEMV: BN weight rows over all of K per program."""
    if x2.shape[0] != 1 or not row_supported(op):
        raise ValueError(f"one-row GEMV config for M = 1 and power-of-two groups, got M={x2.shape[0]}, "
                         f"{op.kernel.name}")
    _row_gemv_kernel[(triton.cdiv(op.n, cfg.bn),)](
        x2, out, *op.args(), op.n, K=op.k, STEP=op.kernel.gemv, ROW_SCALE=op.kernel.has_row_scale, G=op.group,
        GN=op.group_n, GB=gemv_bk(cfg.bk, op.kernel, op.group, op.k)[1], HAS_Z=op.z is not None,
        BN=cfg.bn, BK=cfg.bk, num_warps=cfg.num_warps)


def _run_tiles(x2: torch.Tensor, out: torch.Tensor, op: DenseOperands, cfg: DenseConfig) -> None:
    """The multi-row GEMV or the tl.dot kernel over (N tiles) x (M tiles) x (K splits)."""
    m = x2.shape[0]
    # K per split: whole k-steps, so every program's tiles stay inside one scale group
    steps = triton.cdiv(op.k, cfg.bk)
    k_split = triton.cdiv(steps, cfg.split) * cfg.bk
    split = triton.cdiv(op.k, k_split)
    grid = (triton.cdiv(op.n, cfg.bn), 1 if cfg.gemv else triton.cdiv(m, cfg.bm), split)
    if split > 1 and (grid[1] > 1 or cfg.bn < MIN_BN):
        raise ValueError(f"split-K needs one row of tiles (M <= BM) and BN >= {MIN_BN}: {cfg}, M={m}")
    ws = torch.empty(split, m, op.n, dtype=torch.float32, device=x2.device) if split > 1 else out
    args = (x2, x2.stride(0), out, ws, op.counters, *op.args(), m, op.n, op.k, k_split, split)
    form = dict(ROW_SCALE=op.kernel.has_row_scale, G=op.group, GN=op.group_n, HAS_Z=op.z is not None,
                BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.gemv:
        if m > cfg.bm:
            raise ValueError(f"GEMV config for at most {cfg.bm} rows, got {m}")
        _quant_gemv_kernel[(grid[0], split)](*args, STEP=GEMV_STEPS[op.kernel.name], **form)
    else:
        _quant_gemm_kernel[grid](*args, STEP=op.kernel.step, SWAP=cfg.swap,
                                 DT=tl.float32 if interpreting() else TL_DTYPES[x2.dtype], **form)
