"""Host expert banks: every routed expert of every MoE layer, in slot form, in pinned host RAM.

A layer's bank is a `SlotBuffer` on the CPU with one slot per expert (slot e = expert e), in
exactly the layout a device slot of the same format holds, so a cache miss is a few
contiguous copies and the CPU lane computes straight from it (`SlotBuffer.run_host`).
Banks are built while the checkpoint streams in, one layer at a time.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from moeferry.moe.layer_experts import LayerExperts

if TYPE_CHECKING:  # slots import the Triton kernels: only the offload backends need them
    from moeferry.moe.placement import Placement
    from moeferry.moe.slots import SlotBuffer

log = logging.getLogger("moeferry.moe")


class HostRamError(RuntimeError):
    """Not enough host RAM for the expert banks."""


def available_host_ram() -> int:
    """MemAvailable from /proc/meminfo (bytes), else physical pages x page size."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_loading(bank_bytes: int, layer_bytes: int, mode: str, available: int | None = None,
                 max_threads: int = 8) -> int:
    """Reader threads for building the banks: 1 (serial) or more (parallel). Refuses with the
    numbers when the banks cannot fit. `auto` goes parallel when free RAM holds the banks plus
    every reader's layer in flight, and says so."""
    available = available_host_ram() if available is None else available
    gib = 2 ** 30
    if bank_bytes + layer_bytes > available:
        raise HostRamError(
            f"not enough host RAM for the expert banks: they need {bank_bytes / gib:.2f} GiB (+ "
            f"{layer_bytes / gib:.2f} GiB for the layer being read) and {available / gib:.2f} GiB is available; "
            f"free memory or use --moe-backend resident on a device that holds every expert")
    threads = max(1, min(max_threads, os.cpu_count() or 1))
    fits_parallel = bank_bytes + threads * layer_bytes <= available
    if mode == "serial" or threads == 1:
        return 1
    if mode == "parallel":
        if not fits_parallel:
            log.warning("--expert-load parallel: %d readers need %.2f GiB beyond the banks, %.2f GiB is left; "
                        "reading anyway", threads, threads * layer_bytes / gib, (available - bank_bytes) / gib)
        return threads
    log.info("expert load: %s (banks %.2f GiB, %d readers x %.2f GiB per layer, %.2f GiB available)",
             "parallel" if fits_parallel else "serial", bank_bytes / gib, threads, layer_bytes / gib,
             available / gib)
    return threads if fits_parallel else 1


def build_bank(experts: LayerExperts, pin: bool, placement: "Placement | None" = None) -> "SlotBuffer":
    """One layer's bank: expert e in slot e, in pinned memory when `pin`; `placement` keeps its
    templates from layer to layer (`moe.placement`)."""
    from moeferry.moe.placement import Placement
    from moeferry.moe.slots import SlotBuffer

    bank = SlotBuffer.allocate(experts.format, experts.num_experts, experts.experts[0], "cpu", pin=pin)
    (placement or Placement()).fill(bank, experts)
    return bank


def pinnable(device: torch.device) -> bool:
    return device.type == "cuda"
