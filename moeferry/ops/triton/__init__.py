"""Triton kernels behind the ops in `moeferry.ops`.

Dispatch rule (used by every public op): a call runs its Triton kernel when its tensors are
on CUDA, or when `MOEFERRY_TRITON_INTERPRET=1` is set (then the kernels run on CPU tensors
under Triton's interpreter, which this module switches on). Otherwise the plain-PyTorch
reference runs. This package imports `triton` only when a kernel module is imported, so a
CPU-only run never needs it.
"""
from __future__ import annotations

import functools
import os

import torch

if os.environ.get("MOEFERRY_TRITON_INTERPRET") == "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")


def interpreting() -> bool:
    """Kernels are (or will be) built for Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(x: torch.Tensor) -> bool:
    """Whether an op over tensor `x` should run its Triton kernel."""
    if x.is_cuda:
        return True
    return os.environ.get("MOEFERRY_TRITON_INTERPRET") == "1"


def device_properties(device: torch.device):
    """A CUDA device's properties (SMs, compute capability), asked of the driver once per device:
    decode calls read them."""
    return _properties(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=8)
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device."""
    return device_properties(device).multi_processor_count


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def as_device_int(x, device: torch.device) -> torch.Tensor:
    """A host list (or tensor) of ints as an int32 tensor on `device` (no copy if already one)."""
    if isinstance(x, torch.Tensor):
        if x.device == device and x.dtype == torch.int32:
            return x
        return x.to(device=device, dtype=torch.int32)
    return torch.tensor(list(x), dtype=torch.int32, device=device)
