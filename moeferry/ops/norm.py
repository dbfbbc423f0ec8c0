"""RMSNorm variants (plain, zero-centred, fused residual-add, gated)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moeferry.ops.triton import use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """RMSNorm over the last dim (Triton on CUDA, else `rms_norm_ref`). No workspace."""
    if use_triton(x):
        from moeferry.ops.triton import norm as tn
        return tn.rms_norm(x, weight, eps, zero_centered)
    return rms_norm_ref(x, weight, eps, zero_centered)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
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
    """Fused residual add + RMSNorm: returns (norm(x + residual), x + residual). One kernel on CUDA."""
    if use_triton(x):
        from moeferry.ops.triton import norm as tn
        return tn.add_rms_norm(x, residual, weight, eps, zero_centered)
    return add_rms_norm_ref(x, residual, weight, eps, zero_centered)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = residual + x
    return rms_norm_ref(summed, weight, eps, zero_centered), summed


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated RMSNorm of Gated DeltaNet: w * norm(x) * silu(gate), norm before gate."""
    if use_triton(x):
        from moeferry.ops.triton import norm as tn
        return tn.gated_rms_norm(x, gate, weight, eps)
    return gated_rms_norm_ref(x, gate, weight, eps)


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = weight * normed
    return (out * F.silu(gate.float())).to(x.dtype)
