"""The runtime OOM guard: an out-of-memory error in a step shrinks the expert cache and retries.

`OomGuard.run(step)` runs one engine step. On `torch.OutOfMemoryError` it releases what the
failed step left (garbage, the allocator's cached blocks), shrinks the expert cache elastically
(slots freed, slot table updated, no restart) by the measured transient of the worst step (in
the boot self-test: by the measured deficit of the failed allocation), and retries. When nothing can shrink any more (a resident backend, or the cache at its minimum),
the error goes to the step's requests (`StepOutOfMemory`) and the server keeps serving.
Every shrink is logged with its numbers and counted.

Test hook: `MOEFERRY_FAULT_OOM_STEPS="3,7"` (read once when the guard is made) raises an
out-of-memory error at the start of those steps (1-based, counted from the engine's build: on
CUDA the warm-up's steps come first, then the boot self-test's two when the engine plans its
memory; on the CPU only the self-test's), as a real one would be.
"""
from __future__ import annotations

import gc
import logging
import os
import re

import torch

from moeferry.memory.plan import human_bytes

log = logging.getLogger("moeferry.memory")

MAX_RETRIES = 4
BOOT_RETRIES = 16
SHRINK_GRANULE = 32 * 2**20  # added to a boot deficit: the allocator's rounding, the step's next allocations  # the boot self-test shrinks by the measured deficit, so in smaller steps


_TRIED = re.compile(r"Tried to allocate (\d+(?:\.\d+)?) (GiB|MiB|KiB|B)")
_UNIT = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}


_FREE = re.compile(r"of which (\d+(?:\.\d+)?) (GiB|MiB|KiB|B) is free")


def _bytes(pattern: re.Pattern, message: str) -> int | None:
    m = pattern.search(message)
    return int(float(m.group(1)) * _UNIT[m.group(2)]) if m else None


def requested_bytes(message: str) -> int:
    """The allocation an out-of-memory error says failed (0 when it does not say)."""
    return _bytes(_TRIED, message) or 0


def deficit_bytes(message: str) -> int:
    """How much more the device needed when the allocation failed: the request less the memory
    free at that moment (the error says both); the request alone when it does not say what was
    free, 0 when it says neither."""
    free = _bytes(_FREE, message)
    return max(0, requested_bytes(message) - (free or 0))


class StepOutOfMemory(RuntimeError):
    """A step ran out of memory and shrinking the expert cache could not help."""


class OomGuard:
    def __init__(self, engine, shrink_bytes: int, min_slots: int = 1):
        self.engine = engine
        self.shrink_bytes = shrink_bytes  # how much one shrink frees (the measured worst transient)
        self.min_slots = min_slots
        self.steps = 0
        self.caught = 0
        self.shrinks: list[dict] = []
        faults = os.environ.get("MOEFERRY_FAULT_OOM_STEPS", "")
        self.fault_steps = {int(s) for s in faults.split(",") if s.strip()}

    def run(self, step, boot: bool = False):
        """One guarded step. `boot` (the self-test): each shrink frees only the measured deficit
        (the failed allocation less the memory free after releasing), so the plan loses no more
        slots than the worst step really needs; at runtime a shrink frees at least the measured
        worst transient, so one shrink is enough for any later step."""
        self.steps += 1
        retries = BOOT_RETRIES if boot else MAX_RETRIES
        for attempt in range(retries + 1):
            result, why = self._attempt(step, attempt)
            if why is None:
                return result
            # outside the except clause: the error's traceback (whose frames hold the step's
            # tensors, the expert cache's buffer among them) is gone, so shrinking frees memory
            self.caught += 1
            self._release()
            if attempt == retries or not self._shrink(why, boot):
                raise StepOutOfMemory(f"out of device memory in step {self.steps} and the expert cache cannot "
                                      f"shrink further: {why}")
        raise AssertionError("unreachable")

    def _attempt(self, step, attempt: int) -> tuple:
        """Run the step once: (its value, None), or (None, the out-of-memory error's first line)."""
        try:
            if attempt == 0 and self.steps in self.fault_steps:
                raise torch.OutOfMemoryError(f"injected out-of-memory error in step {self.steps} "
                                             "(MOEFERRY_FAULT_OOM_STEPS)")
            return step(), None
        except torch.OutOfMemoryError as e:
            return None, str(e).splitlines()[0]

    def _release(self) -> None:
        gc.collect()
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)
            torch.cuda.empty_cache()

    def _shrink(self, why: str, boot: bool = False) -> bool:
        experts = self.engine.experts
        have = experts.expert_slots
        slot_bytes = experts.slot_bytes  # 0: no cache of slots (resident)
        if not slot_bytes or have <= self.min_slots:
            log.error("out of memory (%s); the %s backend cannot shrink its expert cache (%d slots)", why,
                      experts.name, have)
            return False
        if boot:
            drop = max(1, -(-(deficit_bytes(why) + SHRINK_GRANULE) // slot_bytes))
        else:  # the worst transient, the failed allocation when the error says, at least 10%
            drop = max(1, -(-max(self.shrink_bytes, requested_bytes(why)) // slot_bytes), have // 10)
        target = max(self.min_slots, have - drop)
        freed = self.engine.shrink_expert_cache(target)  # releases the old slots first
        record = {"step": self.steps, "slots_before": have, "slots_after": experts.expert_slots,
                  "bytes_freed": freed, "reason": why}
        self.shrinks.append(record)
        log.warning("out of memory in step %d (%s): expert cache shrunk %d -> %d slots, %s freed; retrying",
                    self.steps, why, have, experts.expert_slots, human_bytes(freed))
        return True

    def stats(self) -> dict:
        return {"oom_caught": self.caught, "cache_shrinks": len(self.shrinks),
                "last_shrink": self.shrinks[-1] if self.shrinks else None}
