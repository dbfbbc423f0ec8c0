"""Expert slots on the device: a buffer of N slots of one format, and the slot table.

A slot holds one expert's weights in its format's device form: gate_up [2I, H] (gate rows
first) and down [H, I], plus scales (layouts in `moeferry.ops.triton.moe_formats`). The
table maps (layer, expert) -> slot id, -1 when the expert is not resident. The fused MoE
kernels read experts only through the table, so the resident executor (every expert has a
slot, identity table) and the offload cache (a few slots, a table its eviction policy keeps) share them.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from moeferry.checkpoint.formats import FORMATS
from moeferry.moe.layer_experts import ExpertWeights, LayerExperts
from moeferry.moe.placement import Placement
from moeferry.ops.cpu.experts import kernel as cpu_kernel
from moeferry.ops.triton.moe_formats import DENSE, MoEKernel, SlotMatrix, copy_part
from moeferry.ops.triton.moe_decode import DecodeConfig
from moeferry.ops.triton.moe_gemm import MoEConfig, decode_config, fused_moe
from moeferry.ops.triton.moe_prep import RoutingScratch


def kernel_for(fmt) -> MoEKernel:
    """The MoE kernel of a registry format (name or entry)."""
    entry = FORMATS[fmt] if isinstance(fmt, str) else fmt
    return entry.moe_kernel()


class SlotBuffer:
    """`num_slots` expert slots of one format on one device."""

    def __init__(self, gate_up: SlotMatrix, down: SlotMatrix):
        if gate_up.kernel is not down.kernel or gate_up.num_slots != down.num_slots:
            raise ValueError("gate_up and down slots must share format and slot count")
        if gate_up.n != 2 * down.k or gate_up.k != down.n:
            raise ValueError(f"shapes: gate_up [{gate_up.n}, {gate_up.k}] vs down [{down.n}, {down.k}]")
        self.gate_up, self.down = gate_up, down
        self.scratch = RoutingScratch(gate_up.num_slots, gate_up.w.device)
        # calls of up to this many tokens take the decode path (two GEMV launches) instead of
        # the grouped GEMM: 0 until the warm-up times both on the device (`moe.path_choice`)
        self.decode_tokens = 0

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_dense(cls, gate_up: torch.Tensor, down: torch.Tensor) -> "SlotBuffer":
        """Wrap stacked unquantized experts (gate_up [E, 2I, H], down [E, H, I]) without a copy."""
        e, n, k = gate_up.shape
        return cls(SlotMatrix(DENSE, n, k, n // 2, gate_up.contiguous()),
                   SlotMatrix(DENSE, down.shape[1], down.shape[2], down.shape[1], down.contiguous()))

    @classmethod
    def allocate(cls, fmt, num_slots: int, example: ExpertWeights, device, pin: bool = False) -> "SlotBuffer":
        """Uninitialised slots shaped like `example` (one expert's packed gate, up, down);
        `pin`: page-locked host memory."""
        kern = kernel_for(fmt)
        gate, up, down = example
        return cls(kern.empty_matrix(num_slots, [gate, up], device, part=gate.out_features, pin=pin),
                   kern.empty_matrix(num_slots, [down], device, pin=pin))

    @classmethod
    def allocate_like(cls, other: "SlotBuffer", num_slots: int, device=None, pin: bool = False) -> "SlotBuffer":
        """Uninitialised slots of `other`'s layout (on `device`, default other's)."""
        def like(m: SlotMatrix) -> SlotMatrix:
            return dataclasses.replace(m, **{
                k: torch.empty((num_slots, *t.shape[1:]), dtype=t.dtype, device=device or t.device, pin_memory=pin)
                for k, t in m.tensors().items()})
        buf = cls(like(other.gate_up), like(other.down))
        buf.decode_tokens = other.decode_tokens  # same layout, same kernels: the same choice
        return buf

    @classmethod
    def from_experts(cls, fmt, experts: Sequence[ExpertWeights], device, num_slots: int | None = None) -> "SlotBuffer":
        """Slots 0..len(experts)-1 filled with `experts` (one slot each), `num_slots` in all. Off
        the CPU the slots are filled on the host first and copied over in one copy per tensor."""
        on_cpu = torch.device(device).type == "cpu"
        buf = cls.allocate(fmt, (num_slots or len(experts)) if on_cpu else len(experts), experts[0], "cpu")
        Placement().fill(buf, LayerExperts(fmt, experts))
        return buf if on_cpu else buf.to(device, num_slots)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every slot tensor ([slots, ...] each) by name, gate_up's then down's."""
        return [(k, t) for m in (self.gate_up, self.down) for k, t in m.tensors().items()]

    def to(self, device, num_slots: int | None = None, non_blocking: bool = False) -> "SlotBuffer":
        """A copy on `device` (with `num_slots` slots, the first ones filled from these)."""
        out = self.allocate_like(self, num_slots or self.num_slots, device)
        for src, dst in ((self.gate_up, out.gate_up), (self.down, out.down)):
            for name, t in src.tensors().items():
                getattr(dst, name)[:self.num_slots].copy_(t, non_blocking=non_blocking)
        return out

    # -- slots ----------------------------------------------------------------------------
    @property
    def kernel(self) -> MoEKernel:
        return self.gate_up.kernel

    @property
    def num_slots(self) -> int:
        return self.gate_up.num_slots

    @property
    def hidden(self) -> int:
        return self.gate_up.k

    @property
    def inter(self) -> int:
        return self.down.k

    @property
    def bytes_per_slot(self) -> int:
        return self.gate_up.bytes_per_slot + self.down.bytes_per_slot

    @property
    def nbytes(self) -> int:
        return self.bytes_per_slot * self.num_slots

    def pack(self, expert: ExpertWeights) -> tuple[dict, dict]:
        """One expert's slot contents (host tensors, e.g. for a pinned host bank)."""
        gate, up, down = expert
        return self.kernel.pack([gate, up])[0], self.kernel.pack([down])[0]

    def write_packed(self, slot: int, packed: tuple[dict, dict]) -> None:
        self.gate_up.write(slot, packed[0])
        self.down.write(slot, packed[1])

    def write(self, slot: int, expert: ExpertWeights, copy=copy_part) -> None:
        """One expert into `slot`, each part copied straight into place (by `copy(dst, src)`)."""
        gate, up, down = expert
        self.gate_up.write_weights(slot, [gate, up], copy)
        self.down.write_weights(slot, [down], copy)

    def copy_slots(self, dst: list[int], src: "SlotBuffer", src_slots: list[int],
                   gather: tuple | None = None) -> int:
        """Copy experts from `src` (e.g. a host bank) into slots `dst` on the current stream;
        returns bytes copied. `gather` (a `slot_gather.CONFIGS` entry): one kernel launch reads
        them all (`src` pinned or on the device); None: one copy per tensor per expert."""
        if gather and dst:
            launch = self.gather_launch(src, gather)
            if launch is not None:
                launch(src_slots, dst)
                return self.bytes_per_slot * len(dst)
        return self.gate_up.copy_slots(dst, src.gate_up, src_slots) + self.down.copy_slots(dst, src.down, src_slots)

    def copy_indexed(self, src: "SlotBuffer", src_slots: torch.Tensor, dst_slots: torch.Tensor,
                     gather: tuple | None, programs: int | None = None) -> None:
        """Copy experts whose slot lists are tensors on this buffer's device (a negative
        destination moves nothing): on CUDA the gather kernel in config `gather` (its grid
        capped at `programs`), no host work (a CUDA graph can hold it); on the CPU by indexing."""
        if self.gate_up.w.device.type == "cuda":
            self.gather_launch(src, gather).indexed(src_slots, dst_slots, programs)
            return
        keep = dst_slots >= 0
        to, frm = dst_slots[keep].long(), src_slots.reshape(-1)[keep].long()
        for mine, theirs in ((self.gate_up, src.gate_up), (self.down, src.down)):
            for name, t in mine.tensors().items():
                t[to] = getattr(theirs, name)[frm].to(t.device)

    def gather_launch(self, src: "SlotBuffer", config: tuple):
        """The `SlotGather` from `src` into this buffer (made on first use, kept per source and
        config); None when some tensor's slot is not whole words."""
        gathers = self.__dict__.setdefault("_gathers", {})
        key = (id(src), config)
        if key not in gathers:
            views = [(m.word_views(), getattr(src, name).word_views()) for name, m in
                     (("gate_up", self.gate_up), ("down", self.down))]
            launch = None
            if not any(d is None or s is None for d, s in views):
                from moeferry.ops.triton.slot_gather import SlotGather
                launch = SlotGather([(s, d) for dv, sv in views for s, d in zip(sv, dv)], config)
            gathers[key] = (src, launch)  # the source kept: its id stays its own
        return gathers[key][1]

    def read_slot(self, slot: int) -> tuple[dict, dict]:
        """A copy of one slot's contents in `pack`'s form (the inverse of `write_packed`)."""
        return self.gate_up.read(slot), self.down.read(slot)

    # -- compute --------------------------------------------------------------------------
    def run(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, table_row: torch.Tensor,
            shared_slot: int = -1, shared_gate: torch.Tensor | None = None,
            config: MoEConfig | DecodeConfig | None = None) -> torch.Tensor:
        """The fused MoE kernels on these slots; `config` forces a path (default: the decode path
        for up to `decode_tokens` tokens, else the grouped GEMM's config for T)."""
        if config is None and x.shape[0] <= self.decode_tokens:
            config = decode_config(self.gate_up)
        return fused_moe(x, ids, weights, self.gate_up, self.down, table_row, self.scratch,
                         shared_slot, shared_gate, config)

    def run_host(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Sequence[int],
                 threads: int) -> torch.Tensor:
        """The host lane of a host bank whose slot e holds expert e: the pairs routed to `experts`,
        summed in fp32 [T, H] (x, ids, weights on the host). The C kernel (`ops.cpu.experts`)
        reads each weight row once with `threads` threads; without it, `run_reference`."""
        row = torch.full((self.num_slots,), -1, dtype=torch.int32)
        row[list(experts)] = torch.as_tensor(list(experts), dtype=torch.int32)
        cpu = cpu_kernel()
        if cpu is not None:
            return cpu.run(self, x, ids, weights, row, threads)
        return self.run_reference(x.float(), ids, weights.float(), row)

    # slots dequantized together by `run_reference` (a decode step touches <= top_k experts)
    REFERENCE_BATCH = 8

    def run_reference(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, table_row: torch.Tensor,
                      shared_slot: int = -1, shared_gate: torch.Tensor | None = None) -> torch.Tensor:
        """`run` in plain PyTorch, the CPU reference of the fused kernels (same contract: experts
        are read only through `table_row`, -1 = skipped; `shared_gate` [T] adds `shared_slot`
        to every token, weighted by its fp32 sigmoid). Each distinct slot of the step is dequantized once (`dense_slots`, in
        x's dtype), its tokens go through `swiglu`, each pair's output times its routing weight
        is rounded to x's dtype and the pairs are summed in fp32, as the kernels do."""
        from moeferry.ops.moe import swiglu

        slot = table_row.to(ids.device).long()[ids]  # [T, k] slot of each (token, choice)
        pair_w = weights.float()
        if shared_gate is not None:
            slot = torch.cat([slot, slot.new_full((slot.shape[0], 1), shared_slot)], dim=1)
            pair_w = torch.cat([pair_w, torch.sigmoid(shared_gate.reshape(-1, 1).float())], dim=1)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for batch in torch.unique(slot[slot >= 0]).split(self.REFERENCE_BATCH):
            gate_up = self.gate_up.dense_slots(batch, x.dtype)
            down = self.down.dense_slots(batch, x.dtype)
            for s, gu, d in zip(batch.tolist(), gate_up, down):
                tok, j = torch.where(slot == s)
                y = (swiglu(x[tok], gu, d).float() * pair_w[tok, j, None]).to(x.dtype)
                out.index_add_(0, tok, y.float())
        return out.to(x.dtype)


