"""Router top-k in one kernel: fp32 softmax over the experts, the k largest, renormalised.

Same contract as `moeferry.ops.moe.route_topk_ref`: (weights [T, k] in the logits' dtype,
expert ids [T, k] int64), the ids in descending order of probability. Replaces the softmax,
top-k (two kernels in PyTorch: a gather and a bitonic sort), the renormalising division and
the cast to the logits' dtype: five launches per MoE layer in a decode step become one.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(logits_ptr, stride_l, w_ptr, ids_ptr, E, K: tl.constexpr, RENORM: tl.constexpr,
                  BLOCK_E: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride_l + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where((offs < E) & (p == p), p, -1.0)  # padding and NaN (bad logits) rank last
    kk = tl.arange(0, K)
    top_w = tl.zeros([K], dtype=tl.float32)
    top_i = tl.zeros([K], dtype=tl.int64)
    total = 0.0
    for j in tl.static_range(K):  # the j-th largest: the first index holding the maximum
        best = tl.max(p, axis=0)
        idx = tl.minimum(tl.min(tl.where(p == best, offs, BLOCK_E), axis=0), E - 1)  # always a real expert
        top_w = tl.where(kk == j, best, top_w)
        top_i = tl.where(kk == j, idx.to(tl.int64), top_i)
        total += best
        p = tl.where(offs == idx, -2.0, p)  # below the padding: never picked again
    if RENORM:
        top_w = top_w / total
    tl.store(w_ptr + t * K + kk, top_w.to(w_ptr.dtype.element_ty))  # fp32 math, one rounding to the logits' dtype
    tl.store(ids_ptr + t * K + kk, top_i)


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    t, e = router_logits.shape
    weights = torch.empty(t, top_k, dtype=router_logits.dtype, device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=router_logits.device)
    if t:
        _route_kernel[(t,)](router_logits, router_logits.stride(0), weights, ids, e, K=top_k, RENORM=renormalize,
                            BLOCK_E=triton.next_power_of_2(e))
    return weights, ids
