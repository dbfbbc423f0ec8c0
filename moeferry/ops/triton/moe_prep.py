"""Routing prep on the device: group (token, k) pairs by expert slot, padded to BLOCK_M.

Pair p = t * TOPK + j is token t's j-th choice (j == k: the shared expert, if any). For the
GEMM kernels each block of BLOCK_M rows holds pairs of one slot:

    sorted_ids  int32 [max_blocks * BM]  pair ids, block b's rows at [b*BM, b*BM + rows[b])
    block_slot  int32 [max_blocks]       slot of block b
    block_rows  int32 [max_blocks]       valid rows of block b (the rest is padding)
    num_blocks  int32 [1]                blocks in use; programs of blocks past it exit
    pair_slot   int32 [P]                slot of each pair, -1: not resident (contributes 0)
    pair_w      fp32  [P]                routing weight of each pair

No host sync: `max_blocks` is a bound from T, k and the slot count, the rest is on the
device. Three phases, each O(P): (A) look up slots, rank pairs within their slot by an
atomic counter; (B) the first pair of each slot reserves its blocks with an atomic on
num_blocks; (C) scatter pair ids and reset the counters (so the scratch stays zero between
calls). Small P runs all three in one program (barriers between phases); large P runs
three launches. Order inside a block is whatever the atomics gave: every row is computed
independently, so results do not depend on it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

SINGLE_PROGRAM_MAX_PAIRS = 1024
_BLOCK = 256


def _single_block(pairs: int) -> int:
    """The one-program prep's block: 32 pairs for a small decode batch, else _BLOCK (two compiled
    variants in all, both warmed at boot, rather than one per power of two of the pair count)."""
    return 32 if pairs <= 32 else _BLOCK


@triton.jit
def _phase_a(i0, ids_ptr, w_ptr, shw_ptr, table_ptr, shared_slot, P, counts_ptr,
             pair_slot_ptr, pair_w_ptr, rank_ptr,
             K_IN: tl.constexpr, TOPK: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr):
    offs = i0 + tl.arange(0, BLOCK)
    m = offs < P
    t = offs // TOPK
    j = offs % TOPK
    routed = m & (j < K_IN)
    e = tl.load(ids_ptr + t * K_IN + j, mask=routed, other=0)
    s = tl.load(table_ptr + e, mask=routed, other=-1)
    w = tl.load(w_ptr + t * K_IN + j, mask=routed, other=0.0).to(tl.float32)
    if HAS_SHARED:
        sh = m & (j == K_IN)
        s = tl.where(sh, shared_slot, s)
        w = tl.where(sh, tl.sigmoid(tl.load(shw_ptr + t, mask=sh, other=0.0).to(tl.float32)), w)
    valid = m & (s >= 0)
    r = tl.atomic_add(counts_ptr + s, tl.full((BLOCK,), 1, tl.int32), mask=valid)
    tl.store(pair_slot_ptr + offs, tl.where(valid, s, -1), mask=m)
    tl.store(pair_w_ptr + offs, w, mask=m)
    tl.store(rank_ptr + offs, r, mask=valid)


@triton.jit
def _phase_b(i0, P, counts_ptr, gstart_ptr, pair_slot_ptr, rank_ptr, num_blocks_ptr,
             block_slot_ptr, block_rows_ptr, BM: tl.constexpr, BLOCK: tl.constexpr):
    offs = i0 + tl.arange(0, BLOCK)
    m = offs < P
    s = tl.load(pair_slot_ptr + offs, mask=m, other=-1, volatile=True)
    r = tl.load(rank_ptr + offs, mask=m & (s >= 0), other=1, volatile=True)
    first = m & (s >= 0) & (r == 0)
    c = tl.load(counts_ptr + s, mask=first, other=0, volatile=True)
    nb = tl.where(first, (c + BM - 1) // BM, 0)
    b0 = tl.atomic_add(num_blocks_ptr + tl.zeros((BLOCK,), tl.int32), nb, mask=first)
    tl.store(gstart_ptr + s, b0, mask=first)
    for q in range(0, tl.max(nb, 0)):
        mq = first & (q < nb)
        tl.store(block_slot_ptr + b0 + q, s, mask=mq)
        tl.store(block_rows_ptr + b0 + q, tl.minimum(c - q * BM, BM), mask=mq)


@triton.jit
def _phase_c(i0, P, counts_ptr, gstart_ptr, pair_slot_ptr, rank_ptr, sorted_ptr,
             BM: tl.constexpr, BLOCK: tl.constexpr):
    offs = i0 + tl.arange(0, BLOCK)
    m = offs < P
    s = tl.load(pair_slot_ptr + offs, mask=m, other=-1, volatile=True)
    valid = m & (s >= 0)
    r = tl.load(rank_ptr + offs, mask=valid, other=0, volatile=True)
    g = tl.load(gstart_ptr + s, mask=valid, other=0, volatile=True)
    tl.store(sorted_ptr + g * BM + r, offs, mask=valid)
    tl.store(counts_ptr + s, tl.zeros((BLOCK,), tl.int32), mask=valid)


@triton.jit(do_not_specialize=["P"])
def _prep_single_kernel(ids_ptr, w_ptr, shw_ptr, table_ptr, shared_slot, P, counts_ptr, gstart_ptr,
                        pair_slot_ptr, pair_w_ptr, rank_ptr, num_blocks_ptr, block_slot_ptr,
                        block_rows_ptr, sorted_ptr,
                        K_IN: tl.constexpr, TOPK: tl.constexpr, HAS_SHARED: tl.constexpr,
                        BM: tl.constexpr, BLOCK: tl.constexpr):
    tl.store(num_blocks_ptr, 0)
    for i0 in range(0, P, BLOCK):
        _phase_a(i0, ids_ptr, w_ptr, shw_ptr, table_ptr, shared_slot, P, counts_ptr,
                 pair_slot_ptr, pair_w_ptr, rank_ptr, K_IN, TOPK, HAS_SHARED, BLOCK)
    tl.debug_barrier()
    for i0 in range(0, P, BLOCK):
        _phase_b(i0, P, counts_ptr, gstart_ptr, pair_slot_ptr, rank_ptr, num_blocks_ptr,
                 block_slot_ptr, block_rows_ptr, BM, BLOCK)
    tl.debug_barrier()
    for i0 in range(0, P, BLOCK):
        _phase_c(i0, P, counts_ptr, gstart_ptr, pair_slot_ptr, rank_ptr, sorted_ptr, BM, BLOCK)


@triton.jit(do_not_specialize=["P"])
def _prep_a_kernel(ids_ptr, w_ptr, shw_ptr, table_ptr, shared_slot, P, counts_ptr,
                   pair_slot_ptr, pair_w_ptr, rank_ptr, num_blocks_ptr,
                   K_IN: tl.constexpr, TOPK: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(num_blocks_ptr, 0)
    _phase_a(pid * BLOCK, ids_ptr, w_ptr, shw_ptr, table_ptr, shared_slot, P, counts_ptr,
             pair_slot_ptr, pair_w_ptr, rank_ptr, K_IN, TOPK, HAS_SHARED, BLOCK)


@triton.jit(do_not_specialize=["P"])
def _prep_b_kernel(P, counts_ptr, gstart_ptr, pair_slot_ptr, rank_ptr, num_blocks_ptr,
                   block_slot_ptr, block_rows_ptr, BM: tl.constexpr, BLOCK: tl.constexpr):
    _phase_b(tl.program_id(0) * BLOCK, P, counts_ptr, gstart_ptr, pair_slot_ptr, rank_ptr,
             num_blocks_ptr, block_slot_ptr, block_rows_ptr, BM, BLOCK)


@triton.jit(do_not_specialize=["P"])
def _prep_c_kernel(P, counts_ptr, gstart_ptr, pair_slot_ptr, rank_ptr, sorted_ptr,
                   BM: tl.constexpr, BLOCK: tl.constexpr):
    _phase_c(tl.program_id(0) * BLOCK, P, counts_ptr, gstart_ptr, pair_slot_ptr, rank_ptr,
             sorted_ptr, BM, BLOCK)


@dataclass
class Routing:
    sorted_ids: torch.Tensor
    block_slot: torch.Tensor
    block_rows: torch.Tensor
    num_blocks: torch.Tensor
    pair_slot: torch.Tensor
    pair_w: torch.Tensor
    num_tokens: int
    topk: int           # pairs per token (routed k, +1 with a shared expert)
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.block_slot.shape[0]


class RoutingScratch:
    """Per-slot counters the prep kernels use, and the decode path's arrival words (`moe_decode`:
    `down_arrive`, one per (token, row block of down); `gate_up_split`, one per unit of gate_up's
    last wave); zero between calls (the kernels reset them)."""

    ARRIVALS = 4096  # words: T = 64 tokens of H / 32 row blocks at Qwen3.6's H = 2048

    def __init__(self, num_slots: int, device):
        self.counts = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.gstart = torch.empty(num_slots, dtype=torch.int32, device=device)
        self.arrivals = torch.zeros(self.ARRIVALS, dtype=torch.int32, device=device)

    def reset(self) -> None:
        self.counts.zero_()
        self.arrivals.zero_()


def max_blocks(num_pairs: int, num_groups: int, block_m: int) -> int:
    """Blocks `num_pairs` pairs can need when they fall in at most `num_groups` slots."""
    groups = min(num_pairs, num_groups)
    return max(1, min(num_pairs, (num_pairs + groups * (block_m - 1)) // block_m))


def prepare_routing(ids: torch.Tensor, weights: torch.Tensor, table_row: torch.Tensor,
                    scratch: RoutingScratch, block_m: int, shared_slot: int = -1,
                    shared_gate: torch.Tensor | None = None) -> Routing:
    """ids/weights [T, k] (expert ids, routing weights); table_row [E] int32 expert -> slot.
    With `shared_gate` [T] (the shared-expert gate's logits), every token gets one more pair on
    `shared_slot`, weighted by sigmoid(shared_gate) in fp32."""
    t, k_in = ids.shape
    has_shared = shared_gate is not None
    topk = k_in + int(has_shared)
    p = t * topk
    dev = ids.device
    # a call reaches at most its table row's experts (and the shared slot), however many slots
    # the buffer has: an offload cache holds every layer's (4307 on the H200 seed boot, where an
    # 8192-token NVFP4 chunk sized ~600 MiB of block rows for them; its 257 reachable need ~96)
    nmax = max_blocks(p, min(scratch.counts.shape[0], table_row.numel() + int(has_shared)), block_m)
    r = Routing(sorted_ids=torch.empty(nmax * block_m, dtype=torch.int32, device=dev),
                block_slot=torch.empty(nmax, dtype=torch.int32, device=dev),
                block_rows=torch.empty(nmax, dtype=torch.int32, device=dev),
                num_blocks=torch.empty(1, dtype=torch.int32, device=dev),
                pair_slot=torch.empty(p, dtype=torch.int32, device=dev),
                pair_w=torch.empty(p, dtype=torch.float32, device=dev),
                num_tokens=t, topk=topk, block_m=block_m)
    rank = torch.empty(p, dtype=torch.int32, device=dev)
    ids = ids.contiguous()
    weights = weights.contiguous()
    shw = shared_gate.reshape(-1).contiguous() if has_shared else weights
    c, g = scratch.counts, scratch.gstart
    try:
        if p <= SINGLE_PROGRAM_MAX_PAIRS:
            _prep_single_kernel[(1,)](ids, weights, shw, table_row, shared_slot, p, c, g, r.pair_slot, r.pair_w,
                                      rank, r.num_blocks, r.block_slot, r.block_rows, r.sorted_ids,
                                      K_IN=k_in, TOPK=topk, HAS_SHARED=has_shared, BM=block_m,
                                      BLOCK=_single_block(p), num_warps=4)
        else:
            grid = (triton.cdiv(p, _BLOCK),)
            _prep_a_kernel[grid](ids, weights, shw, table_row, shared_slot, p, c, r.pair_slot, r.pair_w, rank,
                                 r.num_blocks, K_IN=k_in, TOPK=topk, HAS_SHARED=has_shared, BLOCK=_BLOCK)
            _prep_b_kernel[grid](p, c, g, r.pair_slot, rank, r.num_blocks, r.block_slot, r.block_rows,
                                 BM=block_m, BLOCK=_BLOCK)
            _prep_c_kernel[grid](p, c, g, r.pair_slot, rank, r.sorted_ids, BM=block_m, BLOCK=_BLOCK)
    except BaseException:
        scratch.reset()  # a half-run prep leaves counters set
        raise
    return r
