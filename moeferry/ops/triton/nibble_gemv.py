"""Decode GEMV steps of the 4-bit slot forms (fp4, int4) on packed halves.

A 4-bit GEMV at T = 1 is bound by instructions, not bytes: decoding each nibble to fp32 and
multiplying it there took ~15 instructions a packed byte. These steps read a row's packed bytes
as 32-bit words (8 nibbles, k in order: nibble i of a word is k = 8w + i) and work on two
values at once in fp16x2 registers:

- a nibble pair (i, i + 4) of a word becomes one fp16x2 register by a shift and a mask (both
  lanes move alike: nibble i sits at bit 4i of the low half, i + 4 at 4i of the high half);
- fp4 (E2M1): the 3 magnitude bits go to fp16 bits 9-11 (value / 2**14, exact, 0.5 a subnormal)
  and the sign bit flips the sign of x's lane instead (one LOP3 on x);
- int4: no shift within a byte: a low nibble or'd into 0x6400 is fp16 1024 + q, minus 1032 is
  q - 8; a high nibble or'd there is 1024 + 16 q, times 1/16 minus 72 is q - 8 (both exact); one
  shift by 8 brings a word's other two pairs down. The zero point's difference from 8 is taken
  off per group in fp32 (sum (q - z) x = sum (q - 8) x - (z - 8) sum x);
- one fma.rn.f16x2 multiplies and adds two products; 16 values (one fp4 scale group) are summed
  in fp16 (the two lanes' 8-term sums added there too) and leave as one fp32; x's scale c is
  undone once per row sum, not per unit.

x is scaled into fp16's range per k-step first (times c = RANGE / max |x|, undone in fp32), so
no product or 16-term sum overflows and small values keep their precision; the products of a
decoded weight (2-4 significant bits) and x are exact, only the 8-term sums round (2**-11).

`gemv(acc, x_ptr, w, s, z, slot, n0, k0, N, K, PART, BN, BK, G, GN, GB, HAS_Z)` is the GEMV
step contract of moe_formats.py ("decode GEMV steps"). Under Triton's interpreter (no inline
assembly) the 16-value unit runs as plain integer and fp32 operations on the same words and x.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import interpreting
from .grid_dependency import wait_for_primary

_ASM: tl.constexpr = tl.constexpr(not interpreting())

FP4_RANGE: tl.constexpr = tl.constexpr(16384.0)  # |x'| <= 2**14: products <= 6, 16-term sums <= 96
INT4_RANGE: tl.constexpr = tl.constexpr(256.0)   # |x'| <= 2**8: products <= 2048, sums <= 32768


def _unit_asm(word, consts: dict[str, int]) -> str:
    """PTX of one 16-value unit: words $1, $2; x pairs $3-$10 (fp16x2); fp32 sum to $0.
    `word(w, xs)` gives the lines adding word w's four nibble pairs times x operands xs into a;
    `consts` the constant registers those lines read (name: 32-bit value)."""
    regs = "".join(f", {name}" for name in consts)
    lines = ["{", f".reg .b32 m, t, a{regs};", ".reg .b16 l, h;", "mov.b32 a, 0;"]
    lines += [f"mov.b32 {name}, 0x{value:08X};" for name, value in consts.items()]
    for w in (1, 2):
        lines += word(f"${w}", [f"${2 + 4 * (w - 1) + j + 1}" for j in range(4)])
    lines += ["mov.b32 {l, h}, a;", "add.rn.f16 l, l, h;", "cvt.f32.f16 $0, l;", "}"]
    return "\n".join(lines)


def _fp4_word(w: str, xs: list[str]) -> list[str]:
    """Pair j: the magnitudes (bits 4j..4j+2 of each half) to bits 9-11, the sign bits (4j + 3) to
    x's bit 15 (xor), one fma."""
    lines = []
    for j, x in enumerate(xs):
        mshift = f"shl.b32 m, {w}, {9 - 4 * j};" if j < 3 else f"shr.b32 m, {w}, 3;"
        sshift = f"shl.b32 t, {w}, {12 - 4 * j};" if j < 3 else f"mov.b32 t, {w};"
        lines.append(f"{mshift} and.b32 m, m, 0x0E000E00; {sshift} and.b32 t, t, 0x80008000; "
                     f"xor.b32 t, t, {x}; fma.rn.f16x2 a, m, t, a;")
    return lines


