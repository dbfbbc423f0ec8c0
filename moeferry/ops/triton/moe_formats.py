"""Per-format pieces of the fused MoE kernels: how one weight tile is read and multiplied.

Every format provides a `@triton.jit` *step* with one signature,

    acc = step(acc, a, w, s, z, slot, n0, k0, N, K, PART, BN, BK, G, GN, HAS_Z, DT, SWAP)

that adds `a [BM, BK] @ W[slot, n0:n0+BN, k0:k0+BK]^T` (dequantized inside the kernel) to
the fp32 accumulator `acc` ([BM, BN], or its transpose [BN, BM] with SWAP). The GEMM kernels in `moe_gemm.py` take the step as a
constexpr argument, so they hold no format switch. `MoEKernel` (one per device form of the
registry in `moeferry.checkpoint.formats`) couples the step with the code that stacks the
registry's `PackedWeight`s into slot tensors; a registry entry finds its kernel through
`QuantFormat.moe_kernel()` (`KERNELS[entry.device_form]`).

Slot layouts of one matrix `[N, K]` (rows = output features), leading dim = slot:

    dense       w bf16/fp16/fp32 [S, N, K]
    fp8_row     w e4m3 [S, N, K]; rs fp32 [S, N] (epilogue row scale)
    fp8_block   w e4m3 [S, N, K]; s fp32 [S, parts * ceil(PART/GN), ceil(K/G)]
                (gate_up stacks gate's and up's block scales: PART = I rows per part)
    fp4         w uint8 [S, N, K/2] (element 2j low nibble); s e4m3 [S, N, K/16];
                rs fp32 [S, N] (the global multiplier, per row since gate and up differ)
    int4        w uint8 [S, N, K/2] unsigned nibbles (same byte layout as fp4);
                s fp16/bf16 [S, N, K/G]; z uint8 [S, N, K/G] (absent: zero point 8)

Group-scaled formats (fp8_block, int4) need BK to divide the group G: the scale is then one
value per output column for the whole k-step and multiplies the dot product, not the tile.

Each `MoEKernel` also carries `dequant`, the CPU reference of its step: plain PyTorch that
turns slots back into dense [N, K] weights (`SlotMatrix.dense` / `dense_slots`), equal to
the registry's `PackedWeight.dequantize` of what was packed into the slot.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moeferry.checkpoint.formats.fp4 import E2M1_VALUES, unpack_nibbles

from .nibble_gemv import FP4_RANGE, INT4_RANGE, fp4_gemv, fp4_tile, fp4_tile_gemv, int4_gemv, int4_tile, int4_tile_gemv

# activation dtypes as the kernels name them (a dtype constexpr)
TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

# -- steps ----------------------------------------------------------------------------------
# SWAP (constexpr): the weight tile is the dot's first operand, acc is [BN, BM] and the tile
# is loaded [BN, BK] (k contiguous). That is the fast orientation for dequantizing steps
# (the tile is dequantized in registers as the MMA's A operand) and for few tokens (BM is
# the narrow side). Without SWAP, acc is [BM, BN] and the tile is loaded [BK, BN].
# Written flat (few nested jit calls): the interpreter pays per call.
@triton.jit
def _dot(w, a, acc, SWAP: tl.constexpr):
    if SWAP:
        return tl.dot(w, tl.trans(a), acc)
    else:
        return tl.dot(a, w, acc)


@triton.jit
def _tile_offs(n0, kk0, N, BN: tl.constexpr, BKK: tl.constexpr, SWAP: tl.constexpr):
    """(row offsets, col offsets, row mask) as broadcastable 2-D index tensors: rows are
    weight rows n, cols k (packed units of BKK); [BN, BKK] with SWAP, else [BKK, BN]."""
    offs_n = n0 + tl.arange(0, BN)
    offs_k = kk0 + tl.arange(0, BKK)
    if SWAP:
        return offs_n[:, None], offs_k[None, :], offs_n[:, None] < N
    else:
        return offs_n[None, :], offs_k[:, None], offs_n[None, :] < N


@triton.jit
def _vec(v, SWAP: tl.constexpr):
    """A per-row [BN] vector broadcast along the k / token side of the tile or acc."""
    if SWAP:
        return v[:, None]
    else:
        return v[None, :]


@triton.jit
def dense_step(acc, a, w_ptr, s_ptr, z_ptr, slot, n0, k0, N, K, PART,
               BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, GN: tl.constexpr,
               HAS_Z: tl.constexpr, DT: tl.constexpr, SWAP: tl.constexpr):
    rn, rk, mn = _tile_offs(n0, k0, N, BN, BK, SWAP)
    b = tl.load(w_ptr + slot * N * K + rn * K + rk, mask=mn & (rk < K), other=0.0)
    return _dot(b.to(DT), a, acc, SWAP)


@triton.jit
def fp8_row_step(acc, a, w_ptr, s_ptr, z_ptr, slot, n0, k0, N, K, PART,
                 BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, GN: tl.constexpr,
                 HAS_Z: tl.constexpr, DT: tl.constexpr, SWAP: tl.constexpr):
    rn, rk, mn = _tile_offs(n0, k0, N, BN, BK, SWAP)
    # uint8 + bitcast: a masked fp8 load with `other=` does not work everywhere
    q = tl.load(w_ptr + slot * N * K + rn * K + rk, mask=mn & (rk < K), other=0)
    return _dot(q.to(tl.float8e4nv, bitcast=True).to(DT), a, acc, SWAP)


@triton.jit
def fp8_block_step(acc, a, w_ptr, s_ptr, z_ptr, slot, n0, k0, N, K, PART,
                   BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, GN: tl.constexpr,
                   HAS_Z: tl.constexpr, DT: tl.constexpr, SWAP: tl.constexpr):
    rn, rk, mn = _tile_offs(n0, k0, N, BN, BK, SWAP)
    q = tl.load(w_ptr + slot * N * K + rn * K + rk, mask=mn & (rk < K), other=0)
    b = q.to(tl.float8e4nv, bitcast=True).to(DT)
    offs_n = n0 + tl.arange(0, BN)
    nbk = tl.cdiv(K, G)
    nbr = tl.cdiv(PART, GN)
    brow = (offs_n // PART) * nbr + (offs_n % PART) // GN
    sc = tl.load(s_ptr + slot * (N // PART) * nbr * nbk + brow * nbk + k0 // G, mask=offs_n < N, other=0.0)
    return acc + _dot(b, a, tl.zeros(acc.shape, tl.float32), SWAP) * _vec(sc, SWAP)


@triton.jit
def fp4_step(acc, a, w_ptr, s_ptr, z_ptr, slot, n0, k0, N, K, PART,
             BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, GN: tl.constexpr,
             HAS_Z: tl.constexpr, DT: tl.constexpr, SWAP: tl.constexpr):
    # BK/2 bytes of a row: low nibble = even k, high = odd k
    kp = K // 2
    rn, rk, mn = _tile_offs(n0, k0 // 2, N, BN, BK // 2, SWAP)
    p = tl.load(w_ptr + slot * N * kp + rn * kp + rk, mask=mn, other=0)
    ks = K // 16
    rn, rk, mn = _tile_offs(n0, k0 // 16, N, BN, BK // 16, SWAP)
    sc = tl.load(s_ptr + slot * N * ks + rn * ks + rk, mask=mn, other=0)
    # e4m3 scale x 2**14 (the E2M1 decode below yields value / 2**14); one per 8 bytes of a row
    sc = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0
    if SWAP:
        sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BN, BK // 16, 8)), (BN, BK // 2))
    else:
        sc = tl.reshape(tl.broadcast_to(sc[:, None, :], (BK // 16, 8, BN)), (BK // 2, BN))
    # E2M1 -> fp16 bits: sign to bit 15, the 3 magnitude bits to bits 9-11 (= value / 2**14)
    v = p.to(tl.uint16)
    lo = (((v & 8) << 12) | ((v & 7) << 9)).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (((v & 128) << 8) | ((v & 112) << 5)).to(tl.float16, bitcast=True).to(tl.float32)
    a_even, a_odd = tl.split(tl.reshape(a, (a.shape[0], BK // 2, 2)))
    acc = _dot((lo * sc).to(DT), a_even, acc, SWAP)  # e2m1 x e4m3 is exact in bf16
    return _dot((hi * sc).to(DT), a_odd, acc, SWAP)


@triton.jit
def int4_step(acc, a, w_ptr, s_ptr, z_ptr, slot, n0, k0, N, K, PART,
              BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, GN: tl.constexpr,
              HAS_Z: tl.constexpr, DT: tl.constexpr, SWAP: tl.constexpr):
    kp = K // 2
    rn, rk, mn = _tile_offs(n0, k0 // 2, N, BN, BK // 2, SWAP)
    p = tl.load(w_ptr + slot * N * kp + rn * kp + rk, mask=mn, other=0)
    offs_n = n0 + tl.arange(0, BN)
    ng = tl.cdiv(K, G)
    goff = slot * N * ng + offs_n * ng + k0 // G
    sc = tl.load(s_ptr + goff, mask=offs_n < N, other=0.0).to(tl.float32)
    if HAS_Z:
        zp = tl.load(z_ptr + goff, mask=offs_n < N, other=8).to(tl.float32)
    else:
        zp = tl.full((BN,), 8.0, tl.float32)
    lo = ((p & 0xF).to(tl.float32) - _vec(zp, SWAP)).to(DT)  # small integers: exact
    hi = ((p >> 4).to(tl.float32) - _vec(zp, SWAP)).to(DT)
    a_even, a_odd = tl.split(tl.reshape(a, (a.shape[0], BK // 2, 2)))
    part = _dot(hi, a_odd, _dot(lo, a_even, tl.zeros(acc.shape, tl.float32), SWAP), SWAP)
    return acc + part * _vec(sc, SWAP)


# -- decode GEMV steps ----------------------------------------------------------------------
# For one token row (decode, `moe_decode.py`) every format also has a GEMV step,
#
#     acc = gemv(acc, x_ptr, w, s, z, slot, n0, k0, N, K, PART, BN, BK, G, GN, GB, HAS_Z)
#
# that adds `W[slot, n0:n0+BN, k0:k0+BK] @ x[k0:k0+BK]` to the fp32 vector acc [BN] on the
# CUDA cores (no tl.dot): the tile stays in the layout it was loaded in ([BN, BK], k
# contiguous), is decoded in registers and reduced along K with `tl.sum`. x_ptr points at the
# token's row (absolute k offsets). Scales are applied once per group to the group's partial
# sum (GB = min(G, BK) values per partial sum), not per weight; int4's zero point too
# (sum (q - z) x = sum q x - z sum x). Rows n >= N are masked (the decode kernels skip a
# non-resident pair by passing n0 >= N). Row scales (fp8_row, fp4) stay in the kernel's epilogue.
# The forms whose step reads x as packed halves (fp4, int4) also have it in two (`MoEKernel.tile`,
# `tile_gemv`: a tile's loads, then its product with x), for a kernel that asks for several tiles'
# weights before it reads any x (moe_decode's `down_preload`).
@triton.jit
def _gemv_rows(n0, N, BN: tl.constexpr):
    offs_n = n0 + tl.arange(0, BN)
    return offs_n, offs_n < N


@triton.jit
def dense_gemv(acc, x_ptr, w_ptr, s_ptr, z_ptr, slot, n0, k0, N, K, PART,
               BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, GN: tl.constexpr, GB: tl.constexpr,
               HAS_Z: tl.constexpr):
    offs_n, mn = _gemv_rows(n0, N, BN)
    offs_k = k0 + tl.arange(0, BK)
    mk = offs_k < K
    w = tl.load(w_ptr + slot * N * K + offs_n[:, None] * K + offs_k[None, :], mask=mn[:, None] & mk[None, :],
                other=0.0).to(tl.float32)
    x = tl.load(x_ptr + offs_k, mask=mk, other=0.0).to(tl.float32)
    return acc + tl.sum(w * x[None, :], axis=1)


@triton.jit
def _fp8_tile(w_ptr, slot, offs_n, mn, offs_k, mk, N, K):
    q = tl.load(w_ptr + slot * N * K + offs_n[:, None] * K + offs_k[None, :], mask=mn[:, None] & mk[None, :],
                other=0)
    return q.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _fp8_rows(x_ptr, w_ptr, slot, n0, k0, N, K, BN: tl.constexpr, BK: tl.constexpr):
    """(fp8 weight tile [BN, BK] in fp32, x [BK] in fp32, its row offsets, their mask)."""
    offs_n, mn = _gemv_rows(n0, N, BN)
    offs_k = k0 + tl.arange(0, BK)
    mk = offs_k < K
    w = _fp8_tile(w_ptr, slot, offs_n, mn, offs_k, mk, N, K)
    return w, tl.load(x_ptr + offs_k, mask=mk, other=0.0).to(tl.float32), offs_n, mn


@triton.jit
def fp8_row_gemv(acc, x_ptr, w_ptr, s_ptr, z_ptr, slot, n0, k0, N, K, PART,
                 BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, GN: tl.constexpr, GB: tl.constexpr,
                 HAS_Z: tl.constexpr):
    w, x, offs_n, mn = _fp8_rows(x_ptr, w_ptr, slot, n0, k0, N, K, BN, BK)
    return acc + tl.sum(w * x[None, :], axis=1)


@triton.jit
def fp8_block_gemv(acc, x_ptr, w_ptr, s_ptr, z_ptr, slot, n0, k0, N, K, PART,
                   BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, GN: tl.constexpr, GB: tl.constexpr,
                   HAS_Z: tl.constexpr):
    w, x, offs_n, mn = _fp8_rows(x_ptr, w_ptr, slot, n0, k0, N, K, BN, BK)
    part = tl.sum(tl.reshape(w * x[None, :], (BN, BK // GB, GB)), axis=2)  # [BN, groups in the tile]
    nbk = tl.cdiv(K, G)
    nbr = tl.cdiv(PART, GN)
    brow = (offs_n // PART) * nbr + (offs_n % PART) // GN
    offs_g = (k0 + tl.arange(0, BK // GB) * GB) // G
    sc = tl.load(s_ptr + slot * (N // PART) * nbr * nbk + brow[:, None] * nbk + offs_g[None, :],
                 mask=mn[:, None] & (offs_g < nbk)[None, :], other=0.0)
    return acc + tl.sum(part * sc, axis=1)


# fp4_gemv and int4_gemv work on packed fp16x2 halves: nibble_gemv.py.


def copy_part(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


# -- slot tensors ---------------------------------------------------------------------------
@dataclass
class SlotMatrix:
    """One weight matrix [N, K] for S slots, in a kernel's slot layout (see module doc)."""

    kernel: "MoEKernel"
    n: int
    k: int
    part: int                      # rows per part (gate_up: I; down: N)
    w: torch.Tensor
    s: torch.Tensor | None = None
    z: torch.Tensor | None = None
    rs: torch.Tensor | None = None
    group: int = 1 << 30           # k-group of s (fp8_block: block cols, int4: group size)
    group_n: int = 1               # fp8_block: block rows

    @property
    def num_slots(self) -> int:
        return self.w.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in (("w", self.w), ("s", self.s), ("z", self.z), ("rs", self.rs)) if v is not None}

    @property
    def bytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors().values())

    def copy_slots(self, dst: list[int], src: "SlotMatrix", src_slots: list[int]) -> int:
        """Copy slots `src_slots` of `src` (same layout, e.g. a pinned host bank) into slots `dst`
        of this matrix, asynchronously on the current stream; returns the bytes copied."""
        moved = 0
        for name, t in self.tensors().items():
            s = getattr(src, name)
            for d, j in zip(dst, src_slots):
                t[d].copy_(s[j], non_blocking=True)
            moved += t[0].numel() * t.element_size() * len(dst)
        return moved

    def word_views(self) -> list[torch.Tensor] | None:
        """Each slot tensor as [slots, words] int32 (`slot_gather.word_view`), made once; None
        when some tensor's slot is not whole words."""
        if not hasattr(self, "_words"):
            from moeferry.ops.triton.slot_gather import word_view
            views = [word_view(t) for t in self.tensors().values()]
            self._words = None if any(v is None for v in views) else views
        return self._words

    def write(self, slot: int, parts: dict[str, torch.Tensor]) -> None:
        """Copy one expert's tensors (as made by `MoEKernel.pack`) into `slot`."""
        for name, t in parts.items():
            getattr(self, name)[slot].copy_(t, non_blocking=True)

    def write_weights(self, slot: int, weights: list, copy=copy_part) -> None:
        """Pack one expert's PackedWeights (stacked by rows, as `MoEKernel.pack`) straight into
        `slot`: one `copy(dst, src)` a part, from the source (e.g. a memory-mapped checkpoint) into place."""
        self.kernel.pack(weights, {name: t[slot] for name, t in self.tensors().items()}, copy)

    def read(self, slot: int) -> dict[str, torch.Tensor]:
        """A copy of one slot's tensors, in `MoEKernel.pack`'s form (the inverse of `write`)."""
        return {name: t[slot].clone() for name, t in self.tensors().items()}

    def dense_slots(self, slots, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Slots `slots` (ints or an index tensor) dequantized to [len(slots), N, K] in `dtype`,
        by the kernel's CPU reference (`MoEKernel.dequant`)."""
        if self.kernel.dequant is None:
            raise ValueError(f"MoE kernel {self.kernel.name} has no CPU reference dequantizer")
        idx = torch.as_tensor(slots, dtype=torch.long, device=self.w.device).reshape(-1)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_slots):
            raise IndexError(f"slots {idx.tolist()} out of range for {self.num_slots} slots")
        return self.kernel.dequant(self, idx, dtype)

    def dense(self, slot: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """One slot's matrix dequantized to [N, K] in `dtype` (see `dense_slots`)."""
        return self.dense_slots([slot], dtype)[0]

    def kernel_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w, s, z, rs) as the kernels take them (fp8 as uint8; absent ones: any tensor)."""
        def arg(t):
            if t is None:
                return self.w
            return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
        return arg(self.w), arg(self.s), arg(self.z), arg(self.rs)


@dataclass(frozen=True)
class MoEKernel:
    """The kernel side of one device form: its step and how to build its slot tensors."""

    name: str
    step: Any                       # a @triton.jit step (see module doc)
    # (weights, out=None) -> (slot tensors, meta); `out`: one slot's tensors to write into
    pack: Callable[..., tuple[dict[str, torch.Tensor], dict[str, int]]]
    has_row_scale: bool = False
    group_scaled: bool = False      # BK must divide the group
    packed_k: bool = False          # k packed two per byte: K % BK == 0 required
    max_bk: int = 256               # larger k-steps spill registers in the dequantizing steps
    gemv: Any = None                # the decode GEMV step (see "decode GEMV steps")
    x_range: float = 0.0            # > 0: the GEMV step also reads x as packed halves (nibble_gemv.pack_units)
    tile: Any = None                # (x_range forms) the GEMV step in two: a tile's loads, then
    tile_gemv: Any = None           # its product with packed x (nibble_gemv, "split in two")
    meta: Mapping[str, Any] = field(default_factory=dict)
    # the CPU reference of `step`: (matrix, slot index tensor, dtype) -> dense [len, N, K]
    dequant: Callable[[SlotMatrix, torch.Tensor, torch.dtype], torch.Tensor] | None = None

    def __repr__(self) -> str:
        return f"<MoEKernel {self.name}>"

    def fit_bk(self, bk: int, group: int, k: int) -> int:
        """Shrink a k-step to what the form allows: at most `max_bk`, a divisor of the scale
        group (group-scaled forms), of K (nibble-packed forms)."""
        bk = min(bk, self.max_bk)
        if self.group_scaled:
            while bk > 16 and (bk > group or group % bk):
                bk //= 2
        if self.packed_k:
            while bk > 32 and k % bk:
                bk //= 2
        return bk

    def slot_matrix(self, per_slot: list[list], part: int | None = None) -> SlotMatrix:
        """Stack slots; `per_slot[s]` = the PackedWeights stacked by rows into that slot's
        matrix (gate_up: [gate, up]; down: [down])."""
        packs = [self.pack(ws) for ws in per_slot]
        tensors, meta = packs[0]
        stacked = {k: torch.stack([p[0][k] for p in packs]) for k in tensors}
        n = sum(w.out_features for w in per_slot[0])
        k = per_slot[0][0].in_features
        return SlotMatrix(self, n, k, part or n, **stacked, **meta)

    def empty_matrix(self, num_slots: int, example: list, device, part: int | None = None,
                     pin: bool = False) -> SlotMatrix:
        """An uninitialised matrix of `num_slots` slots shaped like `example` (one slot's weights);
        `pin`: in page-locked host memory (host expert banks that the device copies from)."""
        tensors, meta = self.pack(example)
        n = sum(w.out_features for w in example)
        stacked = {k: torch.empty((num_slots, *t.shape), dtype=t.dtype, device=device, pin_memory=pin)
                   for k, t in tensors.items()}
        return SlotMatrix(self, n, example[0].in_features, part or n, **stacked, **meta)


# `_pack_<form>(ws, out=None, copy=copy_part)`: one slot's tensors from the PackedWeights stacked by
# rows into it; with `out` (that slot's tensors, e.g. a view of a bank) each part goes straight
# into place by `copy(dst, src)` (a copy now, or recorded: `moe.placement`).
def _rows(parts: list[torch.Tensor], out: torch.Tensor | None, copy=copy_part) -> torch.Tensor:
    if out is None:
        return torch.cat(parts, dim=0)
    row = 0
    for p in parts:
        copy(out[row:row + p.shape[0]], p)
        row += p.shape[0]
    return out


def _cat(ws, attr, out=None, copy=copy_part):
    return _rows([getattr(w, attr) for w in ws], out, copy)


def _row_scale(ws, attr, out=None, copy=copy_part):
    return _rows([getattr(w, attr).float().reshape(-1).expand(w.out_features) for w in ws], out, copy)


def _slot(out, key):
    return None if out is None else out[key]


def _pack_dense(ws, out=None, copy=copy_part):
    return {"w": _cat(ws, "weight", _slot(out, "w"), copy)}, {}


def _pack_fp8_row(ws, out=None, copy=copy_part):
    return ({"w": _cat(ws, "weight", _slot(out, "w"), copy), "rs": _row_scale(ws, "scale", _slot(out, "rs"), copy)},
            {})


def _pack_fp8_block(ws, out=None, copy=copy_part):
    b0, b1 = ws[0].block_size
    if any(tuple(w.block_size) != (b0, b1) for w in ws):
        raise ValueError("fp8_block: gate and up use different block sizes")
    return ({"w": _cat(ws, "weight", _slot(out, "w"), copy),
             "s": _cat(ws, "scale_inv", _slot(out, "s"), copy).float()}, {"group": b1, "group_n": b0})


def _pack_fp4(ws, out=None, copy=copy_part):
    return ({"w": _cat(ws, "packed", _slot(out, "w"), copy), "s": _cat(ws, "scale", _slot(out, "s"), copy),
             "rs": _row_scale(ws, "global_scale", _slot(out, "rs"), copy)}, {"group": 16})


def _pack_int4(ws, out=None, copy=copy_part):
    g = ws[0].group_size
    if any(w.group_size != g for w in ws) or len({w.zeros is None for w in ws}) > 1:
        raise ValueError("int4: gate and up use different group sizes or zero-point modes")
    t = {"w": _cat(ws, "packed", _slot(out, "w"), copy), "s": _cat(ws, "scales", _slot(out, "s"), copy)}
    if ws[0].zeros is not None:
        t["z"] = _cat(ws, "zeros", _slot(out, "z"), copy)
    return t, {"group": g}


# -- CPU references of the steps ------------------------------------------------------------
# `<form>_dequant(m, slots, dtype)` -> [len(slots), N, K]: the weights the matching step
# reconstructs tile by tile inside the kernel (row scales included), as whole-tensor PyTorch
# ops over the slot layout. They are the kernels' CPU references: experts on a CPU "device"
# and the `cpu` MoE backend are computed from slot form with them. The arithmetic is fp32
# in the order of the registry's `PackedWeight.dequantize` (so equal to it), then cast.
def _e4m3(t: torch.Tensor) -> torch.Tensor:
    """fp8 held as float8_e4m3fn or as its raw uint8 bytes, as float8_e4m3fn."""
    return t.view(torch.float8_e4m3fn) if t.dtype == torch.uint8 else t


def _grouped(v: torch.Tensor, g: int) -> torch.Tensor:
    """[..., K] -> [..., ceil(K/g), g] (a view when g divides K, else zero-padded)."""
    pad = -v.shape[-1] % g
    return F.pad(v, (0, pad)).unflatten(-1, (-1, g)) if pad else v.unflatten(-1, (-1, g))


def _ungrouped(v: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of `_grouped`: [..., ceil(K/g), g] -> [..., K]."""
    return v.flatten(-2)[..., :k]


# E2M1 value of both nibbles of every byte: _E2M1_PAIRS[b] = (value(b & 15), value(b >> 4))
_E2M1_PAIRS = E2M1_VALUES[unpack_nibbles(torch.arange(256, dtype=torch.uint8)).long()].view(256, 2)


def dense_dequant(m: SlotMatrix, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return m.w[slots].to(dtype)


def fp8_row_dequant(m: SlotMatrix, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (_e4m3(m.w[slots]).float() * m.rs[slots].float()[..., None]).to(dtype)


def _block_rows(m: SlotMatrix) -> torch.Tensor:
    """[N] row of `s` holding each weight row's block scales: parts stacked, ceil(PART/GN) rows each."""
    n = torch.arange(m.n, device=m.s.device)
    return (n // m.part) * -(-m.part // m.group_n) + (n % m.part) // m.group_n


def fp8_block_dequant(m: SlotMatrix, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    w = _e4m3(m.w[slots]).float()
    s = m.s[slots][:, _block_rows(m)].float()  # [L, N, ceil(K/G)]
    return _ungrouped(_grouped(w, m.group) * s[..., None], m.k).to(dtype)


def fp4_dequant(m: SlotMatrix, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    p = m.w[slots]
    pairs = torch.index_select(_E2M1_PAIRS.to(p.device), 0, p.reshape(-1).int())
    v = pairs.view(*p.shape[:-1], 2 * p.shape[-1])  # [L, N, K] (explicit K: L may be 0)
    s = _e4m3(m.s[slots]).float() * m.rs[slots].float()[..., None]  # [L, N, K/16]
    return _ungrouped(_grouped(v, m.group) * s[..., None], m.k).to(dtype)


def int4_dequant(m: SlotMatrix, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    u = _grouped(unpack_nibbles(m.w[slots]).float(), m.group)  # [L, N, ceil(K/G), G]
    z = m.z[slots].float()[..., None] if m.z is not None else 8.0
    s = m.s[slots].float()[..., None]
    return _ungrouped((u - z) * s, m.k).to(dtype)


DENSE = MoEKernel("dense", dense_step, _pack_dense, gemv=dense_gemv, dequant=dense_dequant)
FP8_ROW = MoEKernel("fp8_row", fp8_row_step, _pack_fp8_row, has_row_scale=True, gemv=fp8_row_gemv,
                    dequant=fp8_row_dequant)
FP8_BLOCK = MoEKernel("fp8_block", fp8_block_step, _pack_fp8_block, group_scaled=True, max_bk=128,
                      gemv=fp8_block_gemv, dequant=fp8_block_dequant)
FP4 = MoEKernel("fp4", fp4_step, _pack_fp4, has_row_scale=True, packed_k=True, max_bk=128, gemv=fp4_gemv,
                x_range=FP4_RANGE.value, tile=fp4_tile, tile_gemv=fp4_tile_gemv, dequant=fp4_dequant)
INT4 = MoEKernel("int4", int4_step, _pack_int4, group_scaled=True, packed_k=True, max_bk=128, gemv=int4_gemv,
                 x_range=INT4_RANGE.value, tile=int4_tile, tile_gemv=int4_tile_gemv, dequant=int4_dequant)

# device form (`QuantFormat.device_form`) -> its kernel
KERNELS: dict[str, MoEKernel] = {k.name: k for k in (DENSE, FP8_ROW, FP8_BLOCK, FP4, INT4)}
