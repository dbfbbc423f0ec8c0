"""Mixture-of-experts routing and expert computation (reference)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moeferry.ops.triton import use_triton


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 softmax over experts, top-k, optional renormalisation (one Triton kernel on CUDA,
    else `route_topk_ref`)."""
    if use_triton(router_logits) and router_logits.stride(-1) == 1 and top_k & (top_k - 1) == 0:
        from moeferry.ops.triton import router
        return router.route_topk(router_logits, top_k, renormalize)
    return route_topk_ref(router_logits, top_k, renormalize)


def route_topk_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 softmax over experts, top-k, optional renormalisation. Returns (weights [T,k] in the
    logits' dtype, expert ids [T,k] int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)); gate_up [2I, H] (gate rows first), down [H, I]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def experts_reference(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, expert_weights
) -> torch.Tensor:
    """sum_k weights[t,k] * expert_{ids[t,k]}(x[t]), one expert after another (the unfused
    reference of the MoE kernels). `expert_weights(e)` returns (gate_up [2I,H], down [H,I])."""
    out = torch.zeros_like(x)
    flat_ids = ids.reshape(-1)
    for e in torch.unique(flat_ids).tolist():
        token, slot = torch.where(ids == e)
        gate_up, down = expert_weights(e)
        y = swiglu(x[token], gate_up, down) * weights[token, slot, None]
        out[token] += y.to(out.dtype)  # a token picks an expert at most once
    return out
