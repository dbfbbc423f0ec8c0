"""Python's cycle collector held off while the engine is built.

Reading a checkpoint's index and loading it create hundreds of thousands of long-lived objects
(an entry per tensor, views, slot tables). Each time enough of them survive, CPython runs a full
collection, which walks every tracked object: torch's own ~170k and everything made since.
Measured on the development machine, a 40-layer checkpoint of Qwen3.6-35B-A3B's tensor count
(256 experts, mixed_nvfp4, small matrices): 4-6 full collections of 80-150 ms in a 1.7-2.4 s
build, none of which freed anything worth having. Inside `paused()` no collection starts on its
own (an explicit `gc.collect()`, as the memory probe makes, still runs); the earlier setting
comes back after, even when the body raises. Decode steps were measured to trigger no full
collection, so serving runs with the collector as Python sets it.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
