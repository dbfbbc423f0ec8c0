"""Page-locked host memory on transparent huge pages, for the expert banks.

A decode step's misses are read from the banks by the device itself (the gather kernel), and the
device translates every host address it reads through its own page tables: over banks of many
GiB in 4 KiB pages, misses scattered across them keep missing its translation caches
(`benchmarks/host_pages.py` measures the gather rate by page backing). Here a bank's bytes are an
anonymous mapping advised MADV_HUGEPAGE (2 MiB pages where the host's THP setting is `always` or
`madvise`; `never`: 4 KiB pages, as before), touched by PyTorch's threads, then registered with
CUDA (cudaHostRegister); the registration is dropped and the mapping unmapped once the last
tensor over it is gone.
"""
from __future__ import annotations

import mmap
import weakref

import torch

HUGE = 2 << 20  # a transparent huge page
BANKS = False   # host banks (pinned slot matrices) made here: off until host_pages.py has timed it on a GPU host
ALIGN = 256     # each tensor carved from a region starts at a multiple of this


def _cuda_register(ptr: int, nbytes: int) -> None:
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes >> 20} MiB failed: {err}")


def _cuda_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def pinned_tensors(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], register=None,
                   unregister=None) -> dict[str, torch.Tensor]:
    """Uninitialised page-locked host tensors of these shapes and dtypes, carved from one mapping
    on huge pages (each at a multiple of ALIGN bytes). `register(ptr, nbytes)` locks the mapping
    for the device, `unregister(ptr)` runs once the last tensor over it is freed (None: CUDA's;
    other callables for tests)."""
    register, unregister = register or _cuda_register, unregister or _cuda_unregister
    at, spans = 0, {}
    for name, (shape, dtype) in shapes.items():
        n = torch.Size(shape).numel() * dtype.itemsize
        spans[name] = (at, n, shape, dtype)
        at += -(-n // ALIGN) * ALIGN
    nbytes = max(HUGE, -(-at // HUGE) * HUGE)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no THP on this host (or kernel): 4 KiB pages, as torch's pinned memory
        pass
    raw = torch.frombuffer(region, dtype=torch.uint8)  # its storage holds the mapping alive
    raw.fill_(0)  # the pages faulted in by PyTorch's threads, not one by one inside the registration
    register(raw.data_ptr(), nbytes)
    weakref.finalize(region, unregister, raw.data_ptr())  # the last tensor's storage gone: the mapping goes
    return {name: raw[off:off + n].view(dtype).view(shape) for name, (off, n, shape, dtype) in spans.items()}
