"""How much of a stretch of work went to Triton compiling kernels (for the boot log).

A kernel's first launch in a process compiles it, or loads it from Triton's on-disk cache when an
earlier process compiled the same specialization (then it takes milliseconds). On a machine's
first boot that is most of the memory probe and the warm-up; the log says how much, so a slow
first boot is told apart from a slow engine. Triton's two compile hooks (`knobs.runtime.
jit_cache_hook`, called before a compile, and `jit_post_compile_hook`, after it) are set only
while `watching`, chained to any hooks already set, and restored after.
"""
from __future__ import annotations

import time
from contextlib import contextmanager


class CompileWatch:
    """Kernels compiled (or loaded from Triton's cache) while `watching`, and their seconds."""

    def __init__(self):
        self.kernels = 0
        self.seconds = 0.0
        self._started: dict[tuple, float] = {}

    @staticmethod
    def _id(kw: dict) -> tuple:
        fn = kw.get("fn")
        return getattr(fn, "module", None), getattr(fn, "name", None), str(kw.get("key"))

    @contextmanager
    def watching(self):
        try:
            from triton import knobs
        except ImportError:  # no Triton: nothing compiles
            yield self
            return
        runtime = knobs.runtime
        before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

        def start(**kw):
            self._started[self._id(kw)] = time.perf_counter()
            return before(**kw) if before is not None else None  # True would skip the compile: only theirs

        def done(**kw):
            t = self._started.pop(self._id(kw), None)
            if t is not None:
                self.kernels += 1
                self.seconds += time.perf_counter() - t
            return after(**kw) if after is not None else None

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = start, done
        try:
            yield self
        finally:
            runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after

    def describe(self) -> str:
        if not self.kernels:
            return "no Triton kernel compiled"
        return (f"{self.kernels} Triton kernels compiled or loaded from Triton's cache in {self.seconds:.1f} s "
                f"(a machine's first boot compiles; later boots load them)")
