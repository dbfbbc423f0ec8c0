"""Gated DeltaNet kernels: chunked prefill (UT/WY form, chunk 64) and a fused decode step.

Notation per v-head h (k-head h // (Hv / Hk)); q, k l2-normalised in fp32, q scaled by
K^-0.5; state S [K, V] fp32 in the pool at [slot, h]. Within a chunk of c <= 64 tokens with
cumulative log-decay G (cumsum of g):
    A = strict_lower((beta k) k^T * exp(G_i - G_j)),   T = (I + A)^-1
    W = T (beta k exp(G)),   U = T (beta v)                       (kernel 1, all chunks in parallel)
    V' = U - W S;   o = (q exp(G)) S + lower((q k^T) * exp(G_i - G_j)) V'
    S <- S exp(G_c) + (k exp(G_c - G))^T V'                       (kernel 2, chunks in sequence)
Kernel 1 runs on a grid (sequence, chunk, v-head) and inverts I + A blockwise in registers
(`_unit_lower_inverse`). Kernel 2 runs on a grid (sequence, v-head, V-block) and carries S in registers
through the sequence's chunks, reading the pool once and writing it once.

Prefill workspace (made per call, see `prefill_workspace`): W fp32 [T, Hv, K], U fp32
[T, Hv, V] and G fp32 [T, Hv]: T * Hv * (K + V + 1) * 4 bytes for a chunk of T tokens (and the
chunks' q k^T, T * Hv * 64 * 4 more, where `PrefillTuning.attn_in_prep`). Decode needs none.

Sequences are chunked from their own first token, so any chunk length works; a negative
state slot (CUDA-graph padding) starts from a zero state and writes nothing back.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeferry.ops.triton import as_device_int, interpreting, next_pow2

CHUNK = 64


@triton.jit
def _unit_lower_inverse(a, r, C: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 for strictly lower A [C, C] (C = 4 * 16), blockwise:
    D = I + (A's 16x16 diagonal blocks) is inverted by forward substitution, 16 steps that each
    finish row i of all four blocks with one matrix product; with N = D^-1 L (L the rest of A,
    strictly block-lower, so N^4 = 0): (I + A)^-1 = (I - N)(I + N^2) D^-1. (Inverting D by
    repeated squaring, 6 products, measured no faster: benchmarks/README.md.)"""
    same_block = (r[:, None] // 16) == (r[None, :] // 16)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    ad = tl.where(same_block, a, 0.0)
    dinv = eye
    for i in range(16):
        sel = (r % 16) == i
        upd = tl.dot(tl.where(sel[:, None], ad, 0.0), dinv, input_precision=PREC)
        dinv = tl.where(sel[:, None], eye - upd, dinv)
    nn = tl.dot(dinv, tl.where(same_block, 0.0, a), input_precision=PREC)
    n2 = tl.dot(nn, nn, input_precision=PREC)
    p = tl.dot(eye - nn, eye + n2, input_precision=PREC)
    return tl.dot(p, dinv, input_precision=PREC)


@triton.jit
def _load_heads(ptr, tok, stride_t, stride_h, h, d, mask):
    return tl.load(ptr + tok[:, None] * stride_t + h * stride_h + d[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _l2norm(x):
    return x / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]


@triton.jit
def _prep_kernel(q_ptr, k_ptr, stride_kt, stride_kh, v_ptr, stride_vt, stride_vh, g_ptr, beta_ptr, stride_gt,
                 cu_ptr, w_ptr, u_ptr, gc_ptr, attn_ptr, scale, HV: tl.constexpr, REP: tl.constexpr,
                 DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                 PREC: tl.constexpr, ATTN: tl.constexpr):
    b = tl.program_id(0)
    c0 = tl.program_id(1) * C
    h = tl.program_id(2)
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    if c0 < n:
        r = tl.arange(0, C)
        valid = r < n - c0
        tok = (start + c0 + r).to(tl.int64)
        kd = tl.arange(0, BK)
        vd = tl.arange(0, BV)
        k_mask = valid[:, None] & (kd < DK)[None, :]
        k = _l2norm(_load_heads(k_ptr, tok, stride_kt, stride_kh, h // REP, kd, k_mask))
        v = _load_heads(v_ptr, tok, stride_vt, stride_vh, h, vd, valid[:, None] & (vd < DV)[None, :])
        g = tl.load(g_ptr + tok * stride_gt + h, mask=valid, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + tok * stride_gt + h, mask=valid, other=0.0).to(tl.float32)
        gc = tl.cumsum(g, axis=0)
        lower = r[:, None] > r[None, :]
        decay = tl.exp(tl.where(lower, gc[:, None] - gc[None, :], float("-inf")))
        kb = k * beta[:, None]
        a = tl.dot(kb, tl.trans(k)) * decay  # strictly lower (decay is 0 elsewhere)
        t = _unit_lower_inverse(a, r, C, PREC)
        u = tl.dot(t, v * beta[:, None])
        w = tl.dot(t, kb * tl.exp(gc)[:, None])
        tl.store(u_ptr + (tok * HV + h)[:, None] * DV + vd[None, :], u, mask=valid[:, None] & (vd < DV)[None, :])
        tl.store(w_ptr + (tok * HV + h)[:, None] * DK + kd[None, :], w, mask=k_mask)
        tl.store(gc_ptr + tok * HV + h, gc, mask=valid)
        if ATTN:  # the chunk's causal, decayed q k^T: the scan's one product that does not need the state
            q = _l2norm(_load_heads(q_ptr, tok, stride_kt, stride_kh, h // REP, kd, k_mask)) * scale
            causal = r[:, None] >= r[None, :]
            attn = tl.dot(q, tl.trans(k)) * tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
            tl.store(attn_ptr + (tok * HV + h)[:, None] * C + r[None, :], attn, mask=valid[:, None])


@triton.jit
def _scan_kernel(q_ptr, k_ptr, stride_qt, stride_qh, w_ptr, u_ptr, gc_ptr, attn_ptr, cu_ptr, slot_ptr, state_ptr,
                 out_ptr, stride_ot, stride_oh, scale, HV: tl.constexpr, REP: tl.constexpr, DK: tl.constexpr,
                 DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, ATTN: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    slot = tl.load(slot_ptr + b).to(tl.int64)
    kd = tl.arange(0, BK)
    vd = vb * BV + tl.arange(0, BV)
    kmask = kd < DK
    vmask = vd < DV
    s_ptrs = state_ptr + ((slot * HV + h) * DK + kd[:, None]) * DV + vd[None, :]
    s = tl.load(s_ptrs, mask=kmask[:, None] & vmask[None, :] & (slot >= 0), other=0.0)
    r = tl.arange(0, C)
    causal = r[:, None] >= r[None, :]
    for c0 in range(0, n, C):
        valid = r < n - c0
        tok = (start + c0 + r).to(tl.int64)
        qk_mask = valid[:, None] & kmask[None, :]
        q = _l2norm(_load_heads(q_ptr, tok, stride_qt, stride_qh, h // REP, kd, qk_mask)) * scale
        k = _l2norm(_load_heads(k_ptr, tok, stride_qt, stride_qh, h // REP, kd, qk_mask))
        gc = tl.load(gc_ptr + tok * HV + h, mask=valid, other=0.0)
        last = tl.minimum(n - c0, C) - 1
        g_last = tl.load(gc_ptr + (start + c0 + last).to(tl.int64) * HV + h)
        w = tl.load(w_ptr + (tok * HV + h)[:, None] * DK + kd[None, :], mask=qk_mask, other=0.0)
        u = tl.load(u_ptr + (tok * HV + h)[:, None] * DV + vd[None, :], mask=valid[:, None] & vmask[None, :],
                    other=0.0)
        if ATTN:
            attn = tl.load(attn_ptr + (tok * HV + h)[:, None] * C + r[None, :], mask=valid[:, None], other=0.0)
        else:
            attn = tl.dot(q, tl.trans(k))
            attn = attn * tl.exp(tl.where(causal & valid[:, None], gc[:, None] - gc[None, :], float("-inf")))
        v_new = u - tl.dot(w, s)
        o = tl.dot(q * tl.exp(gc)[:, None], s) + tl.dot(attn, v_new)
        tl.store(out_ptr + tok[:, None] * stride_ot + h * stride_oh + vd[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=valid[:, None] & vmask[None, :])
        k_tail = k * tl.where(valid, tl.exp(g_last - gc), 0.0)[:, None]
        s = s * tl.exp(g_last) + tl.dot(tl.trans(k_tail), v_new)
    tl.store(s_ptrs, s, mask=kmask[:, None] & vmask[None, :] & (slot >= 0))


@dataclass(frozen=True)
class PrefillTuning:
    """The chunked prefill's kernel variants (benchmarks/prefill_kernels.py measures them)."""
    attn_in_prep: bool = True  # the chunk's q k^T in the parallel kernel (a T * Hv * 64 * 4-byte buffer)
    # the parallel kernel's products (the chunk inverse): "tf32" (one TF32 MMA, 10-bit mantissas:
    # more than bf16 inputs carry) or "tf32x3" (split into three, fp32-exact). H100, 8192 tokens:
    # 2.48 -> 1.57 ms, 1.1e-3 relative to tf32x3's output (benchmarks/prefill_kernels.py)
    prep_precision: str = "tf32"
    scan_bv: int = 32  # V columns of the state per scan program
    scan_warps: int = 4
    scan_stages: int = 2


def prefill_workspace(num_tokens: int, num_v_heads: int, k_dim: int, v_dim: int, device,
                      tuning: PrefillTuning = PrefillTuning()) -> tuple:
    """(W fp32 [T, Hv, K], U fp32 [T, Hv, V], G fp32 [T, Hv], and with attn_in_prep the chunks'
    q k^T fp32 [T, Hv, 64], else None): T * Hv * (K + V + 1 (+ 64)) * 4 bytes."""
    f = dict(dtype=torch.float32, device=device)
    attn = torch.empty(num_tokens, num_v_heads, CHUNK, **f) if tuning.attn_in_prep else None
    return (torch.empty(num_tokens, num_v_heads, k_dim, **f), torch.empty(num_tokens, num_v_heads, v_dim, **f),
            torch.empty(num_tokens, num_v_heads, **f), attn)


def _check_heads(q, k, v):
    assert q.stride() == k.stride(), "q and k must share strides (views of one conv output)"
    assert q.stride(-1) == 1 and v.stride(-1) == 1
    hk, hv = q.shape[1], v.shape[1]
    assert hv % hk == 0
    return hk, hv, hv // hk


def gdn_prefill(q, k, v, g, beta, state_pool, cu_seqlens, state_slots, max_q_len: int | None = None,
                tuning: PrefillTuning = PrefillTuning()) -> torch.Tensor:
    """q, k [T, Hk, K]; v [T, Hv, V]; g, beta [T, Hv]; state_pool [S, Hv, K, V] fp32 (in/out)."""
    t, _, dk = q.shape
    dv = v.shape[2]
    hk, hv, rep = _check_heads(q, k, v)
    dev = q.device
    cu = as_device_int(cu_seqlens, dev)
    slots = as_device_int(state_slots, dev)
    bsz = slots.shape[0]
    out = torch.empty((t, hv, dv), dtype=v.dtype, device=dev)
    if t == 0 or bsz == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu[1:] - cu[:-1]).max().item())
    assert state_pool.dtype == torch.float32 and state_pool.is_contiguous()
    g, beta = g.contiguous(), beta.contiguous()
    assert g.stride(0) == beta.stride(0)
    w, u, gc, attn = prefill_workspace(t, hv, dk, dv, dev, tuning)
    attn = gc if attn is None else attn  # a pointer the kernels never read without ATTN
    bk, bv_full = max(16, next_pow2(dk)), max(16, next_pow2(dv))
    scale = dk ** -0.5
    _prep_kernel[(bsz, triton.cdiv(max_q_len, CHUNK), hv)](
        q, k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1), g, beta, g.stride(0), cu, w, u, gc, attn,
        scale, HV=hv, REP=rep, DK=dk, DV=dv, BK=bk, BV=bv_full, C=CHUNK,
        PREC="ieee" if interpreting() else tuning.prep_precision, ATTN=tuning.attn_in_prep,
        num_warps=8, num_stages=1)
    bv = min(bv_full, tuning.scan_bv)
    _scan_kernel[(bsz, hv, triton.cdiv(dv, bv))](
        q, k, q.stride(0), q.stride(1), w, u, gc, attn, cu, slots, state_pool, out, out.stride(0), out.stride(1),
        scale, HV=hv, REP=rep, DK=dk, DV=dv, BK=bk, BV=bv, C=CHUNK, ATTN=tuning.attn_in_prep,
        num_warps=tuning.scan_warps, num_stages=tuning.scan_stages)
    return out


@triton.jit
def _decode_kernel(q_ptr, k_ptr, stride_qt, stride_qh, v_ptr, stride_vt, stride_vh, a_ptr, b_ptr, stride_at,
                   alog_ptr, dtb_ptr, slot_ptr, state_ptr, out_ptr, scale, HV: tl.constexpr, REP: tl.constexpr,
                   DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   ROUND_BETA: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vd = tl.program_id(2) * BV + tl.arange(0, BV)
    kd = tl.arange(0, BK)
    kmask = kd < DK
    vmask = vd < DV
    slot = tl.load(slot_ptr + i).to(tl.int64)
    q = tl.load(q_ptr + i * stride_qt + (h // REP) * stride_qh + kd, mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + i * stride_qt + (h // REP) * stride_qh + kd, mask=kmask, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    v = tl.load(v_ptr + i * stride_vt + h * stride_vh + vd, mask=vmask, other=0.0).to(tl.float32)
    # gates: beta = sigmoid(b) (in the activation dtype); g = -exp(A_log) * softplus(a + dt_bias)
    bb = tl.load(b_ptr + i * stride_at + h).to(tl.float32)
    beta = 1.0 / (1.0 + tl.exp(-bb))
    if ROUND_BETA:
        beta = beta.to(b_ptr.dtype.element_ty).to(tl.float32)
    x = tl.load(a_ptr + i * stride_at + h).to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * softplus
    s_ptrs = state_ptr + ((slot * HV + h) * DK + kd[:, None]) * DV + vd[None, :]
    m = kmask[:, None] & vmask[None, :]
    s = tl.load(s_ptrs, mask=m & (slot >= 0), other=0.0) * tl.exp(g)
    mem = tl.sum(s * k[:, None], axis=0)
    delta = (v - mem) * beta
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(s_ptrs, s, mask=m & (slot >= 0))
    tl.store(out_ptr + (i * HV + h) * DV + vd, o.to(out_ptr.dtype.element_ty), mask=vmask)


def gdn_decode_gated(q, k, v, a, b, a_log, dt_bias, state_pool, state_slots) -> torch.Tensor:
    """One step for B sequences: q, k [B, Hk, K]; v [B, Hv, V]; a, b [B, Hv] raw gate inputs;
    a_log, dt_bias [Hv]; state_pool [S, Hv, K, V] fp32 (in place); state_slots [B] int32."""
    bsz, _, dk = q.shape
    dv = v.shape[2]
    hk, hv, rep = _check_heads(q, k, v)
    out = torch.empty((bsz, hv, dv), dtype=v.dtype, device=v.device)
    if bsz == 0:
        return out
    assert state_pool.dtype == torch.float32 and state_pool.is_contiguous()
    if a.stride(-1) != 1 or b.stride(-1) != 1 or a.stride(0) != b.stride(0):  # views of one GEMM's output pass as they are
        a, b = a.contiguous(), b.contiguous()
    slots = as_device_int(state_slots, q.device)
    bk = next_pow2(dk)
    bv = min(next_pow2(dv), 32)
    _decode_kernel[(bsz, hv, triton.cdiv(dv, bv))](
        q, k, q.stride(0), q.stride(1), v, v.stride(0), v.stride(1), a, b, a.stride(0), a_log, dt_bias, slots,
        state_pool, out, dk ** -0.5, HV=hv, REP=rep, DK=dk, DV=dv, BK=bk, BV=bv,
        ROUND_BETA=b.dtype != torch.float32, num_warps=4)
    return out