def _int4_word(w: str, xs: list[str]) -> list[str]:
    """Pairs 0, 1 from the word, 2, 3 from it shifted right by 8; no shift within a byte: the low
    nibble or'd into 0x6400 is fp16 1024 + q (minus 1032 (c): q - 8), the high one 1024 + 16 q
    (times 1/16 (s) plus -72 (b): q - 8), both exact."""
    lines = []
    for j, x in enumerate(xs):
        src = w if j < 2 else "t"
        if j == 2:
            lines.append(f"shr.b32 t, {w}, 8;")
        if j % 2 == 0:
            lines.append(f"lop3.b32 m, {src}, 0x000F000F, k, 0xEA; sub.rn.f16x2 m, m, c;")
        else:
            lines.append(f"lop3.b32 m, {src}, 0x00F000F0, k, 0xEA; fma.rn.f16x2 m, m, s, b;")
        lines.append(f"fma.rn.f16x2 a, m, {x}, a;")
    return lines


_INT4_CONSTS = {"c": 0x64086408, "k": 0x64006400, "s": 0x2C002C00, "b": 0xD480D480}  # 1032, 0x6400, 1/16, -72
_FP4_UNIT: tl.constexpr = tl.constexpr(_unit_asm(_fp4_word, {}))
_INT4_UNIT: tl.constexpr = tl.constexpr(_unit_asm(_int4_word, _INT4_CONSTS))
_UNIT_CONSTRAINTS: tl.constexpr = tl.constexpr("=r" + ",r" * 10)


@triton.jit
def _pack_half2(lo, hi):
    """fp32 pair -> one int32 holding (lo, hi) as fp16x2 (lo in the low half)."""
    lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi16 = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return lo16 | (hi16 << 16)


