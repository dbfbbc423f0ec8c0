"""Expert execution: the expert-backend registry.

A backend is chosen by `EngineConfig.moe_backend` and built once per engine. The loader hands
it each MoE layer's experts (`LayerExperts`: host-side packed tensors, read once) and gets
back that layer's executor, called as `executor(x [T, H], ids [T, k], weights [T, k]) -> [T, H]`.
After the last layer `finish(plan)` lets a backend size what depends on the memory plan (the
offload backends' device slot cache). `device_bytes` is what the backend holds on the device;
`stats()` its counters for /v1/stats.

    resident   every expert on the device (Triton kernels on CUDA, CPU references elsewhere)
    offload    experts in pinned host banks, a cache of device slots (LRU or LFU), misses fetched
    cpu        ... misses computed on the CPU from the banks
    hybrid     ... misses split between fetches and CPU compute (`moeferry.moe.offload`)
"""
from __future__ import annotations

import importlib


def __getattr__(name: str):
    if name == "LayerExperts":  # (imported on use: the engine config imports this package, the CLI that)
        return importlib.import_module("moeferry.moe.layer_experts").LayerExperts
    raise AttributeError(f"module 'moeferry.moe' has no attribute {name!r}")


def _resident(cfg, spec, device, dtype):
    from moeferry.moe.resident import ResidentBackend
    return ResidentBackend(cfg, spec, device, dtype)


def _offload(name: str):
    """The offload backends import the Triton kernel layouts (their slots), so only when chosen:
    a CPU-only install without Triton still runs the resident backend."""
    def make(cfg, spec, device, dtype):
        try:
            from moeferry.moe.offload import OffloadBackend
        except ImportError as e:
            raise RuntimeError(f"--moe-backend {name} needs Triton (its expert slots use the kernels' layouts): "
                               f"{e}; install triton or use --moe-backend resident") from None
        return OffloadBackend(cfg, spec, device, dtype, name=name)
    return make


EXPERT_BACKENDS = {
    "resident": _resident,
    "offload": _offload("offload"),
    "cpu": _offload("cpu"),
    "hybrid": _offload("hybrid"),
}


def make_backend(cfg, spec, device, dtype):
    try:
        make = EXPERT_BACKENDS[cfg.moe_backend]
    except KeyError:
        raise ValueError(f"unknown expert backend {cfg.moe_backend!r}; known: {', '.join(EXPERT_BACKENDS)}") from None
    return make(cfg, spec, device, dtype)


__all__ = ["EXPERT_BACKENDS", "LayerExperts", "make_backend"]
