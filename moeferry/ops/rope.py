"""Rotary position embedding (neox style, optionally partial)."""
from __future__ import annotations

import torch

from moeferry.ops.norm import rms_norm
from moeferry.ops.triton import use_triton


def rope_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [T, rotary_dim] for the given positions, cast to the activation dtype."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, R] with R <= D: rotate the first R dims, pass the rest. No workspace."""
    if use_triton(x):
        from moeferry.ops.triton import rope as tr
        return tr.apply_rope(x, cos, sin)
    return apply_rope_ref(x, cos, sin)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 zero_centered: bool, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention's per-head q/k RMSNorm then rotary: q [T, Hq, D], k [T, Hk, D] -> new tensors.
    One Triton launch for the four ops where the norm keeps q's dtype (the reference: `rms_norm_ref`
    then `apply_rope_ref`), else the two ops one after the other."""
    if use_triton(q) and (zero_centered or q_weight.dtype == k_weight.dtype == q.dtype == k.dtype):
        from moeferry.ops.triton import rope as tr
        return tr.qk_norm_rope(q, k, q_weight, k_weight, eps, zero_centered, cos, sin)
    return (apply_rope(rms_norm(q, q_weight, eps, zero_centered), cos, sin),
            apply_rope(rms_norm(k, k_weight, eps, zero_centered), cos, sin))


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    out = x_rot * c + _rotate_half(x_rot) * s
    if x_pass.shape[-1] == 0:
        return out
    return torch.cat([out, x_pass], dim=-1)