@triton.jit
def _half(bits, shift: tl.constexpr):
    """The fp16 at bit `shift` (0 or 16) of int32 words, as fp32 (the interpreter's unit)."""
    return ((bits >> shift) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _unit_words(xc, U: tl.constexpr):
    """U 16-value units of scaled fp32 x as [U, 8] int32: operand (word a, pair j), column 4a + j,
    holds k = 16u + 8a + j (low half) and k + 4 (high half)."""
    x4 = tl.permute(tl.reshape(xc, (U, 2, 2, 4)), (0, 1, 3, 2))          # [unit, word, j, half]
    lo, hi = tl.split(x4)
    return tl.reshape(_pack_half2(lo, hi), (U, 8))


@triton.jit
def _x_pairs(xc, BK: tl.constexpr):
    """x (scaled, fp32 [BK]) as the 8 fp16x2 operands of each 16-value unit, each [BK/16] int32."""
    return _operands(_unit_words(xc, BK // 16), BK)


@triton.jit
def _operands(p, BK: tl.constexpr):
    """int32 [BK/16, 8] (unit, 4 * word + j) -> its 8 columns in that order, each [BK/16]."""
    p = tl.reshape(p, (BK // 16, 2, 2, 2))                              # [unit, word, j // 2, j % 2]
    j_even, j_odd = tl.split(p)
    j0, j2 = tl.split(j_even)
    j1, j3 = tl.split(j_odd)
    a00, a10 = tl.split(j0)
    a01, a11 = tl.split(j1)
    a02, a12 = tl.split(j2)
    a03, a13 = tl.split(j3)
    return a00, a01, a02, a03, a10, a11, a12, a13


@triton.jit
def _words(w_ptr, slot, offs_n, mn, k0, N, K, BK: tl.constexpr):
    """The tile's packed bytes as words: (even, odd) word of each 16-value unit, [BN, BK/16] int32."""
    kw = K // 8
    offs_w = k0 // 8 + tl.arange(0, BK // 8)
    wp = w_ptr.to(tl.pointer_type(tl.int32))
    w = tl.load(wp + slot * N * kw + offs_n[:, None] * kw + offs_w[None, :],
                mask=mn[:, None] & (offs_w < kw)[None, :], other=0)
    return tl.split(tl.reshape(w, (offs_n.shape[0], BK // 16, 2)))


@triton.jit
def _e2m1(q):
    """E2M1 nibbles (0..15, any int type) as fp32 value / 2**14, exact: the sign to fp16 bit 15,
    the 3 magnitude bits to bits 9-11."""
    q = q.to(tl.uint16)
    return (((q & 8) << 12) | ((q & 7) << 9)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _word_emulated(acc, w, x0, x1, x2, x3, FP4: tl.constexpr):
    for j in tl.static_range(4):
        xp = x0 if j == 0 else (x1 if j == 1 else (x2 if j == 2 else x3))
        for half in tl.static_range(2):
            q = (w >> (4 * j + 16 * half)) & 0xF
            if FP4:
                v = _e2m1(q)
            else:
                v = (q - 8).to(tl.float32)
            acc += v * _half(xp, 16 * half)
    return acc


@triton.jit
def _unit_emulated(w0, w1, x00, x01, x02, x03, x10, x11, x12, x13, FP4: tl.constexpr):
    """The 16-value unit in plain operations (fp32 sums; fp4 values / 2**14, int4 q - 8)."""
    acc = _word_emulated(tl.zeros(w0.shape, tl.float32), w0, x00, x01, x02, x03, FP4)
    return _word_emulated(acc, w1, x10, x11, x12, x13, FP4)


@triton.jit
def _units(w0, w1, xs, FP4: tl.constexpr):
    """[BN, BK/16] fp32 sums of every 16-value unit of the tile times x."""
    x00, x01, x02, x03, x10, x11, x12, x13 = xs
    if _ASM:
        args = [w0, w1, x00[None, :], x01[None, :], x02[None, :], x03[None, :],
                x10[None, :], x11[None, :], x12[None, :], x13[None, :]]
        if FP4:
            return tl.inline_asm_elementwise(_FP4_UNIT, _UNIT_CONSTRAINTS, args, dtype=tl.float32, is_pure=True,
                                             pack=1)
        else:
            return tl.inline_asm_elementwise(_INT4_UNIT, _UNIT_CONSTRAINTS, args, dtype=tl.float32, is_pure=True,
                                             pack=1)
    else:
        return _unit_emulated(w0, w1, x00[None, :], x01[None, :], x02[None, :], x03[None, :],
                              x10[None, :], x11[None, :], x12[None, :], x13[None, :], FP4)


@triton.jit
def _byte_units(x_ptr, w_ptr, slot, offs_n, mn, k0, N, K, FP4: tl.constexpr, BK: tl.constexpr):
    """fp32 activations: each byte's two nibbles decoded to fp32 and summed per 16 values there."""
    kp = K // 2
    offs_b = k0 // 2 + tl.arange(0, BK // 2)
    mb = offs_b < kp
    p = tl.load(w_ptr + slot * N * kp + offs_n[:, None] * kp + offs_b[None, :], mask=mn[:, None] & mb[None, :],
                other=0)
    xe = tl.load(x_ptr + 2 * offs_b, mask=mb, other=0.0).to(tl.float32)
    xo = tl.load(x_ptr + 2 * offs_b + 1, mask=mb, other=0.0).to(tl.float32)
    if FP4:
        lo = _e2m1(p & 0xF)
        hi = _e2m1(p >> 4)
    else:
        lo = (p & 0xF).to(tl.float32) - 8.0
        hi = (p >> 4).to(tl.float32) - 8.0
    return tl.sum(tl.reshape(lo * xe[None, :] + hi * xo[None, :], (offs_n.shape[0], BK // 16, 8)), axis=2)


@triton.jit
def _unit_sums(xv, BK: tl.constexpr):
    return tl.sum(tl.reshape(xv, (BK // 16, 16)), axis=1)


@triton.jit
def _packed_x(x_ptr, k0, K, BK: tl.constexpr):
    """A row stored by `pack_units`: (the 8 operands of each unit, 1 / c, sum of x), each [BK/16].
    The row is the launch before's output: a programmatic dependent launch (moe_decode's
    `down_pdl`) waits for it here, after the caller has asked for its weight words."""
    wait_for_primary()
    offs_u = k0 // 16 + tl.arange(0, BK // 16)
    mu = offs_u < K // 16
    pairs = tl.load(x_ptr + offs_u[:, None] * 8 + tl.arange(0, 8)[None, :], mask=mu[:, None], other=0)
    tail = x_ptr.to(tl.pointer_type(tl.float32)) + K // 2
    inv_c = tl.load(tail + offs_u, mask=mu, other=0.0)
    sums = tl.load(tail + K // 16 + offs_u, mask=mu, other=0.0)
    return _operands(pairs, BK), inv_c, sums


@triton.jit
def _nibble_units(x_ptr, w_ptr, slot, offs_n, mn, k0, N, K, RANGE: tl.constexpr, FP4: tl.constexpr,
                  BK: tl.constexpr):
    """(sum of v x over each 16 values [BN, BK/16] fp32 times c, sum of x over each 16 [BK/16],
    1 / c): v the fp4 value / 2**14 or the int4 q - 8. 16-bit x runs the packed-half units (x
    times c = RANGE / max |x| in fp16; the caller undoes c once a row is summed); x as int32 is
    a row `pack_units` stored (per-unit c, undone here: c = 1); fp32 x the exact byte decode (c = 1).
    The weights are asked for before x is prepared."""
    if x_ptr.dtype.element_ty == tl.int32:
        w0, w1 = _words(w_ptr, slot, offs_n, mn, k0, N, K, BK)
        part, sums = _packed_units(w0, w1, x_ptr, k0, K, FP4, BK)
        return part, sums, 1.0
    else:
        offs = k0 + tl.arange(0, BK)
        xv = tl.load(x_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)
        if x_ptr.dtype.element_ty == tl.float32:
            return _byte_units(x_ptr, w_ptr, slot, offs_n, mn, k0, N, K, FP4, BK), _unit_sums(xv, BK), 1.0
        else:
            w0, w1 = _words(w_ptr, slot, offs_n, mn, k0, N, K, BK)
            c = RANGE / tl.maximum(tl.max(tl.abs(xv)), 1e-30)
            return _units(w0, w1, _x_pairs(xv * c, BK), FP4), _unit_sums(xv, BK), 1.0 / c


@triton.jit
def _packed_units(w0, w1, x_ptr, k0, K, FP4: tl.constexpr, BK: tl.constexpr):
    """A tile's words times a `pack_units` row: (sum of v x over each 16 values [BN, BK/16] fp32, with
    the row's per-unit c undone; sum of x over each 16 [BK/16])."""
    xs, inv_c, sums = _packed_x(x_ptr, k0, K, BK)
    return _units(w0, w1, xs, FP4) * inv_c[None, :], sums


@triton.jit
def pack_units(row_ptr, h, n0, K, RANGE: tl.constexpr, BN: tl.constexpr):
    """Store h (fp32 [BN]: values n0..n0+BN of a K-long row; BN and n0 multiples of 16) into an
    int32 row of K/2 + K/8 words for a nibble GEMV step to read as x: per 16-value unit its 8 fp16x2
    operands (scaled by c = RANGE / max |h| of the unit), then 1 / c and sum h of every unit (fp32)."""
    U: tl.constexpr = BN // 16
    hu = tl.reshape(h, (U, 16))
    c = RANGE / tl.maximum(tl.max(tl.abs(hu), axis=1), 1e-30)
    u = n0 // 16 + tl.arange(0, U)
    tl.store(row_ptr + u[:, None] * 8 + tl.arange(0, 8)[None, :], _unit_words(tl.reshape(hu * c[:, None], (BN,)), U))
    tail = row_ptr.to(tl.pointer_type(tl.float32)) + K // 2
    tl.store(tail + u, 1.0 / c)
    tl.store(tail + K // 16 + u, tl.sum(hu, axis=1))


@triton.jit
def fp4_gemv(acc, x_ptr, w_ptr, s_ptr, z_ptr, slot, n0, k0, N, K, PART,
             BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, GN: tl.constexpr, GB: tl.constexpr,
             HAS_Z: tl.constexpr):
    offs_n = n0 + tl.arange(0, BN)
    mn = offs_n < N
    part, sums, inv_c = _nibble_units(x_ptr, w_ptr, slot, offs_n, mn, k0, N, K, FP4_RANGE, True, BK)
    return _fp4_sum(acc, part, _fp4_scales(s_ptr, slot, offs_n, mn, k0, N, K, BK), inv_c)


@triton.jit
def _fp4_scales(s_ptr, slot, offs_n, mn, k0, N, K, BK: tl.constexpr):
    """The tile's E4M3 scale bytes, one per 16 values: [BN, BK/16]."""
    ks = K // 16
    offs_s = k0 // 16 + tl.arange(0, BK // 16)
    return tl.load(s_ptr + slot * N * ks + offs_n[:, None] * ks + offs_s[None, :],
                   mask=mn[:, None] & (offs_s < ks)[None, :], other=0)


@triton.jit
def _fp4_sum(acc, part, sc, inv_c):
    return acc + tl.sum(part * sc.to(tl.float8e4nv, bitcast=True).to(tl.float32), axis=1) * (16384.0 * inv_c)


@triton.jit
def int4_gemv(acc, x_ptr, w_ptr, s_ptr, z_ptr, slot, n0, k0, N, K, PART,
              BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, GN: tl.constexpr, GB: tl.constexpr,
              HAS_Z: tl.constexpr):
    offs_n = n0 + tl.arange(0, BN)
    mn = offs_n < N
    part, sums, inv_c = _nibble_units(x_ptr, w_ptr, slot, offs_n, mn, k0, N, K, INT4_RANGE, False, BK)
    part = _group_sums(part, BN, BK, GB)
    sc, zp = _int4_groups(s_ptr, z_ptr, slot, offs_n, mn, k0, N, K, BK, G, GB, HAS_Z)
    return _int4_sum(acc, part, sums, inv_c, sc, zp, BK, GB, HAS_Z)


@triton.jit
def _group_sums(part, BN: tl.constexpr, BK: tl.constexpr, GB: tl.constexpr):
    """[BN, BK/16] unit sums -> [BN, BK/GB] sums per scale group: sum (q - 8) x per group, times c."""
    return tl.sum(tl.reshape(part, (BN, BK // GB, GB // 16)), axis=2)


@triton.jit
def _int4_groups(s_ptr, z_ptr, slot, offs_n, mn, k0, N, K, BK: tl.constexpr, G: tl.constexpr, GB: tl.constexpr,
                 HAS_Z: tl.constexpr):
    """The tile's group scales and zero points (fp32, [BN, BK/GB]; the scales again without zero points)."""
    ng = tl.cdiv(K, G)
    offs_g = (k0 + tl.arange(0, BK // GB) * GB) // G
    goff = slot * N * ng + offs_n[:, None] * ng + offs_g[None, :]
    gm = mn[:, None] & (offs_g < ng)[None, :]
    sc = tl.load(s_ptr + goff, mask=gm, other=0.0).to(tl.float32)
    zp = tl.load(z_ptr + goff, mask=gm, other=8).to(tl.float32) if HAS_Z else sc
    return sc, zp


@triton.jit
def _int4_sum(acc, part, sums, inv_c, sc, zp, BK: tl.constexpr, GB: tl.constexpr, HAS_Z: tl.constexpr):
    if HAS_Z:
        xs = tl.sum(tl.reshape(sums, (BK // GB, GB // 16)), axis=1)          # sum x per group
        part -= (zp - 8.0) * (xs / inv_c)[None, :]
    return acc + tl.sum(part * sc, axis=1) * inv_c


# The GEMV steps split in two for a kernel that asks for several tiles' weights before it reads
# any x (moe_decode's `down_preload`): `*_tile` loads a tile's words, scales and zero points (a
# 4-tuple), `*_tile_gemv` adds it times x, which must be a row `pack_units` stored (read, and
# waited for where the launch is a programmatic dependent, by `_packed_x`).
@triton.jit
def _tile_words(w_ptr, slot, n0, N, K, BN: tl.constexpr, BK: tl.constexpr):
    """Rows n0..n0+BN of a tile over k 0..BK: (offs_n, row mask, its two word halves)."""
    offs_n = n0 + tl.arange(0, BN)
    mn = offs_n < N
    w0, w1 = _words(w_ptr, slot, offs_n, mn, 0, N, K, BK)
    return offs_n, mn, w0, w1


@triton.jit
def fp4_tile(w_ptr, s_ptr, z_ptr, slot, n0, N, K, BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr,
             GB: tl.constexpr, HAS_Z: tl.constexpr):
    offs_n, mn, w0, w1 = _tile_words(w_ptr, slot, n0, N, K, BN, BK)
    sc = _fp4_scales(s_ptr, slot, offs_n, mn, 0, N, K, BK)
    return w0, w1, sc, sc


@triton.jit
def fp4_tile_gemv(acc, tile, x_ptr, K, BN: tl.constexpr, BK: tl.constexpr, GB: tl.constexpr, HAS_Z: tl.constexpr):
    w0, w1, sc, _ = tile
    part, _ = _packed_units(w0, w1, x_ptr, 0, K, True, BK)
    return _fp4_sum(acc, part, sc, 1.0)


@triton.jit
def int4_tile(w_ptr, s_ptr, z_ptr, slot, n0, N, K, BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr,
              GB: tl.constexpr, HAS_Z: tl.constexpr):
    offs_n, mn, w0, w1 = _tile_words(w_ptr, slot, n0, N, K, BN, BK)
    sc, zp = _int4_groups(s_ptr, z_ptr, slot, offs_n, mn, 0, N, K, BK, G, GB, HAS_Z)
    return w0, w1, sc, zp


@triton.jit
def int4_tile_gemv(acc, tile, x_ptr, K, BN: tl.constexpr, BK: tl.constexpr, GB: tl.constexpr,
                   HAS_Z: tl.constexpr):
    w0, w1, sc, zp = tile
    part, sums = _packed_units(w0, w1, x_ptr, 0, K, False, BK)
    return _int4_sum(acc, _group_sums(part, BN, BK, GB), sums, 1.0, sc, zp, BK, GB, HAS_Z)
