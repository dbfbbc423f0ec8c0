"""Expert execution: the expert-backend registry.

A backend is chosen by `EngineConfig.moe_backend` and built once per engine. The loader hands
it each MoE layer's experts (`LayerExperts`: host-side packed tensors, read once) and gets
back that layer's executor, called as `executor(x [T, H], ids [T, k], weights [T, k]) -> [T, H]`.
After the last layer `finish(plan)` lets a backend size what depends on the memory plan (the
offload backends' device slot cache). `device_bytes` is what the backend holds on the device;
`stats()` its counters for /v1/stats.

    resident   every expert on the device (Triton kernels on CUDA, CPU references elsewhere)
"""
from __future__ import annotations

from moeferry.moe.layer_experts import LayerExperts
from moeferry.moe.resident import ResidentBackend

EXPERT_BACKENDS = {
    "resident": ResidentBackend,
}


def make_backend(cfg, spec, device, dtype):
    try:
        cls = EXPERT_BACKENDS[cfg.moe_backend]
    except KeyError:
        raise ValueError(f"unknown expert backend {cfg.moe_backend!r}; known: {', '.join(EXPERT_BACKENDS)}") from None
    return cls(cfg, spec, device, dtype)


__all__ = ["EXPERT_BACKENDS", "LayerExperts", "make_backend"]
