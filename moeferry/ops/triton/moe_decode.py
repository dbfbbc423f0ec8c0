"""MoE decode path for a few tokens (T * top_k small): two launches, no routing prep.

    out[t] = sum_j w[t, j] * down[s] @ (silu(gate[s] @ x[t]) * (up[s] @ x[t])),  s = table[ids[t, j]]

The grouped-GEMM path (moe_gemm.py) sorts the pairs by slot, pads every expert to a
16-row token tile and runs tl.dot tiles: at T = 1 it launches prep, gate_up, down and the
pair reduction (plus a SiLU reduction with split-K) and spends its time reshuffling
dequantized tiles for the MMA. Here each (token, choice) pair p = t * TOPK + j reads its
slot straight from the table (j == K_IN: the shared expert) and the weights are streamed by
the format's GEMV step (moe_formats.py, "decode GEMV steps") on the CUDA cores:

1. `_decode_gate_up_kernel`, grid (pairs, I / BN): gate and up rows n0..n0+BN of the pair's
   slot times x[t], SiLU(gate) * up written to inter [pairs, I] (x's dtype), or, for the
   4-bit forms (`packs_inter`), as the packed fp16x2 operands their down step reads
   (nibble_gemv.pack_units: scaled per 16 values once here, not by every down program).
2. `_decode_down_kernel`, grid (T, H / BN): for each of the token's pairs, in order, down
   rows n0..n0+BN times the pair's inter row, times the routing weight, rounded to x's dtype
   and summed in fp32 into out[t] (deterministic: no atomics, no reduction launch). With
   `down_pairs` set, grid (T, H / BN, chunks of that many pairs): each program pays the
   memory latency of fewer pairs one after another, and `_sum_chunks_kernel` adds the chunks'
   fp32 rows in order (still deterministic; one more launch). With `down_arrive` the chunks
   are summed without that launch: each program counts its arrival at its (token, row block)
   and the last to arrive adds the chunks' rows in chunk order (`arrivals.last_arrival`).
   With `down_pdl`, down is launched as a programmatic dependent of gate_up: each gate_up
   program lets it start once its GEMV is done (before storing inter), and down waits for
   gate_up's end only where it reads inter (packed halves: after its weight words are asked
   for, `nibble_gemv._packed_x`; other forms at its start), so down's launch, its routing
   reads and (packed) its weight loads run under gate_up's tail. With `down_preload` (forms
   whose GEMV step comes in two, `MoEKernel.tile`), grid (T, H / BN): a program asks for the
   weights of all of its token's pairs first, then applies each to its pair's inter row in
   order: one memory latency a program instead of one a pair, and no chunks to sum.

With `gate_up_split` (gate_up taking all of H in one step) gate_up's grid is one-dimensional:
its units (pair, row block) are waves of one program an SM and a partial last wave, whose units
would keep their SMs one unit longer than the rest (at T = 1 on 132 SMs: 288 units, 24 SMs run
three); `tail_split` cuts each of those into k slices (2-16, by the device's SM count), whose
gate and up sums the last slice to arrive adds in slice order before SiLU and the store.

The arrival counters live in the slot buffer's scratch (`RoutingScratch.arrivals`, zero
between calls: the last arrival sets its word back). gate_up's split and down's chunks both
count from the first word: every gate_up arrival (and reset) is done before down reads inter,
after which alone down's chunks arrive.

One launch for both halves was built twice and timed slower on the GPU (a program per pair's
inter slice and its share of every down row; one launch over a grid barrier): benchmarks/README.md.

A non-resident pair (slot -1) reads no weight: its rows are masked off (n0 moved past N),
its inter row is written as zeros and it adds 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import grid_dependency, num_sms
from .arrivals import last_arrival
from .grid_dependency import release_dependents, wait_for_primary
from .moe_formats import TL_DTYPES, SlotMatrix
from .nibble_gemv import pack_units


@dataclass(frozen=True)
class DecodeConfig:
    gate_up_bn: int = 16   # rows of gate (and of up) per program
    gate_up_bk: int = 256  # k per step of gate_up (over H)
    down_bn: int = 8       # rows of down per program
    down_bk: int = 512     # k per step of down (over I)
    num_warps: int = 4     # gate_up's warps per program
    unroll: bool = False   # gate_up's k loop unrolled (every step's loads issued up front)
    down_warps: int = 4
    down_pairs: int = 0    # pairs per down program (0: all of the token's; fewer: a grid of pair
                           # chunks whose fp32 partial rows a third launch sums in order)
    down_arrive: bool = False  # (down_pairs) the last chunk to arrive sums the chunks: no third launch
    down_pdl: bool = False     # down a programmatic dependent launch of gate_up (module docstring)
    down_preload: bool = False  # (4-bit forms) a down program holds all of its token's pairs and asks
                                # for every pair's weights before it reads any inter (module docstring)
    gate_up_split: int = 0  # (BK >= H) at most this many k slices for each unit of gate_up's last,
                            # partial wave of programs (`tail_split`; module docstring)


# Per slot form (MoEKernel.name): the block sizes `benchmarks/moe_decode_sweep.py` found fastest
# on an H200 over T = 1 and 4 (benchmarks/README.md); other forms take DecodeConfig(). Whole call
# at T = 1 / 4 (top-8 + shared, H100 of the thirty-third session): fp4 13.0-13.1 / 29.4-29.7 us
# (packed-half steps; gate_up BN 16 so that a program holds whole 16-value units to pack; the
# down launch one pair a program, its chunks summed by the last to arrive, in one k step; without
# `down_pdl` 13.8-14.4 / 31.0-31.2), int4 14.2-14.9 / 30.2-31.3 (without 14.8-15.5 / 30.7-31.6; its units
# since down to 13 instructions per 8 weights from 20, not timed yet),
# fp8_row 16.8-17.6 / 40.4-41.0 (17.3-18.1 / 41.1-41.8), fp8_block 18.5 / 40.4 (17.6 / 41.0),
# dense 27.3 / 71.2 (27.8 / 71.5). Timed and not taken: gate_up split over k, its k loop unrolled
# over smaller steps, gate and up rows in one GEMV call, x packed once before gate_up, weight rows
# asked into L1 / L2 before the GEMV (prefetch), gate_up asking down's slots into L2, routing
# without the slot table, two down warps, eight gate_up warps, gate and up tiles' loads all asked
# for before either is summed (a two-tile GEMV step), gate_up releasing down at its start or after
# its gate rows (instead of after both), down in chunks of three pairs (fp8: faster at T = 1,
# slower at T >= 4), twice or half the down rows a program.
DECODE_CONFIGS: dict[str, DecodeConfig] = {
    "dense": DecodeConfig(gate_up_bn=2, gate_up_bk=2048, down_bn=8, down_bk=512, num_warps=4, down_warps=4,
                          down_pdl=True),
    "fp4": DecodeConfig(gate_up_bn=16, gate_up_bk=2048, down_bn=32, down_bk=512, num_warps=4, down_warps=4,
                        down_pairs=1, down_arrive=True, down_pdl=True),
    "int4": DecodeConfig(gate_up_bn=16, gate_up_bk=2048, down_bn=32, down_bk=256, num_warps=4, down_warps=4,
                         down_pairs=1, down_arrive=True, down_pdl=True),
    "fp8_row": DecodeConfig(gate_up_bn=4, gate_up_bk=512, down_bn=4, down_bk=512, num_warps=4, down_warps=2,
                            down_pdl=True),
    "fp8_block": DecodeConfig(gate_up_bn=4, gate_up_bk=2048, down_bn=8, down_bk=512, num_warps=4, down_warps=4,
                              down_pdl=True),
}


@triton.jit
def _route(ids_ptr, rw_ptr, shw_ptr, table_ptr, shared_slot, t, j,
           K_IN: tl.constexpr, TOPK: tl.constexpr, HAS_SHARED: tl.constexpr):
    """(slot, routing weight) of token t's choice j (a scalar or a vector of j); -1: skipped."""
    routed = j < K_IN
    e = tl.load(ids_ptr + t * K_IN + j, mask=routed, other=0)
    s = tl.load(table_ptr + e, mask=routed, other=-1)
    w = tl.load(rw_ptr + t * K_IN + j, mask=routed, other=0.0).to(tl.float32)
    if HAS_SHARED:
        sh = j == K_IN
        s = tl.where(sh, shared_slot, s)
        w = tl.where(sh, tl.sigmoid(tl.load(shw_ptr + t + j * 0, mask=sh, other=0.0).to(tl.float32)), w)
    s = tl.where(j < TOPK, s, -1)
    return s, w


