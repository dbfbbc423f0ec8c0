"""Causal depthwise conv1d + SiLU over a flat batch, with a per-slot rolling conv state.

Grid (sequence, block of BLOCK_T tokens, block of BLOCK_C channels). Inputs left of a
sequence's first new token come from conv_state[slot] (the last K-1 inputs seen before).
The program holding a sequence's first token block also rewrites that sequence's state (the
last K-1 inputs of state|x): only that program reads the old state (BLOCK_T >= K-1), and it
finishes every read before a CTA barrier, so the in-place update has no race. A negative
slot (CUDA-graph padding) reads a zero state and writes nothing. Decode is the same kernel
with one token per sequence. No workspace.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeferry.ops.triton import as_device_int, next_pow2


@triton.jit
def _conv_kernel(x_ptr, stride_xt, w_ptr, state_ptr, stride_ss, stride_sc, cu_ptr, slot_ptr, out_ptr, C,
                 K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    tb = tl.program_id(1)
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    t0 = tb * BLOCK_T
    if t0 < n:
        slot = tl.load(slot_ptr + b).to(tl.int64)
        has_state = slot >= 0
        chans = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = chans < C
        ts = t0 + tl.arange(0, BLOCK_T)
        tmask = ts < n
        sbase = state_ptr + slot * stride_ss + chans[None, :] * stride_sc
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for j in tl.static_range(K):
            p = ts - (K - 1) + j  # input position inside the sequence (< 0: from the state)
            m = tmask[:, None] & cmask[None, :]
            xv = tl.load(x_ptr + (start + p).to(tl.int64)[:, None] * stride_xt + chans[None, :],
                         mask=m & (p >= 0)[:, None], other=0.0)
            sv = tl.load(sbase + (K - 1 + p)[:, None], mask=m & (p < 0)[:, None] & has_state, other=0.0)
            val = tl.where((p >= 0)[:, None], xv.to(tl.float32), sv.to(x_ptr.dtype.element_ty).to(tl.float32))
            wj = tl.load(w_ptr + chans * K + j, mask=cmask, other=0.0).to(tl.float32)
            acc += val * wj[None, :]
        y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        y = y / (1.0 + tl.exp(-y))
        tl.store(out_ptr + (start + ts).to(tl.int64)[:, None] * C + chans[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=tmask[:, None] & cmask[None, :])
        if tb == 0:
            i = tl.arange(0, BLOCK_S)
            sp = n - (K - 1) + i  # positions of the last K-1 inputs
            sm = (i < K - 1)[:, None] & cmask[None, :]
            sx = tl.load(x_ptr + (start + sp).to(tl.int64)[:, None] * stride_xt + chans[None, :],
                         mask=sm & (sp >= 0)[:, None], other=0.0)
            so = tl.load(sbase + (K - 1 + sp)[:, None], mask=sm & (sp < 0)[:, None] & has_state, other=0.0)
            new = tl.where((sp >= 0)[:, None], sx.to(state_ptr.dtype.element_ty), so)
            tl.debug_barrier()
            tl.store(sbase + i[:, None], new, mask=sm & has_state)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, cu_seqlens, state_slots,
                  max_q_len: int | None = None) -> torch.Tensor:
    """x [T, C] (unit channel stride), weight [C, K], conv_state [S, C, K-1] (in place).
    cu_seqlens [B+1], state_slots [B]: int tensors on x's device (or host lists)."""
    t, c = x.shape
    k = weight.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    assert conv_state.stride(2) == 1
    cu = as_device_int(cu_seqlens, x.device)
    slots = as_device_int(state_slots, x.device)
    b = slots.shape[0]
    if max_q_len is None:
        max_q_len = int((cu[1:] - cu[:-1]).max().item()) if b else 0
    out = torch.empty((t, c), dtype=x.dtype, device=x.device)
    if b == 0 or t == 0:
        return out
    block_t = max(next_pow2(k - 1), min(16, next_pow2(max_q_len)))  # 16 x 128: no register spills
    block_c = 128 if block_t >= 16 else 256
    grid = (b, triton.cdiv(max_q_len, block_t), triton.cdiv(c, block_c))
    _conv_kernel[grid](x, x.stride(0), weight, conv_state, conv_state.stride(0), conv_state.stride(1), cu, slots,
                       out, c, K=k, BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_S=next_pow2(max(k - 1, 1)), num_warps=4)
    return out
