"""Paged-KV attention: KV store, decode (split-K flash-decoding) and varlen prefill.

KV layout (see `moeferry.ops.attention`): k_cache/v_cache [num_slots, H_kv, D]; token p of
sequence b lives in slot page_table[b, p // page_size] * page_size + p % page_size. The
query rows of sequence b are q[cu_seqlens[b]:cu_seqlens[b+1]], the last rows of its context
of kv_lens[b] tokens. Softmax and accumulation in fp32; P is cast to V's dtype for P @ V.

Decode: grid (B, H_kv, num_splits); one program serves all GROUP = H_q / H_kv query heads of
one KV head (padded to 16 rows for tl.dot), so each key is read once per KV head. The keys
of a sequence are split evenly over num_splits programs (the split length is computed in the
kernel from kv_lens, so one launch shape serves any lengths: CUDA-graph safe); a second
kernel merges the partial results by their log-sum-exp.
Workspace (caller-allocated, see `decode_workspace`): partial outputs fp32
[B, H_q, num_splits, D] and (max, sum) fp32 [B, H_q, num_splits, 2], i.e.
B * H_q * num_splits * (D + 2) * 4 bytes; none when num_splits == 1.

Prefill: grid (cdiv(max_q_len, BLOCK_M), B, H_q); each program streams its sequence's keys
from the paged cache (prefix and chunk alike) with an online softmax, masking causally; no
[T, T] scores exist anywhere. No workspace.
A sequence with kv_len == 0 (CUDA-graph padding) gets a zero output row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeferry.ops.triton import as_device_int, next_pow2


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, stride_kt, stride_vt, kc_ptr, vc_ptr, slot_ptr, ROW: tl.constexpr,
                     BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < ROW
        k = tl.load(k_ptr + t * stride_kt + offs, mask=m)
        v = tl.load(v_ptr + t * stride_vt + offs, mask=m)
        tl.store(kc_ptr + slot * ROW + offs, k.to(kc_ptr.dtype.element_ty), mask=m)
        tl.store(vc_ptr + slot * ROW + offs, v.to(vc_ptr.dtype.element_ty), mask=m)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k, v [T, H_kv, D] into k_cache/v_cache [num_slots, H_kv, D] (contiguous) at slots [T];
    negative slots are skipped."""
    t = k.shape[0]
    if t == 0:
        return
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    k2, v2 = k.reshape(t, -1), v.reshape(t, -1)
    k2 = k2 if k2.stride(1) == 1 else k2.contiguous()
    v2 = v2 if v2.stride(1) == 1 else v2.contiguous()
    row = k2.shape[1]
    block = min(next_pow2(row), 1024)
    _store_kv_kernel[(t, triton.cdiv(row, block))](k2, v2, k2.stride(0), v2.stride(0), k_cache, v_cache,
                                                   slots.contiguous(), ROW=row, BLOCK=block, num_warps=4)


@triton.jit(do_not_specialize=["stride_pt"])  # the page table's width varies step to step
def _decode_kernel(q_ptr, stride_qt, stride_qh, k_ptr, v_ptr, stride_ks, stride_kh, stride_vs, stride_vh,
                   pt_ptr, stride_pt, kvlen_ptr, out_ptr, po_ptr, pml_ptr, scale, page_size,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, NUM_HQ: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(kvlen_ptr + b)
    split_len = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, kv_len)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pmask = pos < hi
        page = tl.load(pt_ptr + b.to(tl.int64) * stride_pt + pos // page_size, mask=pmask, other=0)
        slot = page.to(tl.int64) * page_size + pos % page_size
        kv_mask = pmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(pmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (b * NUM_HQ + heads).to(tl.int64)[:, None] * HEAD_DIM + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])
    else:
        row = ((b * NUM_HQ + heads) * NUM_SPLITS + split).to(tl.int64)
        tl.store(po_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=gmask[:, None] & dmask[None, :])
        tl.store(pml_ptr + row * 2, m_i, mask=gmask)
        tl.store(pml_ptr + row * 2 + 1, l_i, mask=gmask)


@triton.jit
def _decode_merge_kernel(po_ptr, pml_ptr, out_ptr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         NUM_SPLITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * H_q + h
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    m = tl.load(pml_ptr + (row * NUM_SPLITS + s) * 2)
    l = tl.load(pml_ptr + (row * NUM_SPLITS + s) * 2 + 1)
    m_max = tl.max(m, axis=0)
    w = tl.where(l > 0, tl.exp(m - m_max), 0.0)
    total = tl.sum(w * l, axis=0)
    o = tl.load(po_ptr + (row * NUM_SPLITS + s)[:, None] * HEAD_DIM + d[None, :], mask=dmask[None, :], other=0.0)
    out = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=dmask)


