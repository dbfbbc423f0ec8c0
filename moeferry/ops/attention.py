"""Attention over a paged KV cache.

Layout: the KV pool of one layer is `k_cache`, `v_cache` [num_slots, H_kv, D] with
num_slots = num_pages * page_size. Sequence b owns pages page_table[b, :]; its token at
position p lives in slot page_table[b, p // page_size] * page_size + p % page_size.
The batch is flat: query rows of sequence b are q[cu_seqlens[b]:cu_seqlens[b+1]], and they
are the last rows of that sequence (positions kv_lens[b] - n .. kv_lens[b] - 1).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import _disable_current_modes

from moeferry.ops.triton import use_triton

log = logging.getLogger(__name__)

REF_ROWS = 1024  # query rows per block of the reference (bounds its scores)
FLASH_MIN_TOKENS = 1024  # steps of fewer new tokens: the paged Triton kernel (one launch for the batch)


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
    """Reference implementation: softmax in fp32, GQA by repeating kv heads; query rows in
    blocks of REF_ROWS (the scores of a block, H x REF_ROWS x context fp32, are its workspace)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[1]
    for b in range(len(kv_lens)):
        start, end = cu_seqlens[b], cu_seqlens[b + 1]
        total = kv_lens[b]
        slots = sequence_slots(page_table[b], total, page_size)
        k = k_cache[slots].repeat_interleave(group, dim=1)  # [L, H, D]
        v = v_cache[slots].repeat_interleave(group, dim=1)
        k_pos = torch.arange(total, device=q.device)[None, :]
        for r0 in range(start, end, REF_ROWS):
            r1 = min(end, r0 + REF_ROWS)
            scores = torch.einsum("thd,lhd->htl", q[r0:r1], k).float() * scale
            q_pos = torch.arange(total - (end - r0), total - (end - r1), device=q.device)[:, None]
            scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(q.dtype)
            out[r0:r1] = torch.einsum("htl,lhd->thd", probs, v)
    return out


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cu_seqlens: list[int], kv_lens: list[int], page_table: torch.Tensor, page_size: int,
                    scale: float, flash_only: bool = True) -> torch.Tensor:
    """Causal attention of each sequence's new rows, one SDPA call per sequence (FlashAttention-2
    on the GPU, GQA native: no repeated kv heads). A whole prompt attends over its own keys and
    values k, v [T, H_kv, D] (those store_kv just wrote); a chunk after a cached prefix over its
    context gathered from the pages (k_cache / v_cache, which hold the chunk too), the mask
    aligned to the context's end. Workspace: that gather, 2 * context * H_kv * D elements for the
    longest such sequence, and one copy of the output when the batch has several sequences."""
    gqa = q.shape[1] != k.shape[1]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if flash_only else contextlib.nullcontext():
        outs = [_sequence_attention(q, k, v, k_cache, v_cache, start, end, kv_lens[b], page_table[b], page_size,
                                    scale, gqa)
                for b, (start, end) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:]))]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _sequence_attention(q, k, v, k_cache, v_cache, start: int, end: int, total: int, page_row, page_size: int,
                        scale: float, gqa: bool) -> torch.Tensor:
    """One sequence's rows of `chunk_attention` (its gather freed on return, before the next's)."""
    n = end - start
    if n == total:
        ks, vs, mask = k[start:end], v[start:end], None
    else:
        from torch.nn.attention.bias import causal_lower_right  # imports torch._dynamo (~1 s): when first needed

        slots = sequence_slots(page_row, total, page_size)
        with _disable_current_modes():  # a bias object, no data: built outside any dispatch mode (the boot's
            mask = causal_lower_right(n, total)  # compile-ahead walk), where a Tensor subclass cannot be made
        ks, vs = k_cache[slots], v_cache[slots]
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q[start:end], ks, vs))
    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale,
                                       enable_gqa=gqa)
    return o[0].transpose(0, 1)  # flash's output is [1, n, H, D] in memory: a view, no copy


def _flash_may_serve(device, dtype: torch.dtype) -> bool:
    """The device and dtype `chunk_attention` may serve (CUDA, half precision)."""
    return torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16)


def context_gather_bytes(num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> int:
    """Bytes a token of context costs `chunk_attention`'s gather (its keys and values) for a chunk
    after a prefix, where that path may serve; 0 where the paged kernel does."""
    if not _flash_may_serve(device, dtype):
        return 0
    return 2 * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def use_chunk_attention(q: torch.Tensor, k: torch.Tensor, k_cache: torch.Tensor, q_lens: list[int]) -> bool:
    """Whether `chunk_attention` (flash) serves this step: CUDA, half precision (the cache's too),
    enough new tokens, and flash taking this geometry."""
    if not _flash_may_serve(q.device, q.dtype) or k_cache.dtype != q.dtype:
        return False
    if sum(q_lens) < FLASH_MIN_TOKENS:
        return False
    return _flash_takes(q.device.index or 0, q.dtype, q.shape[1], k.shape[1], q.shape[2])


@functools.lru_cache(maxsize=None)
def _flash_takes(device_index: int, dtype: torch.dtype, hq: int, hkv: int, d: int) -> bool:
    """Two small flash calls of this geometry, a whole prompt and a chunk after a prefix (GQA
    through enable_gqa and head dims up to 256 depend on the torch build and the GPU): their
    answer, logged once. Run for real even when first asked inside a dispatch mode (the boot's
    compile-ahead walk computes nothing: the cached answer would be a wrong "no")."""
    with _disable_current_modes():
        return _try_flash(device_index, dtype, hq, hkv, d)


def _try_flash(device_index: int, dtype: torch.dtype, hq: int, hkv: int, d: int) -> bool:
    dev = torch.device("cuda", device_index)
    q = torch.randn(32, hq, d, device=dev, dtype=dtype)
    k = torch.randn(32, hkv, d, device=dev, dtype=dtype)
    table = torch.arange(2, dtype=torch.int32, device=dev)[None].expand(2, 2)
    try:
        with warnings.catch_warnings():  # SDPA warns why each backend refused; the log line says it once
            warnings.simplefilter("ignore")
            chunk_attention(q, k, k, k, k, [0, 16, 32], [16, 32], table, 16, d ** -0.5)
    except RuntimeError as e:
        log.info("attention prefill: the paged Triton kernel (flash does not take H_q=%d H_kv=%d D=%d %s: %s)",
                 hq, hkv, d, dtype, str(e).splitlines()[0])
        return False
    log.info("attention prefill: SDPA flash for steps of %d+ new tokens (H_q=%d H_kv=%d D=%d)",
             FLASH_MIN_TOKENS, hq, hkv, d)
    return True
