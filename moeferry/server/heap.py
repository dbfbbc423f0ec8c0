"""Give memory freed by a large request back to the operating system.

CPython returns big blocks to the C allocator when they are freed, but glibc keeps the pages
of its heap (and of its per-thread arenas) for reuse, so a 20 MB prompt that was parsed and
tokenized would leave the API process hundreds of MB larger for good. `malloc_trim(0)` hands
the free pages back. Elsewhere than glibc this is a no-op.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

log = logging.getLogger("moeferry.api")


def _load_trim():
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim") if name else None
    except (OSError, AttributeError):
        return None


_TRIM = _load_trim()


def release_free_memory() -> None:
    """Collect garbage and return the free heap pages to the OS."""
    gc.collect()
    if _TRIM is not None:
        _TRIM(0)
