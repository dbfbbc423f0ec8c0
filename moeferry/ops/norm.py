"""RMSNorm variants (plain, zero-centred, fused residual-add, gated)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """RMSNorm over the last dim.

    zero_centered (Qwen3.5): (x * rsqrt(mean(x^2)+eps)) * (1 + w), multiplied in fp32.
    plain (Qwen3): w * (x * rsqrt(mean(x^2)+eps)).to(x.dtype).
    """
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm: returns (norm(x + residual), x + residual)."""
    summed = residual + x
    return rms_norm(summed, weight, eps, zero_centered), summed


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated RMSNorm of Gated DeltaNet: w * norm(x) * silu(gate), norm before gate."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = weight * normed
    return (out * F.silu(gate.float())).to(x.dtype)
