"""Programmatic dependent launch (sm_90+): a launch that starts before the one it follows ends.

A kernel launched with `launch_pdl=True` may start once every program of the kernel before it
in the stream has called `release_dependents` (or exited); it must call `wait_for_primary`
before it reads anything that kernel writes (the wait returns when that kernel has ended and
its writes are visible). Both are no-ops in a launch without the dependency; they compile to
nothing for GPUs before sm_90 (which have no such launch: `supported` says so on the host) and
under Triton's interpreter (which runs launches one after another anyway).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.language.target_info import cuda_capability_geq

from . import device_properties, interpreting

_GPU: tl.constexpr = tl.constexpr(not interpreting())


def supported(device: torch.device) -> bool:
    """Whether launches on `device` can be programmatic dependents (CUDA, sm_90 or later)."""
    return device.type == "cuda" and device_properties(device).major >= 9


@triton.jit
def release_dependents():
    """Let the next launch (if programmatic) start: this program needs nothing more from it."""
    if _GPU:
        if cuda_capability_geq(9, 0):
            gdc_launch_dependents()


@triton.jit
def wait_for_primary():
    """Block until the launch before this one (if this is programmatic) has ended."""
    if _GPU:
        if cuda_capability_geq(9, 0):
            gdc_wait()
