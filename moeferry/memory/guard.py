"""The runtime OOM guard: an out-of-memory error in a step shrinks the expert cache and retries.

`OomGuard.run(step)` runs one engine step. On `torch.OutOfMemoryError` it releases what the
failed step left (garbage, the allocator's cached blocks), shrinks the expert cache elastically
(slots freed, slot table updated, no restart) by the measured transient of the worst step, and
retries. When nothing can shrink any more (a resident backend, or the cache at its minimum),
the error goes to the step's requests (`StepOutOfMemory`) and the server keeps serving.
Every shrink is logged with its numbers and counted.

Test hook: `MOEFERRY_FAULT_OOM_STEPS="3,7"` (read once when the guard is made) raises an
out-of-memory error at the start of those steps (1-based, counted from the engine's build: the
boot self-test's two steps come first when the engine plans its memory), as a real one would be.
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


_TRIED = re.compile(r"Tried to allocate (\d+(?:\.\d+)?) (GiB|MiB|KiB|B)")
_UNIT = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}


def requested_bytes(message: str) -> int:
    """The allocation an out-of-memory error says failed (0 when it does not say)."""
    m = _TRIED.search(message)
    return int(float(m.group(1)) * _UNIT[m.group(2)]) if m else 0


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

    def run(self, step):
        self.steps += 1
        for attempt in range(MAX_RETRIES + 1):
            try:
                if attempt == 0 and self.steps in self.fault_steps:
                    raise torch.OutOfMemoryError(f"injected out-of-memory error in step {self.steps} "
                                                 "(MOEFERRY_FAULT_OOM_STEPS)")
                return step()
            except torch.OutOfMemoryError as e:
                self.caught += 1
                self._release()
                why = str(e).splitlines()[0]
                if attempt == MAX_RETRIES or not self._shrink(why):
                    raise StepOutOfMemory(f"out of device memory in step {self.steps} and the expert cache cannot "
                                          f"shrink further: {why}") from None
        raise AssertionError("unreachable")

    def _release(self) -> None:
        gc.collect()
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)
            torch.cuda.empty_cache()

    def _shrink(self, why: str) -> bool:
        experts = self.engine.experts
        have = experts.expert_slots
        slot_bytes = experts.slot_bytes  # 0: no cache of slots (resident)
        if not slot_bytes or have <= self.min_slots:
            log.error("out of memory (%s); the %s backend cannot shrink its expert cache (%d slots)", why,
                      experts.name, have)
            return False
        need = max(self.shrink_bytes, requested_bytes(why))  # the failed allocation, when the error says
        drop = max(1, -(-need // slot_bytes), have // 10)
        target = max(self.min_slots, have - drop)
        freed = experts.shrink(target)  # releases the old slots itself
        self.engine.on_expert_cache_resized(target)
        record = {"step": self.steps, "slots_before": have, "slots_after": experts.expert_slots,
                  "bytes_freed": freed, "reason": why}
        self.shrinks.append(record)
        log.warning("out of memory in step %d (%s): expert cache shrunk %d -> %d slots, %s freed; retrying",
                    self.steps, why, have, experts.expert_slots, human_bytes(freed))
        return True

    def stats(self) -> dict:
        return {"oom_caught": self.caught, "cache_shrinks": len(self.shrinks),
                "last_shrink": self.shrinks[-1] if self.shrinks else None}
