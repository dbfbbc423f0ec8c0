"""Causal depthwise conv1d with a per-sequence rolling state (Gated DeltaNet input conv)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moeferry.ops.triton import use_triton


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    cu_seqlens: list[int] | torch.Tensor,
    state_slots: list[int] | torch.Tensor,
    max_q_len: int | None = None,
) -> torch.Tensor:
    """x [T, C] flat over sequences; weight [C, K]; conv_state [S, C, K-1] holds the last K-1
    inputs of each sequence slot and is updated in place. Returns silu(conv(x)) [T, C].
    Prefill and decode (one token per sequence) share one Triton kernel; no workspace."""
    if use_triton(x):
        from moeferry.ops.triton import conv as tc
        return tc.causal_conv1d(x, weight, conv_state, cu_seqlens, state_slots, max_q_len)
    host = [v.tolist() if isinstance(v, torch.Tensor) else list(v) for v in (cu_seqlens, state_slots)]
    return causal_conv1d_ref(x, weight, conv_state, *host)


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    cu_seqlens: list[int],
    state_slots: list[int],
) -> torch.Tensor:
    out = torch.empty_like(x)
    width = weight.shape[1]
    for b, slot in enumerate(state_slots):
        start, end = cu_seqlens[b], cu_seqlens[b + 1]
        seq = torch.cat([conv_state[slot].to(x.dtype), x[start:end].t()], dim=1)  # [C, K-1+n]
        y = F.conv1d(seq[None].to(weight.dtype), weight[:, None, :], groups=weight.shape[0])[0]
        out[start:end] = F.silu(y).t().to(x.dtype)
        conv_state[slot] = seq[:, seq.shape[1] - (width - 1):].to(conv_state.dtype)
    return out
