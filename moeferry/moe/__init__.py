"""Expert execution: resident / slot-cache executors over the fused MoE kernels."""
from __future__ import annotations

import torch


def _triton_ok(device) -> bool:
    if torch.device(device).type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def make_expert_executor(gate_up: torch.Tensor, down: torch.Tensor, device, shared: tuple | None = None):
    """Executor for stacked unquantized experts (gate_up [E, 2I, H], down [E, H, I]):
    TritonExperts on CUDA, ResidentExperts (the reference) elsewhere. `shared` =
    (gate_up [2Is, H], down [H, Is]) puts the shared expert in the kernels too; call the
    executor with `shared_weight=` then (CUDA only; elsewhere keep the dense shared MLP)."""
    if _triton_ok(device):
        from moeferry.moe.triton_experts import TritonExperts
        return TritonExperts.resident(gate_up.to(device), down.to(device), shared)
    from moeferry.moe.resident import ResidentExperts
    return ResidentExperts(gate_up.to(device), down.to(device))


def make_packed_expert_executor(experts: list[tuple], dtype: torch.dtype, device):
    """Executor for quantized experts, one (gate, up, down) triple of QuantLinear per expert:
    TritonExperts over a slot buffer of the format's device form on CUDA, PackedExperts (the
    dequantizing reference) elsewhere, or when the triples mix formats."""
    formats = {m.format for triple in experts for m in triple}
    if _triton_ok(device) and len(formats) == 1:
        from moeferry.moe.slots import SlotBuffer
        from moeferry.moe.triton_experts import TritonExperts
        buf = SlotBuffer.from_experts(formats.pop(), [tuple(m.packed for m in t) for t in experts], device)
        return TritonExperts(buf, torch.arange(len(experts), dtype=torch.int32, device=device))
    from moeferry.moe.resident import PackedExperts
    return PackedExperts(experts, dtype)