@triton.jit
def _gate_up_step(g, u, x_row, w_ptr, s_ptr, z_ptr, slot, g0, k0, H, I, GEMV: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, GN: tl.constexpr, GB: tl.constexpr,
                  HAS_Z: tl.constexpr):
    g = GEMV(g, x_row, w_ptr, s_ptr, z_ptr, slot, g0, k0, 2 * I, H, I, BN, BK, G, GN, GB, HAS_Z)
    u = GEMV(u, x_row, w_ptr, s_ptr, z_ptr, slot, g0 + I, k0, 2 * I, H, I, BN, BK, G, GN, GB, HAS_Z)
    return g, u


@triton.jit
def _gate_up_h(x_row, w_ptr, s_ptr, z_ptr, rs_ptr, s, n0, H, I, GEMV: tl.constexpr, ROW_SCALE: tl.constexpr,
               G: tl.constexpr, GN: tl.constexpr, GB: tl.constexpr, HAS_Z: tl.constexpr, UNROLL: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr):
    """SiLU(gate) * up, rows n0..n0+BN of slot s (-1: every row masked off, zeros) times x_row, fp32 [BN]."""
    slot, g0 = _gate_rows(s, n0, I)
    g = tl.zeros((BN,), tl.float32)
    u = tl.zeros((BN,), tl.float32)
    if UNROLL:
        for k0 in tl.static_range(0, H, BK):
            g, u = _gate_up_step(g, u, x_row, w_ptr, s_ptr, z_ptr, slot, g0, k0, H, I, GEMV, BN, BK, G, GN, GB, HAS_Z)
    else:
        for k0 in range(0, H, BK):
            g, u = _gate_up_step(g, u, x_row, w_ptr, s_ptr, z_ptr, slot, g0, k0, H, I, GEMV, BN, BK, G, GN, GB, HAS_Z)
    return _silu_up(g, u, rs_ptr, slot, n0, I, ROW_SCALE, BN)


