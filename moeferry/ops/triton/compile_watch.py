"""How much of a stretch of work went to Triton compiling kernels (for the boot log).

A kernel's first launch in a process compiles it, or loads it from Triton's on-disk cache when an
earlier process compiled the same specialization (then it takes milliseconds). On a machine's
first boot that is most of the memory probe and the warm-up; the log says how much, so a slow
first boot is told apart from a slow engine. Triton's compilation listener (`knobs.compilation.
listener`, called by `triton.compile` at its end with the stage times and whether the on-disk
cache held the kernel) is set only while `watching`, chained to a listener already set, and
restored after. (Not the JIT's `jit_cache_hook`: setting it makes every launch serialize its
specialization to JSON first, which fails for kernels given a function as a constexpr.)
"""
from __future__ import annotations

import threading
from contextlib import contextmanager


class CompileWatch:
    """Kernels compiled, and loaded from Triton's cache, while `watching`, with their seconds."""

    def __init__(self):
        self.compiled = self.loaded = 0
        self.seconds = 0.0
        self._lock = threading.Lock()  # compiles may run on threads (`--compile-workers`)

    @property
    def kernels(self) -> int:
        return self.compiled + self.loaded

    @contextmanager
    def watching(self):
        try:
            from triton import knobs
        except ImportError:  # no Triton: nothing compiles
            yield self
            return
        before = knobs.compilation.listener

        def heard(*, src, metadata, metadata_group, times, cache_hit):
            with self._lock:
                if cache_hit:
                    self.loaded += 1
                else:
                    self.compiled += 1
                self.seconds += (times.ir_initialization + times.total_lowering + times.store_results) / 1e6
            if before is not None:
                before(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

        knobs.compilation.listener = heard
        try:
            yield self
        finally:
            knobs.compilation.listener = before

    def describe(self) -> str:
        if not self.kernels:
            return "no Triton kernel compiled"
        return (f"Triton: {self.compiled} kernels compiled, {self.loaded} loaded from its cache, "
                f"{self.seconds:.1f} s summed over them (a machine's first boot compiles; later boots load them)")