class SlotTable:
    """[num_layers, num_experts] int32 on the device: expert -> slot, -1 = not resident."""

    def __init__(self, num_layers: int, num_experts: int, device):
        self.table = torch.full((num_layers, num_experts), -1, dtype=torch.int32, device=device)

    @classmethod
    def identity(cls, num_layers: int, num_experts: int, device) -> "SlotTable":
        """Layer l's expert e in slot l * num_experts + e (everything resident)."""
        t = cls(num_layers, num_experts, device)
        t.table.copy_(torch.arange(num_layers * num_experts, dtype=torch.int32).view(num_layers, num_experts))
        return t

    def row(self, layer: int) -> torch.Tensor:
        return self.table[layer]

    def assign(self, layer: int, expert: int, slot: int) -> None:
        self.table[layer, expert] = slot

    def evict(self, layer: int, expert: int) -> None:
        self.table[layer, expert] = -1


class HostStaging:
    """Host slot buffers reused from layer to layer while experts are placed on a device: each
    layer's experts are packed into a buffer of their layout (page-locked with `pin`, so the
    copy to the device is a DMA and no layer allocates and faults in fresh host memory). One
    set of buffers per layout (format, slot count, tensor shapes): mixed checkpoints alternate
    formats. With `depth` 2, `to_device` leaves a layer's copy running while the next layer is
    packed into the other buffer (a buffer is refilled only after its copy is done). Layers are
    packed by one `Placement` (its templates skip the per-expert work after a layout's first
    layer). `release()` frees them after loading."""

    def __init__(self, pin: bool, depth: int = 1):
        self.pin, self.depth = pin, depth
        self._buffers: dict[tuple, list[list]] = {}  # layout -> [[buffer, its copy's event or None], ...]
        self._turn: dict[tuple, int] = {}
        self.placement = Placement()

    def _key(self, experts: LayerExperts, extra: Sequence[ExpertWeights]) -> tuple:
        fmt = experts.format
        return kernel_for(fmt).name, experts.num_experts + len(extra), _layout(fmt, experts.experts[0])

    def _fill(self, experts: LayerExperts, extra: Sequence[ExpertWeights], key: tuple) -> list:
        """The next [buffer, event] of this layout (`key`; made on first use), its buffer holding
        expert s in slot s, then `extra`."""
        ring = self._buffers.setdefault(key, [])
        turn = self._turn[key] = (self._turn.get(key, -1) + 1) % self.depth
        if turn == len(ring):
            ring.append([SlotBuffer.allocate(experts.format, key[1], experts.experts[0], "cpu", pin=self.pin), None])
        entry = ring[turn]
        if entry[1] is not None:
            entry[1].synchronize()  # its last copy to the device has finished reading it
        self.placement.fill(entry[0], experts, extra)
        return entry

    def filled(self, experts: LayerExperts, extra: Sequence[ExpertWeights] = ()) -> SlotBuffer:
        """A buffer of this layout (made on first use) with expert s in slot s, then `extra`."""
        return self._fill(experts, extra, self._key(experts, extra))[0]

    def to_device(self, experts: LayerExperts, extra: Sequence[ExpertWeights], device) -> SlotBuffer:
        """The layer's slots on `device`; from page-locked buffers (CUDA) the copy is left running
        on the current stream, and the buffer is refilled only after it."""
        entry = self._fill(experts, extra, self._key(experts, extra))
        out = entry[0].to(device, non_blocking=self.pin)
        if self.pin:
            entry[1] = torch.cuda.Event()
            entry[1].record()
        return out

    def release(self) -> None:
        for ring in self._buffers.values():
            for _, done in ring:
                if done is not None:
                    done.synchronize()
        self._buffers.clear()
        self.placement = Placement()


def _layout(fmt, example: ExpertWeights) -> tuple:
    """The slot layout of one expert: each matrix's tensor shapes and dtypes and its meta (group sizes)."""
    kern = kernel_for(fmt)
    gate, up, down = example
    out = []
    for ws in ([gate, up], [down]):
        tensors, meta = kern.pack(ws)
        out.append((tuple((k, tuple(t.shape), t.dtype) for k, t in tensors.items()), tuple(sorted(meta.items()))))
    return tuple(out)