def decode_splits(batch: int, num_kv_heads: int, max_kv_len: int | None = None, num_sms: int = 132) -> int:
    """Split count that gives about two programs per SM; fewer when contexts are short."""
    want = max(1, (2 * num_sms) // max(batch * num_kv_heads, 1))
    if max_kv_len is not None:
        want = min(want, max(1, max_kv_len // 256))
    return min(next_pow2(want), 32)


def decode_workspace(batch: int, num_heads: int, head_dim: int, num_splits: int, device) -> tuple:
    """(partial_out fp32 [B, H_q, S, D], partial_max_sum fp32 [B, H_q, S, 2]); empty when S == 1."""
    if num_splits == 1:
        return None, None
    return (torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=device),
            torch.empty(batch, num_heads, num_splits, 2, dtype=torch.float32, device=device))


def paged_attention_decode(q, k_cache, v_cache, kv_lens, page_table, page_size: int, scale: float,
                           num_splits: int | None = None, workspace=None) -> torch.Tensor:
    """q [B, H_q, D] (one query token per sequence); kv_lens [B] int32 tensor on q's device."""
    bsz, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    out = torch.empty((bsz, hq, d), dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out
    if num_splits is None:
        num_splits = decode_splits(bsz, hkv)
    po, pml = workspace if workspace is not None else decode_workspace(bsz, hq, d, num_splits, q.device)
    if num_splits == 1:
        po = pml = out
    block_d = next_pow2(d)
    block_n = 64 if block_d <= 128 else 32
    _decode_kernel[(bsz, hkv, num_splits)](
        q, q.stride(0), q.stride(1), k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), page_table, page_table.stride(0), kv_lens, out, po, pml, scale, page_size,
        GROUP=group, HEAD_DIM=d, BLOCK_G=max(16, next_pow2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, NUM_HQ=hq, num_warps=4, num_stages=2)
    if num_splits > 1:
        _decode_merge_kernel[(bsz * hq,)](po, pml, out, HEAD_DIM=d, BLOCK_D=block_d, NUM_SPLITS=num_splits,
                                          num_warps=4)
    return out


@triton.jit(do_not_specialize=["stride_pt"])  # the page table's width varies step to step
def _prefill_kernel(q_ptr, stride_qt, stride_qh, k_ptr, v_ptr, stride_ks, stride_kh, stride_vs, stride_vh,
                    pt_ptr, stride_pt, cu_ptr, kvlen_ptr, out_ptr, scale, page_size,
                    GROUP: tl.constexpr, NUM_HQ: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    mb = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GROUP
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    m0 = mb * BLOCK_M
    if m0 < n:
        kv_len = tl.load(kvlen_ptr + b)
        prefix = kv_len - n
        rows = m0 + tl.arange(0, BLOCK_M)
        rmask = rows < n
        q_pos = prefix + rows
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        q = tl.load(q_ptr + (start + rows).to(tl.int64)[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=rmask[:, None] & dmask[None, :], other=0.0)
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        hi = tl.minimum(kv_len, prefix + m0 + BLOCK_M)
        for s0 in range(0, hi, BLOCK_N):
            pos = s0 + tl.arange(0, BLOCK_N)
            pmask = pos < hi
            page = tl.load(pt_ptr + b.to(tl.int64) * stride_pt + pos // page_size, mask=pmask, other=0)
            slot = page.to(tl.int64) * page_size + pos % page_size
            kv_mask = pmask[:, None] & dmask[None, :]
            k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where((pos[None, :] <= q_pos[:, None]) & pmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + ((start + rows).to(tl.int64) * NUM_HQ + h)[:, None] * HEAD_DIM + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def paged_attention_prefill(q, k_cache, v_cache, cu_seqlens, kv_lens, page_table, page_size: int, scale: float,
                            max_q_len: int) -> torch.Tensor:
    """q [T, H_q, D]; cu_seqlens [B+1], kv_lens [B] int32 tensors on q's device."""
    t, hq, d = q.shape
    hkv = k_cache.shape[1]
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    bsz = kv_lens.shape[0]
    if t == 0 or bsz == 0:
        return out
    block_d = next_pow2(d)
    block_m = 64
    block_n = 32 if block_d <= 128 else 16  # D = 256: 64 x 16 tiles, 8 warps keep spills small (sm_90)
    warps = 4 if block_d <= 128 else 8
    grid = (triton.cdiv(max_q_len, block_m), bsz, hq)
    _prefill_kernel[grid](
        q, q.stride(0), q.stride(1), k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), page_table, page_table.stride(0), cu_seqlens, kv_lens, out, scale, page_size,
        GROUP=hq // hkv, NUM_HQ=hq, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=warps, num_stages=2)
    return out


def paged_attention(q, k_cache, v_cache, cu_seqlens, kv_lens, page_table, page_size: int, scale: float,
                    max_q_len: int | None = None, workspace=None) -> torch.Tensor:
    """Dispatch to the decode kernel when every sequence has one query row, else prefill."""
    dev = q.device
    cu = as_device_int(cu_seqlens, dev)
    kvl = as_device_int(kv_lens, dev)
    if max_q_len is None:
        max_q_len = int((cu[1:] - cu[:-1]).max().item()) if kvl.numel() else 0
    if max_q_len == 1 and q.shape[0] == kvl.shape[0]:
        max_kv = max(kv_lens) if isinstance(kv_lens, (list, tuple)) and kv_lens else None
        splits = None
        if workspace is None:
            splits = decode_splits(q.shape[0], k_cache.shape[1], max_kv)
        else:
            splits = workspace[0].shape[2] if workspace[0] is not None else 1
        return paged_attention_decode(q, k_cache, v_cache, kvl, page_table, page_size, scale, splits, workspace)
    return paged_attention_prefill(q, k_cache, v_cache, cu, kvl, page_table, page_size, scale, max_q_len)
