"""Fused MoE grouped GEMMs over an expert-slot buffer (Triton).

    out[t] = sum_j w[t, j] * down[s] @ (silu(gate[s] @ x[t]) * (up[s] @ x[t])),  s = table[ids[t, j]]

1. `prepare_routing` (moe_prep.py) groups the (token, choice) pairs by slot into blocks of
   BLOCK_M rows, on the device.
2. `_gate_up_kernel`: per (block, BN columns of I) the gate and up tiles of the block's slot,
   SiLU(gate) * up in the epilogue, written in block order to `inter [blocks*BM, I]`.
3. `_down_kernel`: per (block, BN columns of H) `inter @ down[s]^T`, times the routing
   weight, written per pair to `y [T*topk, H]`.
4. `_reduce_kernel`: out[t] = sum over the token's resident pairs of y (fp32 sum).
With split-K (GemmConfig.split > 1, decode) each GEMM program reduces one slice of K and
writes fp32 partial sums: gate_up's are added up and SiLU-multiplied by `_silu_reduce_kernel`,
down's by `_reduce_kernel` together with the pairs.

With a DecodeConfig `fused_moe` runs the decode path of moe_decode.py instead (two launches,
no routing prep, GEMV on the CUDA cores): a slot buffer asks for it up to the token count
its warm-up timing chose (`SlotBuffer.decode_tokens`, `moeferry.moe.path_choice`).

Weights are read through the format's step (moe_formats.py), which dequantizes inside the
kernel; the math is bf16 (the activations' dtype) with fp32 accumulation. Decode (few
tokens) uses BLOCK_M = 16 blocks: every selected expert is one block, so each expert's
weights are read once, streamed by narrow column tiles over many programs (GEMV-like),
with the weight tile as the dot's first operand (`swap`: dequantized in registers, tokens
on the narrow side). Prefill uses wgmma tiles of 64-128 token rows. Under TRITON_INTERPRET=1 the dots run in
fp32 (the interpreter's bf16 dot is wrong).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from . import interpreting
from .moe_decode import DECODE_CONFIGS, DecodeConfig, decode_moe, supports as decode_supports
from .moe_formats import TL_DTYPES, SlotMatrix
from .moe_prep import Routing, RoutingScratch, prepare_routing


@triton.jit
def _tile_ids(pid, num_m, num_n, GROUP_M: tl.constexpr):
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@triton.jit
def _block(pid_m, sorted_ptr, block_slot_ptr, block_rows_ptr, BM: tl.constexpr):
    """Row block pid_m of the sorted routing: (its expert's slot, row offsets, row mask, pairs as int64)."""
    slot = tl.load(block_slot_ptr + pid_m).to(tl.int64)
    offs_m = tl.arange(0, BM)
    mask_m = offs_m < tl.load(block_rows_ptr + pid_m)
    pair = tl.load(sorted_ptr + pid_m * BM + offs_m, mask=mask_m, other=0).to(tl.int64)
    return slot, offs_m, mask_m, pair


@triton.jit(do_not_specialize=["max_blocks"])
def _gate_up_kernel(x_ptr, stride_x, inter_ptr, ws_ptr, w_ptr, s_ptr, z_ptr, rs_ptr,
                    sorted_ptr, block_slot_ptr, block_rows_ptr, num_blocks_ptr, max_blocks, H, I, K_SPLIT, SPLIT,
                    STEP: tl.constexpr, ROW_SCALE: tl.constexpr, G: tl.constexpr, GN: tl.constexpr,
                    HAS_Z: tl.constexpr, TOPK: tl.constexpr, DT: tl.constexpr, SWAP: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile_ids(tl.program_id(0), max_blocks, tl.cdiv(I, BN), GROUP_M)
    pid_k = tl.program_id(1)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    slot, offs_m, mask_m, pair = _block(pid_m, sorted_ptr, block_slot_ptr, block_rows_ptr, BM)
    tok = pair // TOPK
    offs_k = tl.arange(0, BK)
    a_ptrs = x_ptr + tok[:, None] * stride_x + offs_k[None, :]
    n0 = pid_n * BN
    acc_g = tl.zeros((BN, BM) if SWAP else (BM, BN), tl.float32)
    acc_u = tl.zeros((BN, BM) if SWAP else (BM, BN), tl.float32)
    for k0 in range(pid_k * K_SPLIT, tl.minimum(H, pid_k * K_SPLIT + K_SPLIT), BK):
        a = tl.load(a_ptrs + k0, mask=mask_m[:, None] & (offs_k[None, :] + k0 < H), other=0.0).to(DT)
        acc_g = STEP(acc_g, a, w_ptr, s_ptr, z_ptr, slot, n0, k0, 2 * I, H, I, BN, BK, G, GN, HAS_Z, DT, SWAP)
        acc_u = STEP(acc_u, a, w_ptr, s_ptr, z_ptr, slot, n0 + I, k0, 2 * I, H, I, BN, BK, G, GN, HAS_Z, DT, SWAP)
    if SWAP:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    offs_n = n0 + tl.arange(0, BN)
    mask_n = offs_n < I
    if ROW_SCALE:
        acc_g *= tl.load(rs_ptr + slot * 2 * I + offs_n, mask=mask_n, other=0.0)[None, :]
        acc_u *= tl.load(rs_ptr + slot * 2 * I + I + offs_n, mask=mask_n, other=0.0)[None, :]
    rows = (pid_m * BM + offs_m).to(tl.int64)
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT == 1:
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(inter_ptr + rows[:, None] * I + offs_n[None, :], h.to(inter_ptr.dtype.element_ty), mask=mask)
    else:  # partial sums [SPLIT, rows, 2I] (gate | up); _silu_reduce_kernel finishes
        part = ws_ptr + (pid_k * max_blocks * BM + rows[:, None]) * (2 * I) + offs_n[None, :]
        tl.store(part, acc_g, mask=mask)
        tl.store(part + I, acc_u, mask=mask)


@triton.jit(do_not_specialize=["max_blocks"])
def _silu_reduce_kernel(ws_ptr, inter_ptr, block_rows_ptr, num_blocks_ptr, max_blocks, I, SPLIT,
                        BM: tl.constexpr, BN: tl.constexpr):
    """inter = silu(sum gate partials) * (sum up partials), for the written rows of a block."""
    pid_m = tl.program_id(0)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    offs_m = tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (offs_m < tl.load(block_rows_ptr + pid_m))[:, None] & (offs_n < I)[None, :]
    rows = (pid_m * BM + offs_m).to(tl.int64)
    ptrs = ws_ptr + rows[:, None] * (2 * I) + offs_n[None, :]
    g = tl.zeros((BM, BN), tl.float32)
    u = tl.zeros((BM, BN), tl.float32)
    for sp in range(0, SPLIT):
        g += tl.load(ptrs + sp * max_blocks * BM * 2 * I, mask=mask, other=0.0)
        u += tl.load(ptrs + sp * max_blocks * BM * 2 * I + I, mask=mask, other=0.0)
    h = g / (1.0 + tl.exp(-g)) * u
    tl.store(inter_ptr + rows[:, None] * I + offs_n[None, :], h.to(inter_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["max_blocks", "num_pairs"])
def _down_kernel(inter_ptr, y_ptr, w_ptr, s_ptr, z_ptr, rs_ptr, pair_w_ptr,
                 sorted_ptr, block_slot_ptr, block_rows_ptr, num_blocks_ptr, max_blocks, H, I, K_SPLIT, num_pairs,
                 STEP: tl.constexpr, ROW_SCALE: tl.constexpr, G: tl.constexpr, GN: tl.constexpr,
                 HAS_Z: tl.constexpr, DT: tl.constexpr, SWAP: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile_ids(tl.program_id(0), max_blocks, tl.cdiv(H, BN), GROUP_M)
    pid_k = tl.program_id(1)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    slot, offs_m, mask_m, pair = _block(pid_m, sorted_ptr, block_slot_ptr, block_rows_ptr, BM)
    offs_k = tl.arange(0, BK)
    rows = (pid_m * BM + offs_m).to(tl.int64)
    a_ptrs = inter_ptr + rows[:, None] * I + offs_k[None, :]
    n0 = pid_n * BN
    acc = tl.zeros((BN, BM) if SWAP else (BM, BN), tl.float32)
    for k0 in range(pid_k * K_SPLIT, tl.minimum(I, pid_k * K_SPLIT + K_SPLIT), BK):
        a = tl.load(a_ptrs + k0, mask=mask_m[:, None] & (offs_k[None, :] + k0 < I), other=0.0).to(DT)
        acc = STEP(acc, a, w_ptr, s_ptr, z_ptr, slot, n0, k0, H, I, H, BN, BK, G, GN, HAS_Z, DT, SWAP)
    if SWAP:
        acc = tl.trans(acc)
    offs_n = n0 + tl.arange(0, BN)
    mask_n = offs_n < H
    if ROW_SCALE:
        acc *= tl.load(rs_ptr + slot * H + offs_n, mask=mask_n, other=0.0)[None, :]
    acc *= tl.load(pair_w_ptr + pair, mask=mask_m, other=0.0)[:, None]
    y_ptr += pid_k.to(tl.int64) * num_pairs * H  # split-K: partial sums [SPLIT, pairs, H]
    tl.store(y_ptr + pair[:, None] * H + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _reduce_kernel(y_ptr, out_ptr, pair_slot_ptr, H, stride_out, num_pairs, SPLIT,
                   TOPK: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BH + tl.arange(0, BH)
    m = offs < H
    acc = tl.zeros((BH,), tl.float32)
    for j in tl.static_range(TOPK):
        ok = tl.load(pair_slot_ptr + t * TOPK + j) >= 0
        for sp in range(0, SPLIT):
            acc += tl.load(y_ptr + (sp * num_pairs + t * TOPK + j) * H + offs, mask=m & ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=m)


# -- configs --------------------------------------------------------------------------------
@dataclass(frozen=True)
class GemmConfig:
    bn: int
    bk: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 1
    swap: bool = False  # weights as the dot's first operand (see moe_formats.py)
    split: int = 1      # split-K: programs per (block, column tile), each a slice of K


@dataclass(frozen=True)
class MoEConfig:
    block_m: int
    gate_up: GemmConfig
    down: GemmConfig


# (max tokens, config); the first row whose bound >= T wins; KERNEL_CONFIGS[kernel name]
# replaces the table for one kernel. Picked by `benchmarks/moe_kernels.py --sweep` (tiles) and
# `benchmarks/quant_decode.py moe` (split-K of gate_up at T = 1, 4, 16) on an H200 at Qwen3.6
# shapes (E=256, k=8, H=2048, I=512); see benchmarks/README.md. Split-K of down never won.
def _decode(split_1: int, split_4: int, split_16: int) -> list[tuple[int, MoEConfig]]:
    def cfg(bn, split):
        return MoEConfig(16, GemmConfig(bn, 128, 4, 4, swap=True, split=split), GemmConfig(64, 128, 4, 4, swap=True))
    return [(1, cfg(32, split_1)), (4, cfg(32, split_4)), (32, cfg(64, split_16)),
            (512, MoEConfig(32, GemmConfig(64, 64, 4, 4, 8), GemmConfig(64, 64, 4, 4, 8)))]


def _prefill(bm: int, gu_bn: int, swap: bool) -> MoEConfig:
    return MoEConfig(bm, GemmConfig(gu_bn, 64, 8, 3, 8, swap), GemmConfig(128, 64, 8, 3, 8, swap))


CONFIGS: list[tuple[int, MoEConfig]] = _decode(1, 1, 1) + [(1 << 62, _prefill(128, 64, False))]
KERNEL_CONFIGS: dict[str, list[tuple[int, MoEConfig]]] = {
    "dense": _decode(1, 2, 1) + [(4096, _prefill(64, 128, True)), (1 << 62, _prefill(128, 64, True))],
    "fp8_row": _decode(1, 1, 2) + [(1 << 62, _prefill(128, 64, False))],
    "fp8_block": _decode(4, 4, 1) + [(1 << 62, _prefill(128, 64, True))],
    "fp4": _decode(2, 1, 2) + [(1 << 62, _prefill(128, 128, True))],
    "int4": _decode(2, 2, 1) + [(1 << 62, _prefill(64, 128, True))],
}
# interpreter: small tiles; split-K in both orientations (T <= 2 swapped, T in 3..32 not), T > 32 swapped
INTERPRET_CONFIGS: list[tuple[int, MoEConfig]] = [
    (2, MoEConfig(16, GemmConfig(32, 64, swap=True, split=2), GemmConfig(64, 32, swap=True, split=2))),
    (32, MoEConfig(16, GemmConfig(32, 64, split=2), GemmConfig(64, 32, group_m=2))),
    (1 << 62, MoEConfig(32, GemmConfig(32, 64, swap=True), GemmConfig(64, 32, group_m=2, swap=True))),
]


# The decode path (moe_decode.py: GEMV per pair, two launches, no routing prep) runs where a
# slot buffer's `decode_tokens` admits T: the warm-up times both paths on the device at decode
# sizes and keeps the faster (`moeferry.moe.path_choice`); `benchmarks/quant_decode.py moe`
# sweeps the decode path's block sizes against the grouped GEMM per format and T.
INTERPRET_DECODE_CONFIG = DecodeConfig(gate_up_bn=16, gate_up_bk=64, down_bn=32, down_bk=32)


def decode_config(gate_up: SlotMatrix) -> DecodeConfig | None:
    """The decode path's config for this slot form, or None where its kernels do not handle it."""
    if not decode_supports(gate_up):
        return None
    if interpreting():
        return INTERPRET_DECODE_CONFIG
    return DECODE_CONFIGS.get(gate_up.kernel.name, DecodeConfig())


def _fit(g: GemmConfig, m: SlotMatrix) -> GemmConfig:
    """Shrink BK to what the format allows: a divisor of the group (scaled formats) and of K
    (nibble-packed formats); at least 32 so the half-tiles of packed formats are >= 16."""
    bk = m.kernel.fit_bk(g.bk, m.group, m.k)
    if m.kernel.packed_k and (m.k % bk or bk < 32):
        raise ValueError(f"{m.kernel.name}: K={m.k} needs a multiple of 32")
    bn = min(g.bn, max(16, triton.next_power_of_2(m.part)))
    return replace(g, bk=bk, bn=bn)


def choose_config(num_tokens: int, gate_up: SlotMatrix, down: SlotMatrix) -> MoEConfig:
    if interpreting():
        table = INTERPRET_CONFIGS
    else:
        table = KERNEL_CONFIGS.get(gate_up.kernel.name, CONFIGS)
    cfg = next(c for bound, c in table if num_tokens <= bound)
    return replace(cfg, gate_up=_fit(cfg.gate_up, gate_up), down=_fit(cfg.down, down))


# -- launches -------------------------------------------------------------------------------
def _dot_dtype(x: torch.Tensor):
    return tl.float32 if interpreting() else TL_DTYPES[x.dtype]


def _launch_args(m: SlotMatrix, g: GemmConfig):
    w, s, z, rs = m.kernel_args()
    consts = dict(STEP=m.kernel.step, ROW_SCALE=m.kernel.has_row_scale, G=m.group, GN=m.group_n,
                  HAS_Z=m.z is not None, SWAP=g.swap, BN=g.bn, BK=g.bk, GROUP_M=g.group_m,
                  num_warps=g.num_warps, num_stages=g.num_stages)
    return (w, s, z, rs), consts


def _k_split(k: int, g: GemmConfig) -> tuple[int, int]:
    """(K per split, number of splits): whole k-steps per split, so a tile stays in one scale group."""
    steps = triton.cdiv(k, g.bk)
    k_split = triton.cdiv(steps, max(1, g.split)) * g.bk
    return k_split, triton.cdiv(k, k_split)


def gate_up_silu(x: torch.Tensor, gate_up: SlotMatrix, r: Routing, cfg: MoEConfig) -> torch.Tensor:
    """inter [max_blocks * BM, I] in block order (padding rows unwritten)."""
    i = gate_up.n // 2
    rows = r.max_blocks * r.block_m
    inter = torch.empty(rows, i, dtype=x.dtype, device=x.device)
    k_split, split = _k_split(x.shape[1], cfg.gate_up)
    part = torch.empty(split, rows, 2 * i, dtype=torch.float32, device=x.device) if split > 1 else inter
    ws, consts = _launch_args(gate_up, cfg.gate_up)
    grid = (r.max_blocks * triton.cdiv(i, cfg.gate_up.bn), split)
    _gate_up_kernel[grid](x, x.stride(0), inter, part, *ws, r.sorted_ids, r.block_slot, r.block_rows, r.num_blocks,
                          r.max_blocks, x.shape[1], i, k_split, split, TOPK=r.topk, DT=_dot_dtype(x),
                          BM=r.block_m, **consts)
    if split > 1:
        bn = min(256, triton.next_power_of_2(i))
        _silu_reduce_kernel[(r.max_blocks, triton.cdiv(i, bn))](part, inter, r.block_rows, r.num_blocks,
                                                                 r.max_blocks, i, split, BM=r.block_m, BN=bn)
    return inter


def down_weighted(inter: torch.Tensor, down: SlotMatrix, r: Routing, cfg: MoEConfig) -> torch.Tensor:
    """y [SPLIT, T * topk, H]: each pair's expert output times its routing weight, one partial
    sum per K split (fp32 when split, else inter's dtype; rows of non-resident pairs unwritten)."""
    h, i = down.n, down.k
    pairs = r.num_tokens * r.topk
    k_split, split = _k_split(i, cfg.down)
    y = torch.empty(split, pairs, h, dtype=inter.dtype if split == 1 else torch.float32, device=inter.device)
    ws, consts = _launch_args(down, cfg.down)
    grid = (r.max_blocks * triton.cdiv(h, cfg.down.bn), split)
    _down_kernel[grid](inter, y, *ws, r.pair_w, r.sorted_ids, r.block_slot, r.block_rows, r.num_blocks,
                       r.max_blocks, h, i, k_split, pairs, DT=_dot_dtype(inter), BM=r.block_m, **consts)
    return y


def reduce_pairs(y: torch.Tensor, r: Routing, out: torch.Tensor) -> torch.Tensor:
    """out [T, H] = sum over each token's resident pairs (and the K splits) of y [SPLIT, T * topk, H]."""
    split, pairs, h = y.shape
    bh = min(1024, triton.next_power_of_2(h))
    _reduce_kernel[(r.num_tokens, triton.cdiv(h, bh))](y, out, r.pair_slot, h, out.stride(0), pairs, split,
                                                       TOPK=r.topk, BH=bh)
    return out


def fused_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: SlotMatrix,
              down: SlotMatrix, table_row: torch.Tensor, scratch: RoutingScratch, shared_slot: int = -1,
              shared_gate: torch.Tensor | None = None,
              config: MoEConfig | DecodeConfig | None = None) -> torch.Tensor:
    """x [T, H]; ids, weights [T, k]; table_row [E] int32 (expert -> slot, -1: skipped).
    With `shared_gate` [T] (the shared expert gate's logits) the expert in `shared_slot` is added to
    every token, weighted by sigmoid(shared_gate) in fp32 (taken in the kernels).
    `config`: a MoEConfig forces the grouped-GEMM path, a DecodeConfig the decode path
    (default: the grouped GEMM, `choose_config`). Returns [T, H] in x's dtype."""
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    if x.stride(1) != 1:
        x = x.contiguous()
    if isinstance(config, DecodeConfig):
        if not decode_supports(gate_up):
            raise ValueError(f"decode path: {gate_up.kernel.name} slots with group {gate_up.group} not supported")
        return decode_moe(x, ids, weights, gate_up, down, table_row, shared_slot, shared_gate, config,
                          scratch.arrivals)
    cfg = config or choose_config(x.shape[0], gate_up, down)
    r = prepare_routing(ids, weights, table_row, scratch, cfg.block_m, shared_slot, shared_gate)
    out = torch.empty_like(x)
    return reduce_pairs(down_weighted(gate_up_silu(x, gate_up, r, cfg), down, r, cfg), r, out)
