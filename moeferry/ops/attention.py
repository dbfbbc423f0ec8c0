"""Attention over a paged KV cache.

Layout: the KV pool of one layer is `k_cache`, `v_cache` [num_slots, H_kv, D] with
num_slots = num_pages * page_size. Sequence b owns pages page_table[b, :]; its token at
position p lives in slot page_table[b, p // page_size] * page_size + p % page_size.
The batch is flat: query rows of sequence b are q[cu_seqlens[b]:cu_seqlens[b+1]], and they
are the last rows of that sequence (positions kv_lens[b] - n .. kv_lens[b] - 1).
"""
from __future__ import annotations

import torch

from moeferry.ops.triton import use_triton


def _host(x) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Write new keys/values [T, H_kv, D] into their slots [T] (negative slots: skipped on the Triton path)."""
    if use_triton(k):
        from moeferry.ops.triton import attention as ta
        return ta.store_kv(k_cache, v_cache, k, v, slots)
    store_kv_ref(k_cache, v_cache, k, v, slots)


def store_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    k_cache[slots] = k.to(k_cache.dtype)
    v_cache[slots] = v.to(v_cache.dtype)


def sequence_slots(page_row: torch.Tensor, length: int, page_size: int) -> torch.Tensor:
    pos = torch.arange(length, device=page_row.device)
    return page_row[pos // page_size].long() * page_size + pos % page_size


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens: list[int] | torch.Tensor,
    kv_lens: list[int] | torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    scale: float,
    max_q_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of q [T, H_q, D] against each sequence's cached prefix and itself.

    cu_seqlens / kv_lens: host lists or int tensors (int32 on q's device for the Triton path);
    max_q_len: the longest query chunk (saves a device sync on the Triton path).
    Triton path (`moeferry.ops.triton.attention`): a split-K decode kernel when every sequence
    has one query row, else a flash-attention prefill kernel. Workspace: decode only,
    B * H_q * num_splits * (D + 2) * 4 bytes (`triton.attention.decode_workspace`), made per call.
    Prefill needs none.
    """
    if use_triton(q):
        from moeferry.ops.triton import attention as ta
        return ta.paged_attention(q, k_cache, v_cache, cu_seqlens, kv_lens, page_table, page_size, scale,
                                  max_q_len)
    return paged_attention_ref(q, k_cache, v_cache, _host(cu_seqlens), _host(kv_lens), page_table, page_size, scale)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens: list[int],
    kv_lens: list[int],
    page_table: torch.Tensor,
    page_size: int,
    scale: float,
) -> torch.Tensor:
    """Reference implementation: softmax in fp32, GQA by repeating kv heads."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[1]
    for b in range(len(kv_lens)):
        start, end = cu_seqlens[b], cu_seqlens[b + 1]
        n, total = end - start, kv_lens[b]
        slots = sequence_slots(page_table[b], total, page_size)
        k = k_cache[slots].repeat_interleave(group, dim=1)  # [L, H, D]
        v = v_cache[slots].repeat_interleave(group, dim=1)
        qs = q[start:end]
        scores = torch.einsum("thd,lhd->htl", qs, k).float() * scale
        q_pos = torch.arange(total - n, total, device=q.device)[:, None]
        k_pos = torch.arange(total, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out[start:end] = torch.einsum("htl,lhd->thd", probs, v)
    return out