@triton.jit
def _gate_rows(s, n0, I):
    """(slot, first gate row) of slot s's gate rows n0.. (s = -1, a skipped pair: slot 0 and a row
    past all 2 I, so every row is masked off and sums to 0)."""
    return tl.maximum(s, 0).to(tl.int64), tl.where(s >= 0, n0, 2 * I)


@triton.jit
def _silu_up(g, u, rs_ptr, slot, n0, I, ROW_SCALE: tl.constexpr, BN: tl.constexpr):
    """SiLU(gate) * up of rows n0..n0+BN's sums over all of H (row scales applied), fp32 [BN]."""
    if ROW_SCALE:
        offs_n = n0 + tl.arange(0, BN)
        mask_n = offs_n < I
        g *= tl.load(rs_ptr + slot * 2 * I + offs_n, mask=mask_n, other=0.0)
        u *= tl.load(rs_ptr + slot * 2 * I + I + offs_n, mask=mask_n, other=0.0)
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _store_inter(inter_ptr, p, h, n0, I, PACK_RANGE: tl.constexpr, BN: tl.constexpr):
    """Values n0..n0+BN of pair p's inter row: packed halves for a 4-bit down step, else x's dtype."""
    if PACK_RANGE > 0:  # the down step's x as packed halves (nibble_gemv.pack_units)
        pack_units(inter_ptr + p.to(tl.int64) * (I // 2 + I // 8), h, n0, I, PACK_RANGE, BN)
    else:
        offs_n = n0 + tl.arange(0, BN)
        tl.store(inter_ptr + p.to(tl.int64) * I + offs_n, h.to(inter_ptr.dtype.element_ty), mask=offs_n < I)


@triton.jit
def _down_rows(a_row, w_ptr, s_ptr, z_ptr, rs_ptr, s, n0, H, I: tl.constexpr, GEMV: tl.constexpr,
               ROW_SCALE: tl.constexpr, G: tl.constexpr, GN: tl.constexpr, GB: tl.constexpr, HAS_Z: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr):
    """Down rows n0..n0+BN of slot s (-1: zeros) times the pair's inter row, fp32 [BN]."""
    slot = tl.maximum(s, 0).to(tl.int64)
    r0 = tl.where(s >= 0, n0, H)
    acc = tl.zeros((BN,), tl.float32)
    for k0 in tl.static_range(0, I, BK):
        acc = GEMV(acc, a_row, w_ptr, s_ptr, z_ptr, slot, r0, k0, H, I, H, BN, BK, G, GN, GB, HAS_Z)
    if ROW_SCALE:
        acc *= _row_scales(rs_ptr, s, n0 + tl.arange(0, BN), H)
    return acc


@triton.jit
def _row_scales(rs_ptr, s, offs_n, H):
    """Down rows offs_n's scales in slot s (-1: zeros), fp32."""
    return tl.load(rs_ptr + tl.maximum(s, 0).to(tl.int64) * H + offs_n, mask=(offs_n < H) & (s >= 0), other=0.0)


@triton.jit
def _down_chunk(inter_ptr, t, n0, chunk, ids_ptr, rw_ptr, shw_ptr, table_ptr, shared_slot, w_ptr, s_ptr, z_ptr, rs_ptr,
                H, I: tl.constexpr, GEMV: tl.constexpr, ROW_SCALE: tl.constexpr, G: tl.constexpr, GN: tl.constexpr,
                GB: tl.constexpr, HAS_Z: tl.constexpr, K_IN: tl.constexpr, TOPK: tl.constexpr, TP: tl.constexpr,
                HAS_SHARED: tl.constexpr, ROW: tl.constexpr, x_dtype: tl.constexpr, PAIRS: tl.constexpr,
                PDL: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Down rows n0..n0+BN of token t summed over its pairs of this chunk in order, fp32 [BN]."""
    if PAIRS > 1:
        jv = tl.arange(0, TP)
        slots, weights = _route(ids_ptr, rw_ptr, shw_ptr, table_ptr, shared_slot, t, jv, K_IN, TOPK, HAS_SHARED)
    out = tl.zeros((BN,), tl.float32)
    # unrolled over the program's pairs and k (I is a constexpr), branch-free; the compiled code
    # still loads a pair's weights only after the previous pair's work (benchmarks/README.md, the
    # ninth session), so a program pays one memory latency per pair: fewer pairs (down_pairs), fewer
    for jj in tl.static_range(PAIRS):
        j = chunk * PAIRS + jj  # j >= TOPK (the last chunk's padding): slot -1, adds 0
        if PAIRS > 1:
            s = tl.where(j < TOPK, tl.sum(tl.where(jv == j, slots, 0)), -1)
            w = tl.sum(tl.where(jv == j, weights, 0.0))
        else:  # one pair a program: its route read as scalars (no vector to pick it from)
            s, w = _route(ids_ptr, rw_ptr, shw_ptr, table_ptr, shared_slot, t, j, K_IN, TOPK, HAS_SHARED)
        if PDL and jj == 0 and inter_ptr.dtype.element_ty != tl.int32:  # packed halves wait in their read
            wait_for_primary()
        a_row = inter_ptr + (t * TOPK + tl.minimum(j, TOPK - 1)).to(tl.int64) * ROW
        acc = _down_rows(a_row, w_ptr, s_ptr, z_ptr, rs_ptr, s, n0, H, I, GEMV, ROW_SCALE, G, GN, GB, HAS_Z, BN, BK)
        out += (acc * w).to(x_dtype).to(tl.float32)
    return out


@triton.jit
def _down_preloaded(inter_ptr, t, n0, ids_ptr, rw_ptr, shw_ptr, table_ptr, shared_slot, w_ptr, s_ptr, z_ptr, rs_ptr,
                    H, I: tl.constexpr, TILE: tl.constexpr, TILE_GEMV: tl.constexpr, ROW_SCALE: tl.constexpr,
                    G: tl.constexpr, GB: tl.constexpr, HAS_Z: tl.constexpr, K_IN: tl.constexpr, TOPK: tl.constexpr,
                    TP: tl.constexpr, HAS_SHARED: tl.constexpr, ROW: tl.constexpr, x_dtype: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr):
    """Down rows n0..n0+BN of token t summed over its pairs in order, fp32 [BN]: every pair's
    weights (and row scales) asked for before the first pair's inter row is read."""
    jv = tl.arange(0, TP)
    slots, weights = _route(ids_ptr, rw_ptr, shw_ptr, table_ptr, shared_slot, t, jv, K_IN, TOPK, HAS_SHARED)
    offs_n = n0 + tl.arange(0, BN)
    tiles = ()
    row_scales = ()
    for j in tl.static_range(TOPK):
        s = tl.sum(tl.where(jv == j, slots, 0))
        slot = tl.maximum(s, 0).to(tl.int64)
        tiles = tiles + (TILE(w_ptr, s_ptr, z_ptr, slot, tl.where(s >= 0, n0, H), H, I, BN, BK, G, GB, HAS_Z),)
        if ROW_SCALE:
            row_scales = row_scales + (_row_scales(rs_ptr, s, offs_n, H),)
    out = tl.zeros((BN,), tl.float32)
    for j in tl.static_range(TOPK):
        a_row = inter_ptr + (t * TOPK + j).to(tl.int64) * ROW
        acc = TILE_GEMV(tl.zeros((BN,), tl.float32), tiles[j], a_row, I, BN, BK, GB, HAS_Z)
        if ROW_SCALE:
            acc *= row_scales[j]
        out += (acc * tl.sum(tl.where(jv == j, weights, 0.0))).to(x_dtype).to(tl.float32)
    return out


@triton.jit
def _decode_gate_up_kernel(x_ptr, stride_x, inter_ptr, part_ptr, arrive_ptr, ids_ptr, rw_ptr, shw_ptr, table_ptr,
                           shared_slot, w_ptr, s_ptr, z_ptr, rs_ptr, I, FULL,
                           H: tl.constexpr, GEMV: tl.constexpr, ROW_SCALE: tl.constexpr, G: tl.constexpr,
                           GN: tl.constexpr, GB: tl.constexpr, HAS_Z: tl.constexpr, K_IN: tl.constexpr,
                           TOPK: tl.constexpr, HAS_SHARED: tl.constexpr, UNROLL: tl.constexpr,
                           PACK_RANGE: tl.constexpr, RELEASE: tl.constexpr, SPLIT: tl.constexpr,
                           GB_SPLIT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    if SPLIT == 0:  # grid (pairs, I / BN): a program per unit (pair, row block)
        _gate_up_unit(x_ptr, stride_x, inter_ptr, ids_ptr, rw_ptr, shw_ptr, table_ptr, shared_slot, w_ptr, s_ptr,
                      z_ptr, rs_ptr, I, tl.program_id(0), tl.program_id(1) * BN, H, GEMV, ROW_SCALE, G, GN, GB,
                      HAS_Z, K_IN, TOPK, HAS_SHARED, UNROLL, PACK_RANGE, RELEASE, BN, BK)
    else:  # grid (FULL + tail units * SPLIT,): the FULL first units whole, the rest in SPLIT k slices
        blocks = (I + BN - 1) // BN
        q = tl.program_id(0)
        if q < FULL:
            _gate_up_unit(x_ptr, stride_x, inter_ptr, ids_ptr, rw_ptr, shw_ptr, table_ptr, shared_slot, w_ptr,
                          s_ptr, z_ptr, rs_ptr, I, q // blocks, (q % blocks) * BN, H, GEMV, ROW_SCALE, G, GN, GB,
                          HAS_Z, K_IN, TOPK, HAS_SHARED, UNROLL, PACK_RANGE, RELEASE, BN, BK)
        else:
            tail = (q - FULL) // SPLIT
            u = FULL + tail
            _gate_up_slice(x_ptr, stride_x, inter_ptr, part_ptr, arrive_ptr, ids_ptr, rw_ptr, shw_ptr, table_ptr,
                           shared_slot, w_ptr, s_ptr, z_ptr, rs_ptr, I, u // blocks, (u % blocks) * BN, tail,
                           (q - FULL) % SPLIT, H, GEMV, ROW_SCALE, G, GN, GB_SPLIT, HAS_Z, K_IN, TOPK, HAS_SHARED,
                           PACK_RANGE, RELEASE, SPLIT, BN, BK // SPLIT)


@triton.jit
def _gate_up_unit(x_ptr, stride_x, inter_ptr, ids_ptr, rw_ptr, shw_ptr, table_ptr, shared_slot, w_ptr, s_ptr, z_ptr,
                  rs_ptr, I, p, n0, H: tl.constexpr, GEMV: tl.constexpr, ROW_SCALE: tl.constexpr, G: tl.constexpr,
                  GN: tl.constexpr, GB: tl.constexpr, HAS_Z: tl.constexpr, K_IN: tl.constexpr, TOPK: tl.constexpr,
                  HAS_SHARED: tl.constexpr, UNROLL: tl.constexpr, PACK_RANGE: tl.constexpr, RELEASE: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr):
    """Pair p's inter values n0..n0+BN over all of H."""
    t = p // TOPK
    s, _ = _route(ids_ptr, rw_ptr, shw_ptr, table_ptr, shared_slot, t, p % TOPK, K_IN, TOPK, HAS_SHARED)
    h = _gate_up_h(x_ptr + t.to(tl.int64) * stride_x, w_ptr, s_ptr, z_ptr, rs_ptr, s, n0, H, I, GEMV, ROW_SCALE,
                   G, GN, GB, HAS_Z, UNROLL, BN, BK)
    if RELEASE:  # the down launch may start (it waits for this grid's end before reading inter)
        release_dependents()
    _store_inter(inter_ptr, p, h, n0, I, PACK_RANGE, BN)


@triton.jit
def _gate_up_slice(x_ptr, stride_x, inter_ptr, part_ptr, arrive_ptr, ids_ptr, rw_ptr, shw_ptr, table_ptr, shared_slot,
                   w_ptr, s_ptr, z_ptr, rs_ptr, I, p, n0, tail, k_slice, H: tl.constexpr, GEMV: tl.constexpr,
                   ROW_SCALE: tl.constexpr, G: tl.constexpr, GN: tl.constexpr, GB: tl.constexpr,
                   HAS_Z: tl.constexpr, K_IN: tl.constexpr, TOPK: tl.constexpr, HAS_SHARED: tl.constexpr,
                   PACK_RANGE: tl.constexpr, RELEASE: tl.constexpr, SPLIT: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr):
    """Pair p's inter values n0..n0+BN (the `tail`-th unit of the last wave) over k slice `k_slice`
    (BK wide): its gate and up sums go to part_ptr; the last of the unit's SPLIT slices to arrive
    adds them in slice order and stores the unit's inter values."""
    t = p // TOPK
    s, _ = _route(ids_ptr, rw_ptr, shw_ptr, table_ptr, shared_slot, t, p % TOPK, K_IN, TOPK, HAS_SHARED)
    slot, g0 = _gate_rows(s, n0, I)
    zero = tl.zeros((BN,), tl.float32)
    g, up = _gate_up_step(zero, zero, x_ptr + t.to(tl.int64) * stride_x, w_ptr, s_ptr, z_ptr, slot, g0,
                          k_slice * BK, H, I, GEMV, BN, BK, G, GN, GB, HAS_Z)
    rows = part_ptr + tail.to(tl.int64) * (SPLIT * 2 * BN) + tl.arange(0, BN)
    tl.store(rows + k_slice * 2 * BN, g)
    tl.store(rows + k_slice * 2 * BN + BN, up)
    if RELEASE:
        release_dependents()
    if last_arrival(arrive_ptr + tail, SPLIT):
        g = tl.zeros((BN,), tl.float32)
        up = tl.zeros((BN,), tl.float32)
        for c in tl.static_range(SPLIT):
            g += tl.load(rows + c * 2 * BN, cache_modifier=".cg")
            up += tl.load(rows + c * 2 * BN + BN, cache_modifier=".cg")
        _store_inter(inter_ptr, p, _silu_up(g, up, rs_ptr, slot, n0, I, ROW_SCALE, BN), n0, I, PACK_RANGE, BN)


@triton.jit
def _decode_down_kernel(inter_ptr, out_ptr, stride_out, final_ptr, arrive_ptr, ids_ptr, rw_ptr, shw_ptr, table_ptr,
                        shared_slot, w_ptr, s_ptr, z_ptr, rs_ptr, H,
                        I: tl.constexpr, GEMV: tl.constexpr, ROW_SCALE: tl.constexpr, G: tl.constexpr,
                        GN: tl.constexpr, GB: tl.constexpr, HAS_Z: tl.constexpr, K_IN: tl.constexpr,
                        TOPK: tl.constexpr, TP: tl.constexpr, HAS_SHARED: tl.constexpr, ROW: tl.constexpr,
                        x_dtype: tl.constexpr, PAIRS: tl.constexpr, ARRIVE: tl.constexpr, PDL: tl.constexpr,
                        PRELOAD: tl.constexpr, TILE: tl.constexpr, TILE_GEMV: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr):
    t = tl.program_id(0)
    n0 = tl.program_id(1) * BN
    chunk = tl.program_id(2)  # pairs chunk * PAIRS .. + PAIRS of the token (all of them: one chunk)
    offs_n = n0 + tl.arange(0, BN)
    mask_n = offs_n < H
    if PRELOAD:
        out = _down_preloaded(inter_ptr, t, n0, ids_ptr, rw_ptr, shw_ptr, table_ptr, shared_slot, w_ptr, s_ptr, z_ptr,
                              rs_ptr, H, I, TILE, TILE_GEMV, ROW_SCALE, G, GB, HAS_Z, K_IN, TOPK, TP, HAS_SHARED, ROW,
                              x_dtype, BN, BK)
    else:
        out = _down_chunk(inter_ptr, t, n0, chunk, ids_ptr, rw_ptr, shw_ptr, table_ptr, shared_slot, w_ptr, s_ptr,
                          z_ptr, rs_ptr, H, I, GEMV, ROW_SCALE, G, GN, GB, HAS_Z, K_IN, TOPK, TP, HAS_SHARED, ROW,
                          x_dtype, PAIRS, PDL, BN, BK)
    if PAIRS >= TOPK:
        tl.store(out_ptr + t.to(tl.int64) * stride_out + offs_n, out.to(out_ptr.dtype.element_ty), mask=mask_n)
    else:  # this chunk's fp32 partial sum, row (t, chunk) of a [T, chunks, H] buffer (`_sum_chunks_kernel`)
        CHUNKS: tl.constexpr = (TOPK + PAIRS - 1) // PAIRS
        rows = out_ptr + (t * CHUNKS).to(tl.int64) * H + offs_n
        tl.store(rows + chunk * H, out, mask=mask_n)
        if ARRIVE:  # the row block's last chunk to arrive sums the chunks in order into final_ptr
            if last_arrival(arrive_ptr + t * tl.num_programs(1) + tl.program_id(1), CHUNKS):
                total = tl.zeros((BN,), tl.float32)
                for c in tl.static_range(CHUNKS):
                    total += tl.load(rows + c * H, mask=mask_n, other=0.0, cache_modifier=".cg")
                tl.store(final_ptr + t.to(tl.int64) * stride_out + offs_n, total.to(final_ptr.dtype.element_ty),
                         mask=mask_n)


@triton.jit
def _sum_chunks_kernel(part_ptr, out_ptr, stride_out, H, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = the sum of the down launch's CHUNKS partial rows of token t, in chunk order."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < H
    acc = tl.zeros((BLOCK,), tl.float32)
    for c in tl.static_range(CHUNKS):
        acc += tl.load(part_ptr + (t * CHUNKS + c) * H + offs, mask=m, other=0.0)
    tl.store(out_ptr + t * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=m)


def gemv_bk(bk: int, kernel, group: int, k: int) -> tuple[int, int]:
    """(BK, GB) of a GEMV step over K: BK a power of two no wider than K needs, at least 32
    (16 scales of packed formats per row need BK >= 16; nibble pairs need even); GB the values
    per scaled partial sum (a power-of-two group, else the whole BK)."""
    bk = max(32, min(bk, triton.next_power_of_2(k)))
    if kernel.group_scaled:
        if group & (group - 1):
            raise ValueError(f"GEMV step: group {group} is not a power of two")
        return bk, min(group, bk)
    return bk, bk


def _bk(bk: int, m: SlotMatrix) -> tuple[int, int]:
    return gemv_bk(bk, m.kernel, m.group, m.k)


def gemv_handles(kernel, group: int) -> bool:
    """Whether a form's GEMV step runs this layout: the form has one, its scale group is a power of
    two, and at least the 16 values a packed-half unit sums (nibble_gemv) where the form packs."""
    if kernel.gemv is None or not kernel.group_scaled:
        return kernel.gemv is not None
    return not group & (group - 1) and not (kernel.x_range and group < 16)


def supports(gate_up: SlotMatrix) -> bool:
    """Whether the decode kernels handle this slot layout (`gemv_handles`)."""
    return gemv_handles(gate_up.kernel, gate_up.group)


def _route_args(ids, weights, table_row, shared_slot, shared_gate):
    ids, weights = ids.contiguous(), weights.contiguous()
    shw = shared_gate.reshape(-1).contiguous() if shared_gate is not None else weights
    return ids, weights, shw, table_row, shared_slot


def _common(m: SlotMatrix, k_in: int, has_shared: bool) -> dict:
    return dict(GEMV=m.kernel.gemv, ROW_SCALE=m.kernel.has_row_scale, G=m.group, GN=m.group_n,
                HAS_Z=m.z is not None, K_IN=k_in, TOPK=k_in + int(has_shared), HAS_SHARED=has_shared)


def decode_gate_up(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: SlotMatrix,
                   table_row: torch.Tensor, shared_slot: int, shared_gate: torch.Tensor | None,
                   cfg: DecodeConfig, arrivals: torch.Tensor | None = None) -> torch.Tensor:
    """inter [T * topk, I] = SiLU(gate) * up of every (token, choice) pair (launch 1).
    `arrivals`: zeroed int32 words for `gate_up_split` (without them, or too few, no split)."""
    t, k_in = ids.shape
    common = _common(gate_up, k_in, shared_gate is not None)
    i = gate_up.part
    bk, gb = _bk(cfg.gate_up_bk, gate_up)
    bn = min(cfg.gate_up_bn, triton.next_power_of_2(i))
    pack = packs_inter(gate_up, x.dtype, bn)
    pairs, blocks = t * common["TOPK"], triton.cdiv(i, bn)
    inter = _inter_buffer(x, pairs, i, pack)
    sms = _sms(x.device) if bk >= gate_up.k and cfg.gate_up_split else 0
    split = tail_split(pairs * blocks, sms, cfg.gate_up_split)
    tail = (pairs * blocks) % sms if split else 0
    if split and arrivals is not None and arrivals.numel() >= tail:  # the whole waves, then each tail slice
        full = pairs * blocks - tail
        grid = (full + tail * split,)
        part = torch.empty(tail * split * 2 * bn, dtype=torch.float32, device=x.device)  # its gate and up sums
    else:
        grid, part, arrivals, full, split = (pairs, blocks), inter, inter, 0, 0
    _decode_gate_up_kernel[grid](
        x, x.stride(0), inter, part, arrivals,
        *_route_args(ids, weights, table_row, shared_slot, shared_gate),
        *gate_up.kernel_args(), i, full, H=gate_up.k, GB=gb, UNROLL=cfg.unroll,
        PACK_RANGE=gate_up.kernel.x_range if pack else 0.0, RELEASE=_pdl(cfg, x), SPLIT=split,
        GB_SPLIT=_bk(bk // split, gate_up)[1] if split else gb, BN=bn, BK=bk, num_warps=cfg.num_warps, **common)
    return inter


def tail_split(units: int, sms: int, most: int) -> int:
    """The k slices each unit of gate_up's last, partial wave is cut into (0: none). A unit (a
    pair's row block over all of H) is one program; with `units` = waves * sms + tail, the SMs that
    run a tail unit take one unit longer than the rest. Cut into s slices, the tail's units spread
    over the SMs (the last of a unit's slices to arrive sums them). The s of 2, 4, ... `most` that
    leaves the least work on the busiest SM, where that saves at least a tenth of it."""
    waves, tail = divmod(units, sms) if sms else (0, 0)
    if not waves or not tail or most < 2:
        return 0
    cuts = [s for s in (2, 4, 8, 16) if s <= most]
    busiest = {s: waves + triton.cdiv(tail * s, sms) / s for s in cuts}
    best = min(cuts, key=lambda s: (busiest[s], s))
    return best if busiest[best] <= 0.9 * (waves + 1) else 0


def _sms(device: torch.device) -> int:
    """The device's SMs (0 off CUDA: gate_up's units are not split)."""
    return num_sms(device) if device.type == "cuda" else 0


def _inter_buffer(x: torch.Tensor, pairs: int, i: int, pack: bool) -> torch.Tensor:
    """Each pair's inter row: I values in x's dtype, or as `pack_units` stores them (int32: the
    I / 2 fp16x2 operands, then 1 / c and the sum of every 16-value unit)."""
    if pack:
        return torch.empty(pairs, i // 2 + i // 8, dtype=torch.int32, device=x.device)
    return torch.empty(pairs, i, dtype=x.dtype, device=x.device)


def packs_inter(gate_up: SlotMatrix, dtype: torch.dtype, bn: int) -> bool:
    """Whether gate_up hands `inter` to down as packed halves: the form's GEMV step reads them
    (`MoEKernel.x_range`), activations are 16-bit and each program holds whole 16-value units."""
    i = gate_up.part
    return bool(gate_up.kernel.x_range) and dtype != torch.float32 and bn % 16 == 0 and i % bn == 0


def decode_down(inter: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, down: SlotMatrix,
                table_row: torch.Tensor, shared_slot: int, shared_gate: torch.Tensor | None,
                cfg: DecodeConfig, arrivals: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, H] = sum over each token's pairs of down @ inter, times the routing weight (launch 2).
    `inter` is bf16/fp16/fp32 [pairs, I] or, from `packs_inter`, int32 [pairs, I/2 + I/8].
    `arrivals`: zeroed int32 words for `down_arrive` (without them, or too few, a launch sums the chunks)."""
    t, k_in = ids.shape
    common = _common(down, k_in, shared_gate is not None)
    h = down.n
    preload = cfg.down_preload and down.kernel.tile is not None and inter.dtype == torch.int32
    bk, gb = _bk(down.k if preload else cfg.down_bk, down)  # preloaded: a pair's tile is all of I
    bn = min(cfg.down_bn, triton.next_power_of_2(h))
    topk = common["TOPK"]
    pairs = topk if preload else min(cfg.down_pairs or topk, topk)
    chunks, blocks = triton.cdiv(topk, pairs), triton.cdiv(h, bn)
    dest = out if chunks == 1 else torch.empty(t, chunks, h, dtype=torch.float32, device=out.device)
    arrive = chunks > 1 and cfg.down_arrive and arrivals is not None and arrivals.numel() >= t * blocks
    pdl = _pdl(cfg, out)
    _decode_down_kernel[(t, blocks, chunks)](
        inter, dest, out.stride(0), out, arrivals if arrive else out,
        *_route_args(ids, weights, table_row, shared_slot, shared_gate),
        *down.kernel_args(), h, I=down.k, GB=gb, TP=triton.next_power_of_2(topk), ROW=inter.shape[1],
        x_dtype=TL_DTYPES[out.dtype], PAIRS=pairs, ARRIVE=arrive, PDL=pdl, PRELOAD=preload,
        TILE=down.kernel.tile, TILE_GEMV=down.kernel.tile_gemv, BN=bn, BK=bk, num_warps=cfg.down_warps,
        launch_pdl=pdl, **common)
    if chunks > 1 and not arrive:
        block = min(1024, triton.next_power_of_2(h))
        _sum_chunks_kernel[(t, triton.cdiv(h, block))](dest, out, out.stride(0), h, CHUNKS=chunks, BLOCK=block,
                                                       num_warps=4)
    return out


def _pdl(cfg: DecodeConfig, x: torch.Tensor) -> bool:
    """`down_pdl` where the device has programmatic dependent launch (else two plain launches)."""
    return cfg.down_pdl and grid_dependency.supported(x.device)


def decode_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: SlotMatrix, down: SlotMatrix,
               table_row: torch.Tensor, shared_slot: int, shared_gate: torch.Tensor | None,
               cfg: DecodeConfig, arrivals: torch.Tensor | None = None) -> torch.Tensor:
    """`fused_moe`'s contract (x [T, H] contiguous rows, ids/weights [T, k], table_row [E]);
    `arrivals`: the slot buffer's zeroed counter words (`RoutingScratch.arrivals`), which
    `down_arrive` needs (without them a third launch sums the down chunks)."""
    route = (table_row, shared_slot, shared_gate)
    inter = decode_gate_up(x, ids, weights, gate_up, *route, cfg, arrivals)
    return decode_down(inter, torch.empty_like(x), ids, weights, down, *route, cfg, arrivals)
