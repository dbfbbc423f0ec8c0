"""Resident experts: every routed expert of every layer in device memory.

On CUDA a layer's experts are copied once, from the host-side packed tensors, into a slot
buffer of their format that the fused Triton kernels read (identity slot table). Elsewhere
the CPU references run: stacked dense experts, or packed experts dequantized per step.
"""
from __future__ import annotations

import logging

import torch

from moeferry.moe.layer_experts import ExpertWeights, LayerExperts
from moeferry.ops.moe import experts_reference

log = logging.getLogger(__name__)


class DenseExperts:
    """Reference executor over stacked unquantized experts: gate_up [E, 2I, H] (gate rows first), down [E, H, I]."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        self.gate_up, self.down = gate_up, down

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return experts_reference(x, ids, weights, lambda e: (self.gate_up[e], self.down[e]))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate_up, self.down))


class PackedExperts:
    """Reference executor over experts kept in their quantized checkpoint format (one
    (gate, up, down) triple of PackedWeight per expert): dequantizes only the experts a step selects."""

    def __init__(self, experts: list[tuple], dtype: torch.dtype):
        self.experts, self.dtype = experts, dtype

    def _weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up, down = self.experts[e]
        return torch.cat([gate.dequantize(self.dtype), up.dequantize(self.dtype)]), down.dequantize(self.dtype)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return experts_reference(x, ids, weights, self._weights)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for triple in self.experts for w in triple)


def use_kernels(device: torch.device) -> bool:
    """The fused Triton MoE kernels run on CUDA (and nowhere else by default)."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401 - installed?
    except ImportError:
        return False
    return True


class ResidentBackend:
    """Expert backend `resident`: each layer's executor holds all of its experts on the device."""

    name = "resident"

    def __init__(self, cfg, spec, device: torch.device, dtype: torch.dtype):
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.layers: dict[int, object] = {}
        self.expert_slots = 0  # every expert has a slot
        self.load_threads = 1
        self.staging = None  # moe.slots.HostStaging while layers are placed through the kernels

    def prepare(self, bank_bytes: int, layer_bytes: int) -> None:
        """Before the first layer: reader threads for the experts (no host banks are kept)."""
        from moeferry.moe.bank import plan_loading

        self.load_threads = plan_loading(0, layer_bytes, self.cfg.expert_load)

    @property
    def takes_shared(self) -> bool:
        """The shared expert can be one more slot of a layer's kernel (`add_layer(..., shared)`)."""
        return use_kernels(self.device)

    capturing = None  # set by DecodeGraphs while it captures (resident layers never cut a step)

    def graph_mode(self, max_batch: int) -> str:
        """Decode is captured whole: nothing is read on the host during a step."""
        return "whole"

    def before_graph(self, rows: int) -> None:
        """Nothing to hand over before a decode graph runs (offload's cache state may be)."""

    def graph_failed(self) -> None:
        """Nothing to repair after a failed capture (offload's cache may need it)."""

    def link_routers(self, routers: dict) -> None:
        """Resident experts need no prediction of the next layer's routing (offload prefetches)."""

    def decode_targets(self) -> list:
        """Each layer's slot buffer, for the warm-up's choice of MoE path (`moe.path_choice`)."""
        from moeferry.moe.path_choice import DecodeTarget
        return [DecodeTarget(ex.buffer, ex.table_row, ex.shared_slot) for ex in self.layers.values()
                if hasattr(ex, "buffer")]

    def add_layer(self, layer: int, experts: LayerExperts, shared: ExpertWeights | None = None):
        """The layer's executor; `shared` (only when `takes_shared`): the shared expert, in the
        routed experts' format, held in slot E and run with them (`shared_gate=`: the gate logit per token)."""
        if shared is not None and not self.takes_shared:
            raise ValueError("the reference executors take no shared expert (takes_shared is False)")
        if use_kernels(self.device):
            from moeferry.moe.slots import HostStaging
            from moeferry.moe.triton_experts import TritonExperts

            if self.staging is None:  # two page-locked host buffers per slot layout, reused by every layer
                self.staging = HostStaging(pin=self.device.type == "cuda", depth=2)
            buf = self.staging.to_device(experts, [shared] if shared is not None else [], self.device)
            ex = TritonExperts(buf, torch.arange(experts.num_experts, dtype=torch.int32, device=self.device),
                               shared_slot=experts.num_experts if shared is not None else -1)
        elif experts.stacked is not None:
            gate_up, down = experts.stacked
            ex = DenseExperts(gate_up.to(self.device, self.dtype), down.to(self.device, self.dtype))
        else:
            ex = PackedExperts([tuple(w.to(self.device) for w in t) for t in experts.experts], self.dtype)
        self.layers[layer] = ex
        self.expert_slots += experts.num_experts
        return ex

    def finish(self, expert_slots: int | None = None) -> None:
        """All layers are added: the host staging buffers are freed."""
        if self.staging is not None:
            placed = self.staging.placement
            log.info("resident experts: %d layers placed through page-locked host buffers (%d from the first "
                     "layer's template)", placed.templated + placed.plain, placed.templated)
            self.staging.release()
            self.staging = None

    def requested_slots(self) -> int:
        return self.expert_slots

    def probe_slots(self) -> None:
        return None

    @property
    def experts_total(self) -> int:
        return self.expert_slots

    staging_bytes = 0  # no staging area, no cache of slots: the experts are part of the weights
    slot_bytes = 0

    @property
    def device_bytes(self) -> int:
        return sum(ex.nbytes for ex in self.layers.values())

    def stats(self) -> dict:
        return {"backend": self.name, "slots": self.expert_slots, "slots_used": self.expert_slots,
                "device_bytes": self.device_bytes}
