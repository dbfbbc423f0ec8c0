"""Host-to-device copies that do not make the host wait for the device.

A copy from pageable host memory synchronises the CUDA stream: the host waits for every kernel
queued before it (with overlapped steps, the whole step in flight). From pinned memory the copy
is queued behind them and the host goes on; PyTorch's caching host allocator keeps the pinned
block until the copy has run.
"""
from __future__ import annotations

import torch


def staged(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` (on the host) ready for a `non_blocking` copy to `device`: pinned when it is CUDA."""
    return t.pin_memory() if torch.device(device).type == "cuda" else t


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` (on the host) on `device`, the copy queued behind the device's work."""
    return staged(t, device).to(device, non_blocking=True)
